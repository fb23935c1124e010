#include "simulator/memory.h"

#include <algorithm>
#include <numeric>

namespace pipeplan {
namespace {

constexpr const char* kCatNames[kNumMemCats] = {"weights",       "grads",    "optimizer",
                                                "reserve",       "act_text", "act_vision",
                                                "act_generator", "act_held"};

int ActCat(Module m) {
  switch (m) {
    case Module::kVision:
      return kActVision;
    case Module::kGenerator:
      return kActGenerator;
    case Module::kOptimizer:  // Muon's gather buffers
      return kOptimizer;
    default:
      return kActText;
  }
}

}  // namespace

static_assert(kActHeld == kNumMemCats - 1, "MemoryCounters drops act_held as the last");

const char* MemCatName(int cat) {
  return kCatNames[cat];
}

std::array<double, kNumMemCats> StaticMemory(const RankInfo& ri, int vp, double chunk_params,
                                             const MemoryOptions& o, double* host) {
  std::array<double, kNumMemCats> cur{};
  *host = 0;
  for (int m = 0; m < 3; ++m) {
    const double p = ri.params[m], shard = std::max(1.0, ri.state_shard[m]);
    cur[kWeights] += 2 * p;
    if (m == 0 && o.grads_on_host) {
      cur[kGrads] += 2 * 4 * (chunk_params > 0 ? chunk_params : p / std::max(1, vp));
      *host += 4 * p / shard;
    } else if (m == 0 && o.zero_stage >= 2 && shard > 1) {
      const double chunk = chunk_params > 0 ? chunk_params : p / std::max(1, vp);
      cur[kGrads] += 4 * p / shard + 2 * o.grad_bytes * std::min(o.grad_bucket_params, chunk);
    } else {
      cur[kGrads] += 4 * p / (o.zero_stage >= 2 ? shard : 1);
    }
    // Adam: fp32 master and two moments; Muon (its 2-D weights): master and one momentum.
    const double muon = m == 0 ? ri.muon_params : 0;
    cur[kOptimizer] += (12 * (p - muon) + 8 * muon) / (o.zero_stage >= 1 ? shard : 1);
  }
  cur[kReserve] = o.reserve_bytes;
  return cur;
}

std::vector<RankMemory> ComputeMemory(const Table& t, const Timeline& tl, const MemoryOptions& o,
                                      bool with_curves) {
  std::vector<RankMemory> out(t.num_ranks());
  enum Where : uint8_t { kDevice, kHost, kHeld };  // whose bytes an event moves
  struct Event {
    double time;
    OpId op;
    Where where;
  };
  std::vector<Event> events;
  // Remote copies, by the rank that holds their bytes.
  std::vector<std::vector<Event>> held(t.num_ranks());
  for (OpId i = 0; i < t.size(); ++i)
    if (IsCopy(t.kind(i)) && t.peer(i) >= 0)
      held[t.peer(i)].push_back(
          {t.kind(i) == OpKind::kOffload ? tl.start[i] : tl.end[i], i, kHeld});
  // Pipeline ZeRO-2: the largest chunk of each rank, from its gradient shards' copies (each
  // 4 bytes per parameter of the chunk over dp).
  std::vector<double> chunk_params(t.num_ranks(), 0);
  if (o.grads_on_host)
    for (OpId i = 0; i < t.size(); ++i)
      if (t.kind(i) == OpKind::kOffload && t.module(i) == Module::kOptimizer)
        chunk_params[t.rank(i)] =
            std::max(chunk_params[t.rank(i)], t.work(i).payload_bytes * t.meta().dp / 4);
  // ZeRO-2 on the GPU: from the per-micro-batch reductions (grad_bytes per parameter).
  if (!o.grads_on_host && o.zero_stage >= 2)
    for (OpId i = 0; i < t.size(); ++i)
      if (IsMicroBatchReduction(t.module(i), t.mb(i), t.kind(i)))
        chunk_params[t.rank(i)] =
            std::max(chunk_params[t.rank(i)], t.work(i).payload_bytes / o.grad_bytes);
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    double host = 0;
    std::array<double, kNumMemCats> cur =
        StaticMemory(t.ranks()[r], t.meta().vp, chunk_params[r], o, &host);
    RankMemory& rm = out[r];
    // Memory effects in time order (ties: sequence order): device effects at the op's end
    // (a RELOAD's and a filling collective's at its start), host effects of copies at an OFFLOAD's
    // start and a RELOAD's end.
    events.assign(held[r].begin(), held[r].end());
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i) {
      const OpKind k = t.kind(i);
      // A buffer filled by a transfer is allocated when the transfer starts.
      const double delta = t.work(i).mem_delta_bytes;
      if (delta != 0)
        events.push_back(
            {k == OpKind::kReload || (IsCollective(k) && delta > 0) ? tl.start[i] : tl.end[i], i,
             kDevice});
      if (IsCopy(k) && t.peer(i) < 0 && t.module(i) != Module::kOptimizer)  // not gradients
        events.push_back({k == OpKind::kOffload ? tl.start[i] : tl.end[i], i, kHost});
    }
    std::stable_sort(events.begin(), events.end(),
                     [](const Event& a, const Event& b) { return a.time < b.time; });
    auto record = [&](double time, OpId op) {
      double total = std::accumulate(cur.begin(), cur.end(), 0.0);
      for (int c = 0; c < kNumMemCats; ++c) rm.peak_by_cat[c] = std::max(rm.peak_by_cat[c], cur[c]);
      if (total > rm.peak_bytes) rm.peak_bytes = total, rm.peak_time_s = time, rm.at_peak = cur;
      rm.host_peak_bytes = std::max(rm.host_peak_bytes, host);
      if (with_curves) rm.curve.push_back({time, cur, host, op});
    };
    record(0, UINT32_MAX);
    for (const Event& e : events) {
      const Work& w = t.work(e.op);
      const double copied = t.kind(e.op) == OpKind::kOffload ? w.payload_bytes : -w.payload_bytes;
      if (e.where == kHost) {
        host = std::max(0.0, host + copied);
      } else if (e.where == kHeld) {
        cur[kActHeld] = std::max(0.0, cur[kActHeld] + copied);
      } else {
        int cat = ActCat(t.module(e.op));
        cur[cat] = std::max(0.0, cur[cat] + w.mem_delta_bytes);
      }
      record(e.time, e.op);
    }
    rm.oom = o.hbm_bytes > 0 && rm.peak_bytes > o.hbm_bytes;
  }
  return out;
}

