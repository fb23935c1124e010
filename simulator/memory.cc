#include "simulator/memory.h"

#include <algorithm>
#include <numeric>

namespace pipeplan {
namespace {

constexpr const char* kCatNames[kNumMemCats] = {"weights",  "grads",      "optimizer",    "reserve",
                                                "act_text", "act_vision", "act_generator"};

int ActCat(Module m) {
  switch (m) {
    case Module::kVision:
      return kActVision;
    case Module::kGenerator:
      return kActGenerator;
    default:
      return kActText;
  }
}

}  // namespace

const char* MemCatName(int cat) {
  return kCatNames[cat];
}

std::vector<RankMemory> ComputeMemory(const Table& t, const Timeline& tl, const MemoryOptions& o,
                                      bool with_curves) {
  std::vector<RankMemory> out(t.num_ranks());
  std::vector<OpId> order;
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    const RankInfo& ri = t.ranks()[r];
    // bf16 weights, fp32 main gradients (sharded with ZeRO-2), fp32 master and two moments
    // (sharded with ZeRO >= 1), each over the module's state_shard ranks.
    std::array<double, kNumMemCats> cur{};
    for (int m = 0; m < 3; ++m) {
      const double p = ri.params[m], shard = std::max(1.0, ri.state_shard[m]);
      cur[kWeights] += 2 * p;
      cur[kGrads] += 4 * p / (o.zero_stage >= 2 ? shard : 1);
      cur[kOptimizer] += 12 * p / (o.zero_stage >= 1 ? shard : 1);
    }
    cur[kReserve] = o.reserve_bytes;
    RankMemory& rm = out[r];
    // Ops with a memory effect, in order of their end time (ties: sequence order).
    order.clear();
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i)
      if (t.work(i).mem_delta_bytes != 0) order.push_back(i);
    std::stable_sort(order.begin(), order.end(),
                     [&](OpId a, OpId b) { return tl.end[a] < tl.end[b]; });
    auto record = [&](double time) {
      double total = std::accumulate(cur.begin(), cur.end(), 0.0);
      for (int c = 0; c < kNumMemCats; ++c) rm.peak_by_cat[c] = std::max(rm.peak_by_cat[c], cur[c]);
      if (total > rm.peak_bytes) rm.peak_bytes = total, rm.peak_time_s = time, rm.at_peak = cur;
      if (with_curves) rm.curve.push_back({time, cur});
    };
    record(0);
    for (OpId i : order) {
      int cat = ActCat(t.module(i));
      cur[cat] = std::max(0.0, cur[cat] + t.work(i).mem_delta_bytes);
      record(tl.end[i]);
    }
    rm.oom = o.hbm_bytes > 0 && rm.peak_bytes > o.hbm_bytes;
  }
  return out;
}

std::vector<CounterTrack> MemoryCounters(const std::vector<RankMemory>& memory) {
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  std::vector<CounterTrack> tracks;
  for (size_t r = 0; r < memory.size(); ++r) {
    CounterTrack c;
    c.rank = static_cast<int32_t>(r);
    c.name = "memory GiB";
    for (int k = 0; k < kNumMemCats; ++k) c.keys.push_back(kCatNames[k]);
    c.keys.push_back("total");
    for (const MemorySample& s : memory[r].curve) {
      std::vector<double> v(s.bytes.begin(), s.bytes.end());
      v.push_back(std::accumulate(v.begin(), v.end(), 0.0));
      for (double& x : v) x /= kGiB;
      c.times_s.push_back(s.time_s);
      c.samples.push_back(std::move(v));
    }
    tracks.push_back(std::move(c));
  }
  return tracks;
}

}  // namespace pipeplan
