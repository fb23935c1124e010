#include "core/table_io.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <array>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>

#include "core/files.h"
#include "core/memory.h"
#include "core/version.h"
#include "plan.pb.h"

namespace pipeplan {
namespace {

using nlohmann::json;

template <typename Src, typename Dst>
void CopyColumn(const Src& src, Dst* dst) {
  dst->Reserve(static_cast<int>(src.size()));
  for (auto v : src) dst->Add(static_cast<typename Dst::value_type>(v));
}

template <typename Src, typename Dst>
void ReadColumn(const Src& src, Dst* dst) {
  dst->clear();
  ResizeHuge(*dst, src.size());
  std::copy(src.begin(), src.end(), dst->begin());
}

template <typename Src, typename T>
bool ReadEnumColumn(const Src& src, int count, Column<T>* dst) {
  dst->resize(src.size());
  for (int i = 0; i < src.size(); ++i) {
    if (src[i] < 0 || src[i] >= count) return false;
    (*dst)[i] = static_cast<T>(src[i]);
  }
  return true;
}

// Prefix sums of counts into an index, refusing to overflow 32 bits.
template <typename Src>
bool Prefix(const Src& counts, std::vector<uint32_t>* index) {
  uint64_t sum = index->back();
  for (uint32_t c : counts) {
    sum += c;
    if (sum > UINT32_MAX) return false;
    index->push_back(static_cast<uint32_t>(sum));
  }
  return true;
}

json WorkToJson(const Work& w) {
  json j = {{"flops", w.flops},
            {"attn_flops", w.attn_flops},
            {"model_flops", w.model_flops},
            {"hbm_bytes", w.hbm_bytes},
            {"payload_bytes", w.payload_bytes},
            {"mem_delta_bytes", w.mem_delta_bytes},
            {"tp_bytes", w.tp_bytes},
            {"ep_bytes", w.ep_bytes},
            {"tp_calls", w.tp_calls},
            {"ep_calls", w.ep_calls},
            {"kernels", w.kernels},
            {"layer_begin", w.layer_begin},
            {"layer_end", w.layer_end},
            {"fp8_flops", w.fp8_flops}};
  if (w.saved_fp8) j["saved_fp8"] = true;  // written only where set: other plans unchanged
  if (w.ep_overlap_calls > 0 || w.ep_overlap_bytes > 0 || w.ep_overlap_flops > 0) {
    j["ep_overlap_bytes"] = w.ep_overlap_bytes;
    j["ep_overlap_calls"] = w.ep_overlap_calls;
    j["ep_overlap_flops"] = w.ep_overlap_flops;
  }
  return j;
}

Work WorkFromJson(const json& j) {
  Work w;
  w.flops = j.at("flops"), w.attn_flops = j.at("attn_flops"), w.model_flops = j.at("model_flops"),
  w.hbm_bytes = j.at("hbm_bytes");
  w.payload_bytes = j.at("payload_bytes"), w.mem_delta_bytes = j.at("mem_delta_bytes");
  w.tp_bytes = j.at("tp_bytes"), w.ep_bytes = j.at("ep_bytes"), w.tp_calls = j.at("tp_calls");
  w.ep_calls = j.at("ep_calls"), w.kernels = j.at("kernels"), w.layer_begin = j.at("layer_begin");
  w.layer_end = j.at("layer_end");
  w.fp8_flops = j.value("fp8_flops", 0.0);  // older plans lack it
  w.saved_fp8 = j.value("saved_fp8", false);
  w.ep_overlap_bytes = j.value("ep_overlap_bytes", 0.0);
  w.ep_overlap_calls = j.value("ep_overlap_calls", 0);
  w.ep_overlap_flops = j.value("ep_overlap_flops", 0.0);
  return w;
}

json MetaToJson(const PlanMeta& m) {
  return {{"schedule", m.schedule},
          {"modality", m.modality},
          {"pp", m.pp},
          {"vp", m.vp},
          {"dp", m.dp},
          {"tp", m.tp},
          {"cp", m.cp},
          {"ep", m.ep},
          {"microbatches", m.microbatches},
          {"gpus_per_node", m.gpus_per_node},
          {"tokens_per_step", m.tokens_per_step},
          {"samples_per_step", m.samples_per_step},
          {"megatron_flops_per_step", m.megatron_flops_per_step},
          {"megatron_model_flops_per_step", m.megatron_model_flops_per_step},
          {"placement", PlacementName(m.placement)},
          {"config_yaml", m.config_yaml},
          {"tool_version", kVersion}};
}

PlanMeta MetaFromJson(const json& j) {
  PlanMeta m;
  m.schedule = j.at("schedule"), m.modality = j.at("modality"), m.pp = j.at("pp");
  m.vp = j.at("vp"), m.dp = j.at("dp"), m.tp = j.at("tp"), m.cp = j.at("cp"), m.ep = j.at("ep");
  m.microbatches = j.at("microbatches"), m.gpus_per_node = j.at("gpus_per_node");
  m.tokens_per_step = j.at("tokens_per_step"), m.samples_per_step = j.at("samples_per_step");
  m.config_yaml = j.at("config_yaml");
  m.megatron_flops_per_step = j.value("megatron_flops_per_step", 0.0);  // older plans lack it
  m.megatron_model_flops_per_step = j.value("megatron_model_flops_per_step", 0.0);
  if (!ParsePlacement(j.value("placement", std::string("loop")), &m.placement))
    throw json::other_error::create(501, "meta.placement is neither loop nor v", &j);
  return m;
}

}  // namespace

StatusOr<PlanFormat> ParsePlanFormat(const std::string& name) {
  if (name == "pb") return PlanFormat::kPb;
  if (name == "json") return PlanFormat::kJson;
  if (name == "torch-csv") return PlanFormat::kTorchCsv;
  if (name == "torch-csv-comms") return PlanFormat::kTorchCsvComms;
  if (name == "chakra") return PlanFormat::kChakra;
  return InvalidInput(fmt::format(
      "unknown plan format '{}' (expected pb, json, torch-csv, torch-csv-comms or chakra)", name));
}

StatusOr<PlanFormat> FormatFromPath(const std::string& path) {
  auto ends = [&](std::string_view s) {
    return path.size() >= s.size() && path.compare(path.size() - s.size(), s.size(), s) == 0;
  };
  if (ends(".json") || path == "-") return PlanFormat::kJson;
  if (ends(".csv")) return PlanFormat::kTorchCsv;
  if (ends(".pb")) return PlanFormat::kPb;
  if (ends(".et")) return PlanFormat::kChakra;
  struct stat st;
  if (stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode))
    return PlanFormat::kPb;
  return InvalidInput(fmt::format(
      "{}: cannot tell the plan format from the name (.pb, .json, .csv, .et), say --format", path));
}

