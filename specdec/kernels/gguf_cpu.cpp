// Products of float32 activations with weights kept in GGUF's quantized blocks, on the CPU.
//
// The weights stay the file's blocks (Q4_1: 32 weights as 4-bit integers q with a float16
// scale d and minimum m, weight = q * d + m; Q4_0: (q - 8) * d; Q8_0: q * d): they cost
// their bytes (Q4_1: 5 bits a weight) and are read as integers. Each activation row is
// rounded, per block of 32, to 16-bit integers a with a float32 scale s (the block's
// largest magnitude maps to 32767: a relative error of at most 2^-16, against llama.cpp's
// 8 bits). A block's products are then exact integer sums, sum(q * a), and the row's result
//   y = sum over blocks of (d * s) * sum(q * a)  +  sum over blocks of m * (s * sum(a))
// in float32, 8 lanes of partial sums and one fixed order.
//
// Batch invariance: every output y[m, n] is computed by the same operations in the same
// order (explicit fused multiply-adds; the build turns off any other contraction),
// whatever the number of rows M, the threads, or which rows share the call: an
// activation row is rounded on its own, and the integer sums have no order. A token's
// result does not depend on its neighbours in a pass, so a verify pass gives each token
// what a one-token step gives it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int QK = 32;  // weights per block, for every type here
enum Type { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // ggml's type ids

int block_bytes(int type) {
  switch (type) {
    case Q4_0: return 2 + QK / 2;
    case Q4_1: return 4 + QK / 2;
    case Q8_0: return 2 + QK;
  }
  TORCH_CHECK(false, "unsupported GGUF block type ", type);
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// One row of blocks -> k floats: the published weights (an embedding lookup).
__attribute__((noinline)) void dequantize_row(const uint8_t* row, int type, int64_t k, float* out) {
  const int bytes = block_bytes(type);
  for (int64_t b = 0; b < k / QK; ++b, row += bytes, out += QK) {
    const float d = half(row);
    if (type == Q8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(row + 2);
      for (int j = 0; j < QK; ++j) out[j] = q[j] * d;
    } else if (type == Q4_1) {
      const float m = half(row + 2);
      const uint8_t* q = row + 4;
      for (int j = 0; j < QK / 2; ++j) {
        out[j] = (q[j] & 15) * d + m;          // q * d is exact in float32: one rounding, as numpy's
        out[j + QK / 2] = (q[j] >> 4) * d + m;
      }
    } else {
      const uint8_t* q = row + 2;
      for (int j = 0; j < QK / 2; ++j) {
        out[j] = ((q[j] & 15) - 8) * d;
        out[j + QK / 2] = ((q[j] >> 4) - 8) * d;
      }
    }
  }
}

// A block's offset per unit of s * sum(a): m for Q4_1, -8 d for Q4_0 (sum((q - 8) a) =
// sum(q a) - 8 sum(a)), none for Q8_0.
inline float offset(const uint8_t* p, int type, float d) {
  return type == Q4_1 ? half(p + 2) : type == Q4_0 ? -8.0f * d : 0.0f;
}

// An activation row as 16-bit integers per block: a (k of them), the block's scale s,
// and s * sum(a).
struct Rounded {
  std::vector<int16_t> a;
  std::vector<float> scale, scaled_sum;
  Rounded(int64_t rows, int64_t k) : a(rows * k), scale(rows * k / QK), scaled_sum(rows * k / QK) {}
};

inline float block_scale(float amax) { return amax / 32767.0f; }

#if defined(__AVX2__) && defined(__FMA__)

void round_row(const float* x, int64_t k, int16_t* a, float* scale, float* scaled_sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < k / QK; ++b, x += QK, a += QK) {
    __m256 v[4], amax = _mm256_setzero_ps();
    int nan = 0;
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
      nan |= _mm256_movemask_ps(_mm256_cmp_ps(v[j], v[j], _CMP_UNORD_Q));
    }
    float m[8];
    _mm256_storeu_ps(m, amax);
    const float top = std::max(std::max(std::max(m[0], m[1]), std::max(m[2], m[3])),
                               std::max(std::max(m[4], m[5]), std::max(m[6], m[7])));
    if (nan || !(top < INFINITY) || top == 0.0f) {
      std::memset(a, 0, QK * sizeof(int16_t));
      scale[b] = scaled_sum[b] = top == 0.0f && !nan ? 0.0f : NAN;  // what is not finite makes the outputs NaN
      continue;
    }
    const __m256 inverse = _mm256_set1_ps(32767.0f / top);
    __m256i q[4];
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));  // to nearest
    // packs works within 128-bit lanes: put the quarters back in order.
    const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
    const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + 16), hi);
    int32_t s[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s),
                        _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones)));
    scale[b] = block_scale(top);
    scaled_sum[b] = scale[b] * static_cast<float>(((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])));
  }
}

