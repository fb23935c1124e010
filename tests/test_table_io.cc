#include <doctest/doctest.h>
#include <google/protobuf/io/coded_stream.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "chakra_et.pb.h"
#include "core/chakra.h"
#include "core/files.h"
#include "core/table_io.h"
#include "core/torch_csv.h"
#include "helpers.h"
#include "plan.pb.h"

using namespace pipeplan;
using namespace pipeplan::test;

namespace {

void ExpectRoundTrips(const Table& t) {
  auto pb = ParsePb(SerializePb(t));
  REQUIRE_MESSAGE(pb.ok(), pb.status().message());
  CHECK(*pb == t);
  auto js = FromJson(ToJson(t));
  REQUIRE_MESSAGE(js.ok(), js.status().message());
  CHECK(*js == t);
  CHECK(SerializePb(*js) == SerializePb(t));
}

}  // namespace

TEST_CASE("protobuf and JSON round-trips give an equal table") {
  Table t = Plan(SmallConfig(PipelineKind::kInterleaved1F1B, 2, 2, 4, 2));
  REQUIRE(t.size() > 0);
  ExpectRoundTrips(t);
}

TEST_CASE("round-trips keep layer-group pieces and a split generator") {
  Table t = Plan(
      MultimodalConfig("nested", {"model.generator={layers: 2, hidden: 512, mlp: 2048, heads: 8}",
                                  "data.generate={height: 256, width: 256}"}));
  int pieces = 0, shards = 0;
  for (OpId i = 0; i < t.size(); ++i) {
    pieces += t.piece(i) >= 0;
    shards += t.module(i) == Module::kGenerator && t.chunk(i) >= 0;
  }
  CHECK(pieces > 0);
  CHECK(shards > 0);
  ExpectRoundTrips(t);
}

TEST_CASE("round-trips keep which forwards store their activations in FP8") {
  Table t = Plan(MultimodalConfig("nested", {"training.saved_activations=[fp8, bf16, bf16, fp8]",
                                             "model.vision.saved_activations=fp8"}));
  std::set<std::pair<int, int>> marked;  // (module, pp rank)
  for (OpId i = 0; i < t.size(); ++i)
    if (t.work(i).saved_fp8)
      marked.insert({static_cast<int>(t.module(i)), t.ranks()[t.rank(i)].pp});
  for (int pp : {0, 3}) CHECK(marked.count({static_cast<int>(Module::kText), pp}));
  for (int pp : {1, 2}) CHECK_FALSE(marked.count({static_cast<int>(Module::kText), pp}));
  CHECK(std::any_of(marked.begin(), marked.end(),
                    [](auto m) { return m.first == static_cast<int>(Module::kVision); }));
  ExpectRoundTrips(t);
}

TEST_CASE("torch CSV lists compute actions per rank in order, stage = chunk * pp + rank") {
  Table t = Plan(SmallConfig(PipelineKind::kInterleaved1F1B, 2, 2, 4));
  // Rank 1's order (see test_schedules): F0.0 F0.1 F1.0 B1.0 ... -> stages 1, 1, 3, 3, ...
  size_t left_out = 1;
  std::string csv = ToTorchCsv(t, 0, false, &left_out).value();
  CHECK(left_out == 0);
  CHECK(csv ==
        "0F0,0F1,2F0,2F1,0F2,2B0,0F3,2B1,2F2,0B0,2F3,0B1,2B2,2B3,0B2,0B3\n"
        "1F0,1F1,3F0,3B0,3F1,3B1,1F2,1B0,1F3,1B1,3F2,3B2,3F3,3B3,1B2,1B3\n");
}

