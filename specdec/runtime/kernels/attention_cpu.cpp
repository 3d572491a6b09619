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
#include <algorithm>
#include <cstring>
#include <vector>

#include "exp_cpu.h"

namespace {

// sum of a[i] * b[i] over d values (a: the query, b: a key, both already float64: a
// float's conversion is exact, so a key converted once serves every query that reads it), in
// float64: two sets of four sums (i % 8 < 4 and the rest), added lane by lane, then
// (v0 + v2) + (v1 + v3). AVX-512 keeps the two sets in one vector: the same operations on
// each sum.
inline double dot(const double* a, const double* b, int64_t d) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  __m512d acc = _mm512_setzero_pd();
  for (; i + 8 <= d; i += 8) acc = _mm512_fmadd_pd(_mm512_loadu_pd(a + i), _mm512_loadu_pd(b + i), acc);
  double v[4];
  _mm256_storeu_pd(v, _mm256_add_pd(_mm512_castpd512_pd256(acc), _mm512_extractf64x4_pd(acc, 1)));
  double s = (v[0] + v[2]) + (v[1] + v[3]);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  for (; i + 8 <= d; i += 8) {
    acc0 = _mm256_fmadd_pd(_mm256_loadu_pd(a + i), _mm256_loadu_pd(b + i), acc0);
    acc1 = _mm256_fmadd_pd(_mm256_loadu_pd(a + i + 4), _mm256_loadu_pd(b + i + 4), acc1);
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

// Asks for the d values at p (a key or a value row) before they are read: one key-value
// head's rows lie 256 bytes in every 768 of the pool ([slot, head, value]), in blocks of
// slots here and there, a walk the hardware's prefetchers lose at each 4 KiB page. AHEAD
// keys ahead.
constexpr int64_t AHEAD = 8;
inline void prefetch(const float* p, int64_t d) {
#if defined(__AVX2__)
  for (int64_t i = 0; i < d; i += 16) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
#endif
}

// b[i] = a[i] for d floats (exact).
inline void widen(const float* a, double* b, int64_t d) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 4 <= d; i += 4) _mm256_storeu_pd(b + i, _mm256_cvtps_pd(_mm_loadu_ps(a + i)));
#endif
  for (; i < d; ++i) b[i] = a[i];
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

// out[i] += sum over j0 <= j < j1 of p[j] * v_j[i], j in order, for the d values of each v_j
// (v_j at v + offsets[j]), in float64: each out[i] goes on as acc = fma(p[j], v_j[i], acc)
// (plain multiply-adds for the last d % 4), so a sum taken in several ranges is the sum
// taken in one. Blocks of 32 values (64 on AVX-512) keep their sums in registers across the
// range (a sum kept in memory cost a load and a store per key).
inline void weighted_sum(const double* p, const float* v, const int64_t* offsets, int64_t j0, int64_t j1,
                         double* out, int64_t d) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  for (; i + 64 <= d; i += 64) {  // a head of 64 values at once (the default target's)
    __m512d acc[8];
    for (int r = 0; r < 8; ++r) acc[r] = _mm512_loadu_pd(out + i + 8 * r);
    for (int64_t j = j0; j < j1; ++j) {
      if (j + AHEAD < j1) prefetch(v + offsets[j + AHEAD] + i, 64);
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
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_loadu_pd(out + i + 4 * r);
    for (int64_t j = j0; j < j1; ++j) {
      if (j + AHEAD < j1) prefetch(v + offsets[j + AHEAD] + i, 32);
      const __m256d pj = _mm256_set1_pd(p[j]);
      const float* vj = v + offsets[j] + i;
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_pd(pj, _mm256_cvtps_pd(_mm_loadu_ps(vj + 4 * r)), acc[r]);
    }
    for (int r = 0; r < 8; ++r) _mm256_storeu_pd(out + i + 4 * r, acc[r]);
  }
  for (; i + 4 <= d; i += 4) {
    __m256d acc = _mm256_loadu_pd(out + i);
    for (int64_t j = j0; j < j1; ++j)
      acc = _mm256_fmadd_pd(_mm256_set1_pd(p[j]), _mm256_cvtps_pd(_mm_loadu_ps(v + offsets[j] + i)), acc);
    _mm256_storeu_pd(out + i, acc);
  }
#endif
  for (; i < d; ++i) {
    double acc = out[i];
    for (int64_t j = j0; j < j1; ++j) acc += p[j] * v[offsets[j] + i];
    out[i] = acc;
  }
}

// weighted_sum for two queries at once over the keys both read (j0 <= j < j1), d a multiple
// of 64 on AVX-512: each value of v_j converted once for both; each query's sums the same
// operations, in the same order, as weighted_sum's. -> whether it could (else nothing done).
inline bool weighted_sum2(const double* pa, const double* pb, const float* v, const int64_t* offsets, int64_t j0,
                          int64_t j1, double* outa, double* outb, int64_t d) {
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  if (d % 64) return false;
  for (int64_t i = 0; i < d; i += 64) {
    __m512d a[8], b[8];
    for (int r = 0; r < 8; ++r) a[r] = _mm512_loadu_pd(outa + i + 8 * r), b[r] = _mm512_loadu_pd(outb + i + 8 * r);
    for (int64_t j = j0; j < j1; ++j) {
      if (j + AHEAD < j1) prefetch(v + offsets[j + AHEAD] + i, 64);
      const __m512d paj = _mm512_set1_pd(pa[j]), pbj = _mm512_set1_pd(pb[j]);
      const float* vj = v + offsets[j] + i;
      for (int r = 0; r < 8; ++r) {
        const __m512d x = _mm512_cvtps_pd(_mm256_loadu_ps(vj + 8 * r));
        a[r] = _mm512_fmadd_pd(paj, x, a[r]);
        b[r] = _mm512_fmadd_pd(pbj, x, b[r]);
      }
    }
    for (int r = 0; r < 8; ++r) _mm512_storeu_pd(outa + i + 8 * r, a[r]), _mm512_storeu_pd(outb + i + 8 * r, b[r]);
  }
  return true;
#else
  return false;
#endif
}

// The queries of one key-value head that one row's tokens ask in a pass (`n` of them; query
// i attends `lengths[i]` positions), walking its keys and values together: each key is
// read and converted once for all of them, each value once for two (weighted_sum2), where
// a walk per query read both once per query (a pass of several tokens, and the heads that
// share one). Each query's scores, weights and sums are the same operations in the same
// order as a walk of its own. `top`: n doubles of room. softcap: 0, or each score s taken as
// softcap * tanh(s / softcap) before the softmax (Gemma 2's attention).
void attend_queries(const double* queries, const int64_t* lengths, int64_t n, int64_t d, const float* kp,
                    const float* vp, const int64_t* at, double scale, double softcap, double* scores, int64_t L,
                    double* key, double* acc, double* top, float* const* outs) {
  int64_t longest = 0;
  for (int64_t q = 0; q < n; ++q) longest = std::max(longest, lengths[q]);
  std::fill(top, top + n, -INFINITY);
  for (int64_t j = 0; j < longest; ++j) {
    if (j + AHEAD < longest) prefetch(kp + at[j + AHEAD], d);
    widen(kp + at[j], key, d);
    for (int64_t q = 0; q < n; ++q) {
      if (j >= lengths[q]) continue;
      double s = dot(queries + q * d, key, d) * scale;
      if (softcap > 0.0) s = std::tanh(s / softcap) * softcap;  // Gemma 2's cap, in its order
      scores[q * L + j] = s;
      top[q] = std::max(top[q], s);
    }
  }
  for (int64_t q = 0; q < n; ++q) {
    double* s = scores + q * L;
    exp_shifted(s, lengths[q], top[q]);  // now the weights
    double total = 0.0;
    for (int64_t j = 0; j < lengths[q]; ++j) total += s[j];
    top[q] = total;
  }
  std::fill(acc, acc + n * d, 0.0);
  int64_t q = 0;
  for (; q + 2 <= n; q += 2) {
    const int64_t both = std::min(lengths[q], lengths[q + 1]);
    double *a = acc + q * d, *b = acc + (q + 1) * d;
    if (!weighted_sum2(scores + q * L, scores + (q + 1) * L, vp, at, 0, both, a, b, d)) break;
    weighted_sum(scores + q * L, vp, at, both, lengths[q], a, d);
    weighted_sum(scores + (q + 1) * L, vp, at, both, lengths[q + 1], b, d);
  }
  for (; q < n; ++q) weighted_sum(scores + q * L, vp, at, 0, lengths[q], acc + q * d, d);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < d; ++k) outs[i][k] = static_cast<float>(acc[i * d + k] / top[i]);
}

}  // namespace

