#include "helpers.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>

#include "perfetto_trace.pb.h"
#include "planner/lower.h"
#include "planner/plan.h"

namespace pipeplan::test {

Config ParseYaml(const std::string& yaml, std::vector<std::string> sets) {
  auto doc = YamlDoc::FromString("test.yaml", yaml);
  REQUIRE_MESSAGE(doc.ok(), doc.status().message());
  for (auto& s : sets) REQUIRE(doc->ApplySet(s).ok());
  auto c = ParseConfig(std::move(*doc));
  REQUIRE_MESSAGE(c.ok(), c.status().message());
  return std::move(c).value();
}

Config SmallConfig(PipelineKind kind, int pp, int vp, int m, int dp,
                   std::vector<std::string> sets) {
  std::string yaml = fmt::format(R"(
cluster: {{gpu: H100, nodes: 1, gpus_per_node: {}}}
model:
  llm: {{layers: {}, hidden: 256, ffn: 1024, heads: 4, vocab: 1000}}
parallelism: {{tp: 1, pp: {}, vp: {}}}
training: {{seq_length: 128, micro_batch_size: 1, microbatches: {}}}
schedule: {{pipeline: {}}}
)",
                                 pp * dp, 2 * pp * vp, pp, vp, m, PipelineName(kind));
  return ParseYaml(yaml, std::move(sets));
}

std::vector<OpId> RankOps(const Table& t, int32_t rank, const std::function<bool(OpId)>& keep) {
  std::vector<OpId> out;
  for (OpId i = t.rank_begin(rank); i < t.rank_end(rank); ++i)
    if (keep(i)) out.push_back(i);
  return out;
}

Config MultimodalConfig(const std::string& policy, std::vector<std::string> sets) {
  std::string yaml = R"(
cluster: {gpu: H100, nodes: 1, gpus_per_node: 8}
model:
  llm: {layers: 8, hidden: 1024, ffn: 4096, heads: 8, vocab: 32000}
  vision: {layers: 3, hidden: 1024, mlp: 4096, heads: 16, cp_threshold_patches: 4096}
parallelism: {pp: 4}
training: {seq_length: 8192, microbatches: 8}
data:
  seed: 5
  text_tokens: 512
  images_per_sample: 2
  images:
    - {height: 224, width: 224, weight: 0.6}
    - {height: 2048, width: 2048, weight: 0.4}
schedule: {pipeline: 1f1b, modality: )" +
                     policy + "}\n";
  return ParseYaml(yaml, std::move(sets));
}

Table Plan(const Config& c) {
  auto t = BuildPlan(c);
  REQUIRE_MESSAGE(t.ok(), t.status().message());
  return std::move(t).value();
}

Table TableFromOps(const std::vector<std::vector<std::string>>& ranks, int pp, int vp, int m,
                   std::vector<std::vector<int32_t>> groups) {
  std::vector<RankInfo> infos(ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r)
    infos[r].dp = static_cast<int32_t>(r) / pp, infos[r].pp = static_cast<int32_t>(r) % pp;
  TableBuilder b(infos);
  for (auto& g : groups) b.AddGroup(g);
  Work f, bw, p2p;
  f.flops = 1, f.mem_delta_bytes = 1, f.layer_begin = 0, f.layer_end = 1;
  bw.flops = 2, bw.mem_delta_bytes = -1, bw.layer_begin = 0, bw.layer_end = 1;
  p2p.payload_bytes = 1;
  WorkId wf = b.AddWork(f), wb = b.AddWork(bw), wp = b.AddWork(p2p);
  // (sender, receiver, is_backward, module, mb, task, chunk for modality shards) -> handles
  using Key = std::tuple<int, int, bool, int, int, int, int>;
  std::map<Key, std::vector<TableBuilder::Handle>> sends, recvs;
  uint32_t next_tag = 1;
  for (auto& seq : ranks) {
    for (auto& s : seq) {
      auto key = ParseOp(s);
      REQUIRE_MESSAGE(key.ok(), key.status().message());
      OpKind k = key->kind;
      WorkId w = k == OpKind::kF ? wf : k == OpKind::kB ? wb : wp;
      uint32_t tag = IsCollective(k) ? CollectiveTag(k, key->module, key->chunk) : 0;
      auto h = b.AddAndAppend(*key, w, tag);
      bool bwd = k == OpKind::kSendB || k == OpKind::kRecvB;
      int mod = static_cast<int>(key->module),
          shard = key->module == Module::kText ? 0 : key->chunk;
      if (IsSend(k))
        sends[{key->rank, key->peer, bwd, mod, key->mb, key->task, shard}].push_back(h);
      if (IsRecv(k))
        recvs[{key->peer, key->rank, bwd, mod, key->mb, key->task, shard}].push_back(h);
    }
  }
  // Pair in order of appearance; the pair's tag is set after Finish.
  std::vector<std::pair<TableBuilder::Handle, TableBuilder::Handle>> pairs;
  for (auto& [key, ss] : sends) {
    auto& rs = recvs[key];
    for (size_t i = 0; i < std::min(ss.size(), rs.size()); ++i) pairs.push_back({rs[i], ss[i]});
  }
  for (auto& [rv, sd] : pairs) b.AddDep(rv, sd);
  PlanMeta meta;
  meta.pp = pp, meta.vp = vp, meta.dp = static_cast<int32_t>(ranks.size()) / pp,
  meta.microbatches = m;
  auto t = b.Finish(meta);
  REQUIRE_MESSAGE(t.ok(), t.status().message());
  Table out = std::move(t).value();
  TableColumns cols(&out);
  for (OpId i = 0; i < out.size(); ++i)
    if (IsRecv(out.kind(i)) && !out.deps(i).empty())
      cols.tag()[i] = cols.tag()[out.deps(i)[0]] = next_tag++;
  return out;
}

