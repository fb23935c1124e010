// The executor's CPU backend: gradient equivalence with a sequential reference for every
// schedule and placement policy, broken plans caught, timeouts instead of hangs.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "core/table_io.h"
#include "executor/check.h"
#include "helpers.h"

using namespace pipeplan;
using namespace pipeplan::test;

namespace {

CheckResult Check(const Table& t) {
  Timeline tl;
  RunOptions o;
  o.op_timeout_s = 10;
  auto r = RunCpuLocal(t, o, true, &tl);
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  for (OpId i = 0; i < t.size(); ++i) REQUIRE(tl.end[i] >= tl.start[i]);
  return *r;
}

void ExpectEquivalent(const Table& t) {
  CheckResult r = Check(t);
  CHECK(r.loss > 0);
  CHECK(r.loss_error < 1e-9);
  CHECK_MESSAGE(r.max_grad_error < 1e-9, r.worst << " " << r.max_grad_error);
}

}  // namespace

TEST_CASE("gradient equivalence: gpipe, 1f1b, interleaved 1f1b, with data parallelism") {
  for (auto kind : {PipelineKind::kGpipe, PipelineKind::k1F1B}) {
    CAPTURE(static_cast<int>(kind));
    ExpectEquivalent(Plan(SmallConfig(kind, 4, 1, 8, 2)));
  }
  ExpectEquivalent(Plan(SmallConfig(PipelineKind::kInterleaved1F1B, 4, 2, 8)));
  ExpectEquivalent(Plan(SmallConfig(PipelineKind::kInterleaved1F1B, 2, 3, 6, 2)));
  ExpectEquivalent(Plan(SmallConfig(PipelineKind::k1F1B, 1, 1, 3, 2)));  // one stage
}

TEST_CASE("gradient equivalence: uneven stages, bucketed overlapped gradient reduction") {
  // Layers 2 | 3 | 1 | 2 over pp = 4; bucket pieces of the last backward each reduce their
  // own layers over DP; the parameter all-gathers open the step.
  const std::vector<std::string> uneven = {
      "parallelism.pipeline_model_parallel_layout=Et*2|t*3|t|t*2L"};
  ExpectEquivalent(Plan(SmallConfig(PipelineKind::k1F1B, 4, 1, 8, 2, uneven)));
  for (bool gather : {false, true}) {
    CAPTURE(gather);
    std::vector<std::string> sets = {
        "training.overlap_grad_reduce=true", "training.grad_bucket_size=1",
        std::string("training.overlap_param_gather=") + (gather ? "true" : "false")};
    ExpectEquivalent(Plan(SmallConfig(PipelineKind::kInterleaved1F1B, 4, 2, 8, 2, sets)));
    sets.push_back(uneven[0]);
    ExpectEquivalent(Plan(SmallConfig(PipelineKind::k1F1B, 4, 1, 8, 2, sets)));
  }
}

TEST_CASE("gradient equivalence: every modality policy, with a generator and with DEP recompute") {
  for (std::string policy : {"inline", "decoupled", "nested", "bubble-fill", "optimus"}) {
    CAPTURE(policy);
    ExpectEquivalent(Plan(MultimodalConfig(policy)));
    ExpectEquivalent(
        Plan(MultimodalConfig(policy, {"schedule.pipeline=interleaved-1f1b", "parallelism.vp=2"})));
  }
  ExpectEquivalent(Plan(MultimodalConfig("decoupled", {"schedule.decoupled_recompute=true"})));
  // Gangs within a stage's GPUs (bubble-fill also places the images timed), light_ends.
  ExpectEquivalent(Plan(MultimodalConfig(
      "bubble-fill", {"model.vision.cp_max_group=2", "data.microbatch_order=light_ends"})));
  for (std::string policy : {"inline", "decoupled", "nested", "bubble-fill", "optimus"})
    ExpectEquivalent(Plan(
        MultimodalConfig(policy, {"model.generator={layers: 2, hidden: 512, mlp: 2048, heads: 8}",
                                  "data.generate={height: 256, width: 256}"})));
  // Replicated modality parameters: gradients summed over the ranks that hold a copy.
  for (std::string policy : {"inline", "nested"})
    for (std::string zero : {"0", "1"})
      ExpectEquivalent(Plan(MultimodalConfig(
          policy, {"model.generator={layers: 2, hidden: 512, mlp: 2048, heads: 8, placement: "
                   "replicated}",
                   "data.generate={height: 256, width: 256}", "model.vision.placement=replicated",
                   "training.zero_stage=" + zero})));
}

