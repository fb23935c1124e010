// FP8 storage of saved activations: the E4M3 codec against hand-worked values, the block
// quantiser's error bound, and plans whose forwards store in FP8 replayed on the CPU
// backend with the check passing.
#include <doctest/doctest.h>

#include <cmath>

#include "executor/check.h"
#include "executor/fp8_storage.h"
#include "helpers.h"

using namespace pipeplan;
using namespace pipeplan::test;

TEST_CASE("E4M3: hand-worked codes, ties to even, subnormals, saturation") {
  // 1.0 = 2^0: biased exponent 7, mantissa 0 -> 0b0'0111'000.
  CHECK(ToE4M3(1.0) == 0x38);
  CHECK(FromE4M3(0x38) == 1.0);
  // 448 = 1.75 * 2^8: exponent 15, mantissa 6 (mantissa 7 of exponent 15 is NaN).
  CHECK(ToE4M3(448.0) == 0x7E);
  CHECK(FromE4M3(0x7E) == 448.0);
  CHECK(std::isnan(FromE4M3(0x7F)));
  CHECK(ToE4M3(1e6) == 0x7E);   // saturates
  CHECK(ToE4M3(-2.0) == 0xC0);  // sign | exponent 8
  CHECK(FromE4M3(0xC0) == -2.0);
  // Between 1 and 1.125 (spacing 1/8): 1.0625 is the tie, to the even mantissa 0; 1.1875
  // ties between 1.125 (odd) and 1.25 (even).
  CHECK(FromE4M3(ToE4M3(1.0625)) == 1.0);
  CHECK(FromE4M3(ToE4M3(1.1875)) == 1.25);
  CHECK(FromE4M3(ToE4M3(1.07)) == 1.125);
  // Subnormals are multiples of 2^-9: 2^-9 is code 1; 1.5 * 2^-9 ties to 2 * 2^-9; 7.5 *
  // 2^-9 rounds up to 2^-6, the smallest normal (exponent 1, mantissa 0: code 8).
  CHECK(ToE4M3(std::ldexp(1, -9)) == 0x01);
  CHECK(FromE4M3(ToE4M3(std::ldexp(1.5, -9))) == std::ldexp(2, -9));
  CHECK(ToE4M3(std::ldexp(7.5, -9)) == 0x08);
  CHECK(ToE4M3(std::ldexp(0.4, -9)) == 0x00);
  // The mantissa carries into the exponent: 1.9375 ties between 1.875 (odd) and 2 (even).
  CHECK(ToE4M3(1.9375) == 0x40);
  // Above 448 (464 would round to the NaN code's 480), and infinity, saturate.
  CHECK(ToE4M3(464.0) == 0x7E);
  CHECK(ToE4M3(INFINITY) == 0x7E);
  CHECK(ToE4M3(-INFINITY) == 0xFE);
  // Every finite code decodes to a value that encodes back to it.
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    CAPTURE(c);
    CHECK(ToE4M3(FromE4M3(static_cast<uint8_t>(c))) == c);
  }
}

TEST_CASE("1x128 block quantisation: one scale per block of a row, error within the bound") {
  // Rows of 200 elements: blocks of 128 and 72, each with its own scale.
  const int row = 200, rows = 3;
  Tensor x(row * rows);
  for (size_t k = 0; k < x.size(); ++k)  // magnitudes over ten decades, both signs
    x[k] = std::sin(0.7 * k + 0.3) * std::pow(10.0, static_cast<double>(k % 11) - 5);
  x[5] = 0;
  const Fp8Tensor q = QuantiseFp8(x, row);
  REQUIRE(q.scales.size() == 2 * rows);
  // Blocks beyond fp32's range of scales still quantise to finite values.
  for (double big : {1e-44, 1e42}) {
    const Tensor z = DequantiseFp8(QuantiseFp8(Tensor{big, -big / 3, 0}, 3));
    CHECK(std::isfinite(z[0]));
    CHECK(z[2] == 0);
  }
  const Tensor y = DequantiseFp8(q);
  for (int r = 0; r < rows; ++r)
    for (int b = 0; b < 2; ++b) {
      const int begin = r * row + b * kFp8Block, end = r * row + (b == 0 ? kFp8Block : row);
      double amax = 0;
      for (int k = begin; k < end; ++k) amax = std::max(amax, std::abs(x[k]));
      const float s = q.scales[2 * r + b];
      // The block's largest magnitude maps to E4M3's largest, 448 (to fp32's rounding).
      double ymax = 0;
      for (int k = begin; k < end; ++k) ymax = std::max(ymax, std::abs(y[k]));
      CHECK(ymax == 448.0 * s);
      CHECK(ymax == doctest::Approx(amax).epsilon(1e-6));
      for (int k = begin; k < end; ++k) {
        CAPTURE(k);
        CHECK(std::abs(y[k] - x[k]) <= Fp8ErrorBound(x[k], s));
      }
    }
  CHECK(y[5] == 0);
  // Elements in E4M3's normal range (|x| / s >= 2^-6) keep 2^-4 of themselves, and some
  // lose more than 2^-6; smaller ones flush towards multiples of 2^-9 s, some all the way.
  double worst = 0;
  int flushed = 0;
  for (size_t k = 0; k < x.size(); ++k) {
    const float s = q.scales[k / row * 2 + (k % row >= kFp8Block)];
    if (std::abs(x[k]) >= 0x1.0p-6 * s)
      worst = std::max(worst, std::abs(y[k] - x[k]) / std::abs(x[k]));
    else
      flushed += x[k] != 0 && y[k] == 0;
  }
  CHECK(worst > 0x1.0p-6);
  CHECK(worst <= 0x1.0p-4);
  CHECK(flushed > 0);
}

