// Paged attention on the CPU for the engine's quantized models: every new token of a pass
// attends its own session's keys and values where they lie in the pool, in float64, and
// the result is rounded to float32 once.
//
// Why float64: its rounding to float32 does not depend on the order of the sums (see
// specdec.quantize), so a token gets the same bits in a one-token step, in a verify
// pass, beside other sessions, and in transformers' own float64 attention (the
// reference the exactness tests hold the engine to). Each (token, head) is computed on
// its own, in one fixed order: batch invariant by construction.
//
// Why a kernel: torch's attention for one decode token of the default target (9 heads,
// ~100 positions) spent its time gathering and converting the keys and values and in
// the call's set-up, not in the arithmetic (a quarter of a step's time went there).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
// AVX-512, where the build's CPU has it, takes 8 float64 lanes at once: the same operations
// on each sum, in the same order, so the same bits.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "exp_cpu.h"

namespace {

// sum of a[i] * b[i] over d values (a: the query, already float64), in float64: two sets of
// four sums (i % 8 < 4 and the rest), added lane by lane, then (v0 + v2) + (v1 + v3).
// AVX-512 keeps the two sets in one vector: the same operations on each sum.
inline double dot(const double* a, const float* b, int64_t d) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  __m512d acc = _mm512_setzero_pd();
  for (; i + 8 <= d; i += 8) acc = _mm512_fmadd_pd(_mm512_loadu_pd(a + i), _mm512_cvtps_pd(_mm256_loadu_ps(b + i)), acc);
  double v[4];
  _mm256_storeu_pd(v, _mm256_add_pd(_mm512_castpd512_pd256(acc), _mm512_extractf64x4_pd(acc, 1)));
  double s = (v[0] + v[2]) + (v[1] + v[3]);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  for (; i + 8 <= d; i += 8) {
    acc0 = _mm256_fmadd_pd(_mm256_loadu_pd(a + i), _mm256_cvtps_pd(_mm_loadu_ps(b + i)), acc0);
    acc1 = _mm256_fmadd_pd(_mm256_loadu_pd(a + i + 4), _mm256_cvtps_pd(_mm_loadu_ps(b + i + 4)), acc1);
  }
  double v[4];
  _mm256_storeu_pd(v, _mm256_add_pd(acc0, acc1));
  double s = (v[0] + v[2]) + (v[1] + v[3]);
#else
  double s = 0.0;
#endif
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

using specdec_exp::exp_nonpositive;

// s[j] = e^(s[j] - top) for j < n: each score's weight, whatever its place in the row
// (exp_cpu.h). (AVX2's 4 lanes on AVX-512 too: 8 measured no faster.)
inline void exp_shifted(double* s, int64_t n, double top) {
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256d shift = _mm256_set1_pd(top);
  for (; j + 4 <= n; j += 4)
    _mm256_storeu_pd(s + j, specdec_exp::exp_nonpositive4(_mm256_sub_pd(_mm256_loadu_pd(s + j), shift)));
#endif
  for (; j < n; ++j) s[j] = exp_nonpositive(s[j] - top);
}

// out[i] = sum over j < n of p[j] * v_j[i], j in order, for the d values of each v_j
// (v_j at v + offsets[j]), in float64: each out[i] is acc = fma(p[j], v_j[i], acc) from
// 0 (plain multiply-adds for the last d % 4). Blocks of 32 values (64 on AVX-512) keep their
// sums in registers across all j (a sum kept in memory cost a load and a store per key).
inline void weighted_sum(const double* p, const float* v, const int64_t* offsets, int64_t n, double* out, int64_t d) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  for (; i + 64 <= d; i += 64) {  // a head of 64 values at once (the default target's)
    __m512d acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = _mm512_setzero_pd();
    for (int64_t j = 0; j < n; ++j) {
      const __m512d pj = _mm512_set1_pd(p[j]);
      const float* vj = v + offsets[j] + i;
      for (int r = 0; r < 8; ++r) acc[r] = _mm512_fmadd_pd(pj, _mm512_cvtps_pd(_mm256_loadu_ps(vj + 8 * r)), acc[r]);
    }
    for (int r = 0; r < 8; ++r) _mm512_storeu_pd(out + i + 8 * r, acc[r]);
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 32 <= d; i += 32) {
    __m256d acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_pd();
    for (int64_t j = 0; j < n; ++j) {
      const __m256d pj = _mm256_set1_pd(p[j]);
      const float* vj = v + offsets[j] + i;
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_pd(pj, _mm256_cvtps_pd(_mm_loadu_ps(vj + 4 * r)), acc[r]);
    }
    for (int r = 0; r < 8; ++r) _mm256_storeu_pd(out + i + 4 * r, acc[r]);
  }
  for (; i + 4 <= d; i += 4) {
    __m256d acc = _mm256_setzero_pd();
    for (int64_t j = 0; j < n; ++j)
      acc = _mm256_fmadd_pd(_mm256_set1_pd(p[j]), _mm256_cvtps_pd(_mm_loadu_ps(v + offsets[j] + i)), acc);
    _mm256_storeu_pd(out + i, acc);
  }
#endif
  for (; i < d; ++i) {
    double acc = 0.0;
    for (int64_t j = 0; j < n; ++j) acc += p[j] * v[offsets[j] + i];
    out[i] = acc;
  }
}

}  // namespace

