// Multi-process execution over MPI (built when MPI is found): one process per rank, as
// started by `srun` or `mpirun`. The CPU backend's transport is MPI point-to-point (any
// size tag, carried in the message) and non-blocking collectives on one communicator per
// plan group, each wait bounded by the op timeout. Rank 0 gathers every rank's timeline
// (one merged trace) and, with a check, every rank's gradients.
#pragma once

#include <string>

#include "core/table.h"
#include "core/timeline.h"
#include "executor/check.h"

namespace pipeplan {

// MPI_Init with the process's arguments; false if MPI is not built in.
bool MpiAvailable();
// This process's rank in MPI_COMM_WORLD (after MpiAvailable).
int MpiRank();
struct MpiResult {
  int rank = 0, world = 1;
  CheckResult check;
  Timeline merged;  // on rank 0: every rank's ops
};
// Runs this process's rank; on a failure the error names the rank and op, and the caller
// should exit non-zero (every rank does: a failed rank aborts the job). `own` gets this
// rank's ops as they ran, also after a failure (a partial trace).
StatusOr<MpiResult> RunCpuMpi(const Table& t, const RunOptions& o, bool check, Timeline* own);
void MpiFinalize();
// Process 0's bytes (NCCL's unique id) to every process.
Status MpiBroadcast(std::string* bytes);
[[noreturn]] void MpiAbort(int code);

}  // namespace pipeplan
