#include "core/perfetto_trace.h"

#include <fmt/format.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <algorithm>
#include <array>
#include <iterator>

#include "core/files.h"
#include "core/trace_lanes.h"
#include "perfetto_trace.pb.h"

namespace pipeplan {
namespace {

namespace pb = perfetto::protos;
constexpr uint32_t kSequence = 1;  // one writer: one packet sequence

// Interned strings: categories (module names) and argument names, by iid.
constexpr const char* kArgNames[] = {"",      "microbatch", "chunk",         "task",
                                     "flops", "hbm_bytes",  "payload_bytes", "predicted_us"};
enum Arg : uint64_t { kMb = 1, kChunk, kTask, kFlops, kHbm, kPayload, kPredicted };
uint64_t CategoryIid(Module m) {
  return static_cast<uint64_t>(m) + 1;
}

// One event to write, in time order. At one time: slice ends first, then SEND begins (a
// flow's start must precede its end in the file), then other begins; a zero-length slice's
// end right after its begin; counter samples last.
struct Event {
  int64_t ns;
  uint32_t id;         // op, or index of the counter sample
  uint8_t phase, sub;  // phase 0 end, 1 SEND begin, 2 begin, 3 counter; sub 1 = an end
  bool operator<(const Event& e) const {
    if (ns != e.ns) return ns < e.ns;
    if (phase != e.phase) return phase < e.phase;
    if (id != e.id) return id < e.id;
    return sub < e.sub;
  }
};

class PacketWriter {
 public:
  explicit PacketWriter(OutputFile* f) : f_(f) {}
  // Appends `p` as field 1 of Trace (tag, length, bytes); writes out every ~1 MiB.
  Status Put(pb::TracePacket& p) {
    p.set_trusted_packet_sequence_id(kSequence);
    {
      google::protobuf::io::StringOutputStream sink(&buf_);
      google::protobuf::io::CodedOutputStream coded(&sink);
      coded.WriteTag(0x0a);  // field 1, length-delimited
      coded.WriteVarint32(static_cast<uint32_t>(p.ByteSizeLong()));
      p.SerializeWithCachedSizes(&coded);
    }
    p.Clear();
    return buf_.size() >= (size_t{1} << 20) ? Flush() : Status::Ok();
  }
  Status Flush() {
    Status s = f_->Write(buf_);
    buf_.clear();
    return s;
  }

