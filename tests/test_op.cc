#include <doctest/doctest.h>

#include "core/op.h"

using namespace pipeplan;

TEST_CASE("op string form round-trips for every kind and module") {
  for (int k = 0; k < kNumOpKinds; ++k) {
    for (int m = 0; m < kNumModules; ++m) {
      OpKey op{3, static_cast<OpKind>(k), static_cast<Module>(m), 1, 7, -1, -1};
      if (IsP2P(op.kind) || IsCollective(op.kind)) op.peer = 2;
      if (op.module == Module::kVision) op.task = 4;
      std::string s = FormatOp(op);
      auto back = ParseOp(s);
      REQUIRE_MESSAGE(back.ok(), s << ": " << back.status().message());
      CHECK(*back == op);
      CHECK(FormatOp(*back) == s);
    }
  }
}

TEST_CASE("op string form matches the documented examples") {
  CHECK(FormatOp({0, OpKind::kF, Module::kText, 1, 3}) == "r0 F c1 m3");
  CHECK(FormatOp({2, OpKind::kSendF, Module::kText, 0, 1, -1, 3}) == "r2 SEND_F c0 m1 ->r3");
  CHECK(FormatOp({3, OpKind::kRecvF, Module::kText, 0, 1, -1, 2}) == "r3 RECV_F c0 m1 <-r2");
  CHECK(FormatOp({1, OpKind::kReduceScatter, Module::kText, 0, -1, -1, 1}) ==
        "r1 REDUCE_SCATTER c0 @g1");
  CHECK(FormatOp({0, OpKind::kF, Module::kVision, -1, 4, 2}) == "r0 vision.F m4 t2");
  CHECK(FormatOp({5, OpKind::kOptStep, Module::kOptimizer}) == "r5 OPT_STEP");
}

TEST_CASE("bad op strings are rejected with the reason") {
  CHECK(ParseOp("F c1 m3").status().message() == "bad op 'F c1 m3': expected r<rank>");
  CHECK(ParseOp("r0 FORWARD c1").status().message() ==
        "bad op 'r0 FORWARD c1': unknown kind 'FORWARD'");
  CHECK(ParseOp("r0 F m3 c1").status().message() ==
        "bad op 'r0 F m3 c1': fields out of canonical order");
  CHECK(ParseOp("r0 F c1 c2").status().message() == "bad op 'r0 F c1 c2': bad field 'c2'");
  CHECK(ParseOp("r0 F ->r1").status().message() == "bad op 'r0 F ->r1': bad field '->r1'");
  CHECK(!ParseOp("r0 audio.F m1").ok());
  CHECK(!ParseOp("r-1 F").ok());
}