TEST_CASE("corrupt plan files are rejected, not crashed on") {
  Table t = Plan(SmallConfig(PipelineKind::k1F1B, 2, 1, 2));
  std::string pb = SerializePb(t);
  CHECK(!ParsePb(pb.substr(0, pb.size() / 2)).ok());
  CHECK(!ParsePb("garbage").ok());
  CHECK(!FromJson("{\"format_version\": 1}").ok());
  std::string js = ToJson(t);
  size_t at = js.find("\"r1 ");
  REQUIRE(at != std::string::npos);
  js.replace(at, 4, "\"r9 ");  // a rank that does not exist
  CHECK(!FromJson(js).ok());
}

TEST_CASE("plan files with inconsistent metadata or work are rejected") {
  Table t = Plan(SmallConfig(PipelineKind::k1F1B, 2, 1, 2));
  auto bad = [&](auto edit) {
    auto j = nlohmann::json::parse(ToJson(t));
    edit(j);
    return FromJson(j.dump()).status().message();
  };
  CHECK(bad([](auto& j) { j["meta"]["vp"] = -1; }) ==
        "plan metadata: parallel sizes and micro-batches must be >= 1");
  CHECK(bad([](auto& j) { j["meta"]["dp"] = 3; }) == "plan has 2 ranks but dp x pp = 3 x 2");
  CHECK(bad([](auto& j) { j["works"][0]["layer_begin"] = -5; }) ==
        "a work entry has an invalid memory effect, call count or layer range");
  CHECK(bad([](auto& j) { j["works"][0]["flops"] = -1.0; }) ==
        "a work entry has a negative or non-finite amount");
  CHECK(bad([](auto& j) { j["ops"][1]["deps"] = {1000000}; }) ==
        "dependency on op 1000000 which does not exist");
}

TEST_CASE("the streamed writers give what the libraries write for the same document") {
  Table t = Plan(MultimodalConfig("bubble-fill"));
  // JSON: the hand-written ops layout is the JSON library's dump with one space of indent.
  const std::string js = ToJson(t);
  CHECK(nlohmann::json::parse(js).dump(1) + "\n" == js);
  // Protobuf: the generated message parses the bytes and writes them back unchanged.
  proto::Plan p;
  const std::string pb = SerializePb(t);
  REQUIRE(p.ParseFromString(pb));
  CHECK(p.ops().rank_size() == static_cast<int>(t.size()));
  CHECK(p.SerializeAsString() == pb);
}

TEST_CASE("JSON plans: any layout and escapes read, bad op values refused") {
  Table t = Plan(SmallConfig(PipelineKind::k1F1B, 2, 1, 2));
  nlohmann::json doc = nlohmann::json::parse(ToJson(t));
  auto read = [](const nlohmann::json& j) { return FromJson(j.dump()); };  // compact layout
  auto same = read(doc);
  REQUIRE_MESSAGE(same.ok(), same.status().message());
  CHECK(*same == t);
  // An op string with escapes, and a key of a later version inside an op.
  std::string text = doc.dump();
  const size_t at = text.find("\"r0 F");
  REQUIRE(at != std::string::npos);
  text.replace(at, 5, "\"\\u0072\\u0030 F");
  text.replace(text.find("\"work\""), 6, "\"later\": [1, {\"x\": \"]\"}], \"work\"");
  auto escaped = FromJson(text);
  REQUIRE_MESSAGE(escaped.ok(), escaped.status().message());
  CHECK(*escaped == t);
  for (const char* bad : {"-1", "1.5", "4294967296", "\"3\"", "01"}) {
    CAPTURE(bad);
    std::string b = doc.dump();
    const size_t w = b.find("\"work\":") + 7;
    b.replace(w, b.find_first_of(",}", w) - w, bad);
    auto r = FromJson(b);
    REQUIRE(!r.ok());
    CHECK(r.status().message().find("not a pipeplan JSON plan") != std::string::npos);
  }
  nlohmann::json no_op = doc;
  no_op["ops"][0].erase("op");
  CHECK(!read(no_op).ok());
  nlohmann::json no_ops = doc;
  no_ops.erase("ops");
  CHECK(!read(no_ops).ok());
}