// A block's 32 weight integers as two vectors of 16-bit lanes: weights 0-15 and 16-31.
inline void block_ints(const uint8_t* p, int type, __m256i w[2]) {
  if (type == Q8_0) {
    w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2)));
    w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 18)));
    return;
  }
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (type == Q4_1 ? 4 : 2)));
  const __m128i mask = _mm_set1_epi8(15);
  w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask));
  w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
}

// One block of one output: every path adds a block to an output with exactly this.
inline void add_block(const __m256i w[2], float d, float m, const int16_t* a, float s, float scaled_sum, __m256& acc,
                      float& offsets) {
  const __m256i sums = _mm256_add_epi32(
      _mm256_madd_epi16(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
      _mm256_madd_epi16(w[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16))));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d * s), acc);
  offsets = std::fma(m, scaled_sum, offsets);
}

inline float finish(__m256 acc, float offsets) {
  float v[8];
  _mm256_storeu_ps(v, acc);
  return (((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]))) + offsets;
}

// One weight row against activation rows t0 .. t0 + T - 1: each block decoded once for all.
template <int T>
void output_tile(const uint8_t* row, int type, int64_t k, const Rounded& x, int64_t t0, float* y, int64_t n_out) {
  const int bytes = block_bytes(type);
  const int64_t nb = k / QK;
  __m256 acc[T];
  float offsets[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps(), offsets[t] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * bytes;
    __m256i w[2];
    block_ints(p, type, w);
    const float d = half(p), m = offset(p, type, d);
    for (int t = 0; t < T; ++t) {
      const int64_t i = (t0 + t) * nb + b;
      add_block(w, d, m, x.a.data() + i * QK, x.scale[i], x.scaled_sum[i], acc[t], offsets[t]);
    }
  }
  for (int t = 0; t < T; ++t) y[(t0 + t) * n_out] = finish(acc[t], offsets[t]);
}

// A decode step's two output rows at once: the same operations per output as
// output_tile<1>, interleaved (one row alone waits on its chains' latency).
void output_pair(const uint8_t* row0, const uint8_t* row1, int type, int64_t k, const Rounded& x, float* y) {
  const int bytes = block_bytes(type);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  float offsets0 = 0.0f, offsets1 = 0.0f;
  for (int64_t b = 0; b < k / QK; ++b) {
    const uint8_t *p0 = row0 + b * bytes, *p1 = row1 + b * bytes;
    __m256i w0[2], w1[2];
    block_ints(p0, type, w0);
    block_ints(p1, type, w1);
    const float d0 = half(p0), d1 = half(p1);
    add_block(w0, d0, offset(p0, type, d0), x.a.data() + b * QK, x.scale[b], x.scaled_sum[b], acc0, offsets0);
    add_block(w1, d1, offset(p1, type, d1), x.a.data() + b * QK, x.scale[b], x.scaled_sum[b], acc1, offsets1);
  }
  y[0] = finish(acc0, offsets0);
  y[1] = finish(acc1, offsets1);
}
#define HAVE_PAIR 1

// Tiles of four activation rows: eight spill AVX2's 16 registers (measured slower).
void output_row(const uint8_t* row, int type, int64_t k, const Rounded& x, int64_t rows, float* y, int64_t n_out) {
  int64_t t = 0;
  for (; t + 4 <= rows; t += 4) output_tile<4>(row, type, k, x, t, y, n_out);
  switch (rows - t) {
    case 1: output_tile<1>(row, type, k, x, t, y, n_out); break;
    case 2: output_tile<2>(row, type, k, x, t, y, n_out); break;
    case 3: output_tile<3>(row, type, k, x, t, y, n_out); break;
  }
}

