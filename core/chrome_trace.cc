#include "core/chrome_trace.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "core/version.h"

namespace pipeplan {
namespace {

enum Track { kCompute = 0, kVision, kGenerator, kSend, kRecv, kColl, kNumTracks };
constexpr const char* kTrackNames[kNumTracks] = {"compute", "vision",  "generator",
                                                 "pp send", "pp recv", "collectives"};
constexpr int kMaxLanes = 8;
constexpr int kTidsPerRank = kNumTracks * kMaxLanes;

Track TrackOf(const Table& t, OpId i) {
  OpKind k = t.kind(i);
  if (IsSend(k)) return kSend;
  if (IsRecv(k)) return kRecv;
  if (IsCollective(k)) return kColl;
  if (t.module(i) == Module::kVision) return kVision;
  if (t.module(i) == Module::kGenerator) return kGenerator;
  return kCompute;
}

bool Included(const std::vector<int32_t>& filter, int32_t v) {
  return filter.empty() || std::find(filter.begin(), filter.end(), v) != filter.end();
}

}  // namespace

std::string ChromeTrace(const Table& t, const Timeline& tl,
                        const std::vector<CounterTrack>& counters, const TraceOptions& o) {
  std::vector<uint8_t> include(t.num_ranks());
  for (int32_t r = 0; r < t.num_ranks(); ++r)
    include[r] = Included(o.ranks, r) && Included(o.dp_replicas, t.ranks()[r].dp);
  std::string out;
  out.reserve(t.size() * 200 + 4096);
  out += "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  bool first = true;
  auto emit = [&](const std::string& ev) {
    if (!first) out += ",\n";
    first = false;
    out += ev;
  };
  std::vector<int32_t> tid_of(t.size(), -1);
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    if (!include[r]) continue;
    const RankInfo& ri = t.ranks()[r];
    emit(fmt::format(
        R"({{"ph":"M","name":"process_name","pid":{},"args":{{"name":"rank {} [dp {} pp {}; {} GPUs from GPU {}]"}}}})",
        r, r, ri.dp, ri.pp, ri.gpus, ri.first_gpu));
    emit(fmt::format(
        R"({{"ph":"M","name":"process_sort_index","pid":{},"args":{{"sort_index":{}}}}})", r, r));
    // Lanes: an op goes to the first lane of its track whose last event has ended.
    double lane_end[kNumTracks][kMaxLanes];
    bool lane_used[kNumTracks][kMaxLanes] = {};
    for (auto& row : lane_end) std::fill(std::begin(row), std::end(row), -1.0);
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i) {
      Track tr = TrackOf(t, i);
      int lane = 0;
      while (lane + 1 < kMaxLanes && lane_end[tr][lane] > tl.start[i]) ++lane;
      lane_end[tr][lane] = std::max(lane_end[tr][lane], tl.end[i]);
      lane_used[tr][lane] = true;
      tid_of[i] = r * kTidsPerRank + tr * kMaxLanes + lane;
    }
    for (int tr = 0; tr < kNumTracks; ++tr)
      for (int lane = 0; lane < kMaxLanes; ++lane)
        if (lane_used[tr][lane]) {
          std::string name =
              lane ? fmt::format("{} #{}", kTrackNames[tr], lane + 1) : kTrackNames[tr];
          int tid = r * kTidsPerRank + tr * kMaxLanes + lane;
          emit(fmt::format(
              R"({{"ph":"M","name":"thread_name","pid":{},"tid":{},"args":{{"name":"{}"}}}})", r,
              tid, name));
          emit(fmt::format(
              R"({{"ph":"M","name":"thread_sort_index","pid":{},"tid":{},"args":{{"sort_index":{}}}}})",
              r, tid, tid));
        }
  }
  for (OpId i = 0; i < t.size(); ++i) {
    if (!include[t.rank(i)] || tl.start[i] < 0) continue;  // negative: never ran
    const Work& w = t.work(i);
    std::string args =
        fmt::format(R"("module":"{}","kind":"{}")", ModuleName(t.module(i)), KindName(t.kind(i)));
    if (t.mb(i) >= 0) args += fmt::format(R"(,"microbatch":{})", t.mb(i));
    if (t.chunk(i) >= 0) args += fmt::format(R"(,"chunk":{})", t.chunk(i));
    if (t.task(i) >= 0) args += fmt::format(R"(,"task":{})", t.task(i));
    if (w.flops > 0) args += fmt::format(R"(,"flops":{:.6g})", w.flops);
    if (w.hbm_bytes > 0) args += fmt::format(R"(,"hbm_bytes":{:.6g})", w.hbm_bytes);
    if (w.payload_bytes > 0) args += fmt::format(R"(,"payload_bytes":{:.6g})", w.payload_bytes);
    if (o.predicted_s) args += fmt::format(R"(,"predicted_us":{:.6g})", (*o.predicted_s)[i] * 1e6);
    emit(fmt::format(
        R"({{"ph":"X","name":"{}","cat":"{}","pid":{},"tid":{},"ts":{:.6f},"dur":{:.6f},"args":{{{}}}}})",
        t.str(i), ModuleName(t.module(i)), t.rank(i), tid_of[i], tl.start[i] * 1e6,
        (tl.end[i] - tl.start[i]) * 1e6, args));
    if (IsRecv(t.kind(i)) && t.send_of(i) != UINT32_MAX) {
      OpId s = t.send_of(i);
      if (!include[t.rank(s)] || tl.start[s] < 0) continue;
      emit(fmt::format(
          R"({{"ph":"s","name":"p2p","cat":"p2p","id":{},"pid":{},"tid":{},"ts":{:.6f}}})",
          t.tag(i), t.rank(s), tid_of[s], tl.start[s] * 1e6));
      emit(fmt::format(
          R"({{"ph":"f","bp":"e","name":"p2p","cat":"p2p","id":{},"pid":{},"tid":{},"ts":{:.6f}}})",
          t.tag(i), t.rank(i), tid_of[i], tl.start[i] * 1e6));
    }
  }
  for (const CounterTrack& c : counters) {
    if (c.rank < 0 || c.rank >= t.num_ranks() || !include[c.rank]) continue;
    for (size_t s = 0; s < c.times_s.size(); ++s) {
      std::string args;
      for (size_t k = 0; k < c.keys.size(); ++k)
        args += fmt::format(R"({}"{}":{:.6g})", k ? "," : "", c.keys[k], c.samples[s][k]);
      emit(fmt::format(R"({{"ph":"C","name":"{}","pid":{},"ts":{:.6f},"args":{{{}}}}})", c.name,
                       c.rank, c.times_s[s] * 1e6, args));
    }
  }
  nlohmann::json other = {{"tool", "pipeplan"},
                          {"version", kVersion},
                          {"source", o.source},
                          {"schedule", t.meta().schedule},
                          {"modality", t.meta().modality},
                          {"config", t.meta().config_yaml}};
  out += "\n],\"otherData\":" + other.dump() + "}\n";
  return out;
}

}  // namespace pipeplan
