#include "core/chrome_trace.h"

#include <fmt/compile.h>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "core/files.h"
#include "core/trace_lanes.h"
#include "core/version.h"

namespace pipeplan {
namespace trace {

Track TrackOf(const Table& t, OpId i) {
  OpKind k = t.kind(i);
  if (IsSend(k)) return kSend;
  if (IsRecv(k)) return kRecv;
  if (IsCollective(k)) return kColl;
  if (IsCopy(k)) return kCopy;
  if (t.module(i) == Module::kVision) return kVision;
  if (t.module(i) == Module::kGenerator) return kGenerator;
  return kCompute;
}

int64_t Ns(double seconds) {
  return std::llround(seconds * 1e9);
}

char* General6(double v, char* out) {
  return std::to_chars(out, out + 32, v, std::chars_format::general, 6).ptr;
}

std::string LaneName(int tr, int32_t lane) {
  return lane ? fmt::format("{} #{}", kTrackNames[tr], lane + 1) : kTrackNames[tr];
}

std::string RankLabel(const Table& t, int32_t r) {
  const RankInfo& ri = t.ranks()[r];
  return fmt::format("rank {} [dp {} pp {}; {} GPUs from GPU {}]", r, ri.dp, ri.pp, ri.gpus,
                     ri.first_gpu);
}

std::vector<uint8_t> IncludedRanks(const Table& t, const TraceOptions& o) {
  auto included = [](const std::vector<int32_t>& filter, int32_t v) {
    return filter.empty() || std::find(filter.begin(), filter.end(), v) != filter.end();
  };
  std::vector<uint8_t> include(t.num_ranks());
  for (int32_t r = 0; r < t.num_ranks(); ++r)
    include[r] = included(o.ranks, r) && included(o.dp_replicas, t.ranks()[r].dp);
  return include;
}

Lanes AssignLanes(const Table& t, const Timeline& tl, const std::vector<uint8_t>& include) {
  Lanes out;
  out.lane.assign(t.size(), -1);
  out.count.assign(t.num_ranks(), {});
  std::vector<int64_t> lane_end[kNumTracks];
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    if (!include[r]) continue;
    for (auto& l : lane_end) l.clear();
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i) {
      if (tl.start[i] < 0) continue;
      const Track tr = TrackOf(t, i);
      const int64_t start = Ns(tl.start[i]), end = std::max(start, Ns(tl.end[i]));
      auto& lanes = lane_end[tr];
      size_t lane = 0;
      while (lane < lanes.size() && lanes[lane] > start) ++lane;
      if (lane == lanes.size()) {
        if (lanes.size() == kMaxLanes)
          lane = kMaxLanes - 1;  // never in practice
        else
          lanes.push_back(end);
      }
      lanes[lane] = std::max(lanes[lane], end);
      out.lane[i] = static_cast<int32_t>(lane);
    }
    for (int tr = 0; tr < kNumTracks; ++tr)
      out.count[r][tr] = static_cast<int32_t>(lane_end[tr].size());
  }
  return out;
}

}  // namespace trace