TEST_CASE("an output file replaces nothing until committed, and gzips on the way") {
  const std::string dir = TempDir(), path = dir + "/out.txt";
  {
    OutputFile f;
    REQUIRE(f.Open(path).ok());
    REQUIRE(f.Write("half").ok());
  }  // never committed
  CHECK(!Exists(path));
  CHECK(RunShell("ls " + dir).out.find("tmp") == std::string::npos);  // no temp file left
  std::string big;
  for (int i = 0; i < 200000; ++i) big += "line " + std::to_string(i) + "\n";
  OutputFile f;
  REQUIRE(f.Open(path + ".gz", true).ok());
  REQUIRE(f.Write(std::string_view(big).substr(0, 12345)).ok());
  REQUIRE(f.Write(std::string_view(big).substr(12345)).ok());
  REQUIRE(f.Commit().ok());
  CHECK(f.bytes_written() == big.size());
  CHECK(RunShell("gzip -dc " + path + ".gz").out == big);
}

namespace {

// Reads a Chakra file: the GlobalMetadata, then every Node (each length-delimited).
bool ReadChakra(const std::string& path, ChakraProtoMsg::GlobalMetadata* meta,
                std::vector<ChakraProtoMsg::Node>* nodes) {
  const std::string bytes = Slurp(path);
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                                            static_cast<int>(bytes.size()));
  auto next = [&](google::protobuf::MessageLite* m) {
    uint32_t len = 0;
    if (!in.ReadVarint32(&len)) return false;
    const auto limit = in.PushLimit(static_cast<int>(len));
    const bool ok = m->ParseFromCodedStream(&in) && in.ConsumedEntireMessage();
    in.PopLimit(limit);
    return ok;
  };
  if (!next(meta)) return false;
  nodes->clear();
  while (in.CurrentPosition() < static_cast<int>(bytes.size())) {
    nodes->emplace_back();
    if (!next(&nodes->back())) return false;
  }
  return true;
}

const ChakraProtoMsg::AttributeProto* AttrOf(const ChakraProtoMsg::Node& n, const std::string& k) {
  for (const auto& a : n.attr())
    if (a.name() == k) return &a;
  return nullptr;
}

}  // namespace

