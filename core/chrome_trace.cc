#include "core/chrome_trace.h"

#include <fmt/compile.h>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <new>
#include <nlohmann/json.hpp>
#include <system_error>
#include <thread>

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

// Writers into room reserved at the end of a buffer (the caller sizes it): the per-op
// events are most of a trace, and a call per piece of text would cost more than the text.
//
// `s` as a JSON string literal: quotes, and escapes for ", \ and control bytes (JSON's rules;
// other bytes pass through as UTF-8). Room: 6 bytes per byte of `s`, and 2.
char* WriteQuoted(char* p, std::string_view s) {
  *p++ = '"';
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c != '"' && c != '\\') {
      *p++ = ch;
    } else if (c < 0x20) {
      constexpr char kHex[] = "0123456789abcdef";
      p = std::copy_n("\\u00", 4, p);
      *p++ = kHex[c >> 4], *p++ = kHex[c & 15];
    } else {
      *p++ = '\\', *p++ = ch;
    }
  }
  *p++ = '"';
  return p;
}

// Nanoseconds as microseconds with three decimals. Room: 25 bytes.
char* WriteUs(char* p, int64_t ns) {
  if (ns < 0) *p++ = '-';
  const uint64_t a = ns < 0 ? 0 - static_cast<uint64_t>(ns) : static_cast<uint64_t>(ns);
  p = std::to_chars(p, p + 20, a / 1000).ptr;
  const auto frac = static_cast<unsigned>(a % 1000);
  *p++ = '.', *p++ = static_cast<char>('0' + frac / 100);
  *p++ = static_cast<char>('0' + frac / 10 % 10), *p++ = static_cast<char>('0' + frac % 10);
  return p;
}

// A cursor over `room` bytes reserved at the end of `buf`; the buffer ends where the
// cursor is when it goes.
class Room {
 public:
  Room(fmt::memory_buffer& buf, size_t room) : buf_(buf) {
    const size_t old = buf.size();
    buf.resize(old + room);
    p_ = buf.data() + old;
  }
  Room(const Room&) = delete;
  Room& operator=(const Room&) = delete;
  ~Room() { buf_.resize(static_cast<size_t>(p_ - buf_.data())); }
  template <size_t N>
  Room& operator<<(const char (&literal)[N]) {
    p_ = std::copy_n(literal, N - 1, p_);
    return *this;
  }
  Room& Text(std::string_view s) {
    p_ = std::copy_n(s.data(), s.size(), p_);
    return *this;
  }
  Room& Quoted(std::string_view s) {  // room: 6 bytes per byte, and 2
    p_ = WriteQuoted(p_, s);
    return *this;
  }
  Room& Op(const OpKey& op) {  // the op's name (nothing to escape); room: kMaxOpText
    p_ = WriteOp(p_, op);
    return *this;
  }
  Room& Int(int64_t v) {  // room: 20 bytes
    p_ = std::to_chars(p_, p_ + 20, v).ptr;
    return *this;
  }
  Room& Us(int64_t ns) {  // room: 25 bytes
    p_ = WriteUs(p_, ns);
    return *this;
  }
  Room& General6(double v) {  // as {:.6g} writes it; room: 32 bytes
    p_ = trace::General6(v, p_);
    return *this;
  }

 private:
  fmt::memory_buffer& buf_;
  char* p_;
};

void Quote(fmt::memory_buffer& out, std::string_view s) {
  Room(out, 6 * s.size() + 2).Quoted(s);
}

void Us(fmt::memory_buffer& out, int64_t ns) {
  Room(out, 25).Us(ns);
}

// `key` then the number as {:.6g} writes it.
void Field6(fmt::memory_buffer& out, std::string_view key, double v) {
  Room(out, key.size() + 32).Text(key).General6(v);
}

// The trace's text, handed to `sink` in pieces of about kFlushBytes. The sink runs on a
// thread of its own, one piece behind: the next piece is formatted while the last one is
// written (the kernel's copy into the page cache, or gzip, is about as long as the
// formatting). Where the machine refuses a thread, each piece is written at once.
class TraceText {
 public:
  static constexpr size_t kFlushBytes = size_t{1} << 20;
  explicit TraceText(const std::function<Status(std::string_view)>& sink) : sink_(sink) {
    try {
      writer_ = std::thread([this] { WriteLoop(); });
    } catch (const std::system_error&) {
    }
  }
  TraceText(const TraceText&) = delete;
  TraceText& operator=(const TraceText&) = delete;
  ~TraceText() {
    if (!writer_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    writer_.join();
  }
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
  // Hands the text so far to the sink once it is kFlushBytes long (`all`: now, and waits
  // until everything is written). Returns the sink's first error.
  Status Flush(bool all = false) {
    if (!all && buf_.size() < kFlushBytes) return Status::Ok();
    if (!writer_.joinable()) {
      if (status_.ok()) status_ = Write(buf_);
      buf_.clear();
      return status_;
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !full_; });  // the writer is done with the last piece
    if (!status_.ok()) return status_;
    std::swap(buf_, next_);
    buf_.clear();
    full_ = true;
    cv_.notify_all();
    if (all) cv_.wait(lock, [&] { return !full_; });
    return status_;
  }

