#include "executor/process_map.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>

namespace pipeplan {

StatusOr<ProcessMap> MapProcesses(const Table& t, int32_t world) {
  int64_t gpus = 0;
  for (const RankInfo& r : t.ranks()) gpus += r.gpus;
  if (world != gpus)
    return InvalidInput(fmt::format(
        "{} processes for a plan of {} ranks holding {} GPUs: start one process per GPU", world,
        t.num_ranks(), gpus));
  ProcessMap pm;
  pm.world = world;
  pm.rank.assign(world, -1);
  pm.shard.assign(world, -1);
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    const RankInfo& info = t.ranks()[r];
    if (info.gpus != t.ranks()[0].gpus)
      return InvalidPlan(fmt::format(
          "rank {} holds {} GPUs and rank 0 {}: one process per GPU needs the same on every rank",
          r, info.gpus, t.ranks()[0].gpus));
    if (info.gpus < 1 || info.first_gpu < 0 || info.first_gpu > world - info.gpus)
      return InvalidPlan(fmt::format("rank {}: GPUs [{}, {}) outside the {} processes", r,
                                     info.first_gpu, int64_t{info.first_gpu} + info.gpus, world));
    pm.first.push_back(info.first_gpu);
    for (int32_t s = 0; s < info.gpus; ++s) {
      int32_t p = info.first_gpu + s;
      if (pm.rank[p] >= 0)
        return InvalidPlan(fmt::format("GPU {} belongs to ranks {} and {}", p, pm.rank[p], r));
      pm.rank[p] = r, pm.shard[p] = s;
    }
  }
  return pm;
}

CommPlan PlanCommunicators(const Table& t, const ProcessMap& pm) {
  CommPlan cp;
  auto add = [&](std::vector<int32_t> procs) {
    std::sort(procs.begin(), procs.end());
    cp.members.push_back(std::move(procs));
    return static_cast<int32_t>(cp.members.size()) - 1;
  };
  cp.rank_comm.assign(t.num_ranks(), -1);
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    const int32_t gpus = t.ranks()[r].gpus;
    if (gpus < 2) continue;
    std::vector<int32_t> procs;
    for (int32_t s = 0; s < gpus; ++s) procs.push_back(pm.process(r, s));
    cp.rank_comm[r] = add(std::move(procs));
  }
  std::set<std::pair<int32_t, int32_t>> pairs;
  std::map<int32_t, bool> groups;  // group -> used by gangs (compute stream), else collectives
  for (OpId i = 0; i < t.size(); ++i) {
    if (IsSend(t.kind(i))) pairs.insert({t.rank(i), t.peer(i)});
    if (t.grouped(i)) groups[t.peer(i)] = IsCompute(t.kind(i));
  }
  const int32_t shards = t.num_ranks() > 0 ? t.ranks()[0].gpus : 1;
  for (auto [from, to] : pairs)
    for (int32_t s = 0; s < shards; ++s)
      cp.p2p[{from, to, s}] = add({pm.process(from, s), pm.process(to, s)});
  // Plan groups with the same members share a communicator (vision CP re-forms the same
  // sub-groups every round), kept apart for gangs and collectives, which run on
  // different streams.
  std::map<std::pair<std::vector<int32_t>, bool>, int32_t> same;
  for (auto [g, gang] : groups)
    for (int32_t s = 0; s < shards; ++s) {
      std::vector<int32_t> procs;
      for (int32_t r : t.group(g)) procs.push_back(pm.process(r, s));
      std::sort(procs.begin(), procs.end());
      auto [it, fresh] = same.try_emplace({procs, gang}, -1);
      if (fresh) it->second = add(std::move(procs));
      cp.group[{g, s}] = it->second;
    }
  // Rounds: each communicator goes to the first round where none of its members is taken.
  std::vector<std::vector<char>> taken(pm.world);
  cp.round.resize(cp.members.size());
  for (size_t c = 0; c < cp.members.size(); ++c) {
    int32_t k = 0;
    auto free_in = [&](int32_t round) {
      for (int32_t p : cp.members[c])
        if (round < static_cast<int32_t>(taken[p].size()) && taken[p][round]) return false;
      return true;
    };
    while (!free_in(k)) ++k;
    for (int32_t p : cp.members[c]) {
      if (static_cast<int32_t>(taken[p].size()) <= k) taken[p].resize(k + 1, 0);
      taken[p][k] = 1;
    }
    cp.round[c] = k;
    cp.rounds = std::max(cp.rounds, k + 1);
  }
  return cp;
}

std::vector<int32_t> CommPlan::Colors(int32_t p) const {
  std::vector<int32_t> colors(rounds, -1);
  for (size_t c = 0; c < members.size(); ++c)
    if (std::binary_search(members[c].begin(), members[c].end(), p))
      colors[round[c]] = static_cast<int32_t>(c);
  return colors;
}

int32_t CommPlan::RankIn(int32_t c, int32_t p) const {
  const auto& m = members[c];
  auto it = std::lower_bound(m.begin(), m.end(), p);
  return it != m.end() && *it == p ? static_cast<int32_t>(it - m.begin()) : -1;
}

ReceiveOrder::ReceiveOrder(const Table& t) : t_(t), position_(t.size(), UINT32_MAX) {
  for (OpId i = 0; i < t.size(); ++i)
    if (IsSend(t.kind(i))) {
      auto& order = sends_[{t.rank(i), t.peer(i)}];
      position_[i] = static_cast<uint32_t>(order.size());
      order.push_back(i);
    }
}

std::vector<OpId> ReceiveOrder::Post(OpId recv) {
  const OpId send = t_.send_of(recv);
  const std::pair<int32_t, int32_t> pair{t_.peer(recv), t_.rank(recv)};
  size_t& posted = posted_[pair];
  if (send == UINT32_MAX || position_[send] < posted) return {};
  const auto& order = sends_[pair];
  std::vector<OpId> out(order.begin() + posted, order.begin() + position_[send] + 1);
  posted = position_[send] + 1;
  return out;
}

}  // namespace pipeplan