namespace {

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) v >>= 7, ++n;
  return n;
}
void PutVarint(fmt::memory_buffer& out, uint64_t v) {
  while (v >= 0x80) out.push_back(static_cast<char>(v | 0x80)), v >>= 7;
  out.push_back(static_cast<char>(v));
}
// Protobuf encodings of int32 (sign-extended to 64 bits), sint32 (zigzag) and uint32.
uint64_t Int32(int32_t v) {
  return static_cast<uint64_t>(static_cast<int64_t>(v));
}
uint64_t Sint32(int32_t v) {
  return (static_cast<uint32_t>(v) << 1) ^ static_cast<uint32_t>(v >> 31);
}

// The plan as protobuf, handed to `sink` in pieces: everything but the ops through the
// generated message; the ops message (the last field) written here column by column from
// the table, as the message would serialize them (packed fields in field order), without a
// copy of the columns.
template <typename Sink>
Status StreamPb(const Table& t, Sink&& sink) {
  proto::Plan p;
  p.set_format_version(1);
  auto* m = p.mutable_meta();
  const PlanMeta& pm = t.meta();
  m->set_schedule(pm.schedule), m->set_modality(pm.modality), m->set_pp(pm.pp), m->set_vp(pm.vp);
  m->set_dp(pm.dp), m->set_tp(pm.tp), m->set_cp(pm.cp), m->set_ep(pm.ep);
  m->set_microbatches(pm.microbatches), m->set_gpus_per_node(pm.gpus_per_node);
  m->set_tokens_per_step(pm.tokens_per_step), m->set_samples_per_step(pm.samples_per_step);
  m->set_megatron_flops_per_step(pm.megatron_flops_per_step);
  m->set_megatron_model_flops_per_step(pm.megatron_model_flops_per_step);
  m->set_config_yaml(pm.config_yaml), m->set_tool_version(kVersion);
  m->set_placement(std::string(PlacementName(pm.placement)));
  for (const RankInfo& r : t.ranks()) {
    auto* pr = p.add_ranks();
    pr->set_dp(r.dp), pr->set_pp(r.pp), pr->set_gpus(r.gpus), pr->set_first_gpu(r.first_gpu);
    pr->set_node(r.node);
    for (double v : r.params) pr->add_params(v);
    for (double v : r.state_shard) pr->add_state_shard(v);
    pr->set_muon_params(r.muon_params);
  }
  for (int32_t r = 0; r < t.num_ranks(); ++r) p.add_rank_op_count(t.rank_end(r) - t.rank_begin(r));
  for (const Work& w : t.works()) {
    auto* pw = p.add_works();
    pw->set_flops(w.flops), pw->set_attn_flops(w.attn_flops), pw->set_model_flops(w.model_flops),
        pw->set_hbm_bytes(w.hbm_bytes);
    pw->set_payload_bytes(w.payload_bytes), pw->set_mem_delta_bytes(w.mem_delta_bytes);
    pw->set_tp_bytes(w.tp_bytes), pw->set_ep_bytes(w.ep_bytes), pw->set_tp_calls(w.tp_calls);
    pw->set_ep_calls(w.ep_calls), pw->set_kernels(w.kernels), pw->set_layer_begin(w.layer_begin);
    pw->set_fp8_flops(w.fp8_flops);
    pw->set_layer_end(w.layer_end);
    pw->set_saved_fp8(w.saved_fp8);
    pw->set_ep_overlap_bytes(w.ep_overlap_bytes), pw->set_ep_overlap_calls(w.ep_overlap_calls);
    pw->set_ep_overlap_flops(w.ep_overlap_flops);
  }
  for (int32_t g = 0; g < t.num_groups(); ++g) {
    p.add_group_size(static_cast<uint32_t>(t.group(g).size()));
    for (int32_t r : t.group(g)) p.add_group_ranks(r);
  }
  RETURN_IF_ERROR(sink(p.SerializeAsString()));

  const size_t n = t.size();
  const std::span<const uint32_t> deps = t.dep_list();
  // Calls visit(field number, count, value) for each column; value(i) is the varint to write.
  auto columns = [&](auto&& visit) {
    visit(1, n, [&](size_t i) { return Int32(t.rank(i)); });
    visit(2, n, [&](size_t i) { return Int32(static_cast<int32_t>(t.kind(i))); });
    visit(3, n, [&](size_t i) { return Int32(static_cast<int32_t>(t.module(i))); });
    visit(4, n, [&](size_t i) { return Sint32(t.chunk(i)); });
    visit(5, n, [&](size_t i) { return Sint32(t.mb(i)); });
    visit(6, n, [&](size_t i) { return Sint32(t.task(i)); });
    visit(7, n, [&](size_t i) { return Sint32(t.peer(i)); });
    visit(8, n, [&](size_t i) { return uint64_t{t.tag(i)}; });
    visit(9, n, [&](size_t i) { return uint64_t{t.work_id(i)}; });
    visit(10, n, [&](size_t i) { return uint64_t{t.deps(i).size()}; });
    visit(11, deps.size(), [&](size_t k) { return uint64_t{deps[k]}; });
    visit(12, n, [&](size_t i) { return Sint32(t.piece(i)); });
  };
  std::array<size_t, 13> bytes{};
  size_t total = 0;
  columns([&](int field, size_t count, auto value) {
    for (size_t i = 0; i < count; ++i) bytes[field] += VarintSize(value(i));
    if (bytes[field] > 0) total += 1 + VarintSize(bytes[field]) + bytes[field];
  });
  fmt::memory_buffer buf;
  PutVarint(buf, 8 << 3 | 2);  // Plan.ops, length-delimited
  PutVarint(buf, total);
  Status status = Status::Ok();
  columns([&](int field, size_t count, auto value) {
    if (bytes[field] == 0 || !status.ok()) return;
    PutVarint(buf, static_cast<uint64_t>(field) << 3 | 2);
    PutVarint(buf, bytes[field]);
    for (size_t i = 0; i < count; ++i) {
      PutVarint(buf, value(i));
      if (buf.size() >= (size_t{1} << 20)) {
        status = sink(std::string_view(buf.data(), buf.size()));
        buf.clear();
        if (!status.ok()) return;
      }
    }
  });
  RETURN_IF_ERROR(status);
  return sink(std::string_view(buf.data(), buf.size()));
}

