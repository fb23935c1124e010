#include "executor/fp8_storage.h"

#include <algorithm>
#include <cassert>
#include <cfloat>
#include <cmath>

namespace pipeplan {

// Bound, for y = x / s (computed in double, off by at most 2^-53 |y|):
// - normal range (|y| >= 2^-6): y = (1 + f) 2^e with 2^e <= |y|; keeping 3 bits of f moves y
//   by at most half their last place, 2^(e-4) <= 2^-4 |y|;
// - subnormal range (|y| < 2^-6): the spacing is 2^-9, so the error is at most 2^-10;
// - saturation: s is amax / 448 rounded to fp32 (relative error 2^-24), so |y| <= 448 (1 +
//   2^-24) and clamping to 448 moves y by less than 2^-4 |y|;
// the 2^-53 |y| <= 2^-44 of the division is inside the 2^-10 term. Dequantising multiplies
// a 4-bit significand by a 24-bit one: exact in double. Times s: the bound in the header.
uint8_t ToE4M3(double v) {
  if (std::isnan(v)) return 0x7F;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const double a = std::abs(v);
  if (a >= kE4M3Max) return sign | 0x7E;  // 448: saturate
  if (a < 0x1.0p-6) {                     // subnormal: m * 2^-9, m = 0..7 (8 is 2^-6)
    const double m = std::nearbyint(std::ldexp(a, 9));
    return sign | static_cast<uint8_t>(m);  // m == 8 is exponent 1, mantissa 0: code 8
  }
  int e;
  const double f = std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1): significand 2f, exponent e-1
  double mant = std::nearbyint(std::ldexp(f, 4) - 8);  // (2f - 1) * 8
  int exp = e - 1 + 7;
  if (mant == 8) mant = 0, ++exp;
  if (exp > 15 || (exp == 15 && mant == 7)) return sign | 0x7E;
  return sign | static_cast<uint8_t>(exp << 3 | static_cast<int>(mant));
}

double FromE4M3(uint8_t code) {
  const int exp = code >> 3 & 0xF, mant = code & 7;
  if (exp == 15 && mant == 7) return NAN;
  const double a = exp == 0 ? std::ldexp(mant, -9) : std::ldexp(8 + mant, exp - 10);
  return code & 0x80 ? -a : a;
}

Fp8Tensor QuantiseFp8(const Tensor& x, int row) {
  assert(row > 0 && x.size() % row == 0);
  Fp8Tensor q;
  q.row = row;
  q.codes.resize(x.size());
  for (size_t r = 0; r < x.size(); r += row)
    for (size_t b = r; b < r + row; b += kFp8Block) {
      const size_t end = std::min(b + kFp8Block, r + row);
      double amax = 0;
      for (size_t k = b; k < end; ++k) amax = std::max(amax, std::abs(x[k]));
      // A normal fp32 scale (the bound's premise): blocks of extreme magnitude clamp it.
      const float s =
          amax > 0
              ? static_cast<float>(std::clamp(amax / kE4M3Max, double{FLT_MIN}, double{FLT_MAX}))
              : 1.0f;
      q.scales.push_back(s);
      for (size_t k = b; k < end; ++k) q.codes[k] = ToE4M3(x[k] / s);
    }
  return q;
}

Tensor DequantiseFp8(const Fp8Tensor& q) {
  Tensor x(q.codes.size());
  size_t block = 0;
  for (size_t r = 0; r < x.size(); r += q.row)
    for (size_t b = r; b < r + q.row; b += kFp8Block, ++block) {
      const size_t end = std::min(b + kFp8Block, r + q.row);
      for (size_t k = b; k < end; ++k) x[k] = FromE4M3(q.codes[k]) * q.scales[block];
    }
  return x;
}

double Fp8ErrorBound(double x, double s) {
  return 0x1.0p-4 * std::abs(x) + 0x1.0p-10 * s;
}

}  // namespace pipeplan