TEST_CASE("FP8 storage: forwards are marked, the CPU backend quantises, the check passes") {
  for (std::string policy : {"inline", "decoupled", "nested", "bubble-fill", "optimus"}) {
    CAPTURE(policy);
    const Table t = Plan(MultimodalConfig(
        policy, {"training.saved_activations=fp8", "model.vision.saved_activations=fp8"}));
    int marked[3] = {0, 0, 0};
    for (OpId i = 0; i < t.size(); ++i) {
      if (!t.work(i).saved_fp8) continue;
      CHECK((t.kind(i) == OpKind::kF || t.kind(i) == OpKind::kRecompute));
      ++marked[static_cast<int>(t.module(i))];
    }
    CHECK(marked[static_cast<int>(Module::kText)] > 0);
    CHECK(marked[static_cast<int>(Module::kVision)] > 0);
    Timeline tl;
    auto r = RunCpuLocal(t, RunOptions{}, true, &tl);
    REQUIRE_MESSAGE(r.ok(), r.status().message());
    CHECK_MESSAGE(r->passed(), r->worst << " " << r->max_grad_error << " > " << r->grad_tolerance);
    CHECK(r->fp8_storage);
    // Real quantisation: the gradients moved far more than any summation order could move
    // them, and by no more than E4M3's relative step (2^-3) could plausibly explain.
    CHECK(r->fp8_effect > 1e3 * r->grad_tolerance);
    CHECK(r->fp8_effect < 0.5);
  }
}

TEST_CASE("FP8 storage of activations a RECOMPUTE rebuilds (decoupled, outputs kept)") {
  const Table t = Plan(MultimodalConfig(
      "decoupled", {"schedule.decoupled_recompute=true", "model.vision.saved_activations=fp8"}));
  int rebuilt = 0;
  for (OpId i = 0; i < t.size(); ++i) {
    if (t.module(i) != Module::kVision) continue;
    CHECK_FALSE((t.kind(i) == OpKind::kF && t.work(i).saved_fp8));  // it keeps its output only
    rebuilt += t.kind(i) == OpKind::kRecompute && t.work(i).saved_fp8;
  }
  CHECK(rebuilt > 0);
  Timeline tl;
  auto r = RunCpuLocal(t, RunOptions{}, true, &tl);
  REQUIRE_MESSAGE(r.ok(), r.status().message());
  CHECK(r->passed());
  CHECK(r->fp8_effect > 1e3 * r->grad_tolerance);
}

TEST_CASE("FP8 storage with a split backward and with host offload replays and checks") {
  for (auto sets : std::vector<std::vector<std::string>>{
           {"training.saved_activations=fp8"},
           {"training.saved_activations=fp8", "training.offload=host",
            "cluster.hardware.host_link_bw=1e15"}}) {
    for (PipelineKind kind : {PipelineKind::kZbH1, PipelineKind::k1F1B}) {
      const Table t = Plan(SmallConfig(kind, 4, 1, 8, 2, sets));
      Timeline tl;
      auto r = RunCpuLocal(t, RunOptions{}, true, &tl);
      REQUIRE_MESSAGE(r.ok(), r.status().message());
      CHECK(r->passed());
      CHECK(r->fp8_effect > 1e3 * r->grad_tolerance);
    }
  }
  // Without FP8 storage nothing is marked and nothing is reported.
  const Table plain = Plan(SmallConfig(PipelineKind::k1F1B, 4, 1, 8));
  Timeline tl;
  auto r = RunCpuLocal(plain, RunOptions{}, true, &tl);
  REQUIRE(r.ok());
  CHECK_FALSE(r->fp8_storage);
  CHECK(r->fp8_effect == 0);
}
