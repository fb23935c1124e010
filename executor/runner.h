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

// Runs rank r's sequence in order on the calling thread, calling run_op for each op and
// timing it. On failure the error names the rank and the op (also stored in *failed when
// given). Backends that move their own data and run their own streams (the NCCL backend)
// run through this; the others through RunRank.
Status RunSequence(const Table& t, int32_t rank, const std::function<Status(OpId)>& run_op,
                   const RunOptions& o, std::chrono::steady_clock::time_point t0,
                   Timeline* measured, OpId* failed = nullptr);

// Rank r's ops over a Backend for compute and a Transport for SEND/RECV/collectives, on
// the simulator's streams: the compute stream (compute ops, SEND/RECV) on the calling
// thread, the collective stream and each direction of host copies on a thread of its own,
// each in sequence order and each op after the rank's ops it depends on. So a rank waiting
// in a collective still sends what its peers need, as a GPU's collective stream lets it.
// Backend calls are made one at a time; transport waits happen outside that lock. The
// first failure of a stream aborts the transport (waking the rank's other streams).
Status RunRank(const Table& t, int32_t rank, Backend& backend, Transport& transport,
               const RunOptions& o, std::chrono::steady_clock::time_point t0, Timeline* measured,
               OpId* failed = nullptr);

// Runs every rank as a thread of this process (`backends[r]` for rank r) over an
// in-process transport. The first failure aborts the others; the error returned is the
// root cause (of several timeouts, the wait that began first); the timeline holds what ran.
Status RunLocal(const Table& t, std::vector<std::unique_ptr<Backend>>& backends,
                const RunOptions& o, Timeline* measured);

}  // namespace pipeplan
