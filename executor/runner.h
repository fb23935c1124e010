// The runner replays one rank's sequence of a plan through two small interfaces: a
// Backend runs compute ops and owns the tensors; a Transport moves them. Every op is
// timed; the result is a measured Timeline (the simulator's type).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/table.h"
#include "core/timeline.h"
#include "executor/transport.h"

namespace pipeplan {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Status Compute(OpId op) = 0;                         // F, B, RECOMPUTE, OPT_STEP, gangs
  virtual StatusOr<Tensor> Outgoing(OpId send) = 0;            // payload of a SEND
  virtual Status Incoming(OpId recv, Tensor data) = 0;         // payload of a RECV
  virtual StatusOr<Tensor> Contribution(OpId collective) = 0;  // what a rank reduces
  virtual Status Reduced(OpId collective, Tensor sum) = 0;
};

struct RunOptions {
  double op_timeout_s = 60;  // longest wait of one RECV or collective
  int32_t fault_rank = -1;   // testing: this rank fails at its first SEND (-1 = none)
  bool fault_kill = false;   // testing: ... by killing its own process (SIGKILL), as a crash
  // Called as each op ends without error, with its times (seconds from the run's start):
  // a trace journal (TraceJournal) keeps them where the process may die.
  std::function<void(OpId, double start_s, double end_s)> on_op_done;
};

// Runs rank r's sequence, calling run_op for each op and timing it. On failure the error
// names the rank and the op (also stored in *failed when given). Backends that move their
// own data (the NCCL backend) run through this; the others through RunRank.
Status RunSequence(const Table& t, int32_t rank, const std::function<Status(OpId)>& run_op,
                   const RunOptions& o, std::chrono::steady_clock::time_point t0,
                   Timeline* measured, OpId* failed = nullptr);

// RunSequence over a Backend for compute and a Transport for SEND/RECV/collectives.
Status RunRank(const Table& t, int32_t rank, Backend& backend, Transport& transport,
               const RunOptions& o, std::chrono::steady_clock::time_point t0, Timeline* measured,
               OpId* failed = nullptr);

// Runs every rank as a thread of this process (`backends[r]` for rank r) over an
// in-process transport. The first failure aborts the others; the error returned is the
// root cause (of several timeouts, the wait that began first); the timeline holds what ran.
Status RunLocal(const Table& t, std::vector<std::unique_ptr<Backend>>& backends,
                const RunOptions& o, Timeline* measured);

}  // namespace pipeplan