// What a streaming writer (write(sink)) hands to its sink: one string, or a file.
template <typename Writer>
std::string Collect(Writer&& write) {
  std::string out;
  (void)write([&](std::string_view piece) {  // this sink never fails
    out.append(piece);
    return Status::Ok();
  });
  return out;
}
template <typename Writer>
Status WriteStreamed(const std::string& path, Writer&& write) {
  OutputFile f;
  RETURN_IF_ERROR(f.Open(path));
  RETURN_IF_ERROR(write([&](std::string_view piece) { return f.Write(piece); }));
  return f.Commit();
}

}  // namespace

std::string SerializePb(const Table& t) {
  return Collect([&](auto sink) { return StreamPb(t, sink); });
}

StatusOr<Table> ParsePb(const std::string& bytes) {
  proto::Plan p;
  if (!p.ParseFromString(bytes)) return InvalidInput("not a pipeplan protobuf plan");
  if (p.format_version() != 1)
    return InvalidInput(fmt::format("unsupported plan format version {}", p.format_version()));
  Table t;
  TableColumns c(&t);
  const auto& m = p.meta();
  PlanMeta& pm = c.meta();
  pm.schedule = m.schedule(), pm.modality = m.modality(), pm.pp = m.pp(), pm.vp = m.vp();
  pm.dp = m.dp(), pm.tp = m.tp(), pm.cp = m.cp(), pm.ep = m.ep();
  pm.microbatches = m.microbatches(), pm.gpus_per_node = m.gpus_per_node();
  pm.tokens_per_step = m.tokens_per_step(), pm.samples_per_step = m.samples_per_step();
  pm.megatron_flops_per_step = m.megatron_flops_per_step();
  pm.megatron_model_flops_per_step = m.megatron_model_flops_per_step();
  pm.config_yaml = m.config_yaml();
  if (!ParsePlacement(m.placement().empty() ? "loop" : m.placement(), &pm.placement))
    return InvalidInput(fmt::format("meta.placement '{}' is neither loop nor v", m.placement()));
  for (const auto& pr : p.ranks()) {
    RankInfo r{pr.dp(), pr.pp(), pr.gpus(), pr.first_gpu(), pr.node(), {0, 0, 0}};
    for (int i = 0; i < std::min(3, pr.params_size()); ++i) r.params[i] = pr.params(i);
    r.state_shard[0] = pm.dp;  // plans written before state_shard: the text shards over DP
    for (int i = 0; i < std::min(3, pr.state_shard_size()); ++i)
      r.state_shard[i] = pr.state_shard(i);
    r.muon_params = pr.muon_params();
    c.ranks().push_back(r);
  }
  if (!Prefix(p.rank_op_count(), &c.rank_begin())) return InvalidInput("plan rank index overflows");
  for (const auto& pw : p.works()) {
    c.works().push_back(Work{pw.flops(), pw.attn_flops(), pw.model_flops(), pw.hbm_bytes(),
                             pw.payload_bytes(), pw.mem_delta_bytes(), pw.tp_bytes(), pw.ep_bytes(),
                             pw.tp_calls(), pw.ep_calls(), pw.kernels(), pw.layer_begin(),
                             pw.layer_end(), pw.fp8_flops(), pw.saved_fp8(), pw.ep_overlap_bytes(),
                             pw.ep_overlap_flops(), pw.ep_overlap_calls()});
  }
  if (!Prefix(p.group_size(), &c.group_begin())) return InvalidInput("plan group index overflows");
  ReadColumn(p.group_ranks(), &c.group_ranks());
  const auto& o = p.ops();
  ReadColumn(o.rank(), &c.rank());
  if (!ReadEnumColumn(o.kind(), kNumOpKinds, &c.kind()) ||
      !ReadEnumColumn(o.module(), kNumModules, &c.module()))
    return InvalidInput("plan has an unknown op kind or module");
  ReadColumn(o.chunk(), &c.chunk());
  ReadColumn(o.mb(), &c.mb());
  ReadColumn(o.task(), &c.task());
  ReadColumn(o.piece(), &c.piece());
  if (o.piece_size() == 0) c.piece().assign(c.kind().size(), -1);  // written before pieces
  ReadColumn(o.peer(), &c.peer());
  ReadColumn(o.tag(), &c.tag());
  ReadColumn(o.work(), &c.work());
  c.dep_begin().reserve(o.dep_count_size() + 1);
  if (!Prefix(o.dep_count(), &c.dep_begin()))
    return InvalidInput("plan dependency index overflows");
  ReadColumn(o.deps(), &c.deps());
  RETURN_IF_ERROR(c.CheckConsistent());
  return t;
}

