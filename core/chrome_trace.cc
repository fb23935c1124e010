#include "core/chrome_trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "core/version.h"

namespace pipeplan {
namespace {

enum Track { kCompute = 0, kVision, kGenerator, kSend, kRecv, kColl, kNumTracks };
constexpr const char* kTrackNames[kNumTracks] = {"compute", "vision",  "generator",
                                                 "pp send", "pp recv", "collectives"};
constexpr int kLanesPerTrack = 10000;  // tid = rank * kTidsPerRank + track * lanes + lane
constexpr int64_t kTidsPerRank = int64_t{kNumTracks} * kLanesPerTrack;

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

// A JSON string literal (escaped by the JSON library).
std::string Quote(std::string_view s) {
  return nlohmann::json(std::string(s)).dump();
}

// Times are written in whole nanoseconds (as microseconds with three decimals): Perfetto
// rounds to nanoseconds on import, and slices that touch would otherwise overlap by one.
int64_t Ns(double seconds) {
  return std::llround(seconds * 1e9);
}
std::string Us(int64_t ns) {
  return fmt::format("{}{}.{:03d}", ns < 0 ? "-" : "", std::abs(ns) / 1000, std::abs(ns) % 1000);
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
  auto ran = [&](OpId i) { return include[t.rank(i)] && tl.start[i] >= 0; };
  std::vector<int64_t> tid_of(t.size(), -1);
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    if (!include[r]) continue;
    const RankInfo& ri = t.ranks()[r];
    const std::string pname = fmt::format("rank {} [dp {} pp {}; {} GPUs from GPU {}]", r, ri.dp,
                                          ri.pp, ri.gpus, ri.first_gpu);
    emit(fmt::format(R"({{"ph":"M","name":"process_name","pid":{},"args":{{"name":{}}}}})", r,
                     Quote(pname)));
    emit(fmt::format(
        R"({{"ph":"M","name":"process_sort_index","pid":{},"args":{{"sort_index":{}}}}})", r, r));
    // Lanes: an op goes to the first lane of its track that is free at its start (in whole
    // nanoseconds), a new lane when none is: ops of one lane never overlap or nest.
    std::vector<int64_t> lane_end[kNumTracks];
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i) {
      if (tl.start[i] < 0) continue;
      const Track tr = TrackOf(t, i);
      const int64_t start = Ns(tl.start[i]), end = std::max(start, Ns(tl.end[i]));
      auto& lanes = lane_end[tr];
      size_t lane = 0;
      while (lane < lanes.size() && lanes[lane] > start) ++lane;
      if (lane == lanes.size()) {
        if (lanes.size() == kLanesPerTrack)
          lane = kLanesPerTrack - 1;  // never in practice
        else
          lanes.push_back(end);
      }
      lanes[lane] = std::max(lanes[lane], end);
      tid_of[i] = r * kTidsPerRank + tr * int64_t{kLanesPerTrack} + static_cast<int64_t>(lane);
    }
    for (int tr = 0; tr < kNumTracks; ++tr)
      for (size_t lane = 0; lane < lane_end[tr].size(); ++lane) {
        const std::string name =
            lane ? fmt::format("{} #{}", kTrackNames[tr], lane + 1) : kTrackNames[tr];
        const int64_t tid =
            r * kTidsPerRank + tr * int64_t{kLanesPerTrack} + static_cast<int64_t>(lane);
        emit(fmt::format(
            R"({{"ph":"M","name":"thread_name","pid":{},"tid":{},"args":{{"name":{}}}}})", r, tid,
            Quote(name)));
        emit(fmt::format(
            R"({{"ph":"M","name":"thread_sort_index","pid":{},"tid":{},"args":{{"sort_index":{}}}}})",
            r, tid, tr * kLanesPerTrack + static_cast<int>(lane)));
      }
  }
  for (OpId i = 0; i < t.size(); ++i) {
    if (!ran(i)) continue;  // negative start: never ran
    const Work& w = t.work(i);
    std::string args = fmt::format(R"("module":{},"kind":{})", Quote(ModuleName(t.module(i))),
                                   Quote(KindName(t.kind(i))));
    if (t.mb(i) >= 0) args += fmt::format(R"(,"microbatch":{})", t.mb(i));
    if (t.chunk(i) >= 0) args += fmt::format(R"(,"chunk":{})", t.chunk(i));
    if (t.task(i) >= 0) args += fmt::format(R"(,"task":{})", t.task(i));
    if (w.flops > 0) args += fmt::format(R"(,"flops":{:.6g})", w.flops);
    if (w.hbm_bytes > 0) args += fmt::format(R"(,"hbm_bytes":{:.6g})", w.hbm_bytes);
    if (w.payload_bytes > 0) args += fmt::format(R"(,"payload_bytes":{:.6g})", w.payload_bytes);
    if (o.predicted_s) args += fmt::format(R"(,"predicted_us":{:.6g})", (*o.predicted_s)[i] * 1e6);
    const int64_t start = Ns(tl.start[i]), end = std::max(start, Ns(tl.end[i]));
    emit(fmt::format(
        R"({{"ph":"X","name":{},"cat":{},"pid":{},"tid":{},"ts":{},"dur":{},"args":{{{}}}}})",
        Quote(t.str(i)), Quote(ModuleName(t.module(i))), t.rank(i), tid_of[i], Us(start),
        Us(end - start), args));
  }
  // Flow arrows SEND -> RECV after every slice: each binds to the slice it starts or ends
  // in, which the importer must have read first.
  for (OpId i = 0; i < t.size(); ++i) {
    if (!IsRecv(t.kind(i)) || !ran(i)) continue;
    const OpId s = t.send_of(i);
    if (s == UINT32_MAX || !ran(s)) continue;
    emit(fmt::format(R"({{"ph":"s","name":"p2p","cat":"p2p","id":{},"pid":{},"tid":{},"ts":{}}})",
                     t.tag(i), t.rank(s), tid_of[s], Us(Ns(tl.start[s]))));
    emit(fmt::format(
        R"({{"ph":"f","bp":"e","name":"p2p","cat":"p2p","id":{},"pid":{},"tid":{},"ts":{}}})",
        t.tag(i), t.rank(i), tid_of[i], Us(Ns(tl.start[i]))));
  }
  for (const CounterTrack& c : counters) {
    if (c.rank < 0 || c.rank >= t.num_ranks() || !include[c.rank]) continue;
    for (size_t s = 0; s < c.times_s.size(); ++s) {
      std::string args;
      for (size_t k = 0; k < c.keys.size(); ++k)
        args += fmt::format(R"({}{}:{:.6g})", k ? "," : "", Quote(c.keys[k]), c.samples[s][k]);
      emit(fmt::format(R"({{"ph":"C","name":{},"pid":{},"ts":{},"args":{{{}}}}})", Quote(c.name),
                       c.rank, Us(Ns(c.times_s[s])), args));
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
