// One process per GPU (the NCCL mode): which plan rank and which of its GPUs ("shard")
// each process runs, the communicators the plan needs, and the order in which to create
// them. Plain C++ so that it is tested without a GPU; the NCCL backend consumes it.
//
// Process p is global GPU p (Megatron order tp-cp-dp-pp, RankInfo::first_gpu). Shard s of
// a rank talks to shard s of other ranks, as Megatron's TP ranks each talk to the same TP
// rank of the next stage:
//   - a SEND r->q of shard s uses the two-process communicator "r->q, shard s" (one per
//     direction, so a send blocked on a slow receiver never delays a transfer the other way);
//   - a collective or gang on plan group g uses "group g, shard s";
//   - folded TP/CP collectives inside a compute op use the rank's communicator (its GPUs).
// Communicators are split from the world communicator in rounds: the communicators of one
// round have disjoint members, so one ncclCommSplit call per round creates all of them.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "core/status.h"
#include "core/table.h"

namespace pipeplan {

struct ProcessMap {
  int32_t world = 0;           // processes = GPUs of all ranks
  std::vector<int32_t> rank;   // per process: its plan rank
  std::vector<int32_t> shard;  // per process: its index among the rank's GPUs
  std::vector<int32_t> first;  // per plan rank: its first process
  int32_t process(int32_t r, int32_t s) const { return first[r] + s; }
};

// Fails unless `world` equals the plan's GPU count, the ranks' GPUs tile [0, world) and
// every rank holds the same number of GPUs.
StatusOr<ProcessMap> MapProcesses(const Table& t, int32_t world);

struct CommPlan {
  std::vector<std::vector<int32_t>> members;  // per communicator: processes, ascending
  std::vector<int32_t> round;                 // per communicator: its split round
  int32_t rounds = 0;
  std::map<std::tuple<int32_t, int32_t, int32_t>, int32_t> p2p;  // (from, to, shard) -> comm
  std::map<std::pair<int32_t, int32_t>, int32_t> group;          // (group, shard) -> comm
  std::vector<int32_t> rank_comm;  // per plan rank: its GPUs' communicator (-1: one GPU)

  // Per round, the communicator process p joins, or -1 (NCCL_SPLIT_NOCOLOR).
  std::vector<int32_t> Colors(int32_t p) const;
  // p's rank inside communicator c (the split key is the process id).
  int32_t RankIn(int32_t c, int32_t p) const;
};

CommPlan PlanCommunicators(const Table& t, const ProcessMap& pm);

// NCCL matches the transfers between two processes in the order they are posted, not by
// tag, but a plan may receive a peer's transfers in another order than the peer sends them
// (a vision embedding overtaking text activations). The receiver therefore posts its
// receives in the sender's order: to get one transfer it first receives the earlier ones
// and holds them until their RECV runs. Sends are eager, so the earlier ones are already
// posted when the wanted one is: this never waits longer than the wanted transfer itself.
class ReceiveOrder {
 public:
  explicit ReceiveOrder(const Table& t);
  // The SENDs whose transfers must be received now, in order, for `recv` to complete:
  // empty if it arrived early (held), else ending with recv's own SEND.
  std::vector<OpId> Post(OpId recv);

 private:
  const Table& t_;
  std::map<std::pair<int32_t, int32_t>, std::vector<OpId>> sends_;  // (from, to): in order
  std::map<std::pair<int32_t, int32_t>, size_t> posted_;
  std::vector<uint32_t> position_;  // per SEND: its index in its pair's order
};

}  // namespace pipeplan
