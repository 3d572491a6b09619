// Products of float32 activations with weights kept in GGUF's quantized blocks, on the CPU.
//
// A block of 32 weights is de-quantized in registers to exactly the float32 values the
// published model holds (q * d + m for Q4_1, (q - 8) * d for Q4_0, q * d for Q8_0, with
// d and m the block's float16 scale and minimum), and the products are float32 fused
// multiply-adds. The weights cost their blocks' bytes (Q4_1: 5 bits a weight), the
// arithmetic that of float32.
//
// Batch invariance: every output y[m, n] is computed by the same operations in the same
// order over k (explicit fused multiply-adds; the build turns off any other contraction),
// whatever the number of rows M, the threads, or which rows share the call. A token's result does not depend on its neighbours in a
// pass, so a verify pass gives each token what a one-token step gives it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

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

// One row of blocks -> k floats.
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// One block's 32 weights as four 8-wide float vectors, exactly as dequantize_row gives them.
inline void block_avx2(const uint8_t* p, int type, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(half(p));
  if (type == Q8_0) {
    for (int j = 0; j < 4; ++j) {
      __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2 + 8 * j));
      w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
    return;
  }
  const uint8_t* qs = p + (type == Q4_1 ? 4 : 2);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  __m256 q[4] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                 _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                 _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                 _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
  if (type == Q4_1) {
    const __m256 m = _mm256_set1_ps(half(p + 2));
    for (int j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(q[j], d, m);  // q * d exact: one rounding
  } else {
    const __m256 eight = _mm256_set1_ps(8.0f);
    for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(_mm256_sub_ps(q[j], eight), d);
  }
}

inline float reduce(const __m256 a[4]) {
  const __m256 s = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
  float v[8];
  _mm256_storeu_ps(v, s);
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// y[t * N] for activations x[t * K], t < T, from one output row: either its blocks (`row`,
// de-quantized here) or the same row already de-quantized (`w`). Every y[m, n] sees the
// same operations in the same order whichever way and whatever T is: the tiling only
// decides what stays in registers and what is read twice.
template <int T>
inline void rows_avx2(const float* x, int64_t K, const uint8_t* row, int type, int bytes, const float* w, float* y,
                      int64_t N) {
  __m256 acc[T][4];
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / QK; ++b) {
    __m256 wb[4];
    if (w != nullptr) {
      for (int j = 0; j < 4; ++j) wb[j] = _mm256_loadu_ps(w + b * QK + 8 * j);
    } else {
      block_avx2(row + b * bytes, type, wb);
    }
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < 4; ++j)
        acc[t][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + t * K + b * QK + 8 * j), wb[j], acc[t][j]);
  }
  for (int t = 0; t < T; ++t) y[t * N] = reduce(acc[t]);
}

// A decode step's two output rows at once: the same operations per output as
// rows_avx2<1>, interleaved (one row's chains alone wait on the fused multiply-add's
// latency).
void output_rows_pair(const float* x, int64_t K, const uint8_t* row0, const uint8_t* row1, int type, float* y) {
  const int bytes = block_bytes(type);
  __m256 a0[4], a1[4];
  for (int j = 0; j < 4; ++j) a0[j] = a1[j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / QK; ++b) {
    __m256 w0[4], w1[4];
    block_avx2(row0 + b * bytes, type, w0);
    block_avx2(row1 + b * bytes, type, w1);
    for (int j = 0; j < 4; ++j) {
      const __m256 xv = _mm256_loadu_ps(x + b * QK + 8 * j);
      a0[j] = _mm256_fmadd_ps(xv, w0[j], a0[j]);
      a1[j] = _mm256_fmadd_ps(xv, w1[j], a1[j]);
    }
  }
  y[0] = reduce(a0);
  y[1] = reduce(a1);
}
#define HAVE_PAIR 1

void output_row(const float* x, int64_t M, int64_t K, const uint8_t* row, int type, float* y, int64_t N,
                float* buffer) {
  const int bytes = block_bytes(type);
  if (M == 1) {  // a decode step: the blocks straight into registers
    rows_avx2<1>(x, K, row, type, bytes, nullptr, y, N);
    return;
  }
  // Several activations: de-quantize the row once (it stays in L1), two activations at a time.
  for (int64_t b = 0; b < K / QK; ++b) {
    __m256 wb[4];
    block_avx2(row + b * bytes, type, wb);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(buffer + b * QK + 8 * j, wb[j]);
  }
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) rows_avx2<2>(x + m * K, K, row, type, bytes, buffer, y + m * N, N);
  if (m < M) rows_avx2<1>(x + m * K, K, row, type, bytes, buffer, y + m * N, N);
}

#else  // portable: de-quantize the row, then one dot per activation row

// x . w over k (a multiple of 32): four partial sums per lane group, summed in a fixed order.
__attribute__((noinline)) float dot(const float* x, const float* w, int64_t k) {
  float a[32] = {0};
  for (int64_t i = 0; i < k; i += QK)
    for (int j = 0; j < QK; ++j) a[j] = std::fma(x[i + j], w[i + j], a[j]);
  float s[8];
  for (int j = 0; j < 8; ++j) s[j] = (a[j] + a[j + 8]) + (a[j + 16] + a[j + 24]);
  return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

void output_row(const float* x, int64_t M, int64_t K, const uint8_t* row, int type, float* y, int64_t N,
                float* buffer) {
  dequantize_row(row, type, K, buffer);
  for (int64_t m = 0; m < M; ++m) y[m * N] = dot(x + m * K, buffer, K);
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
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = w.size(1);
  // Output rows are split between threads; each row's blocks are de-quantized once for
  // all M activations (cheap for a verify pass's few rows).
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(K);
    int64_t n = begin;
#ifdef HAVE_PAIR
    if (M == 1)
      for (; n + 2 <= end; n += 2) output_rows_pair(xp, K, wp + n * row_bytes, wp + (n + 1) * row_bytes, type, yp + n);
#endif
    for (; n < end; ++n) output_row(xp, M, K, wp + n * row_bytes, type, yp + n, N, buffer.data());
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