namespace {

// Everything of a plan but its ops, as a JSON document.
json HeaderJson(const Table& t) {
  json j;
  j["format_version"] = 1;
  j["meta"] = MetaToJson(t.meta());
  json ranks = json::array();
  for (const RankInfo& r : t.ranks()) {
    json rank = {{"dp", r.dp},
                 {"pp", r.pp},
                 {"gpus", r.gpus},
                 {"first_gpu", r.first_gpu},
                 {"node", r.node},
                 {"params", {r.params[0], r.params[1], r.params[2]}},
                 {"state_shard", {r.state_shard[0], r.state_shard[1], r.state_shard[2]}}};
    if (r.muon_params > 0) rank["muon_params"] = r.muon_params;  // only where set
    ranks.push_back(std::move(rank));
  }
  j["ranks"] = std::move(ranks);
  json works = json::array();
  for (const Work& w : t.works()) works.push_back(WorkToJson(w));
  j["works"] = std::move(works);
  json groups = json::array();
  for (int32_t g = 0; g < t.num_groups(); ++g) {
    auto members = t.group(g);
    groups.push_back(json(std::vector<int32_t>(members.begin(), members.end())));
  }
  j["groups"] = std::move(groups);
  j["ops"] = json::array();
  return j;
}

// The JSON plan, handed to `sink` in pieces: the header as the JSON library writes it
// (keys sorted, one space of indent per level), the ops array written here in the same
// layout, so the text is what dumping one document would give.
template <typename Sink>
Status StreamJson(const Table& t, Sink&& sink) {
  const std::string header = DumpJson(HeaderJson(t));
  // Strings are escaped, so a line starting with one space and "ops" is the top-level key.
  const std::string_view key = "\n \"ops\": []";
  const size_t at = header.find(key);
  if (at == std::string::npos) return Internal("JSON plan header without its ops");
  RETURN_IF_ERROR(sink(std::string_view(header).substr(0, at)));
  fmt::memory_buffer buf;
  auto num = [&](uint32_t v) {
    const fmt::format_int digits(v);
    buf.append(digits.data(), digits.data() + digits.size());
  };
  auto put = [&](std::string_view text) { buf.append(text); };
  put(t.size() == 0 ? "\n \"ops\": []" : "\n \"ops\": [");
  std::string name;
  for (OpId i = 0; i < t.size(); ++i) {
    put(i == 0 ? "\n  {" : ",\n  {");
    auto d = t.deps(i);
    if (!d.empty()) {
      put("\n   \"deps\": [");
      for (size_t k = 0; k < d.size(); ++k) {
        put(k == 0 ? "\n    " : ",\n    ");
        num(d[k]);
      }
      put("\n   ],");
    }
    name.clear();
    AppendOp(&name, t.key(i));  // op names need no escapes
    put("\n   \"op\": \"");
    put(name);
    put("\",");
    if (t.tag(i) != 0) {
      put("\n   \"tag\": ");
      num(t.tag(i));
      put(",");
    }
    put("\n   \"work\": ");
    num(t.work_id(i));
    put("\n  }");
    if (buf.size() >= (size_t{1} << 20)) {
      RETURN_IF_ERROR(sink(std::string_view(buf.data(), buf.size())));
      buf.clear();
    }
  }
  if (t.size() > 0) put("\n ]");
  RETURN_IF_ERROR(sink(std::string_view(buf.data(), buf.size())));
  RETURN_IF_ERROR(sink(std::string_view(header).substr(at + key.size())));
  return sink("\n");
}

}  // namespace

