// Discrete-event engine over an operator table.
//
// Semantics (the executor implements the same):
// - Each rank has a compute stream (compute ops and SEND/RECV), a collective stream and
//   two host copy streams (OFFLOAD to host, RELOAD from it). Ops of one stream run in
//   sequence order, one at a time.
// - An op starts when the previous op of its stream has ended and all its explicit
//   dependencies have ended.
// - A maximal run of consecutive SEND/RECV ops on a rank is posted at once (batched p2p,
//   as Megatron's send_forward_recv_backward). A SEND and its RECV start together when
//   both are posted and end together; the op after the run waits for all of it.
// - A collective starts when every member rank has posted it (stream ready, deps ended).
// Since there is no contention beyond stream order, start times are the longest paths of
// this constraint graph; the engine computes them in one worklist pass, O(ops + deps).
// If ops remain that can never start, that is a deadlock: it is reported with the op
// each blocked rank waits on, in string form.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "core/table.h"
#include "core/timeline.h"

namespace pipeplan {

// The links the engine follows besides stream order and dependencies, computed once per
// table and shared by every pass over it: each SEND's RECV and back, each collective or
// gang op's instance (its members, in op order).
struct EngineIndex {
  std::vector<OpId> partner;         // SEND <-> RECV; UINT32_MAX for other ops
  std::vector<uint32_t> instance;    // grouped op -> instance; UINT32_MAX for other ops
  std::vector<uint32_t> inst_begin;  // CSR over instances: members [begin[c], begin[c + 1])
  std::vector<OpId> inst_members;
};
// Fails (InvalidPlan) on a RECV without its SEND or an instance missing group members.
StatusOr<EngineIndex> IndexForEngine(const Table& t);

// durations: seconds per op (CostModel::Durations, or zeros for a progress check).
StatusOr<Timeline> Simulate(const Table& t, const std::vector<double>& durations);
// The same with the table's index built once; `reuse`'s buffers (a previous pass's
// timeline) hold the result.
StatusOr<Timeline> Simulate(const Table& t, const std::vector<double>& durations,
                            const EngineIndex& index, Timeline reuse = {});
// The same plan with one module's ops absent: they count as done at time 0, so no stream
// waits behind them and no op waits for them (their SEND/RECV and collectives are all of
// that module). The step of the other modules alone, in the plan's own order.
StatusOr<Timeline> SimulateWithout(const Table& t, const std::vector<double>& durations,
                                   const EngineIndex& index, Module without, Timeline reuse = {});

// Critical path: from the op that ends last, back through the constraint that set each
// start. Returns op ids in time order.
std::vector<OpId> CriticalPath(const Table& t, const Timeline& tl, const EngineIndex& index);

}  // namespace pipeplan