Table WithDep(const Table& t, OpId op, OpId on) {
  Table out = t;
  auto& deps = out.mutable_deps();
  auto& begin = out.mutable_dep_begin();
  deps.insert(deps.begin() + begin[op + 1], on);
  for (size_t i = op + 1; i < begin.size(); ++i) ++begin[i];
  return out;
}

OpId Find(const Table& t, const std::string& op) {
  for (OpId i = 0; i < t.size(); ++i)
    if (t.str(i) == op) return i;
  FAIL("op not found: " << op);
  return 0;
}

RunResult RunCli(const std::string& args) {
  return RunShell(fmt::format("{} {}", PIPEPLAN_BIN, args));
}

RunResult RunShell(const std::string& command) {
  std::string cmd = command + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::string TempDir() {
  char tmpl[] = "/tmp/pipeplan_test_XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  return tmpl;
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

std::string TraceRuleBroken(const std::string& text) {
  using nlohmann::json;
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.contains("traceEvents")) return "not a Chrome trace";
  auto ns = [](const json& v, int64_t* out) {
    const double us = v.get<double>();
    *out = std::llround(us * 1000);
    return std::abs(us * 1000 - static_cast<double>(*out)) < 1e-3;
  };
  // Slices per (pid, tid) as they are read, for the flow rule; then sorted, for overlap.
  std::map<std::pair<int64_t, int64_t>, std::vector<std::pair<int64_t, int64_t>>> slices;
  for (const json& e : j["traceEvents"]) {
    const std::string ph = e.value("ph", "");
    if (ph != "X" && ph != "s" && ph != "f" && ph != "C") continue;
    int64_t ts;
    if (!ns(e["ts"], &ts)) return fmt::format("ts {} is not in whole nanoseconds", e["ts"].dump());
    if (ph == "C") continue;
    const auto key = std::make_pair(e.value("pid", int64_t{0}), e.value("tid", int64_t{0}));
    if (ph == "X") {
      int64_t dur;
      if (!ns(e["dur"], &dur))
        return fmt::format("dur {} is not in whole nanoseconds", e["dur"].dump());
      slices[key].push_back({ts, ts + dur});
      continue;
    }
    bool bound = false;
    for (auto [b, end] : slices[key]) bound = bound || (b <= ts && ts <= end);
    if (!bound)
      return fmt::format("flow {} {} at {} ns has no slice of its thread written before it", ph,
                         e["id"].dump(), ts);
  }
  for (auto& [key, v] : slices) {
    std::sort(v.begin(), v.end());
    for (size_t i = 1; i < v.size(); ++i)
      if (v[i].first < v[i - 1].second)
        return fmt::format("slices of pid {} tid {} overlap at {} ns", key.first, key.second,
                           v[i].first);
  }
  return "";
}

std::string TraceFileRuleBroken(const std::string& path) {
  if (path.size() > 3 && path.compare(path.size() - 3, 3, ".gz") == 0) {
    RunResult r = RunShell("gzip -dc " + path);
    if (r.exit_code != 0) return "not gzip: " + r.out;
    return TraceRuleBroken(r.out);
  }
  return TraceRuleBroken(Slurp(path));
}

std::string PftraceRuleBroken(const std::string& path, PftraceCounts* counts) {
  namespace pb = perfetto::protos;
  const std::string bytes = Slurp(path);
  size_t pos = 0;
  auto varint = [&](uint64_t* v) {
    *v = 0;
    for (int shift = 0; pos < bytes.size() && shift < 64; shift += 7) {
      const auto c = static_cast<unsigned char>(bytes[pos++]);
      *v |= uint64_t{c & 0x7fu} << shift;
      if (c < 0x80) return true;
    }
    return false;
  };
  std::map<uint64_t, int> open;  // track uuid -> open slices
  std::set<uint64_t> categories, arg_names;
  std::map<uint64_t, int> flow_state;  // 1 started, 2 terminated
  uint64_t last_ts = 0;
  bool cleared = false;
  *counts = {};
  pb::TracePacket p;
  for (size_t n = 0; pos < bytes.size(); ++n) {
    uint64_t tag = 0, len = 0;
    if (!varint(&tag) || tag != 0x0a || !varint(&len) || pos + len > bytes.size())
      return fmt::format("packet {}: not a Trace.packet field", n);
    if (!p.ParseFromArray(bytes.data() + pos, static_cast<int>(len)))
      return fmt::format("packet {}: not a TracePacket", n);
    pos += len;
    if (p.sequence_flags() & 1) {
      cleared = true;
      for (const auto& c : p.interned_data().event_categories()) categories.insert(c.iid());
      for (const auto& a : p.interned_data().debug_annotation_names()) arg_names.insert(a.iid());
    }
    if ((p.sequence_flags() & 2) && !cleared)
      return fmt::format("packet {} needs interned data before any was sent", n);
    if (p.has_track_descriptor()) {
      const auto& d = p.track_descriptor();
      if (open.count(d.uuid())) return fmt::format("track {} described twice", d.uuid());
      if (d.has_parent_uuid() && !open.count(d.parent_uuid()))
        return fmt::format("track {} has an undescribed parent {}", d.uuid(), d.parent_uuid());
      open[d.uuid()] = 0;
    }
    if (!p.has_track_event()) continue;
    const auto& e = p.track_event();
    if (p.timestamp() < last_ts)
      return fmt::format("packet {}: time {} ns before the previous {} ns", n, p.timestamp(),
                         last_ts);
    last_ts = p.timestamp();
    auto track = open.find(e.track_uuid());
    if (track == open.end())
      return fmt::format("packet {}: event on undescribed track {}", n, e.track_uuid());
    for (uint64_t c : e.category_iids())
      if (!categories.count(c)) return fmt::format("packet {}: unknown category iid {}", n, c);
    for (const auto& a : e.debug_annotations())
      if (a.has_name_iid() && !arg_names.count(a.name_iid()))
        return fmt::format("packet {}: unknown argument name iid {}", n, a.name_iid());
    switch (e.type()) {
      case pb::TrackEvent::TYPE_SLICE_BEGIN:
        if (track->second != 0)
          return fmt::format("{} at {} ns opens on track {} inside another slice", e.name(),
                             p.timestamp(), e.track_uuid());
        track->second = 1;
        ++counts->slices;
        counts->names.push_back(e.name());
        for (uint64_t f : e.flow_ids())
          if (flow_state[f]++ != 0) return fmt::format("flow {} started twice", f);
        for (uint64_t f : e.terminating_flow_ids()) {
          if (flow_state[f] != 1)
            return fmt::format("flow {} ends at {} without a start before it", f, p.timestamp());
          flow_state[f] = 2;
          ++counts->flows;
        }
        break;
      case pb::TrackEvent::TYPE_SLICE_END:
        if (track->second != 1)
          return fmt::format("packet {}: a slice ends on track {} with none open", n,
                             e.track_uuid());
        track->second = 0;
        break;
      case pb::TrackEvent::TYPE_COUNTER:
        ++counts->counter_values;
        break;
      default:
        return fmt::format("packet {}: unexpected event type {}", n, static_cast<int>(e.type()));
    }
  }
  for (auto [uuid, k] : open)
    if (k != 0) return fmt::format("a slice on track {} never ends", uuid);
  for (auto [f, st] : flow_state)
    if (st != 2) return fmt::format("flow {} never ends", f);
  return "";
}

}  // namespace pipeplan::test