namespace {

using trace::kNumTracks;
using trace::kTrackNames;
using trace::Ns;
constexpr int64_t kTidsPerRank = int64_t{kNumTracks} * trace::kMaxLanes;
// tid = rank * kTidsPerRank + track * kMaxLanes + lane
int64_t Tid(int32_t rank, int track, int32_t lane) {
  return rank * kTidsPerRank + track * int64_t{trace::kMaxLanes} + lane;
}

// Appends `s` as a JSON string literal: quotes, and escapes for ", \ and control bytes
// (JSON's rules; other bytes pass through as UTF-8).
void Quote(fmt::memory_buffer& out, std::string_view s) {
  out.push_back('"');
  size_t plain = 0;  // start of the run of bytes that need no escape
  for (size_t k = 0; k < s.size(); ++k) {
    const auto c = static_cast<unsigned char>(s[k]);
    if (c >= 0x20 && c != '"' && c != '\\') continue;
    out.append(s.data() + plain, s.data() + k);
    plain = k + 1;
    if (c < 0x20)
      fmt::format_to(fmt::appender(out), FMT_COMPILE("\\u{:04x}"), c);
    else
      out.push_back('\\'), out.push_back(static_cast<char>(c));
  }
  out.append(s.data() + plain, s.data() + s.size());
  out.push_back('"');
}

void Us(fmt::memory_buffer& out, int64_t ns) {
  if (ns < 0) out.push_back('-');
  const uint64_t a = ns < 0 ? 0 - static_cast<uint64_t>(ns) : static_cast<uint64_t>(ns);
  const fmt::format_int whole(a / 1000);
  out.append(whole.data(), whole.data() + whole.size());
  const auto frac = static_cast<unsigned>(a % 1000);
  const char digits[4] = {'.', static_cast<char>('0' + frac / 100),
                          static_cast<char>('0' + frac / 10 % 10),
                          static_cast<char>('0' + frac % 10)};
  out.append(digits, digits + 4);
}

// `key` then the number as {:.6g} writes it.
void Field6(fmt::memory_buffer& out, std::string_view key, double v) {
  out.append(key);
  char text[32];
  out.append(text, trace::General6(v, text));
}

// The trace's text, handed to `sink` in pieces of about kFlushBytes.
class TraceText {
 public:
  static constexpr size_t kFlushBytes = size_t{1} << 20;
  explicit TraceText(const std::function<Status(std::string_view)>& sink) : sink_(sink) {}
  fmt::memory_buffer& buf() { return buf_; }
  // Starts the next event.
  fmt::memory_buffer& Event() {
    if (!first_) buf_.append(std::string_view(",\n"));
    first_ = false;
    return buf_;
  }
  template <typename... Args>
  void Add(fmt::format_string<Args...> f, Args&&... args) {
    fmt::format_to(fmt::appender(buf_), f, std::forward<Args>(args)...);
  }
  Status Flush(bool all = false) {
    if (!status_.ok() || (!all && buf_.size() < kFlushBytes)) return status_;
    status_ = sink_(std::string_view(buf_.data(), buf_.size()));
    buf_.clear();
    return status_;
  }

 private:
  const std::function<Status(std::string_view)>& sink_;
  fmt::memory_buffer buf_;
  bool first_ = true;
  Status status_ = Status::Ok();
};

}  // namespace

