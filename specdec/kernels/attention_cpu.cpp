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
#include <vector>

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

// q: [T, H, d] float32, the pass's new tokens packed; k_pool, v_pool: [slots, KVH, d] float32;
// slots: [B, L] int64, each row's pool slots in position order; rows: [T] the row of
// each token; lengths: [T] how many positions each token attends (its position + 1).
// -> [T, H, d] float32: softmax(scale * q k) v over those positions, head h reading
// key-value head h / (H / KVH).
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
  const int64_t T = q.size(0), H = q.size(1), d = q.size(2), KVH = k_pool.size(1), S = k_pool.size(0);
  const int64_t B = slots.size(0), L = slots.size(1);
  TORCH_CHECK(k_pool.size(2) == d && H % KVH == 0, "q's heads do not match the pool's");
  TORCH_CHECK(rows.numel() == T && lengths.numel() == T, "rows and lengths need one entry per token");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(rp[t] >= 0 && rp[t] < B && lp[t] >= 1 && lp[t] <= L, "token ", t, " reads outside its row");
  for (int64_t i = 0; i < B * L; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < S, "slot ", sp[i], " out of the pool");
  auto out = torch::empty({T, H, d}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
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
      double total = 0.0;
      for (int64_t j = 0; j < n; ++j) {
        scores[j] = std::exp(scores[j] - top);  // now the weights
        total += scores[j];
      }
      weighted_sum(scores.data(), vp, at.data(), n, acc.data(), d);
      for (int64_t i = 0; i < d; ++i) op[th * d + i] = static_cast<float>(acc[i] / total);
    }
  });
  return out;
}
