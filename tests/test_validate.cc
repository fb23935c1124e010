#include <doctest/doctest.h>

#include "helpers.h"
#include "planner/validate.h"

using namespace pipeplan;
using namespace pipeplan::test;

namespace {

// 1F1B, pp = 2, two micro-batches, written out by hand.
std::vector<std::vector<std::string>> Valid() {
  return {{"r0 F c0 m0", "r0 SEND_F c0 m0 ->r1", "r0 F c0 m1", "r0 SEND_F c0 m1 ->r1",
           "r0 RECV_B c0 m0 <-r1", "r0 B c0 m0", "r0 RECV_B c0 m1 <-r1", "r0 B c0 m1"},
          {"r1 RECV_F c0 m0 <-r0", "r1 F c0 m0", "r1 B c0 m0", "r1 SEND_B c0 m0 ->r0",
           "r1 RECV_F c0 m1 <-r0", "r1 F c0 m1", "r1 B c0 m1", "r1 SEND_B c0 m1 ->r0"}};
}

std::string Why(const Table& t) {
  Status s = ValidatePlan(t);
  REQUIRE(!s.ok());
  CHECK(s.code() == ErrorCode::kInvalidPlan);
  return s.message();
}

}  // namespace

TEST_CASE("every generated schedule validates") {
  for (auto k : {PipelineKind::kGpipe, PipelineKind::k1F1B})
    for (int pp : {1, 2, 4})
      for (int m : {1, 3, 8}) {
        CAPTURE(pp);
        CAPTURE(m);
        Status s = ValidatePlan(Plan(SmallConfig(k, pp, 1, m, 2)));
        CHECK_MESSAGE(s.ok(), s.message());
      }
  for (int pp : {2, 4, 8})
    for (int vp : {2, 3, 4})
      for (int m : {pp, 2 * pp, 2 * pp + 2, 4 * pp}) {
        CAPTURE(pp);
        CAPTURE(vp);
        CAPTURE(m);
        Status s = ValidatePlan(Plan(SmallConfig(PipelineKind::kInterleaved1F1B, pp, vp, m)));
        CHECK_MESSAGE(s.ok(), s.message());
      }
}

TEST_CASE("the hand-written table is valid") {
  CHECK(ValidatePlan(TableFromOps(Valid(), 2, 1, 2)).ok());
}

TEST_CASE("missing RECV") {
  auto ops = Valid();
  ops[1].erase(ops[1].begin() + 4);  // r1 RECV_F c0 m1
  CHECK(Why(TableFromOps(ops, 2, 1, 2)) == "r0 SEND_F c0 m1 ->r1: no matching RECV");
}

TEST_CASE("dependency cycle") {
  Table t = TableFromOps(Valid(), 2, 1, 2);
  // r0's first forward waits for r1's first backward, which needs r0's forward.
  Table broken = WithDep(t, Find(t, "r0 F c0 m0"), Find(t, "r1 B c0 m0"));
  CHECK(Why(broken).find("dependency cycle") != std::string::npos);
}

TEST_CASE("a dependency on a later op of the same rank") {
  // r0's reduction first in its sequence, waiting for its last backward: on the collective
  // stream that is no cycle (the engine would run it), but a sequence that is not an order
  // its ops can run in.
  auto ops = Valid();
  ops[0].insert(ops[0].begin(), "r0 ALL_REDUCE c0 @g0");
  ops[1].push_back("r1 ALL_REDUCE c0 @g0");
  Table t = TableFromOps(ops, 2, 1, 2, {{0, 1}});
  REQUIRE(ValidatePlan(t).ok());
  Table broken = WithDep(t, Find(t, "r0 ALL_REDUCE c0 @g0"), Find(t, "r0 B c0 m1"));
  CHECK(Why(broken) ==
        "r0 ALL_REDUCE c0 @g0: depends on r0 B c0 m1, which comes after it on its rank");
}

TEST_CASE("deadlocking order of collectives") {
  auto ops = Valid();
  ops[0].push_back("r0 ALL_REDUCE c0 @g0");
  ops[0].push_back("r0 ALL_REDUCE c1 @g0");
  ops[1].push_back("r1 ALL_REDUCE c1 @g0");
  ops[1].push_back("r1 ALL_REDUCE c0 @g0");
  Table t = TableFromOps(ops, 2, 1, 2, {{0, 1}});
  CHECK(Why(t) ==
        "deadlock: 4 of 20 ops can never start; blocked ranks wait on:\n"
        "  r0 ALL_REDUCE c0 @g0 (waits for other group members)\n"
        "  r1 ALL_REDUCE c1 @g0 (waits for other group members)");
}

TEST_CASE("micro-batch skipping a chunk") {
  // One rank, two chunks: micro-batch 1 never runs chunk 1 forward.
  std::vector<std::vector<std::string>> ops = {{"r0 F c0 m0", "r0 F c1 m0", "r0 B c1 m0",
                                                "r0 B c0 m0", "r0 F c0 m1", "r0 B c1 m1",
                                                "r0 B c0 m1"}};
  CHECK(Why(TableFromOps(ops, 1, 2, 2)) == "micro-batch 1 of replica 0 skips r0 F c1 m1");
}

TEST_CASE("consumer before its input arrives") {
  auto ops = Valid();
  std::swap(ops[1][0], ops[1][1]);  // r1 computes F m0 before receiving it
  CHECK(Why(TableFromOps(ops, 2, 1, 2)) ==
        "r1 F c0 m0: runs before r1 RECV_F c0 m0 <-r0 delivers its input");
}

TEST_CASE("send before the producer ran") {
  auto ops = Valid();
  std::swap(ops[0][0], ops[0][1]);  // r0 sends m0 before computing it
  CHECK(Why(TableFromOps(ops, 2, 1, 2)) ==
        "r0 SEND_F c0 m0 ->r1: sends before r0 F c0 m0 produced it");
}