// q: T tokens x H heads x d float32, the pass's new tokens packed; k_pool, v_pool: slots x
// KVH x d float32; slots: B rows of L int64, each row's pool slots in position order;
// rows: the row of each token; lengths: how many positions each token attends (its
// position + 1) -> out: T x H x d float32, softmax(scale * q k) v over those positions,
// head h reading key-value head h / (H / KVH). The caller has checked the table
// (check_table).
void attend(const float* qp, int64_t T, int64_t H, int64_t d, const float* kp, const float* vp, int64_t KVH,
            const int64_t* sp, int64_t L, const int64_t* rp, const int64_t* lp, double scale, float* op) {
  const int64_t group = H / KVH;
  at::parallel_for(0, T * H, 8, [&](int64_t begin, int64_t end) {
    std::vector<double> scores(L), acc(d), query(d);
    std::vector<int64_t> at(L);  // where each position's key and value lie in the pools
    for (int64_t th = begin; th < end; ++th) {
      const int64_t t = th / H, h = th % H, kv = h / group, n = lp[t];
      const int64_t* row_slots = sp + rp[t] * L;
      for (int64_t i = 0; i < d; ++i) query[i] = qp[th * d + i];  // exact: converted once, not per key
      double top = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        at[j] = (row_slots[j] * KVH + kv) * d;
        scores[j] = dot(query.data(), kp + at[j], d) * scale;
        top = std::max(top, scores[j]);
      }
      exp_shifted(scores.data(), n, top);  // now the weights
      double total = 0.0;
      for (int64_t j = 0; j < n; ++j) total += scores[j];
      weighted_sum(scores.data(), vp, at.data(), n, acc.data(), d);
      for (int64_t i = 0; i < d; ++i) op[th * d + i] = static_cast<float>(acc[i] / total);
    }
  });
}

// slots [B, L], rows [T], lengths [T] as `attend` takes them (int64, contiguous), checked
// against a pool of S slots: every token reads inside its row, every slot inside the pool.
void check_table(const torch::Tensor& slots, const torch::Tensor& rows, const torch::Tensor& lengths, int64_t T,
                 int64_t S) {
  TORCH_CHECK(slots.dim() == 2 && rows.numel() == T && lengths.numel() == T,
              "slots must be [rows, L]; rows and lengths need one entry per token");
  const int64_t B = slots.size(0), L = slots.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(rp[t] >= 0 && rp[t] < B && lp[t] >= 1 && lp[t] <= L, "token ", t, " reads outside its row");
  for (int64_t i = 0; i < B * L; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < S, "slot ", sp[i], " out of the pool");
}

// q: [T, H, d] float32; k_pool, v_pool: [slots, KVH, d] float32; slots [B, L], rows [T],
// lengths [T] as `attend` takes them -> [T, H, d] float32.
torch::Tensor attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slots,
                        torch::Tensor rows, torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be [T, H, d] float32");
  TORCH_CHECK(k_pool.scalar_type() == torch::kFloat32 && v_pool.scalar_type() == torch::kFloat32 &&
                  k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes(),
              "the pools must be contiguous [slots, KVH, d] float32");
  q = q.contiguous();
  slots = slots.to(torch::kLong).contiguous();
  rows = rows.to(torch::kLong).contiguous();
  lengths = lengths.to(torch::kLong).contiguous();
  const int64_t T = q.size(0), H = q.size(1), d = q.size(2), KVH = k_pool.size(1);
  TORCH_CHECK(k_pool.size(2) == d && H % KVH == 0, "q's heads do not match the pool's");
  check_table(slots, rows, lengths, T, k_pool.size(0));
  auto out = torch::empty({T, H, d}, q.options());
  attend(q.data_ptr<float>(), T, H, d, k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), KVH,
         slots.data_ptr<int64_t>(), slots.size(1), rows.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), scale,
         out.data_ptr<float>());
  return out;
}