#else  // portable: the same arithmetic, one lane

void round_row(const float* x, int64_t k, int16_t* a, float* scale, float* scaled_sum) {
  for (int64_t b = 0; b < k / QK; ++b, x += QK, a += QK) {
    float top = 0.0f;
    bool finite = true;
    for (int j = 0; j < QK; ++j) top = std::max(top, std::fabs(x[j])), finite = finite && std::isfinite(x[j]);
    if (!finite || top == 0.0f) {
      std::memset(a, 0, QK * sizeof(int16_t));
      scale[b] = scaled_sum[b] = finite ? 0.0f : NAN;  // what is not finite makes the outputs NaN
      continue;
    }
    const float inverse = 32767.0f / top;
    int32_t sum = 0;
    for (int j = 0; j < QK; ++j) sum += a[j] = static_cast<int16_t>(std::nearbyint(x[j] * inverse));
    scale[b] = block_scale(top);
    scaled_sum[b] = scale[b] * static_cast<float>(sum);
  }
}

void output_row(const uint8_t* row, int type, int64_t k, const Rounded& x, int64_t rows, float* y, int64_t n_out) {
  const int bytes = block_bytes(type);
  const int64_t nb = k / QK;
  for (int64_t t = 0; t < rows; ++t) {
    float acc = 0.0f, offsets = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = row + b * bytes;
      const int16_t* a = x.a.data() + (t * nb + b) * QK;
      int32_t sum = 0;
      for (int j = 0; j < QK; ++j) {
        int q;
        if (type == Q8_0) q = reinterpret_cast<const int8_t*>(p + 2)[j];
        else q = j < QK / 2 ? (p[(type == Q4_1 ? 4 : 2) + j] & 15) : (p[(type == Q4_1 ? 4 : 2) + j - QK / 2] >> 4);
        sum += q * a[j];
      }
      const float d = half(p);
      acc = std::fma(static_cast<float>(sum), d * x.scale[t * nb + b], acc);
      offsets = std::fma(offset(p, type, d), x.scaled_sum[t * nb + b], offsets);
    }
    y[t * n_out] = acc + offsets;
  }
}
#endif

}  // namespace

// x: [M, K] float32; w: [N, K / 32 * block_bytes] uint8 blocks -> [M, N] float32.
torch::Tensor matmul(torch::Tensor x, torch::Tensor w, int64_t type) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8, "w must be [N, bytes] uint8");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % QK == 0 && w.size(1) == K / QK * block_bytes(type), "w's blocks do not cover x's ", K,
              " columns");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  auto y = torch::empty({M, N}, x.options());
  Rounded rounded(M, K);
  const float* xp = x.data_ptr<float>();
  for (int64_t t = 0; t < M; ++t)
    round_row(xp + t * K, K, rounded.a.data() + t * K, rounded.scale.data() + t * (K / QK),
              rounded.scaled_sum.data() + t * (K / QK));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
  // Output rows are split between threads; each row's blocks are decoded once for up to 4
  // activation rows.
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
#ifdef HAVE_PAIR
    if (M == 1)
      for (; n + 2 <= end; n += 2) output_pair(wp + n * row_bytes, wp + (n + 1) * row_bytes, type, K, rounded, yp + n);
#endif
    for (; n < end; ++n) output_row(wp + n * row_bytes, type, K, rounded, M, yp + n, N);
  });
  return y;
}

// Rows `ids` of w, de-quantized: [len(ids), K] float32 (an embedding lookup).
torch::Tensor dequantize(torch::Tensor w, int64_t type, torch::Tensor ids) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w must be [N, bytes] uint8");
  ids = ids.to(torch::kLong).contiguous();
  const int64_t K = w.size(1) / block_bytes(type) * QK, N = w.size(0), n = ids.numel();
  auto out = torch::empty({n, K}, torch::dtype(torch::kFloat32));
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "row ", ip[i], " out of range");
    dequantize_row(w.data_ptr<uint8_t>() + ip[i] * w.size(1), type, K, out.data_ptr<float>() + i * K);
  }
  return out;
}
