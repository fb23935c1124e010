// The closed-loop list scheduler of modality work, on pipelines small enough to time by
// hand, and the exposure metrics it is judged by.
#include <doctest/doctest.h>

#include "helpers.h"
#include "planner/list_schedule.h"
#include "planner/plan.h"
#include "planner/validate.h"

using namespace pipeplan;
using namespace pipeplan::test;

namespace {

// pp = 2, 1F1B, m = 2, one replica; text F = 1 s, B = 2 s per stage, free transfers.
// Text-only timeline (by hand): r0 F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9];
//                               r1 F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]. Step 9 s.
ListInput TwoStages() {
  ListInput in;
  in.shape = PipelineShape{2, 1, 1, 2};
  auto orders = TextSchedule(PipelineKind::k1F1B, 2, 1, 2);
  REQUIRE(orders.ok());
  in.orders = *orders;
  in.f_s = {1, 1};
  in.b_s = {2, 2};
  in.next_p2p_s = {0, 0};
  return in;
}

// One vision task of micro-batch `mb` on rank `rank` (consumer: r0).
ModalityWork OneTask(int mb, int rank) {
  ModalityWork w;
  VisionTask t;
  t.d = 0, t.mb = mb, t.rank = rank;
  w.vision.push_back(t);
  return w;
}

}  // namespace

TEST_CASE("list scheduler: text alone matches the hand-timed 1F1B") {
  ListInput in = TwoStages();
  auto r = ScheduleModality(in, ModalityWork{}, ListRules{});
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  CHECK(r->text_makespan_s == doctest::Approx(9));
}

TEST_CASE("list scheduler: a forward that fits the warm-up gap costs nothing") {
  // r1 idles [0, 1] waiting for r0's F0; a 1 s forward of micro-batch 1 (needed by r0's
  // F1 at 1 s) fits there exactly.
  ListInput in = TwoStages();
  in.vf_s = {1}, in.vb_s = {0}, in.out_s = {0};
  ModalityWork w = OneTask(1, 1);
  for (bool steal : {false, true}) {
    ListRules rules;
    rules.steal = steal;
    auto r = ScheduleModality(in, w, rules);
    REQUIRE_MESSAGE(r.ok(), r.status().message());
    CHECK(r->makespan_s == doctest::Approx(9));
    REQUIRE(r->vision.size() == 1);
    CHECK(r->vision[0].rank == 1);
    CHECK(r->vision[0].f_at == doctest::Approx(0));
    CHECK(r->vision[0].f.kind == OpKind::kF);  // before r1's first text op, F c0 m0
    CHECK(r->vision[0].f.mb == 0);
  }
}

TEST_CASE("list scheduler: a forward longer than the gap delays its consumer by the excess") {
  // A 2 s forward on r1 must end before r0's F1 (1 s): it runs [0, 2], F1 starts at 2.
  // By hand: r0 F0 [0,1] F1 [2,3] B0 [5,7] B1 [8,10]; r1 vF [0,2] F0 [2,3] B0 [3,5]
  // F1 [5,6] B1 [6,8]. Step 10 s.
  ListInput in = TwoStages();
  in.vf_s = {2}, in.vb_s = {0}, in.out_s = {0};
  ListRules rules;
  auto r = ScheduleModality(in, OneTask(1, 1), rules);
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  CHECK(r->makespan_s == doctest::Approx(10));
}

TEST_CASE("list scheduler: a backward waits for its gradient, then fills the cool-down gap") {
  // The forward of micro-batch 0 precedes every text op (r0's F0 needs it): the text
  // timeline shifts by 1 s. Micro-batch 0's gradient leaves r0 when its B0 ends (7 s); r1
  // finishes its text at 8 s and r0 at 10 s: a 2 s backward on r1 runs [8, 10] and hides
  // behind r0's last backward.
  ListInput in = TwoStages();
  in.vf_s = {1}, in.vb_s = {2}, in.out_s = {0};
  ListRules rules;
  auto r = ScheduleModality(in, OneTask(0, 1), rules);
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  CHECK(r->makespan_s == doctest::Approx(10));
  CHECK(r->vision[0].b_at == doctest::Approx(8));
}

TEST_CASE("list scheduler: the shards of a gang start together") {
  // dp = 2, pp = 1: two replicas of one stage; one image split over both ranks.
  ListInput in;
  in.shape = PipelineShape{1, 1, 2, 2};
  auto orders = TextSchedule(PipelineKind::k1F1B, 1, 1, 2);
  REQUIRE(orders.ok());
  in.orders = *orders;
  in.f_s = {1}, in.b_s = {2}, in.next_p2p_s = {0, 0};
  ModalityWork w;
  for (int shard = 0; shard < 2; ++shard) {
    VisionTask t;
    t.d = 0, t.mb = 1, t.task = 0, t.rank = shard, t.shard = shard, t.gang_ranks = {0, 1};
    w.vision.push_back(t);
  }
  in.vf_s = {0.5, 0.5}, in.vb_s = {1, 1}, in.out_s = {0, 0};
  for (bool steal : {false, true}) {
    ListRules rules;
    rules.steal = steal;
    auto r = ScheduleModality(in, w, rules);
    REQUIRE_MESSAGE(r.ok(), r.status().message());
    REQUIRE(r->vision.size() == 2);
    CHECK(r->vision[0].f_at == r->vision[1].f_at);
    CHECK(r->vision[0].b_at == r->vision[1].b_at);
    CHECK(r->vision[0].rank == 0);  // shards never move
    CHECK(r->vision[1].rank == 1);
  }
}

TEST_CASE("exposure: inline on one stage exposes all of the encoder; bound is the busiest rank") {
  // One stage, one replica: every op is serial, so removing the vision ops shortens the
  // step by exactly their compute time; the step equals the bound (nothing idles).
  Config c = MultimodalConfig(
      "inline", {"parallelism.pp=1", "cluster.gpus_per_node=1", "training.microbatches=2"});
  Table t = Plan(c);
  auto r = RunSimulation(t, SimOptionsFor(c));
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  double vision = 0;
  for (OpId i = 0; i < t.size(); ++i)
    if (t.module(i) == Module::kVision && IsCompute(t.kind(i))) vision += r->durations[i];
  CHECK(vision > 0);
  CHECK(r->metrics.vision_exposed_s == doctest::Approx(vision));
  CHECK(r->metrics.vision_hidden_fraction == doctest::Approx(0));
  CHECK(r->metrics.lower_bound_s == doctest::Approx(r->metrics.ranks[0].busy_s));
  CHECK(r->metrics.generator_exposed_s == -1);
}

TEST_CASE("policies on the list scheduler validate, and bubble-fill is never slower than nested") {
  for (int m : {4, 8, 16}) {
    CAPTURE(m);
    auto step = [&](const std::string& policy) {
      Config c = MultimodalConfig(policy, {"training.microbatches=" + std::to_string(m)});
      Table t = Plan(c);
      Status valid = ValidatePlan(t);
      CHECK_MESSAGE(valid.ok(), policy << ": " << valid.message());
      auto r = RunSimulation(t, SimOptionsFor(c));
      REQUIRE_MESSAGE(r.ok(), r.status().message());
      CHECK(r->metrics.step_time_s >= r->metrics.lower_bound_s);
      return r->metrics.step_time_s;
    };
    const double nested = step("nested"), bubble = step("bubble-fill");
    step("optimus");
    CHECK(bubble <= nested);
  }
}
