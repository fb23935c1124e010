#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

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