std::string ToJson(const Table& t) {
  return Collect([&](auto sink) { return StreamJson(t, sink); });
}

namespace {

// A strict reader over JSON text for the ops array of a plan (its bulk: read here without
// building a document); the rest of the plan is read by the JSON library.
class JsonScan {
 public:
  explicit JsonScan(std::string_view text, size_t from = 0) : s_(text), p_(from) {}
  size_t pos() const { return p_; }
  void Ws() {
    while (p_ < s_.size() && (s_[p_] == ' ' || s_[p_] == '\n' || s_[p_] == '\r' || s_[p_] == '\t'))
      ++p_;
  }
  // Skips whitespace, then takes `c` if it comes next.
  bool Take(char c) {
    Ws();
    if (p_ < s_.size() && s_[p_] == c) return ++p_, true;
    return false;
  }
  Status Expect(char c) { return Take(c) ? Status::Ok() : Error(fmt::format("expected '{}'", c)); }
  // A string's text, valid until the next call (escapes are decoded by the JSON library).
  StatusOr<std::string_view> String() {
    Ws();
    if (p_ >= s_.size() || s_[p_] != '"') return Error("expected a string");
    const size_t begin = p_++;
    bool escaped = false;
    for (; p_ < s_.size() && s_[p_] != '"'; ++p_) {
      if (static_cast<unsigned char>(s_[p_]) < 0x20) return Error("control character in a string");
      if (s_[p_] == '\\') escaped = true, ++p_;
    }
    if (p_ >= s_.size()) return Error("unterminated string");
    ++p_;
    if (!escaped) return s_.substr(begin + 1, p_ - begin - 2);
    try {
      decoded_ = json::parse(s_.substr(begin, p_ - begin)).get<std::string>();
      return std::string_view(decoded_);
    } catch (const json::exception&) {
      return Error("bad escape in a string");
    }
  }
  // An integer in [0, 2^32).
  StatusOr<uint32_t> Unsigned() {
    Ws();
    uint64_t v = 0;
    const size_t begin = p_;
    while (p_ < s_.size() && s_[p_] >= '0' && s_[p_] <= '9' && v <= UINT32_MAX)
      v = v * 10 + (s_[p_++] - '0');
    if (p_ == begin || v > UINT32_MAX || (p_ - begin > 1 && s_[begin] == '0') ||
        (p_ < s_.size() && (s_[p_] == '.' || s_[p_] == 'e' || s_[p_] == 'E' || s_[p_] == '-' ||
                            (s_[p_] >= '0' && s_[p_] <= '9'))))
      return Error("expected an integer in [0, 2^32)");
    return static_cast<uint32_t>(v);
  }
  // Skips one value of any type (its syntax checked by the library when it is kept).
  Status Skip() {
    Ws();
    if (p_ >= s_.size()) return Error("unexpected end");
    const char c = s_[p_];
    if (c == '"') return String().status();
    if (c == '[' || c == '{') {
      int depth = 0;
      do {
        Ws();
        if (p_ >= s_.size()) return Error("unexpected end");
        const char x = s_[p_];
        if (x == '"') {
          RETURN_IF_ERROR(String().status());
          continue;
        }
        if (x == '[' || x == '{') ++depth;
        if (x == ']' || x == '}') --depth;
        ++p_;
      } while (depth > 0);
      return Status::Ok();
    }
    const size_t begin = p_;
    while (p_ < s_.size() && std::string_view(",]} \n\r\t").find(s_[p_]) == std::string_view::npos)
      ++p_;
    return p_ > begin ? Status::Ok() : Error("expected a value");
  }
  Status Error(std::string_view what) const {
    size_t line = 1;
    for (size_t k = 0; k < std::min(p_, s_.size()); ++k) line += s_[k] == '\n';
    return InvalidInput(fmt::format("not a pipeplan JSON plan: line {}: {}", line, what));
  }