TEST_CASE("gradient equivalence: a V schedule's last-stage reduction does not block the encoder") {
  // ZBV with nested placement, a one-round window: rank 0 runs chunk 1's (the last
  // stage's) last weight-gradient pass before chunk 0's input-gradient pass of micro-batch
  // 4, after which it sends that micro-batch's encoder gradient to a task on rank 4.
  // Chunk 1's reduction over data parallelism (ranks 0 and 4) right after that last pass
  // had rank 0 wait in it for rank 4, which waited for the gradient: a deadlock for an
  // executor that ran a rank's ops one by one. The reduction now comes after the rank's
  // last encoder-gradient SEND. The bucketed reductions and ZeRO-2's per-micro-batch ones
  // keep their places: there the executor's collective stream, beside its compute stream,
  // is what lets rank 0 send the gradient while its reduction waits (with the collectives
  // in the compute stream's thread, as before, both runs time out).
  for (const char* grads :
       {"training.zero_stage=1", "training.overlap_grad_reduce=true", "training.zero_stage=2"}) {
    CAPTURE(grads);
    auto c = LoadConfig(
        std::string(PIPEPLAN_SOURCE_DIR) + "/configs/default.yaml",
        {"schedule.pipeline=zbv", "parallelism.vp=2", "schedule.modality=nested",
         "training.microbatches=6", "data.seed=43", "schedule.modality_window=1", grads});
    REQUIRE_MESSAGE(c.ok(), c.status().message());
    ExpectEquivalent(Plan(*c));
  }
}

TEST_CASE("a plan with a receive moved after its consumer fails loudly, not silently") {
  Table t = Plan(SmallConfig(PipelineKind::k1F1B, 2, 1, 2));
  auto j = nlohmann::json::parse(ToJson(t));
  // On rank 1, swap "RECV_F c0 m0" with the forward that needs it.
  auto& ops = j["ops"];
  size_t recv = 0;
  while (ops[recv]["op"] != "r1 RECV_F c0 m0 <-r0") ++recv;
  REQUIRE(ops[recv + 1]["op"] == "r1 F c0 m0");
  std::swap(ops[recv], ops[recv + 1]);
  auto broken = FromJson(j.dump());
  REQUIRE(broken.ok());
  Timeline tl;
  auto r = RunCpuLocal(*broken, RunOptions{}, true, &tl);
  REQUIRE(!r.ok());
  CHECK(r.status().message() ==
        "rank 1: r1 F c0 m0: its input from the previous stage has not arrived");
}

TEST_CASE("a peer that never sends: the receiver times out, names itself, and every rank stops") {
  Table t = Plan(SmallConfig(PipelineKind::k1F1B, 2, 1, 2));
  auto j = nlohmann::json::parse(ToJson(t));
  // Rank 0's SEND of m1's activations goes to a tag nobody receives: rank 1 waits.
  for (auto& op : j["ops"])
    if (op["op"] == "r0 SEND_F c0 m1 ->r1") op["tag"] = 999999;
  for (auto& op : j["ops"])
    if (op["op"] == "r1 RECV_F c0 m1 <-r0") op.erase("deps");
  auto broken = FromJson(j.dump());
  REQUIRE(broken.ok());
  Timeline tl;
  RunOptions o;
  o.op_timeout_s = 0.2;
  auto r = RunCpuLocal(*broken, o, false, &tl);
  REQUIRE(!r.ok());
  // Rank 1 waits for m1's activations; rank 0 waits for m1's gradient from rank 1. Both
  // time out; either may be reported, with its rank and op.
  const std::string& m = r.status().message();
  CHECK((m == "rank 1: r1 RECV_F c0 m1 <-r0: timed out after 0.2 s: the matching SEND never came" ||
         m == "rank 0: r0 RECV_B c0 m1 <-r1: timed out after 0.2 s: the matching SEND never came"));
  // Partial timeline: rank 0's first ops ran, the waiting op never finished cleanly.
  CHECK(tl.start[0] >= 0);
}

TEST_CASE("a reduction made to wait for a later op of its rank is refused before anything runs") {
  // The streams of a rank wait for their dependencies with no timeout of their own (the ops
  // waited for end or fail at a transport's timeout), which holds where every dependency on
  // the rank is an earlier op: a plan where one is not is refused, not waited on.
  Table t = Plan(SmallConfig(PipelineKind::k1F1B, 2, 1, 2, 2));
  auto j = nlohmann::json::parse(ToJson(t));
  uint32_t opt_step = 0, n = 0;
  for (auto& op : j["ops"]) {
    if (op["op"] == "r1 OPT_STEP") opt_step = n;
    ++n;
  }
  bool edited = false;
  for (auto& op : j["ops"])
    if (!edited && op["op"].get<std::string>().rfind("r1 REDUCE_SCATTER", 0) == 0) {
      op["deps"].push_back(opt_step);
      edited = true;
    }
  REQUIRE(edited);
  auto broken = FromJson(j.dump());
  REQUIRE(broken.ok());
  Timeline tl;
  RunOptions o;
  o.op_timeout_s = 30;  // a wait would end in a timeout, not in this error
  auto r = RunCpuLocal(*broken, o, false, &tl);
  REQUIRE(!r.ok());
  CHECK(r.status().message().find("rank 1: r1 REDUCE_SCATTER") == 0);
  CHECK(r.status().message().find("depends on r1 OPT_STEP, which is not before it") !=
        std::string::npos);
}

