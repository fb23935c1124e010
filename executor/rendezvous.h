// Sharing a small secret (NCCL's unique id) from process 0 with every process of a job
// through a file in a directory they all see (a shared file system across nodes). The
// MPI way is in mpi_run.h.
#pragma once

#include <string>

#include "core/status.h"

namespace pipeplan {

struct FileRendezvous {
  std::string dir;        // shared directory
  std::string key;        // unique per job step (SLURM_JOB_ID.SLURM_STEP_ID by default)
  double timeout_s = 60;  // how long the other processes wait for process 0's file
  std::string path() const { return dir + "/pipeplan-nccl-id." + key; }
};

// The default key: SLURM_JOB_ID.SLURM_STEP_ID, else "" (none: the caller must give one).
std::string DefaultRendezvousKey();

// Process 0 writes `*id` (atomically); the others wait for the file and read it into *id.
// The file names the world size, so a leftover file of another job size is refused.
Status ShareThroughFile(const FileRendezvous& r, int process, int world, std::string* id);
// Process 0 removes the file once every process has joined.
void RemoveRendezvousFile(const FileRendezvous& r);

}  // namespace pipeplan