std::vector<CounterTrack> MemoryCounters(const std::vector<RankMemory>& memory) {
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  std::vector<CounterTrack> tracks;
  // "host" and "act_held" keys only in plans that offload to host, or to another rank.
  bool offloads = false, holds = false;
  for (const RankMemory& m : memory)
    offloads = offloads || m.host_peak_bytes > 0, holds = holds || m.peak_by_cat[kActHeld] > 0;
  for (size_t r = 0; r < memory.size(); ++r) {
    CounterTrack c;
    c.rank = static_cast<int32_t>(r);
    c.name = "memory GiB";
    for (int k = 0; k < kNumMemCats; ++k)
      if (k != kActHeld || holds) c.keys.push_back(kCatNames[k]);
    c.keys.push_back("total");
    if (offloads) c.keys.push_back("host");  // offloaded activations, outside the total
    for (const MemorySample& s : memory[r].curve) {
      std::vector<double> v(s.bytes.begin(), s.bytes.end());
      if (!holds) v.pop_back();  // act_held, the last category, is 0
      v.push_back(std::accumulate(s.bytes.begin(), s.bytes.end(), 0.0));
      if (offloads) v.push_back(s.host_bytes);
      for (double& x : v) x /= kGiB;
      c.times_s.push_back(s.time_s);
      c.samples.push_back(std::move(v));
    }
    tracks.push_back(std::move(c));
  }
  return tracks;
}

nlohmann::json MemoryTimelineJson(const Table& t, const std::vector<RankMemory>& memory,
                                  const std::vector<uint8_t>& include) {
  nlohmann::json keys = nlohmann::json::array();
  for (int k = 0; k < kNumMemCats; ++k) keys.push_back(kCatNames[k]);
  keys.push_back("total"), keys.push_back("host");
  nlohmann::json ranks = nlohmann::json::array();
  for (size_t r = 0; r < memory.size(); ++r) {
    if (!include.empty() && !include[r]) continue;
    nlohmann::json samples = nlohmann::json::array();
    for (const MemorySample& s : memory[r].curve) {
      nlohmann::json bytes(s.bytes);
      bytes.push_back(std::accumulate(s.bytes.begin(), s.bytes.end(), 0.0));
      bytes.push_back(s.host_bytes);
      samples.push_back({{"time_s", s.time_s},
                         {"op", s.op == UINT32_MAX ? "start" : t.str(s.op)},
                         {"bytes", std::move(bytes)}});
    }
    ranks.push_back({{"rank", r},
                     {"peak_bytes", memory[r].peak_bytes},
                     {"peak_time_s", memory[r].peak_time_s},
                     {"host_peak_bytes", memory[r].host_peak_bytes},
                     {"samples", std::move(samples)}});
  }
  return {{"unit", "bytes per GPU"}, {"keys", std::move(keys)}, {"ranks", std::move(ranks)}};
}

}  // namespace pipeplan