// q: T tokens x H heads x d float32, the pass's new tokens packed; k_pool, v_pool: slots x
// KVH x d float32; slots: B rows of L int64, each row's pool slots in position order;
// rows: the row of each token; lengths: how many positions each token attends (its
// position + 1) -> out: T x H x d float32, softmax(scale * q k) v over those positions
// (each score capped first where softcap > 0: attend_queries), head h reading key-value
// head h / (H / KVH). The caller has checked the table
// (check_table).
// The work: for each run of consecutive tokens of one row and each key-value head, its
// queries (those tokens x the heads that read it), in blocks small enough that both
// threads get work in a one-token pass. Each query's result is computed on its own
// arithmetic whatever its block: batch invariant by construction.
void attend(const float* qp, int64_t T, int64_t H, int64_t d, const float* kp, const float* vp, int64_t KVH,
            const int64_t* sp, int64_t L, const int64_t* rp, const int64_t* lp, double scale, double softcap,
            float* op) {
  const int64_t group = H / KVH;
  struct Block { int64_t t0, kv, first, count; };  // queries first..first+count of (t0.., kv)
  std::vector<Block> blocks;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  for (int64_t t0 = 0; t0 < T;) {
    int64_t t1 = t0 + 1;
    while (t1 < T && rp[t1] == rp[t0]) ++t1;
    const int64_t queries = (t1 - t0) * group;
    // as many blocks as keep every thread busy twice over, no more (each block reads its keys once)
    const int64_t wanted = std::max<int64_t>(1, (2 * threads + KVH - 1) / KVH);
    const int64_t size = std::max<int64_t>(1, (queries + wanted - 1) / wanted);
    for (int64_t kv = 0; kv < KVH; ++kv)
      for (int64_t first = 0; first < queries; first += size)
        blocks.push_back({t0, kv, first, std::min(size, queries - first)});
    t0 = t1;
  }
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<double> scores, queries, acc, top, key(d);
    std::vector<int64_t> at(L), lengths;
    std::vector<float*> outs;
    for (int64_t b = begin; b < end; ++b) {
      const Block& block = blocks[b];
      const int64_t* row_slots = sp + rp[block.t0] * L;
      scores.resize(block.count * L);
      queries.resize(block.count * d);
      acc.resize(block.count * d);
      top.resize(block.count);
      lengths.resize(block.count);
      outs.resize(block.count);
      int64_t longest = 0;
      for (int64_t i = 0; i < block.count; ++i) {  // query i: token first / group's head first % group
        const int64_t t = block.t0 + (block.first + i) / group, h = block.kv * group + (block.first + i) % group;
        const int64_t th = t * H + h;
        for (int64_t k = 0; k < d; ++k) queries[i * d + k] = qp[th * d + k];  // exact: converted once, not per key
        lengths[i] = lp[t];
        outs[i] = op + th * d;
        longest = std::max(longest, lp[t]);
      }
      for (int64_t j = 0; j < longest; ++j) at[j] = (row_slots[j] * KVH + block.kv) * d;
      attend_queries(queries.data(), lengths.data(), block.count, d, kp, vp, at.data(), scale, softcap,
                     scores.data(), L, key.data(), acc.data(), top.data(), outs.data());
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
// lengths [T] as `attend` takes them; softcap: 0 (none) or Gemma 2's -> [T, H, d] float32.
torch::Tensor attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slots,
                        torch::Tensor rows, torch::Tensor lengths, double scale, double softcap) {
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
  TORCH_CHECK(softcap >= 0.0, "softcap must be 0 (none) or positive");
  check_table(slots, rows, lengths, T, k_pool.size(0));
  auto out = torch::empty({T, H, d}, q.options());
  attend(q.data_ptr<float>(), T, H, d, k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), KVH,
         slots.data_ptr<int64_t>(), slots.size(1), rows.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), scale,
         softcap, out.data_ptr<float>());
  return out;
}