TEST_CASE("execute CLI: --check passes, the measured trace is a Chrome trace of every op") {
  std::string dir = TempDir();
  std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/default.yaml";
  REQUIRE(RunCli("plan " + cfg + " -o " + dir + "/p.pb").exit_code == 0);
  RunResult r =
      RunCli("execute " + dir + "/p.pb --local-ranks 8 --check --trace " + dir + "/m.json");
  CHECK_MESSAGE(r.exit_code == 0, r.out);
  CHECK(r.out.find("PASS") != std::string::npos);
  CHECK(TraceFileRuleBroken(dir + "/m.json") == "");
  auto trace = nlohmann::json::parse(Slurp(dir + "/m.json"));
  CHECK(trace["otherData"]["source"] == "measured");
  size_t slices = 0;
  for (auto& e : trace["traceEvents"]) slices += e["ph"] == "X";
  auto t = LoadPlan(dir + "/p.pb");
  REQUIRE(t.ok());
  CHECK(slices == t->size());
  CHECK(RunCli("execute " + dir + "/p.pb --local-ranks 3").exit_code == 2);
  RunResult cuda =
      RunCli("execute " + dir + "/p.pb --local-ranks 8 --backend cuda --trace " + dir + "/c.json");
  CHECK(cuda.exit_code != 0);
  CHECK(cuda.out.find("CUDA") != std::string::npos);
}

TEST_CASE(
    "compare lines up a simulated and a measured trace, and its calibration loads in simulate") {
  std::string dir = TempDir();
  std::string cfg = std::string(PIPEPLAN_SOURCE_DIR) + "/configs/small_text.yaml";
  REQUIRE(RunCli("plan " + cfg + " -o " + dir + "/p.pb").exit_code == 0);
  REQUIRE(RunCli("simulate " + dir + "/p.pb --trace " + dir + "/sim.json").exit_code == 0);
  REQUIRE(
      RunCli("execute " + dir + "/p.pb --local-ranks 4 --trace " + dir + "/cpu.json").exit_code ==
      0);
  CHECK(TraceFileRuleBroken(dir + "/sim.json") == "");
  CHECK(TraceFileRuleBroken(dir + "/cpu.json") == "");
  // A CPU run is far faster than the plan's H100s could be: no calibration from it.
  RunResult cpu =
      RunCli("compare " + dir + "/sim.json " + dir + "/cpu.json --calibrate " + dir + "/bad.yaml");
  CHECK(cpu.exit_code == 2);
  CHECK(cpu.out.find("not from this GPU") != std::string::npos);
  CHECK(!Exists(dir + "/bad.yaml"));
  // A "measured" run on GPUs at half the catalog's efficiencies: the fit finds them.
  REQUIRE(RunCli("simulate " + dir + "/p.pb --trace " + dir + "/meas.json" +
                 " --set cluster.hardware.compute_efficiency=0.375" +
                 " --set cluster.hardware.attention_efficiency=0.25" +
                 " --set cluster.hardware.hbm_efficiency=0.4")
              .exit_code == 0);
  RunResult r =
      RunCli("compare " + dir + "/sim.json " + dir + "/meas.json --calibrate " + dir + "/cal.yaml");
  REQUIRE_MESSAGE(r.exit_code == 0, r.out);
  CHECK(r.out.find("ops              356 matched, 0 only simulated, 0 only measured") !=
        std::string::npos);
  CHECK(r.out.find("worst ops (measured - predicted):") != std::string::npos);
  std::string cal = Slurp(dir + "/cal.yaml");
  const size_t at = cal.find("compute_efficiency:");
  REQUIRE(at != std::string::npos);
  // Compute time doubled except kernel launches and the folded TP transfers, which did not
  // change: the fitted efficiency lies between the slow GPUs' and the catalog's.
  const double fitted = std::stod(cal.substr(at + 19));
  CHECK(fitted > 0.375);
  CHECK(fitted < 0.75);
  // The fitted factors reproduce the measured compute total when simulated again.
  RunResult again = RunCli("simulate " + dir + "/p.pb --calibration " + dir + "/cal.yaml --json");
  REQUIRE_MESSAGE(again.exit_code == 0, again.out);
  CHECK(RunCli("compare " + dir + "/sim.json " + cfg).exit_code == 2);  // not a trace
  CHECK(RunCli("simulate " + dir + "/p.pb --set parallelism.pp=2").exit_code ==
        2);  // plans take hardware only
}
