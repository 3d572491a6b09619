// The MLP's activations, row-invariant by construction: silu(x) = x / (1 + e^-x)
// (Llama's family), and GELU's tanh approximation (Gemma's, transformers'
// gelu_pytorch_tanh), 0.5 x (1 + tanh(u)) = x / (1 + e^-2u), u = sqrt(2/pi) (x + 0.044715 x^3):
// the same form as silu's, so the same operations.
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

// x / (1 + e^-z), with e = e^-|z| never above 1: x / (1 + e) for z >= 0, x e / (1 + e)
// below (the same value, without e^-z overflowing). silu's z is x, gelu_tanh's 2u.
inline float over_one_plus_exp(double x, double z) {
  const double e = specdec_exp::exp_nonpositive(0.0 - std::fabs(z));
  return static_cast<float>((z >= 0.0 ? x : x * e) / (1.0 + e));
}

constexpr double GELU_A = 0.044715, GELU_2K = 2.0 * 0.7978845608028654;  // 2 sqrt(2/pi)

inline double gelu_z(double x) { return GELU_2K * (x + GELU_A * x * x * x); }

}  // namespace

// x: n float32 values -> y: x / (1 + e^-z) of each, z = x (silu) or 2u (gelu_tanh): the
// same operations in AVX2's lanes and in the scalar rest.
template <bool GELU>
void activate_values(const float* x, int64_t n, float* y) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256d zero = _mm256_setzero_pd(), one = _mm256_set1_pd(1.0), sign = _mm256_set1_pd(-0.0);
  const __m256d a = _mm256_set1_pd(GELU_A), k = _mm256_set1_pd(GELU_2K);
  for (; i + 4 <= n; i += 4) {
    const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
    const __m256d z =
        GELU ? _mm256_mul_pd(k, _mm256_add_pd(v, _mm256_mul_pd(_mm256_mul_pd(_mm256_mul_pd(a, v), v), v))) : v;
    const __m256d e = specdec_exp::exp_nonpositive4(_mm256_sub_pd(zero, _mm256_andnot_pd(sign, z)));
    const __m256d num = _mm256_blendv_pd(_mm256_mul_pd(v, e), v, _mm256_cmp_pd(z, zero, _CMP_GE_OQ));
    _mm_storeu_ps(y + i, _mm256_cvtpd_ps(_mm256_div_pd(num, _mm256_add_pd(one, e))));
  }
#endif
  for (; i < n; ++i) y[i] = over_one_plus_exp(x[i], GELU ? gelu_z(x[i]) : x[i]);
}

// x: rows of n float32 at a stride of `stride` values -> y: rows of n, contiguous, through
// activation 0 (silu) or 1 (gelu_tanh); rows split between threads whole.
void activate_rows(int64_t activation, const float* x, int64_t rows, int64_t n, int64_t stride, float* y) {
  auto values = activation == 0 ? activate_values<false> : activate_values<true>;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) values(x + r * stride, n, y + r * n);
  });
}

namespace {

torch::Tensor activate(int64_t activation, torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "the activations take float32 only");
  x = x.contiguous();
  auto y = torch::empty_like(x);
  const int64_t n = x.dim() ? x.size(-1) : 1;
  if (x.numel()) activate_rows(activation, x.data_ptr<float>(), x.numel() / n, n, n, y.data_ptr<float>());
  return y;
}

}  // namespace

// x: [..., n] float32 -> silu(x), gelu_tanh(x): the same bits for a value wherever it lies.
torch::Tensor silu(torch::Tensor x) { return activate(0, x); }
torch::Tensor gelu_tanh(torch::Tensor x) { return activate(1, x); }