Status StreamChromeTrace(const Table& t, const Timeline& tl,
                         const std::vector<CounterTrack>& counters, const TraceOptions& o,
                         const std::function<Status(std::string_view)>& sink) {
  const std::vector<uint8_t> include = trace::IncludedRanks(t, o);
  const trace::Lanes lanes = trace::AssignLanes(t, tl, include);
  TraceText out(sink);
  auto& buf = out.buf();
  out.Add("{{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
  auto ran = [&](OpId i) { return include[t.rank(i)] && tl.start[i] >= 0; };
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    if (!include[r]) continue;
    out.Event();
    out.Add(R"({{"ph":"M","name":"process_name","pid":{},"args":{{"name":)", r);
    Quote(buf, trace::RankLabel(t, r));
    out.Add("}}}}");
    out.Event();
    out.Add(R"({{"ph":"M","name":"process_sort_index","pid":{},"args":{{"sort_index":{}}}}})", r,
            r);
    for (int tr = 0; tr < kNumTracks; ++tr)
      for (int32_t lane = 0; lane < lanes.count[r][tr]; ++lane) {
        const std::string name = trace::LaneName(tr, lane);
        const int64_t tid = Tid(r, tr, lane);
        out.Event();
        out.Add(R"({{"ph":"M","name":"thread_name","pid":{},"tid":{},"args":{{"name":)", r, tid);
        Quote(buf, name);
        out.Add("}}}}");
        out.Event();
        out.Add(
            R"({{"ph":"M","name":"thread_sort_index","pid":{},"tid":{},"args":{{"sort_index":{}}}}})",
            r, tid, tr * trace::kMaxLanes + lane);
      }
    RETURN_IF_ERROR(out.Flush());
  }
  std::string name;
  auto put = [&](std::string_view text) { buf.append(text); };
  for (OpId i = 0; i < t.size(); ++i) {
    if (!ran(i)) continue;  // negative start: never ran
    const Work& w = t.work(i);
    const int64_t start = Ns(tl.start[i]), end = std::max(start, Ns(tl.end[i]));
    const std::string_view module = ModuleName(t.module(i));
    name.clear();
    AppendOp(&name, t.key(i));
    out.Event();
    put(R"({"ph":"X","name":)");
    Quote(buf, name);
    put(R"(,"cat":)");
    Quote(buf, module);
    fmt::format_to(fmt::appender(buf), FMT_COMPILE(R"(,"pid":{},"tid":{},"ts":)"), t.rank(i),
                   Tid(t.rank(i), trace::TrackOf(t, i), lanes.lane[i]));
    Us(buf, start);
    put(R"(,"dur":)");
    Us(buf, end - start);
    put(R"(,"args":{"module":)");
    Quote(buf, module);
    put(R"(,"kind":)");
    Quote(buf, KindName(t.kind(i)));
    auto field = [&](std::string_view key, int32_t v) {
      if (v < 0) return;
      put(key);
      const fmt::format_int digits(v);
      buf.append(digits.data(), digits.data() + digits.size());
    };
    field(R"(,"microbatch":)", t.mb(i));
    field(R"(,"chunk":)", t.chunk(i));
    field(R"(,"task":)", t.task(i));
    if (w.flops > 0) Field6(buf, R"(,"flops":)", w.flops);
    if (w.hbm_bytes > 0) Field6(buf, R"(,"hbm_bytes":)", w.hbm_bytes);
    if (w.payload_bytes > 0) Field6(buf, R"(,"payload_bytes":)", w.payload_bytes);
    if (o.predicted_s) Field6(buf, R"(,"predicted_us":)", (*o.predicted_s)[i] * 1e6);
    put("}}");
    RETURN_IF_ERROR(out.Flush());
  }
  // Flow arrows SEND -> RECV after every slice: each binds to the slice it starts or ends
  // in, which the importer must have read first.
  for (OpId i = 0; i < t.size(); ++i) {
    if (!IsRecv(t.kind(i)) || !ran(i)) continue;
    const OpId s = t.send_of(i);
    if (s == UINT32_MAX || !ran(s)) continue;
    out.Event();
    fmt::format_to(
        fmt::appender(buf),
        FMT_COMPILE(R"({{"ph":"s","name":"p2p","cat":"p2p","id":{},"pid":{},"tid":{},"ts":)"),
        t.tag(i), t.rank(s), Tid(t.rank(s), trace::kSend, lanes.lane[s]));
    Us(buf, Ns(tl.start[s]));
    buf.push_back('}');
    out.Event();
    fmt::format_to(
        fmt::appender(buf),
        FMT_COMPILE(
            R"({{"ph":"f","bp":"e","name":"p2p","cat":"p2p","id":{},"pid":{},"tid":{},"ts":)"),
        t.tag(i), t.rank(i), Tid(t.rank(i), trace::kRecv, lanes.lane[i]));
    Us(buf, Ns(tl.start[i]));
    buf.push_back('}');
    RETURN_IF_ERROR(out.Flush());
  }
  for (const CounterTrack& c : counters) {
    if (c.rank < 0 || c.rank >= t.num_ranks() || !include[c.rank]) continue;
    for (size_t s = 0; s < c.times_s.size(); ++s) {
      out.Event();
      out.Add(R"({{"ph":"C","name":)");
      Quote(buf, c.name);
      fmt::format_to(fmt::appender(buf), FMT_COMPILE(R"(,"pid":{},"ts":)"), c.rank);
      Us(buf, Ns(c.times_s[s]));
      buf.append(std::string_view(R"(,"args":{)"));
      for (size_t k = 0; k < c.keys.size(); ++k) {
        if (k) buf.push_back(',');
        Quote(buf, c.keys[k]);
        Field6(buf, ":", c.samples[s][k]);
      }
      buf.append(std::string_view("}}"));
      RETURN_IF_ERROR(out.Flush());
    }
  }
  nlohmann::json other = {{"tool", "pipeplan"},
                          {"version", kVersion},
                          {"source", o.source},
                          {"schedule", t.meta().schedule},
                          {"modality", t.meta().modality},
                          {"config", t.meta().config_yaml}};
  out.Add("\n],\"otherData\":{}}}\n", DumpJson(other, -1));
  return out.Flush(true);
}

