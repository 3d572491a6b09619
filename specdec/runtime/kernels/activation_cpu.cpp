// The MLP's activation, silu(x) = x / (1 + e^-x), row-invariant by construction.
//
// Why our own: torch's silu splits a pass's T x inter values between threads in equal
// pieces, and runs each piece's whole SIMD vectors through Sleef's exp and its rest
// through libm's, which round differently. A piece that starts mid-row gives that row's
// first values other bits than a one-token step gives them (the default target, 86
// tokens at 8 threads: keys apart from position 17 on). Here every value goes through
// the same operations, in AVX2's lanes and in the scalar rest alike (exp_cpu.h), in
// float64, rounded to float32 once: a row's bits do not depend on the pass, the row's
// place in it, or the threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "exp_cpu.h"

namespace {

// e = e^-|x|, never above 1; silu = x / (1 + e) for x >= 0, x e / (1 + e) below (the
// same value, without e^-x overflowing).
inline float silu_one(float value) {
  const double x = value, e = specdec_exp::exp_nonpositive(0.0 - std::fabs(x));
  return static_cast<float>((x >= 0.0 ? x : x * e) / (1.0 + e));
}

}  // namespace

// x: n float32 values -> y: their silu.
void silu_values(const float* x, int64_t n, float* y) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256d zero = _mm256_setzero_pd(), one = _mm256_set1_pd(1.0);
  const __m256d sign = _mm256_set1_pd(-0.0);
  for (; i + 4 <= n; i += 4) {
    const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
    const __m256d e = specdec_exp::exp_nonpositive4(_mm256_sub_pd(zero, _mm256_andnot_pd(sign, v)));
    const __m256d num = _mm256_blendv_pd(_mm256_mul_pd(v, e), v, _mm256_cmp_pd(v, zero, _CMP_GE_OQ));
    _mm_storeu_ps(y + i, _mm256_cvtpd_ps(_mm256_div_pd(num, _mm256_add_pd(one, e))));
  }
#endif
  for (; i < n; ++i) y[i] = silu_one(x[i]);
}

// x: rows of n float32 at a stride of `stride` values -> y: rows of n, contiguous; rows
// split between threads whole.
void silu_rows(const float* x, int64_t rows, int64_t n, int64_t stride, float* y) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_values(x + r * stride, n, y + r * n);
  });
}

// x: [..., n] float32 -> silu(x), the same bits for a value wherever it lies.
torch::Tensor silu(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "silu: float32 only");
  x = x.contiguous();
  auto y = torch::empty_like(x);
  const int64_t n = x.dim() ? x.size(-1) : 1;
  if (x.numel()) silu_rows(x.data_ptr<float>(), x.numel() / n, n, n, y.data_ptr<float>());
  return y;
}