 private:
  std::string_view s_;
  size_t p_ = 0;
  std::string decoded_;
};

// Reads the ops array (at the scanner's position) into the table's columns.
Status ReadJsonOps(JsonScan& in, TableColumns& c, size_t most_ops) {
  // Room for as many ops as the text could hold (pages never written stay unused).
  for (auto* col : {&c.rank(), &c.chunk(), &c.mb(), &c.task(), &c.peer(), &c.piece()})
    col->reserve(most_ops);
  c.kind().reserve(most_ops), c.module().reserve(most_ops), c.tag().reserve(most_ops);
  c.work().reserve(most_ops), c.dep_begin().reserve(most_ops + 1), c.deps().reserve(most_ops);
  RETURN_IF_ERROR(in.Expect('['));
  int32_t last_rank = 0;
  size_t i = 0;
  if (!in.Take(']')) {
    do {
      RETURN_IF_ERROR(in.Expect('{'));
      std::optional<OpKey> key;
      std::optional<uint32_t> work;
      uint32_t tag = 0;
      if (!in.Take('}')) {
        do {
          ASSIGN_OR_RETURN(std::string_view name, in.String());
          RETURN_IF_ERROR(in.Expect(':'));
          if (name == "op") {
            ASSIGN_OR_RETURN(std::string_view text, in.String());
            auto k = ParseOp(text);
            if (!k.ok()) return InvalidInput(fmt::format("op {}: {}", i, k.status().message()));
            key = *k;
          } else if (name == "work") {
            ASSIGN_OR_RETURN(work, in.Unsigned());
          } else if (name == "tag") {
            ASSIGN_OR_RETURN(tag, in.Unsigned());
          } else if (name == "deps") {
            RETURN_IF_ERROR(in.Expect('['));
            if (!in.Take(']')) {
              do {
                ASSIGN_OR_RETURN(uint32_t d, in.Unsigned());
                c.deps().push_back(d);
              } while (in.Take(','));
              RETURN_IF_ERROR(in.Expect(']'));
            }
          } else {
            RETURN_IF_ERROR(in.Skip());  // keys of later versions
          }
        } while (in.Take(','));
        RETURN_IF_ERROR(in.Expect('}'));
      }
      if (!key) return in.Error(fmt::format("op {} has no \"op\"", i));
      if (!work) return in.Error(fmt::format("op {} has no \"work\"", i));
      if (key->rank < last_rank)
        return InvalidInput(fmt::format("op {} ('{}') is out of rank order", i, FormatOp(*key)));
      last_rank = key->rank;
      c.rank().push_back(key->rank), c.kind().push_back(key->kind);
      c.module().push_back(key->module), c.chunk().push_back(key->chunk);
      c.mb().push_back(key->mb), c.task().push_back(key->task), c.peer().push_back(key->peer);
      c.piece().push_back(key->piece);
      c.tag().push_back(tag), c.work().push_back(*work);
      if (c.deps().size() > UINT32_MAX) return InvalidInput("plan dependency index overflows");
      c.dep_begin().push_back(static_cast<uint32_t>(c.deps().size()));
      ++i;
    } while (in.Take(','));
    RETURN_IF_ERROR(in.Expect(']'));
  }
  return Status::Ok();
}

}  // namespace

