// CUDA + NCCL backend (built when nvcc and NCCL are found): one process per GPU, as
// started by `srun` or `mpirun`. Each process runs its rank's sequence on its GPU:
//   - compute ops: the cuBLAS GEMMs of the single-GPU backend (FLOPs per GPU equal to the
//     op's), a memory-bound pass of the op's HBM bytes, and its folded TP/CP collectives as
//     NCCL all-reduces over the rank's GPUs (or, for a gang, over the gang's group);
//   - SEND/RECV: ncclSend/ncclRecv of the op's payload on a two-process communicator per
//     direction; sends are eager (each on its own stream), receives block; a receive posts
//     the sender's earlier transfers first (ReceiveOrder) and holds them;
//   - collectives: the matching NCCL collective over the group's communicator (all-to-all as
//     grouped send/recv), asynchronous, waited for by the ops that depend on them.
// Before the clocks start, every communicator is connected by one use of each kind it will
// carry (NCCL connects lazily, which would make the first eager send wait for its peer),
// and every GEMM size runs once (kernels load lazily). Every op is timed with CUDA events;
// communicators are non-blocking so that every wait, joining included, is bounded by the
// op timeout and polls NCCL's asynchronous errors; a failure aborts the communicators
// (never a hang).
// With `check`, every transfer carries a stamp of its SEND and every collective a value
// whose result is known, and every receiver verifies what arrived.
#pragma once

#include <functional>
#include <string>

#include "core/status.h"
#include "core/table.h"
#include "core/timeline.h"
#include "executor/runner.h"

namespace pipeplan {

struct NcclLaunch {
  int32_t process = 0, world = 1;
  int32_t local_rank = 0;  // selects the GPU: local_rank % visible GPUs
  // Shares NCCL's unique id: on entry process 0's id, on return everyone's (MPI or a file).
  std::function<Status(std::string* id)> share_id;
  std::function<void()> joined;  // called on process 0 once every process has joined
};

struct NcclResult {
  Timeline merged;               // every rank's ops (an op spans its GPUs' first start to last end)
  int64_t checked = 0, bad = 0;  // transfers and collectives verified, over every process
  std::string mismatch;          // this process's first wrong transfer, if any
  std::string device;            // this process's GPU
};

// Runs this process's share of `t`. On failure the error names the rank and op. `own`
// gets this process's ops as they ran, also after a failure (a partial trace).
StatusOr<NcclResult> RunNccl(const Table& t, const NcclLaunch& launch, const RunOptions& o,
                             bool check, Timeline* own);

}  // namespace pipeplan
