// FP8 storage of saved activations, as forwards marked `saved_fp8` in a plan store them:
// E4M3 (the OCP 8-bit float: sign, 4 exponent bits with bias 7, 3 mantissa bits; largest
// finite value 448, subnormals down to 2^-9, no infinities) with one fp32 scale per block of
// 128 consecutive elements of a row (the 1x128 tile-wise activation quantisation of
// DeepSeek-V3, section 3.3.1; planner/workload.h: kFp8StoredPerBf16 counts the same bytes).
// Each block is scaled so that its largest magnitude maps to 448; values round to nearest,
// ties to even, and saturate at 448.
//
// Error of one element x of a block with scale s (derivation in fp8_storage.cc; for blocks
// whose largest magnitude is within fp32's normal range times 448):
//   |x - Dequantise(Quantise(x))| <= 2^-4 |x| + 2^-10 s.
#pragma once

#include <cstdint>
#include <vector>

#include "executor/transport.h"

namespace pipeplan {

inline constexpr double kE4M3Max = 448;
inline constexpr int kFp8Block = 128;

uint8_t ToE4M3(double v);
double FromE4M3(uint8_t code);

struct Fp8Tensor {
  std::vector<uint8_t> codes;
  std::vector<float> scales;  // one per block of each row
  int row = 0;                // elements per row
};
// `x` as rows of `row` elements (row > 0, dividing x.size()).
Fp8Tensor QuantiseFp8(const Tensor& x, int row);
Tensor DequantiseFp8(const Fp8Tensor& q);
// The per-element bound above for x in its block of scale s.
double Fp8ErrorBound(double x, double s);

}  // namespace pipeplan