StatusOr<Table> FromJson(const std::string& text) {
  Table t;
  TableColumns c(&t);
  // The top-level "ops" array is read here as it is scanned; the rest, without it, is read
  // as a document by the JSON library.
  JsonScan scan(text);
  size_t ops_begin = std::string::npos, ops_end = 0;
  RETURN_IF_ERROR(scan.Expect('{'));
  if (!scan.Take('}')) {
    do {
      ASSIGN_OR_RETURN(std::string_view name, scan.String());
      const bool ops = name == "ops";
      RETURN_IF_ERROR(scan.Expect(':'));
      scan.Ws();
      const size_t begin = scan.pos();
      if (ops && ops_begin != std::string::npos)
        return InvalidInput("not a pipeplan JSON plan: \"ops\" appears twice");
      // An op takes at least 24 bytes of text ({"op":"r0 F","work":0}).
      RETURN_IF_ERROR(ops ? ReadJsonOps(scan, c, (text.size() - begin) / 24 + 1) : scan.Skip());
      if (ops) ops_begin = begin, ops_end = scan.pos();
    } while (scan.Take(','));
    RETURN_IF_ERROR(scan.Expect('}'));
  }
  if (ops_begin == std::string::npos) return InvalidInput("not a pipeplan JSON plan: no \"ops\"");
  try {
    const std::string rest = text.substr(0, ops_begin) + "[]" + text.substr(ops_end);
    RETURN_IF_ERROR(CheckJsonDepth(rest));
    json j = json::parse(rest);
    if (j.at("format_version") != 1) return InvalidInput("unsupported JSON plan format version");
    c.meta() = MetaFromJson(j.at("meta"));
    for (const json& r : j.at("ranks")) {
      RankInfo ri{r.at("dp"), r.at("pp"), r.at("gpus"), r.at("first_gpu"), r.at("node"), {}};
      for (int k = 0; k < 3; ++k) ri.params[k] = r.at("params").at(k);
      ri.state_shard[0] = c.meta().dp;  // plans written before state_shard: text over DP
      if (r.contains("state_shard"))
        for (int k = 0; k < 3; ++k) ri.state_shard[k] = r.at("state_shard").at(k);
      ri.muon_params = r.value("muon_params", 0.0);
      c.ranks().push_back(ri);
    }
    for (const json& w : j.at("works")) c.works().push_back(WorkFromJson(w));
    for (const json& g : j.at("groups")) {
      for (int32_t r : g) c.group_ranks().push_back(r);
      c.group_begin().push_back(static_cast<uint32_t>(c.group_ranks().size()));
    }
  } catch (const json::exception& e) {
    return InvalidInput(fmt::format("not a pipeplan JSON plan: {}", e.what()));
  }
  // Ops come rank by rank (checked as read), each rank one of the plan's.
  const int32_t R = static_cast<int32_t>(c.ranks().size());
  const size_t n = c.rank().size();
  int32_t r = 0;
  for (size_t i = 0; i < n; ++i) {
    if (c.rank()[i] >= R)
      return InvalidInput(fmt::format("op {} ('{}') is out of rank order", i, t.str(i)));
    for (; r < c.rank()[i]; ++r) c.rank_begin().push_back(static_cast<uint32_t>(i));
  }
  for (; r < R; ++r) c.rank_begin().push_back(static_cast<uint32_t>(n));
  RETURN_IF_ERROR(c.CheckConsistent());
  return t;
}

Status SavePlan(const Table& t, const std::string& path, PlanFormat format) {
  switch (format) {
    case PlanFormat::kPb:
      return WriteStreamed(path, [&](auto sink) { return StreamPb(t, sink); });
    case PlanFormat::kJson:
      return WriteStreamed(path, [&](auto sink) { return StreamJson(t, sink); });
    case PlanFormat::kTorchCsv:
    case PlanFormat::kTorchCsvComms:
      return Internal("a PyTorch CSV is written with ToTorchCsv (core/torch_csv.h)");
    case PlanFormat::kChakra:
      return Internal("Chakra traces are written with WriteChakraTraces (core/chakra.h)");
  }
  return Internal("unknown plan format");
}

StatusOr<Table> LoadPlan(const std::string& path) {
  ASSIGN_OR_RETURN(std::string bytes, ReadFile(path));
  size_t first = bytes.find_first_not_of(" \t\r\n");
  StatusOr<Table> t =
      (first != std::string::npos && bytes[first] == '{') ? FromJson(bytes) : ParsePb(bytes);
  if (!t.ok()) return InvalidInput(fmt::format("{}: {}", path, t.status().message()));
  return t;
}

}  // namespace pipeplan