 private:
  OutputFile* f_;
  std::string buf_;
};

void Annotate(pb::TrackEvent* e, Arg name, int64_t v) {
  auto* a = e->add_debug_annotations();
  a->set_name_iid(name);
  a->set_int_value(v);
}
void Annotate(pb::TrackEvent* e, Arg name, double v) {
  auto* a = e->add_debug_annotations();
  a->set_name_iid(name);
  a->set_double_value(v);
}

}  // namespace

StatusOr<size_t> WritePerfettoTrace(const std::string& path, const Table& t, const Timeline& tl,
                                    const std::vector<CounterTrack>& counters,
                                    const TraceOptions& o) {
  const std::vector<uint8_t> include = trace::IncludedRanks(t, o);
  const trace::Lanes lanes = trace::AssignLanes(t, tl, include);
  OutputFile f;
  RETURN_IF_ERROR(f.Open(path, std::string_view(path).ends_with(".gz")));
  PacketWriter out(&f);
  pb::TracePacket p;
  // Track uuids, given in order: 1 the trace, then per rank its process track, its lanes,
  // its counters.
  uint64_t next_uuid = 1;
  p.set_sequence_flags(1);  // SEQ_INCREMENTAL_STATE_CLEARED: interned data starts here
  auto* interned = p.mutable_interned_data();
  for (int m = 0; m < kNumModules; ++m) {
    auto* c = interned->add_event_categories();
    c->set_iid(CategoryIid(static_cast<Module>(m)));
    c->set_name(std::string(ModuleName(static_cast<Module>(m))));
  }
  for (uint64_t k = 1; k < std::size(kArgNames); ++k) {
    auto* n = interned->add_debug_annotation_names();
    n->set_iid(k);
    n->set_name(kArgNames[k]);
  }
  p.mutable_track_descriptor()->set_uuid(next_uuid++);
  p.mutable_track_descriptor()->set_name(
      fmt::format("pipeplan: {} {} ({})", t.meta().schedule, t.meta().modality, o.source));
  RETURN_IF_ERROR(out.Put(p));
  std::vector<std::array<uint64_t, trace::kNumTracks>> lane_uuid(t.num_ranks());  // lane 0's
  std::vector<uint64_t> process_uuid(t.num_ranks(), 0);
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    if (!include[r]) continue;
    process_uuid[r] = next_uuid++;
    auto* d = p.mutable_track_descriptor();
    d->set_uuid(process_uuid[r]);
    d->mutable_process()->set_pid(r);
    d->mutable_process()->set_process_name(trace::RankLabel(t, r));
    RETURN_IF_ERROR(out.Put(p));
    for (int tr = 0; tr < trace::kNumTracks; ++tr) {
      lane_uuid[r][tr] = next_uuid;
      for (int32_t lane = 0; lane < lanes.count[r][tr]; ++lane) {
        d = p.mutable_track_descriptor();
        d->set_uuid(next_uuid++);
        d->set_parent_uuid(process_uuid[r]);
        d->set_name(trace::LaneName(tr, lane));
        d->set_sibling_order_rank(tr * trace::kMaxLanes + lane);
        RETURN_IF_ERROR(out.Put(p));
      }
    }
  }
  // Counter tracks, one per (counter, key); samples flattened as (counter, sample).
  std::vector<uint64_t> counter_uuid(counters.size(), 0);  // of key 0; keys follow
  std::vector<std::pair<uint32_t, uint32_t>> samples;
  for (uint32_t c = 0; c < counters.size(); ++c) {
    const CounterTrack& ct = counters[c];
    if (ct.rank < 0 || ct.rank >= t.num_ranks() || !include[ct.rank]) continue;
    counter_uuid[c] = next_uuid;
    for (size_t k = 0; k < ct.keys.size(); ++k) {
      auto* d = p.mutable_track_descriptor();
      d->set_uuid(next_uuid++);
      d->set_parent_uuid(process_uuid[ct.rank]);
      d->set_name(fmt::format("{}: {}", ct.name, ct.keys[k]));
      RETURN_IF_ERROR(out.Put(p));
    }
    for (uint32_t s = 0; s < ct.times_s.size(); ++s) samples.push_back({c, s});
  }
  std::vector<OpId> recv_of(t.size(), UINT32_MAX);  // of each SEND drawn, its RECV drawn
  std::vector<Event> events;
  for (OpId i = 0; i < t.size(); ++i) {
    if (lanes.lane[i] < 0) continue;
    if (IsRecv(t.kind(i)))
      if (const OpId s = t.send_of(i); s != UINT32_MAX && lanes.lane[s] >= 0) recv_of[s] = i;
    const int64_t start = trace::Ns(tl.start[i]), end = std::max(start, trace::Ns(tl.end[i]));
    const uint8_t begin = IsSend(t.kind(i)) ? 1 : 2;
    events.push_back({start, i, begin, 0});
    events.push_back({end, i, static_cast<uint8_t>(end == start ? begin : 0), 1});
  }
  for (uint32_t k = 0; k < samples.size(); ++k)
    events.push_back({trace::Ns(counters[samples[k].first].times_s[samples[k].second]), k, 3, 0});
  std::sort(events.begin(), events.end());
  std::string name;
  for (const Event& ev : events) {
    p.set_timestamp(static_cast<uint64_t>(ev.ns));
    auto* e = p.mutable_track_event();
    if (ev.phase == 3) {  // a counter holds its value: only keys that changed are written
      const auto [c, s] = samples[ev.id];
      const CounterTrack& ct = counters[c];
      for (size_t k = 0; k < ct.keys.size(); ++k) {
        if (s > 0 && ct.samples[s][k] == ct.samples[s - 1][k]) continue;
        p.set_timestamp(static_cast<uint64_t>(ev.ns));
        e = p.mutable_track_event();
        e->set_type(pb::TrackEvent::TYPE_COUNTER);
        e->set_track_uuid(counter_uuid[c] + k);
        e->set_double_counter_value(ct.samples[s][k]);
        RETURN_IF_ERROR(out.Put(p));
      }
      p.Clear();
      continue;
    }
    const OpId i = ev.id;
    const trace::Track tr = trace::TrackOf(t, i);
    e->set_track_uuid(lane_uuid[t.rank(i)][tr] + static_cast<uint64_t>(lanes.lane[i]));
    if (ev.sub == 1) {
      e->set_type(pb::TrackEvent::TYPE_SLICE_END);
      RETURN_IF_ERROR(out.Put(p));
      continue;
    }
    e->set_type(pb::TrackEvent::TYPE_SLICE_BEGIN);
    p.set_sequence_flags(2);  // SEQ_NEEDS_INCREMENTAL_STATE: uses the interned strings
    name.clear();
    AppendOp(&name, t.key(i));
    e->set_name(name);  // the op string names its module and kind
    e->add_category_iids(CategoryIid(t.module(i)));
    if (t.mb(i) >= 0) Annotate(e, kMb, int64_t{t.mb(i)});
    if (t.chunk(i) >= 0) Annotate(e, kChunk, int64_t{t.chunk(i)});
    if (t.task(i) >= 0) Annotate(e, kTask, int64_t{t.task(i)});
    const Work& w = t.work(i);
    if (w.flops > 0) Annotate(e, kFlops, w.flops);
    if (w.hbm_bytes > 0) Annotate(e, kHbm, w.hbm_bytes);
    if (w.payload_bytes > 0) Annotate(e, kPayload, w.payload_bytes);
    if (o.predicted_s) Annotate(e, kPredicted, (*o.predicted_s)[i] * 1e6);
    // Flows: from the SEND's slice to its RECV's, both drawn; the id is the RECV's.
    if (IsRecv(t.kind(i))) {
      const OpId s = t.send_of(i);
      if (s != UINT32_MAX && lanes.lane[s] >= 0) e->add_terminating_flow_ids(uint64_t{i} + 1);
    } else if (IsSend(t.kind(i)) && recv_of[i] != UINT32_MAX) {
      e->add_flow_ids(uint64_t{recv_of[i]} + 1);
    }
    RETURN_IF_ERROR(out.Put(p));
  }
  RETURN_IF_ERROR(out.Flush());
  RETURN_IF_ERROR(f.Commit());
  return f.bytes_written();
}

}  // namespace pipeplan
