// Schedule orders checked against independent derivations: hand-written orders from the
// published rules, and PyTorch pipelining's step-indexed formulas for interleaved 1F1B.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <map>

#include "planner/schedules.h"

using namespace pipeplan;

namespace {

std::vector<StageOrder> Orders(PipelineKind k, int pp, int vp, int m, int g = 0) {
  auto o = TextSchedule(k, pp, vp, m, g);
  REQUIRE_MESSAGE(o.ok(), o.status().message());
  return *o;
}

// PyTorch ScheduleInterleaved1F1B._calculate_single_rank_operations, transcribed: the
// step index selects the stage through forward_stage_index / backward_stage_index and a
// per-stage counter gives the micro-batch.
StageOrder TorchInterleaved(int pp, int vp, int m, int rank) {
  int rounds = std::max(1, m / pp);
  int mpr = m / rounds;  // microbatches_per_round
  int warmup = std::min((vp - 1) * mpr + 2 * (pp - 1 - rank), m * vp);
  int fwd_bwd = vp * m - warmup;
  int total = warmup + fwd_bwd + warmup;
  auto fwd_stage = [&](int step) { return ((step / mpr) % vp) * pp + rank; };
  auto bwd_stage = [&](int step) { return (vp - 1 - ((step - warmup) / mpr) % vp) * pp + rank; };
  std::map<int, int> fwd_mb, bwd_mb;
  StageOrder out;
  for (int op = 0; op < total; ++op) {
    if (op < warmup + fwd_bwd) {
      int s = fwd_stage(op);
      out.push_back({OpKind::kF, s / pp, fwd_mb[s]++});
    }
    if (op >= warmup) {
      int s = bwd_stage(op);
      out.push_back({OpKind::kB, s / pp, bwd_mb[s]++});
    }
  }
  return out;
}

}  // namespace

TEST_CASE("1F1B pp=4 m=8 equals the published order") {
  auto o = Orders(PipelineKind::k1F1B, 4, 1, 8);
  CHECK(FormatOrder(o[0]) ==
        "F0.0 F0.1 F0.2 F0.3 B0.0 F0.4 B0.1 F0.5 B0.2 F0.6 B0.3 F0.7 B0.4 B0.5 B0.6 B0.7");
  CHECK(FormatOrder(o[2]) ==
        "F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 F0.4 B0.3 F0.5 B0.4 F0.6 B0.5 F0.7 B0.6 B0.7");
  CHECK(FormatOrder(o[3]) ==
        "F0.0 B0.0 F0.1 B0.1 F0.2 B0.2 F0.3 B0.3 F0.4 B0.4 F0.5 B0.5 F0.6 B0.6 F0.7 B0.7");
}

TEST_CASE("GPipe runs all forwards then all backwards") {
  auto o = Orders(PipelineKind::kGpipe, 2, 1, 3);
  CHECK(FormatOrder(o[0]) == "F0.0 F0.1 F0.2 B0.0 B0.1 B0.2");
  CHECK(FormatOrder(o[1]) == FormatOrder(o[0]));
}

TEST_CASE("1F1B over a grid: warm-up = min(pp - r - 1, m), then strict alternation") {
  for (int pp : {2, 4, 8})
    for (int m : {pp, 2 * pp, 2 * pp + 2, 4 * pp, 1}) {
      auto orders = Orders(PipelineKind::k1F1B, pp, 1, m);
      for (int r = 0; r < pp; ++r) {
        CAPTURE(pp);
        CAPTURE(m);
        CAPTURE(r);
        const StageOrder& o = orders[r];
        REQUIRE(o.size() == static_cast<size_t>(2 * m));
        int w = std::min(pp - r - 1, m);
        int f = 0, b = 0;
        for (size_t i = 0; i < o.size(); ++i) {
          // Forwards and backwards each in micro-batch order.
          if (o[i].kind == OpKind::kF)
            CHECK(o[i].mb == f++);
          else
            CHECK(o[i].mb == b++);
          CHECK(f - b <= w + 1);  // never more than warm-up + 1 in flight
          if (i < static_cast<size_t>(w)) CHECK(o[i].kind == OpKind::kF);
        }
        // Steady state: after warm-up, F and B alternate until forwards run out.
        for (int k = 0; k < m - w; ++k) {
          CHECK(o[w + 2 * k].kind == OpKind::kF);
          CHECK(o[w + 2 * k + 1].kind == OpKind::kB);
        }
      }
    }
}

TEST_CASE("interleaved pp=2 vp=2 m=4 equals the hand-derived Megatron order") {
  auto o = Orders(PipelineKind::kInterleaved1F1B, 2, 2, 4);
  CHECK(FormatOrder(o[0]) ==
        "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3");
  CHECK(FormatOrder(o[1]) ==
        "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 B0.2 B0.3");
}

TEST_CASE("interleaved over a grid equals PyTorch's step formulas and Megatron's warm-up") {
  for (int pp : {2, 4, 8})
    for (int vp : {2, 3, 4})
      for (int m : {pp, 2 * pp, 2 * pp + 2, 4 * pp}) {
        auto orders = Orders(PipelineKind::kInterleaved1F1B, pp, vp, m);
        for (int r = 0; r < pp; ++r) {
          CAPTURE(pp);
          CAPTURE(vp);
          CAPTURE(m);
          CAPTURE(r);
          CHECK(FormatOrder(orders[r]) == FormatOrder(TorchInterleaved(pp, vp, m, r)));
          // Megatron: warm-up = (pp - r - 1) * 2 + (vp - 1) * group, capped at m * vp.
          int g = m % pp == 0 ? pp : m / std::max(1, m / pp);
          int w = std::min((pp - r - 1) * 2 + (vp - 1) * g, m * vp);
          int leading = 0;
          while (leading < static_cast<int>(orders[r].size()) &&
                 orders[r][leading].kind == OpKind::kF)
            ++leading;
          CHECK(leading == std::min(w + 1, m * vp));
        }
      }
}

TEST_CASE("Megatron's microbatch_group_size_per_vp_stage: the last group takes the remainder") {
  // m = 6, group 4: table = (0..3 x c0), (0..3 x c1), (4,5 x c0), (4,5 x c1).
  auto o = Orders(PipelineKind::kInterleaved1F1B, 2, 2, 6, 4);
  std::string fwd;
  for (const Step& s : o[1])
    if (s.kind == OpKind::kF) fwd += fmt::format("{}.{} ", s.chunk, s.mb);
  CHECK(fwd == "0.0 0.1 0.2 0.3 1.0 1.1 1.2 1.3 0.4 0.5 1.4 1.5 ");
}
