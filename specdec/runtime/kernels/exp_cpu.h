// e^x for x <= 0 in float64, within about an ulp, for the kernels that need it (the
// attention's softmax weights, the activation): the same operations on every value, in
// the 4 lanes of AVX2 and in the scalar rest alike, so a value's result does not depend on
// where in a row it lies or on how a pass's elements were split between threads.
//
// Why our own: std::exp cost a call per value (attention of 5 tokens over 125 positions,
// 30 layers, cache-hot, one thread: 3.4 -> 2.9 ms), and torch's elementwise exp runs
// SIMD lanes (Sleef) and a scalar rest (libm) that round differently: a thread's piece
// that starts mid-row then gives a row other bits than a one-token step does.
//
// x = k ln2 + r, |r| <= ln2 / 2; e^r by its Taylor series to r^13 (the rest below 1e-17
// of it); 2^k put into the exponent's bits. Below e^-708 (2^-1021) the result is 0.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace specdec_exp {

constexpr double EXP_FLOOR = -708.0, LOG2E = 0x1.71547652b82fep0, LN2_HI = 0x1.62e42fefa39efp-1,
                 LN2_LO = 0x1.abc9e3b39803fp-56, BIAS = 0x1.8p52 + 1023.0;  // k + BIAS: k + 1023 in the low bits
constexpr double TAYLOR[14] = {1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040,
                               1.0 / 40320, 1.0 / 362880, 1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600,
                               1.0 / 6227020800};

inline double exp_nonpositive(double x) {
  if (x < EXP_FLOOR) return 0.0;
  const double k = std::nearbyint(x * LOG2E);
  const double r = std::fma(-k, LN2_LO, std::fma(-k, LN2_HI, x));
  double p = TAYLOR[13];
  for (int i = 12; i >= 0; --i) p = std::fma(p, r, TAYLOR[i]);
  uint64_t bits;
  const double biased = k + BIAS;
  std::memcpy(&bits, &biased, 8);
  bits <<= 52;
  double scale;
  std::memcpy(&scale, &bits, 8);
  return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp_nonpositive on 4 values at once: the same operations, lane by lane.
inline __m256d exp_nonpositive4(__m256d x) {
  const __m256d k = _mm256_round_pd(_mm256_mul_pd(x, _mm256_set1_pd(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256d minus_k = _mm256_sub_pd(_mm256_setzero_pd(), k);
  const __m256d r =
      _mm256_fmadd_pd(minus_k, _mm256_set1_pd(LN2_LO), _mm256_fmadd_pd(minus_k, _mm256_set1_pd(LN2_HI), x));
  __m256d p = _mm256_set1_pd(TAYLOR[13]);
  for (int i = 12; i >= 0; --i) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(TAYLOR[i]));
  const __m256d scale =
      _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_castpd_si256(_mm256_add_pd(k, _mm256_set1_pd(BIAS))), 52));
  const __m256d kept = _mm256_cmp_pd(x, _mm256_set1_pd(EXP_FLOOR), _CMP_NLT_UQ);  // NaN kept: it stays NaN
  return _mm256_and_pd(_mm256_mul_pd(p, scale), kept);
}
#endif

}  // namespace specdec_exp