TEST_CASE("Chakra export round-trips: per-rank files whose dependency graph is the table's") {
  namespace ck = ChakraProtoMsg;
  const Config c = MultimodalConfig("nested");  // p2p, collectives, CP gangs, vision ops
  const Table t = Plan(c);
  const std::string dir = TempDir();
  std::vector<double> durations(t.size());
  for (OpId i = 0; i < t.size(); ++i) durations[i] = 1e-3 * (1 + i % 7);
  REQUIRE(WriteChakraTraces(t, dir + "/et", durations).ok());

  // Expected stream order, walking each rank's compute stream forwards: a run of
  // consecutive SEND/RECV ops is posted when the op before it ends; the op after a run
  // waits for the run's RECVs (sends are eager) and the op before the run.
  std::vector<std::set<uint64_t>> ctrl(t.size());
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    OpId last = UINT32_MAX, last_coll = UINT32_MAX;
    bool in_run = false;
    std::set<uint64_t> run_recvs;
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i) {
      if (IsCollective(t.kind(i))) {
        if (last_coll != UINT32_MAX) ctrl[i] = {last_coll};
        last_coll = i;
        continue;
      }
      if (IsP2P(t.kind(i))) {
        if (!in_run) {
          in_run = true;
          run_recvs.clear();
        }
        if (last != UINT32_MAX) ctrl[i] = {last};
        if (IsRecv(t.kind(i))) run_recvs.insert(i);
        continue;
      }
      if (in_run) ctrl[i] = run_recvs, in_run = false;
      if (last != UINT32_MAX) ctrl[i].insert(last);
      last = i;
    }
  }

  std::map<std::tuple<int, int, int>, int> p2p_keys;  // (src, dst, tag) -> SEND + RECV seen
  size_t nodes_read = 0;
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    CAPTURE(r);
    ck::GlobalMetadata meta;
    std::vector<ck::Node> nodes;
    REQUIRE(ReadChakra(ChakraFileName(dir + "/et", r), &meta, &nodes));
    bool rank_attr = false;
    for (const auto& a : meta.attr())
      rank_attr = rank_attr || (a.name() == "rank" && a.int32_val() == r);
    CHECK(rank_attr);
    REQUIRE(nodes.size() == t.rank_end(r) - t.rank_begin(r));
    for (size_t k = 0; k < nodes.size(); ++k) {
      const ck::Node& n = nodes[k];
      const OpId i = t.rank_begin(r) + static_cast<OpId>(k);
      CAPTURE(t.str(i));
      ++nodes_read;
      REQUIRE(n.id() == i);
      CHECK(n.name() == t.str(i));
      CHECK(n.duration_micros() == static_cast<uint64_t>(std::llround(durations[i] * 1e6)));
      // Dependencies: data = the table's same-rank deps; ctrl = stream order.
      std::set<uint64_t> data(n.data_deps().begin(), n.data_deps().end()), want_data;
      for (OpId d : t.deps(i))
        if (t.rank(d) == r) want_data.insert(d);
      CHECK(data == want_data);
      CHECK(std::set<uint64_t>(n.ctrl_deps().begin(), n.ctrl_deps().end()) == ctrl[i]);
      const OpKind kind = t.kind(i);
      if (IsP2P(kind)) {
        CHECK(n.type() == (IsSend(kind) ? ck::COMM_SEND_NODE : ck::COMM_RECV_NODE));
        const int src = AttrOf(n, "comm_src")->int32_val(),
                  dst = AttrOf(n, "comm_dst")->int32_val();
        CHECK((IsSend(kind) ? src : dst) == r);
        if (IsRecv(kind)) CHECK(src == t.rank(t.send_of(i)));  // the cross-rank dependency
        ++p2p_keys[{src, dst, AttrOf(n, "comm_tag")->int32_val()}];
        CHECK(AttrOf(n, "comm_size")->int64_val() == std::llround(t.work(i).payload_bytes));
      } else if (IsCollective(kind)) {
        CHECK(n.type() == ck::COMM_COLL_NODE);
        const auto& members = AttrOf(n, "pg_ranks")->int32_list().values();
        const auto group = t.group(t.peer(i));
        CHECK(std::vector<int32_t>(members.begin(), members.end()) ==
              std::vector<int32_t>(group.begin(), group.end()));
        const int64_t type = AttrOf(n, "comm_type")->int64_val();
        CHECK(type == (kind == OpKind::kAllReduce       ? ck::ALL_REDUCE
                       : kind == OpKind::kReduceScatter ? ck::REDUCE_SCATTER
                       : kind == OpKind::kAllGather     ? ck::ALL_GATHER
                                                        : ck::ALL_TO_ALL));
      } else {
        CHECK(n.type() == ck::COMP_NODE);
        CHECK(AttrOf(n, "num_ops")->int64_val() ==
              std::llround(t.work(i).flops / t.ranks()[r].gpus));
        CHECK(AttrOf(n, "is_cpu_op")->bool_val() == false);
      }
    }
  }
  CHECK(nodes_read == t.size());
  // Every transfer is one SEND and one RECV with the same (src, dst, tag), and no other.
  for (const auto& [key, seen] : p2p_keys) CHECK(seen == 2);

  // The command writes one file per rank.
  const std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/default.yaml";
  const RunResult r = RunCli("plan " + cfg + " --format chakra -o " + dir + "/cli");
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("8 files") != std::string::npos);
  CHECK(Exists(dir + "/cli.7.et"));
  CHECK(!Exists(dir + "/cli.8.et"));
}
