// Hostile input: each class of malformed or oversized input ends in a clear error (exit 2
// for bad input) naming what is wrong, never a crash, a hang or a silent wrong answer.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <sys/stat.h>

#include <fstream>

#include "executor/check.h"
#include "helpers.h"
#include "planner/plan.h"

using namespace pipeplan;
using namespace pipeplan::test;

namespace {

const std::string kDefault = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/default.yaml";
const std::string kSmall = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/small_text.yaml";

void Write(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Runs the CLI; expects exit code `code` and `needle` in its output.
void ExpectError(const std::string& args, int code, const std::string& needle) {
  RunResult r = RunCli(args);
  CAPTURE(args);
  CAPTURE(r.out);
  CHECK(r.exit_code == code);
  CHECK(r.out.find(needle) != std::string::npos);
  CHECK(r.out.find("internal error") == std::string::npos);
}

}  // namespace

TEST_CASE("sizes: products of config values cannot overflow, and images must fit") {
  const std::string plan = "plan " + kDefault + " -o /dev/null --set ";
  ExpectError(plan + "model.vision.merge=65536", 2, "'model.vision.merge' must be <= 64");
  ExpectError(plan + "parallelism.pp=65536 --set parallelism.vp=65536", 2, "");
  ExpectError(plan + "'data.images=[{height: 16777216, width: 16777216, frames: 16777216}]'", 2,
              "'data.images[0].height' must be <= 1048576");
  ExpectError(plan + "'data.images=[{height: 1000000, width: 1000000}]'", 2,
              "never fits a micro-batch");
  ExpectError(plan + "training.micro_batch_size=16777216", 2, "micro_batch_size*seq_length");
  ExpectError(plan + "cluster.nodes=1000000", 2, "GPUs in all");
}

TEST_CASE("resources: a plan above the memory budget is refused before it is built") {
  ExpectError("plan " + kDefault + " -o /dev/null --set cluster.nodes=100000", 2,
              "above the memory budget");
  ExpectError("plan " + kDefault + " -o /dev/null --max-memory 0.0001", 2, "(--max-memory)");
  // A sweep grid too large, and nonsense thread counts.
  std::string many;
  for (int i = 1; i <= 400; ++i) many += fmt::format("{}{}", i > 1 ? "," : "", i);
  ExpectError("sweep " + kSmall + " --vary training.microbatches=" + many +
                  " --vary training.seq_length=" + many,
              2, "more than 100000 points");
  ExpectError("sweep " + kSmall + " --vary training.microbatches=8 --jobs -3", 2, "--jobs");
  RunResult jobs = RunCli("sweep " + kSmall + " --vary training.microbatches=8,16 --jobs 100000");
  CHECK(jobs.exit_code == 0);  // one thread per point at most
}

TEST_CASE("manifests: nesting, integer ranges and generation targets are checked") {
  const std::string dir = TempDir();
  auto manifest = [&](const std::string& name, const std::string& line) {
    Write(dir + "/" + name, line + "\n");
    return "plan " + kDefault + " -o /dev/null --set data.manifest=" + dir + "/" + name;
  };
  ExpectError(manifest("deep.jsonl", "{\"id\": " + std::string(200000, '[') + "1" +
                                         std::string(200000, ']') + "}"),
              2, "nested more than 64 levels");
  ExpectError(manifest("obj.jsonl", "{\"id\": {\"a\": 1}}"), 2, "'id' must be a string");
  ExpectError(manifest("wrap.jsonl", "{\"images\": [[4294967297, 4294967297]]}"), 2,
              "bad value for 'images'");
  ExpectError(manifest("gen.jsonl", "{\"generate\": [100000000, 100000000]}"), 2,
              "bad value for 'generate'");
  ExpectError(manifest("video.jsonl", "{\"videos\": [[0, 10, 10]]}"), 2, "bad value for 'videos'");
  // Found by scripts/fuzz.sh: a count beyond int64 arrives as a double.
  ExpectError(manifest("huge.jsonl", "{\"text_tokens\": 1111111111111111111512}"), 2,
              "'text_tokens' must be an integer in [0, 2147483647]");
  ExpectError(manifest("float.jsonl", "{\"text_tokens\": 12.5}"), 2,
              "'text_tokens' must be an integer");
}

TEST_CASE("calibration files made of aliases are refused, not expanded") {
  const std::string dir = TempDir();
  std::string yaml = "a0: &a0 {x: 1, y: 1}\n";
  for (int i = 1; i <= 40; ++i)
    yaml += fmt::format("a{}: &a{} {{x: *a{}, y: *a{}}}\n", i, i, i - 1, i - 1);
  Write(dir + "/cal.yaml", yaml);
  ExpectError("simulate " + kSmall + " --calibration " + dir + "/cal.yaml", 2, "aliases");
}

TEST_CASE("the validator refuses plans the executor could not run safely") {
  const std::string dir = TempDir();
  REQUIRE(RunCli("plan " + kSmall + " -o " + dir + "/p.json").exit_code == 0);
  const std::string text = Slurp(dir + "/p.json");
  auto edited = [&](const std::string& from, const std::string& to, const std::string& name) {
    std::string t = text;
    const size_t at = t.find(from);
    REQUIRE(at != std::string::npos);
    t.replace(at, from.size(), to);
    Write(dir + "/" + name, t);
    return dir + "/" + name;
  };
  // meta.vp claims 3 chunks, the ops have 2: an error, not a crash.
  ExpectError("validate " + edited("\"vp\": 2", "\"vp\": 3", "vp.json"), 3, "does not exist");
  // A work entry without a layer range (the executor would index the model at -1).
  ExpectError("validate " + edited("\"layer_begin\": 0", "\"layer_begin\": -1", "w.json"), 3,
              "no layer range");
  ExpectError("execute " + dir + "/w.json --local-ranks 4", 3, "no layer range");
  // Two billion micro-batches claimed by a small file: refused without allocating for them.
  ExpectError("validate " + edited("\"microbatches\": 8", "\"microbatches\": 2000000000", "m.json"),
              2, "micro-batches");
}

TEST_CASE("compare: a trace without pipeplan's metadata is an error, not an abort") {
  const std::string dir = TempDir();
  Write(dir + "/t.json",
        R"({"traceEvents": [{"ph": "X", "name": "r0 F c0 m0", "ts": 0, "dur": 1}]})");
  RunResult plain = RunCli("compare " + dir + "/t.json " + dir + "/t.json");
  CHECK(plain.exit_code == 0);
  ExpectError("compare " + dir + "/t.json " + dir + "/t.json --calibrate " + dir + "/c.yaml", 2,
              "otherData.config");
  Write(dir + "/bad.json", "{\"traceEvents\": " + std::string(1000, '[') + "}");
  ExpectError("compare " + dir + "/bad.json " + dir + "/t.json", 2, "nested");
}

TEST_CASE("options out of range are errors") {
  const std::string dir = TempDir();
  REQUIRE(RunCli("plan " + kSmall + " -o " + dir + "/p.pb").exit_code == 0);
  const std::string p = dir + "/p.pb";
  ExpectError("execute " + p + " --local-ranks 4 --fault 99", 2, "--fault 99");
  ExpectError("execute " + p + " --local-ranks -4", 2, "--local-ranks -4");
  ExpectError("simulate " + p + " --trace " + dir + "/t.json --trace-ranks 99", 2,
              "--trace-ranks 99");
  ExpectError("simulate " + p + " --trace " + dir + "/t.json --trace-ranks -1", 2,
              "--trace-ranks -1");
  ExpectError("show " + p + " --rank -5", 2, "--rank -5");
  ExpectError("plan " + kSmall + " -o " + dir + "/plan.out", 2, "cannot tell the plan format");
  // Unit costs give times in units and no rates.
  RunResult unit = RunCli("simulate " + p + " --cost unit");
  CHECK(unit.exit_code == 0);
  CHECK(unit.out.find("step time        57 units") != std::string::npos);
  CHECK(unit.out.find("MFU") == std::string::npos);
}

TEST_CASE("outputs: devices and FIFOs are written, not replaced, links keep pointing") {
  const std::string dir = TempDir();
  REQUIRE(RunCli("plan " + kSmall + " -o /dev/null").exit_code == 0);
  struct stat st;
  REQUIRE(stat("/dev/null", &st) == 0);
  CHECK(S_ISCHR(st.st_mode));
  // A symlink to a file not yet written: the file appears, the link stays a link.
  REQUIRE(symlink((dir + "/real.pb").c_str(), (dir + "/link.pb").c_str()) == 0);
  REQUIRE(RunCli("plan " + kSmall + " -o " + dir + "/link.pb").exit_code == 0);
  REQUIRE(lstat((dir + "/link.pb").c_str(), &st) == 0);
  CHECK(S_ISLNK(st.st_mode));
  CHECK(Exists(dir + "/real.pb"));
  // "-": the plan on stdout, the summary on stderr.
  RunResult out = RunShell(std::string(PIPEPLAN_BIN) + " plan " + kSmall +
                           " --format json -o - 2>/dev/null | head -c 1");
  CHECK(out.out == "{");
}

TEST_CASE("the gradient check's bound holds for deep models, and a wrong plan still fails") {
  // 1,600 layers: the plan and the reference agree to rounding (the visual rows are summed
  // in one order on both sides), within the bound derived from the summation.
  Config c = MultimodalConfig("nested", {"model.llm.layers=1600"});
  Table t = Plan(c);
  Timeline tl;
  RunOptions o;
  o.op_timeout_s = 30;
  auto r = RunCpuLocal(t, o, true, &tl);
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  CHECK(r->passed());
  CHECK(r->grad_tolerance < 1e-9);
}

TEST_CASE("outputs: SIGINT in the middle of a write leaves neither the file nor its temp") {
  const std::string dir = TempDir();
  // The gzipped trace of a plan of about 300k ops (a second or more of writing); the signal
  // is sent as soon as the temp file appears.
  const std::string cmd = fmt::format(
      "{} simulate {} --set cluster.nodes=32 --set training.microbatches=64 --trace "
      "{}/big.json.gz >/dev/null 2>&1 & pid=$!; seen=0; "
      "while kill -0 $pid 2>/dev/null; do "
      "  if ls {}/big.json.gz.tmp.* >/dev/null 2>&1; then kill -INT $pid; seen=1; break; fi; "
      "  sleep 0.002; "
      "done; wait $pid; echo \"seen=$seen rc=$?\"; ls {}",
      PIPEPLAN_BIN, kDefault, dir, dir, dir);
  RunResult r = RunShell(cmd);
  CAPTURE(r.out);
  REQUIRE_MESSAGE(r.out.find("seen=1") != std::string::npos,
                  "the write ended before the signal was sent: make the plan larger");
  CHECK(r.out.find("rc=130") != std::string::npos);  // ended by SIGINT, as asked
  CHECK(r.out.find("big.json") == std::string::npos);
}

TEST_CASE("bytes that are not UTF-8 in a sweep CSV become U+FFFD in the report, not an abort") {
  // Found by the sweep_csv fuzz target (tests/fuzz/sweep_csv/not_utf8): the JSON writer threw
  // on the byte 0x86 in a column name.
  const std::string dir = TempDir();
  {
    std::ofstream f(dir + "/u.csv", std::ios::binary);
    f << "parallelism.pp\x86,step_time_s,bubble_fraction,mfu,tokens_per_s,samples_per_s,"
         "peak_memory_bytes,oom,pareto,error\n2,1,0.1,0.2,1000,1,1e9,0,1,\n";
  }
  const RunResult r = RunCli("report " + dir + "/u.csv -o " + dir + "/u.html");
  CHECK(r.exit_code == 0);
  CHECK(Slurp(dir + "/u.html").find("parallelism.pp\xef\xbf\xbd") != std::string::npos);
}