std::string ChromeTrace(const Table& t, const Timeline& tl,
                        const std::vector<CounterTrack>& counters, const TraceOptions& o) {
  std::string text;
  const std::function<Status(std::string_view)> sink = [&](std::string_view piece) {
    text.append(piece);
    return Status::Ok();
  };
  (void)StreamChromeTrace(t, tl, counters, o, sink);  // this sink never fails
  return text;
}

StatusOr<size_t> WriteChromeTrace(const std::string& path, const Table& t, const Timeline& tl,
                                  const std::vector<CounterTrack>& counters,
                                  const TraceOptions& o) {
  OutputFile f;
  RETURN_IF_ERROR(f.Open(path, std::string_view(path).ends_with(".gz")));
  const std::function<Status(std::string_view)> sink = [&](std::string_view piece) {
    return f.Write(piece);
  };
  RETURN_IF_ERROR(StreamChromeTrace(t, tl, counters, o, sink));
  RETURN_IF_ERROR(f.Commit());
  return f.bytes_written();
}

StatusOr<std::unique_ptr<TraceJournal>> TraceJournal::Open(const std::string& path, const Table& t,
                                                           int32_t rank) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return InvalidInput(fmt::format("{}: cannot write the trace journal", path));
  std::unique_ptr<TraceJournal> j(new TraceJournal(t, path, f));
  fmt::memory_buffer buf;
  fmt::format_to(fmt::appender(buf),
                 R"([{{"ph":"M","name":"process_name","pid":{},"args":{{"name":)", rank);
  Quote(buf, fmt::format("rank {} (journal: ops as they ended)", rank));
  buf.append(std::string_view("}},\n"));
  std::fwrite(buf.data(), 1, buf.size(), f);
  std::fflush(f);
  return j;
}

void TraceJournal::Append(OpId i, double start_s, double end_s) {
  if (f_ == nullptr) return;
  fmt::memory_buffer buf;
  const int64_t start = Ns(start_s), end = std::max(start, Ns(end_s));
  buf.append(std::string_view(R"({"ph":"X","name":)"));
  Quote(buf, t_.str(i));
  fmt::format_to(fmt::appender(buf), R"(,"cat":"{}","pid":{},"tid":0,"ts":)",
                 ModuleName(t_.module(i)), t_.rank(i));
  Us(buf, start);
  buf.append(std::string_view(",\"dur\":"));
  Us(buf, end - start);
  fmt::format_to(fmt::appender(buf), R"(,"args":{{"module":"{}","kind":"{}"}}}},)",
                 ModuleName(t_.module(i)), KindName(t_.kind(i)));
  buf.push_back('\n');
  std::fwrite(buf.data(), 1, buf.size(), f_);
  std::fflush(f_);  // in the kernel's hands now: survives the process
}

void TraceJournal::Remove() {
  if (f_ != nullptr) std::fclose(f_), f_ = nullptr;
  std::remove(path_.c_str());
}

TraceJournal::~TraceJournal() {
  if (f_ != nullptr) std::fclose(f_);
}

}  // namespace pipeplan