 private:
  Status Write(const fmt::memory_buffer& piece) {
    try {
      return sink_(std::string_view(piece.data(), piece.size()));
    } catch (const std::bad_alloc&) {
      return Internal("out of memory while writing the trace");
    }
  }
  void WriteLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return full_ || stop_; });
      if (!full_) return;
      const bool failed = !status_.ok();
      lock.unlock();  // next_ is the writer's until full_ is cleared
      Status s = failed ? Status::Ok() : Write(next_);
      lock.lock();
      if (status_.ok()) status_ = std::move(s);
      full_ = false;
      cv_.notify_all();
    }
  }
  const std::function<Status(std::string_view)>& sink_;
  fmt::memory_buffer buf_, next_;  // being formatted; being written (while full_)
  bool first_ = true;
  std::mutex mu_;
  std::condition_variable cv_;
  bool full_ = false, stop_ = false;
  Status status_ = Status::Ok();  // the sink's first error (guarded by mu_ with a writer)
  std::thread writer_;
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
  // Room for an op event: its literals, its name, names of kinds and modules, seven
  // integers and four numbers.
  constexpr size_t kEventRoom = 512 + kMaxOpText;
  for (OpId i = 0; i < t.size(); ++i) {
    if (!ran(i)) continue;  // negative start: never ran
    const Work& w = t.work(i);
    const int64_t start = Ns(tl.start[i]), end = std::max(start, Ns(tl.end[i]));
    const std::string_view module = ModuleName(t.module(i));
    out.Event();
    {
      Room e(buf, kEventRoom);
      e << R"({"ph":"X","name":")";
      e.Op(t.key(i)) << R"(","cat":)";
      e.Quoted(module) << R"(,"pid":)";
      e.Int(t.rank(i)) << R"(,"tid":)";
      e.Int(Tid(t.rank(i), trace::TrackOf(t, i), lanes.lane[i])) << R"(,"ts":)";
      e.Us(start) << R"(,"dur":)";
      e.Us(end - start) << R"(,"args":{"module":)";
      e.Quoted(module) << R"(,"kind":)";
      e.Quoted(KindName(t.kind(i)));
      if (t.mb(i) >= 0) e << R"(,"microbatch":)", e.Int(t.mb(i));
      if (t.chunk(i) >= 0) e << R"(,"chunk":)", e.Int(t.chunk(i));
      if (t.task(i) >= 0) e << R"(,"task":)", e.Int(t.task(i));
      if (w.flops > 0) e << R"(,"flops":)", e.General6(w.flops);
      if (w.hbm_bytes > 0) e << R"(,"hbm_bytes":)", e.General6(w.hbm_bytes);
      if (w.payload_bytes > 0) e << R"(,"payload_bytes":)", e.General6(w.payload_bytes);
      if (o.predicted_s) e << R"(,"predicted_us":)", e.General6((*o.predicted_s)[i] * 1e6);
      e << "}}";
    }
    RETURN_IF_ERROR(out.Flush());
  }
  // Flow arrows SEND -> RECV after every slice: each binds to the slice it starts or ends
  // in, which the importer must have read first.
  for (OpId i = 0; i < t.size(); ++i) {
    if (!IsRecv(t.kind(i)) || !ran(i)) continue;
    const OpId s = t.send_of(i);
    if (s == UINT32_MAX || !ran(s)) continue;
    out.Event();
    {
      Room e(buf, kEventRoom);
      e << R"({"ph":"s","name":"p2p","cat":"p2p","id":)";
      e.Int(t.tag(i)) << R"(,"pid":)";
      e.Int(t.rank(s)) << R"(,"tid":)";
      e.Int(Tid(t.rank(s), trace::kSend, lanes.lane[s])) << R"(,"ts":)";
      e.Us(Ns(tl.start[s])) << "}";
    }
    out.Event();
    {
      Room e(buf, kEventRoom);
      e << R"({"ph":"f","bp":"e","name":"p2p","cat":"p2p","id":)";
      e.Int(t.tag(i)) << R"(,"pid":)";
      e.Int(t.rank(i)) << R"(,"tid":)";
      e.Int(Tid(t.rank(i), trace::kRecv, lanes.lane[i])) << R"(,"ts":)";
      e.Us(Ns(tl.start[i])) << "}";
    }
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
