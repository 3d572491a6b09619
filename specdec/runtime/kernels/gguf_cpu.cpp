// Products of float32 activations with weights kept in GGUF's quantized blocks, on the CPU.
//
// The weights stay the file's blocks, or blocks of our own that a model's float weights
// are quantized into at load (Q8_M: Q4_1's form with 8-bit q, weight = q * d + m). Every
// type is read as blocks of 32 columns, each with integers q and a scale d (and an
// offset m) of its own:
//   Q4_0  4-bit q, weight (q - 8) d        Q4_1  4-bit q, q d + m       Q8_0  8-bit signed q, q d
//   Q5_0  5-bit q, (q - 16) d              Q5_1  5-bit q, q d + m
//   Q4_K  superblocks of 8 blocks: 4-bit q, weight q (d sc) - (d_min m), with sc and m 6-bit
//         integers per block, d and d_min float16 per superblock
//   Q5_K  Q4_K with 5-bit q
//   Q6_K  superblocks of 8 blocks: 6-bit q, weight (q - 32) (d sc), with sc an 8-bit signed
//         integer per 16 columns, d float16 per superblock
// d sc and d_min m are exact in float32 (11 bits of d times 8 of sc), so a K block is the
// same sum as any other with those for its d and m. They cost their bytes (Q4_K: 4.5 bits
// a weight) and are read as integers. The bytes are rearranged
// once at load (`pack`): 8 output rows side by side, so that one 16-lane multiply-add of
// their integers with a broadcast pair of activations leaves each row's sum in a lane of
// its own. A block of 8 rows then costs 16 such products and no horizontal sums; the
// file's order (one row at a time, 8 partial sums added across lanes at the end) cost
// about twice the instructions a block (measured: a one-token pass 1.6-1.8x faster).
//
// Each activation row is rounded, per block of 32, to 16-bit integers a with a float32
// scale s (the block's largest magnitude maps to 32767: a relative error of at most
// 2^-16, against llama.cpp's 8 bits). A block's products are then exact integer sums,
// sum(q * a), and each output is, block by block in order, in float32:
//   acc = fma(float(sum(q * a)), d * s, acc);  acc = fma(m, s * sum(a), acc)
// (m: the minimum for Q4_1, Q5_1 and Q8_M, -8 d for Q4_0, -16 d for Q5_0, -(d_min m) for
// Q4_K and Q5_K; no second step for Q8_0, or for Q6_K, whose q - 32 is summed as a signed
// integer, and whose two halves of 16 columns each take their own step:
//   acc = fma(float(sum(q a) over columns 0-15), d sc0 s, acc); then columns 16-31, d sc1 s).
//
// Batch invariance: every output y[m, n] is computed by the same operations in the same
// order (explicit fused multiply-adds; the build turns off any other contraction),
// whatever the number of rows M, the threads, or which rows share the call: an
// activation row is rounded on its own, and the integer sums have no order. A token's
// result does not depend on its neighbours in a pass, so a verify pass gives each token
// what a one-token step gives it.
//
// Three paths compute those same bits, the widest the build's CPU has taken by default
// (`isas`, `set_isa`): AVX-512 with VNNI (16 rows, two groups, to a 32-lane multiply-add
// that adds into its sums in one instruction), AVX2 (one group of 8 rows to a 16-lane
// multiply-add, then an add), and portable C++ (one lane). The integer sums are exact
// whatever the width; the float steps are the same per output, lane by lane.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <c10/util/StringUtil.h>

namespace {

constexpr int QK = 32;  // weights per block, for every type here
constexpr int ROWS = 8;  // output rows side by side in the packed layout
// ggml's type ids; Q8_M is ours, no file's
enum Type { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_M = 100 };
#define SPECDEC_TYPES(X) X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(Q8_0) X(Q4_K) X(Q5_K) X(Q6_K) X(Q8_M)

constexpr bool known(int type) {
  return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0 || type == Q4_K ||
         type == Q5_K || type == Q6_K || type == Q8_M;
}
constexpr bool k_quant(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }
// Whether a type's blocks hold a minimum m of their own, and 8-bit integers.
constexpr bool has_min(int type) { return type == Q4_1 || type == Q5_1 || type == Q8_M; }
constexpr bool bytes_q(int type) { return type == Q8_0 || type == Q8_M; }
// Whether a block's outputs take the second step, acc = fma(m, s * sum(a), acc).
constexpr bool offset_step(int type) { return type != Q8_0 && type != Q6_K; }
// Bits of q above the low 4: Q5's one kept as a plane, Q6_K's two as crumbs (the layout below).
constexpr int planes(int type) { return type == Q5_0 || type == Q5_1 || type == Q5_K ? 1 : type == Q6_K ? 2 : 0; }
constexpr bool crumbs(int type) { return type == Q6_K; }
// The weights of one of the file's blocks, and its bytes.
constexpr int file_weights(int type) { return k_quant(type) ? 256 : QK; }
constexpr int file_bytes(int type) {
  return type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q5_0 ? 22 : type == Q5_1 ? 24 : type == Q8_0 ? 34
       : type == Q4_K ? 144 : type == Q5_K ? 176 : type == Q6_K ? 210 : 36;  // Q8_M: d, m and 32 bytes
}

void check_type(int64_t type) { TORCH_CHECK(known(static_cast<int>(type)), "unsupported block type ", type); }

// The packed layout: rows in groups of 8 (the last padded with zero blocks); per group,
// per block of 32 columns: the 8 rows' scales (d, float16, then m for the types that hold
// one; a K type's sc and m, or Q6_K's sc0 and sc1, a byte each), then the integers with
// the 8 rows interleaved two columns at a time: a 16-lane vector of them, multiplied by a
// broadcast pair of activations, gives each row's sum over the two columns in its own
// 32-bit lane. 4-bit q packs that vector's 16 integers as the low nibbles of 16 bytes and
// another's as their high nibbles: in each 32 bytes (8 columns), the low nibbles hold
// columns 0-3, the high ones 4-7, two columns to a half. The bits above the low 4 follow.
// Q5's fifth as a plane: per pair of columns, a 16-bit word whose bit 2 r + (column % 2)
// is that bit of row r's q. Q6_K's two as crumbs: per 8 columns, 16 bytes, byte
// 2 r + (column % 2) holding in bits 2 w and 2 w + 1 those of row r's q in the w-th pair
// of the 8 (the nibbles' lanes: one widening and a shift give every lane its two bits;
// as two planes, each lane's bits were a mask of its own to build, and bound Q6_K's
// products at 0.6x Q4_K's bytes a second). A K type's 8 blocks follow their superblock's
// d (and d_min) of the 8 rows, float16. The bytes are the file's bytes, rearranged (a K block's 6-bit sc and
// m widened to a byte each: 16 bytes a superblock more than the file's 1152).
constexpr int head_bytes(int type) { return k_quant(type) ? 2 * ROWS : (has_min(type) ? 4 : 2) * ROWS; }
constexpr int ints_offset(int type) { return head_bytes(type); }
constexpr int planes_offset(int type) { return head_bytes(type) + ROWS * (bytes_q(type) ? QK : QK / 2); }
constexpr int block_group_bytes(int type) { return planes_offset(type) + planes(type) * 2 * (QK / 2); }
constexpr int super_head(int type) { return type == Q6_K ? 2 * ROWS : k_quant(type) ? 4 * ROWS : 0; }
constexpr int super_blocks(int type) { return k_quant(type) ? 8 : 1; }
constexpr int super_bytes(int type) { return super_head(type) + super_blocks(type) * block_group_bytes(type); }

// A group's bytes for nb blocks of 32 columns (nb a whole number of the file's blocks).
int64_t group_stride(int type, int64_t nb) { return nb / super_blocks(type) * super_bytes(type); }

// Block b of a group, and the superblock that holds it (a legacy type's: the block).
inline const uint8_t* super_of(const uint8_t* group, int type, int64_t b) {
  return group + b / super_blocks(type) * super_bytes(type);
}
inline const uint8_t* block_of(const uint8_t* group, int type, int64_t b) {
  return super_of(group, type, b) + super_head(type) + b % super_blocks(type) * block_group_bytes(type);
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

// Column c's q (every bit of it, unsigned but for Q8_0) in block b of a row of the file's
// blocks.
inline int file_q(const uint8_t* row, int type, int64_t b, int c) {
  if (!k_quant(type)) {
    const uint8_t* p = row + b * file_bytes(type);
    if (type == Q8_0) return reinterpret_cast<const int8_t*>(p + 2)[c];
    if (type == Q8_M) return p[4 + c];
    const int qs = type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
    const int q = c < 16 ? p[qs + c] & 15 : p[qs + c - 16] >> 4;
    if (planes(type) == 0) return q;
    uint32_t qh;  // Q5_0, Q5_1: bit c the fifth of column c
    std::memcpy(&qh, p + qs - 4, 4);
    return q | ((qh >> c) & 1) << 4;
  }
  const uint8_t* p = row + b / 8 * file_bytes(type);
  const int s = b % 8;  // the block in its superblock
  if (type == Q6_K) {  // ql 128 bytes, qh 64, then the scales and d; a half of 128 columns at a time
    const int h = s / 4, j = s % 4;
    const uint8_t low = p[64 * h + 32 * (j % 2) + c];
    return (j < 2 ? low & 15 : low >> 4) | ((p[128 + 32 * h + c] >> (2 * j)) & 3) << 4;
  }
  const uint8_t* qs = p + (type == Q5_K ? 48 : 16);  // after d, d_min, 12 bytes of scales (and Q5_K's qh)
  const uint8_t byte = qs[32 * (s / 2) + c];
  const int q = s % 2 ? byte >> 4 : byte & 15;
  return type == Q5_K ? q | ((p[16 + c] >> s) & 1) << 4 : q;
}

// A K block's 6-bit sc and m (block s of its superblock), from the superblock's 12 bytes.
inline void k_scale_min(const uint8_t* scales, int s, uint8_t& sc, uint8_t& m) {
  if (s < 4) {
    sc = scales[s] & 63, m = scales[s + 4] & 63;
  } else {
    sc = (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4;
    m = (scales[s + 4] >> 4) | (scales[s] >> 6) << 4;
  }
}

// Where the low 4 bits (or the byte) of (row r in its group, column c of the block) lie:
// their byte, and whether they are its high nibble.
inline int packed_index(int type, int r, int c, bool& high) {
  const int pair = c / 2, lane = 2 * r + c % 2;
  if (bytes_q(type)) { high = false; return 16 * pair + lane; }
  const int chunk = c / 8, within = pair % 4;  // pairs 0 and 1 low nibbles, 2 and 3 high
  high = within >= 2;
  return 32 * chunk + 16 * (within % 2) + lane;
}

// The byte of a packed block's crumbs that holds (row r, column c)'s two bits above the low 4.
inline int crumb_index(int type, int r, int c) { return planes_offset(type) + 16 * (c / 8) + 2 * r + c % 2; }

// Plane `plane`'s word of column pair `pair` in a packed block.
inline uint16_t plane_word(const uint8_t* block, int type, int plane, int pair) {
  uint16_t word;
  std::memcpy(&word, block + planes_offset(type) + 2 * (QK / 2 * plane + pair), 2);
  return word;
}

// The integer a packed block multiplies for (row r, column c): q, or Q6_K's q - 32.
inline int packed_int(const uint8_t* block, int type, int r, int c) {
  bool high;
  const uint8_t byte = block[ints_offset(type) + packed_index(type, r, c, high)];
  if (type == Q8_0) return static_cast<int8_t>(byte);
  if (type == Q8_M) return byte;
  int q = high ? byte >> 4 : byte & 15;
  if (crumbs(type)) return (q | ((block[crumb_index(type, r, c)] >> (2 * (c / 2 % 4))) & 3) << 4) - 32;
  for (int plane = 0; plane < planes(type); ++plane)
    q |= ((plane_word(block, type, plane, c / 2) >> (2 * r + c % 2)) & 1) << (4 + plane);
  return q;
}

// Row r's scales of a packed block: d for columns 0-15 and 16-31 (the same but for
// Q6_K), and m, the offset per unit of s * sum(a): the minimum for Q4_1, Q5_1 and Q8_M,
// -8 d for Q4_0 (sum((q - 8) a) = sum(q a) - 8 sum(a)), -16 d for Q5_0, -(d_min m) for Q4_K
// and Q5_K, none for Q8_0 and Q6_K.
inline void block_scales(const uint8_t* super, const uint8_t* block, int type, int r, float& d0, float& d1,
                         float& m) {
  m = 0.0f;
  if (!k_quant(type)) {
    d0 = d1 = half(block + 2 * r);
    m = has_min(type) ? half(block + 2 * ROWS + 2 * r) : type == Q4_0 ? -8.0f * d0 : type == Q5_0 ? -16.0f * d0 : 0.0f;
  } else if (type == Q6_K) {
    const float d = half(super + 2 * r);
    d0 = d * static_cast<float>(static_cast<int8_t>(block[r]));
    d1 = d * static_cast<float>(static_cast<int8_t>(block[ROWS + r]));
  } else {
    d0 = d1 = half(super + 2 * r) * static_cast<float>(block[r]);
    m = -(half(super + 2 * ROWS + 2 * r) * static_cast<float>(block[ROWS + r]));
  }
}

// Activation rows as 16-bit integers per block: a (k of them), the block's scale s, and
// s * sum(a).
struct Rounded {
  std::vector<int16_t> a;
  std::vector<float> scale, scaled_sum;
  Rounded(int64_t rows, int64_t k) : a(rows * k), scale(rows * k / QK), scaled_sum(rows * k / QK) {}
};

inline float block_scale(float amax) { return amax / 32767.0f; }

#if defined(__AVX2__)
// A one-token pass streams every weight once, and the hardware's prefetchers alone kept
// the products well below the memory's bandwidth on a Xeon (AVX-512, one thread, 166 MB
// of Q4_1 blocks streamed: 7.0 GB/s; with the blocks 8 KiB ahead asked for at each block,
// 10.5 GB/s into L1, 11.2 into L2, 12.0 into L3, the plain reads' 15.4 the bound; 16 and
// 32 KiB ahead no better). On an AMD EPYC (AVX-512 VNNI, 2 threads), the 1.5B Qwen2.5-Coder's
// Q4_K_M products in a pass's order, best of 5, two runs: 8 KiB ahead 44.4 and 39.9 ms,
// 4 KiB 46.6 and 49.9, 16 KiB 40.7 and 34.2, 24 KiB 38.4 and 35.1, 32 KiB 36.4 and 30.8,
// 64 KiB 34.8 and 30.4, none 47.0 and 47.7. A hint only: it never faults, past the end of
// the weights included.
constexpr int AHEAD = 32768;
template <int BYTES>
inline void prefetch_ahead(const uint8_t* block) {
  for (int line = 0; line < BYTES; line += 64) _mm_prefetch(reinterpret_cast<const char*>(block + AHEAD + line), _MM_HINT_T2);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

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

inline __m256i pair_of(const int16_t* a) {  // two activations, in every 32-bit lane
  int32_t v;
  std::memcpy(&v, a, 4);
  return _mm256_set1_epi32(v);
}

// Bit `value` of each 16-bit lane of w set where the lane's bit of `word` is (a plane of
// bits above the low 4: the lanes' rows and columns as in the integers' vector).
inline __m256i with_plane(__m256i w, uint16_t word, short value) {
  const __m256i lanes = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                          static_cast<short>(-32768));
  const __m256i bits = _mm256_and_si256(_mm256_set1_epi16(static_cast<short>(word)), lanes);
  return _mm256_or_si256(w, _mm256_and_si256(_mm256_cmpeq_epi16(bits, lanes), _mm256_set1_epi16(value)));
}

// Q6_K: the crumbs of the w-th pair of 8 columns (crumbs: the bytes widened to 16-bit
// lanes) as bits 4 and 5 of each lane of w, less 32.
template <int W>
inline __m256i with_crumbs(__m256i w, __m256i crumbs) {
  const __m256i both = _mm256_set1_epi16(0x30);
  const __m256i bits = W < 2 ? _mm256_and_si256(_mm256_slli_epi16(crumbs, 4 - 2 * W), both)
                       : _mm256_and_si256(W == 2 ? crumbs : _mm256_srli_epi16(crumbs, 2), both);
  return _mm256_sub_epi16(_mm256_or_si256(w, bits), _mm256_set1_epi16(32));
}

inline __m256 bytes_to_floats(const uint8_t* p, bool is_signed) {  // 8 bytes -> 8 floats
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}

// One group's 8 rows against activation rows t0 .. t0 + T - 1: each block's integers are
// unpacked once for all T. Per row and token, in one fixed order whatever T:
//   acc = fma(float(sum(q * a)), d * s, acc); acc = fma(m, s * sum(a), acc)   block by block
// (Q6_K: its two halves' sums, each times its own d, and no second step).
template <int TYPE, int T>
void group_tile(const uint8_t* group, int64_t nb, const Rounded& x, int64_t t0, float* y, int64_t n_out, int rows) {
  constexpr int bytes = block_group_bytes(TYPE), ints_at = ints_offset(TYPE);
  const int64_t k = nb * QK;
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i nibbles = _mm256_set1_epi8(15);
  __m256 d, neg_d_min;  // a K type's superblock: its d (and -d_min) of the 8 rows
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = block_of(group, TYPE, b);
    const uint8_t* ints = p + ints_at;
    prefetch_ahead<bytes>(p);
    __m256i sums[T], first[T];  // first: Q6_K's columns 0-15
    for (int t = 0; t < T; ++t) sums[t] = _mm256_setzero_si256();
    for (int chunk = 0; chunk < 4; ++chunk) {  // 8 columns: four pairs
      if (TYPE == Q6_K && chunk == 2)
        for (int t = 0; t < T; ++t) first[t] = sums[t], sums[t] = _mm256_setzero_si256();
      const int16_t* a = x.a.data() + t0 * k + b * QK + 8 * chunk;
      __m256i lo, hi, high_bits;
      if constexpr (crumbs(TYPE))
        high_bits = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + planes_offset(TYPE) + 16 * chunk)));
      if constexpr (!bytes_q(TYPE)) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ints + 32 * chunk));
        lo = _mm256_and_si256(v, nibbles), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibbles);
      }
      // One pair's 8 rows at a time, each multiplied into every token's sums before the
      // next is unpacked: few live registers, nothing spilled.
      auto pair = [&](auto j_) {
        constexpr int j = decltype(j_)::value;
        __m256i w;
        if constexpr (TYPE == Q8_0) {
          w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ints + 64 * chunk + 16 * j)));
        } else if constexpr (TYPE == Q8_M) {
          w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ints + 64 * chunk + 16 * j)));
        } else {
          const __m256i half = j < 2 ? lo : hi;
          w = _mm256_cvtepu8_epi16(j % 2 ? _mm256_extracti128_si256(half, 1) : _mm256_castsi256_si128(half));
          if constexpr (crumbs(TYPE)) {
            w = with_crumbs<j>(w, high_bits);
          } else {
            for (int plane = 0; plane < planes(TYPE); ++plane)
              w = with_plane(w, plane_word(p, TYPE, plane, 4 * chunk + j), static_cast<short>(16 << plane));
          }
        }
        for (int t = 0; t < T; ++t)
          sums[t] = _mm256_add_epi32(sums[t], _mm256_madd_epi16(w, pair_of(a + t * k + 2 * j)));
      };
      pair(std::integral_constant<int, 0>()), pair(std::integral_constant<int, 1>());
      pair(std::integral_constant<int, 2>()), pair(std::integral_constant<int, 3>());
    }
    __m256 d0, d1, m;
    if constexpr (!k_quant(TYPE)) {
      d0 = d1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      m = has_min(TYPE) ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * ROWS)))
          : _mm256_mul_ps(d0, _mm256_set1_ps(TYPE == Q5_0 ? -16.0f : -8.0f));
    } else {
      if (b % super_blocks(TYPE) == 0) {  // converted once a superblock
        const uint8_t* s = super_of(group, TYPE, b);
        d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
        if constexpr (TYPE != Q6_K)
          neg_d_min = _mm256_xor_ps(_mm256_set1_ps(-0.0f),
                                    _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * ROWS))));
      }
      d0 = _mm256_mul_ps(d, bytes_to_floats(p, TYPE == Q6_K));
      d1 = TYPE == Q6_K ? _mm256_mul_ps(d, bytes_to_floats(p + ROWS, true)) : d0;
      m = TYPE == Q6_K ? d0 : _mm256_mul_ps(neg_d_min, bytes_to_floats(p + ROWS, false));  // -(d_min m)
    }
    for (int t = 0; t < T; ++t) {
      const int64_t i = (t0 + t) * nb + b;
      const __m256 scale = _mm256_set1_ps(x.scale[i]);
      if constexpr (TYPE == Q6_K)
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(first[t]), _mm256_mul_ps(d0, scale), acc[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[t]), _mm256_mul_ps(d1, scale), acc[t]);
      if constexpr (offset_step(TYPE)) acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.scaled_sum[i]), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    float out[ROWS];
    _mm256_storeu_ps(out, acc[t]);
    std::memcpy(y + (t0 + t) * n_out, out, rows * sizeof(float));
  }
}

// Tiles of up to six activation rows, as even as can be (8 rows: 4 + 4): a tile's sums
// and accumulators stay in registers, and each block's integers are unpacked once for
// all its rows. Measured on the target's 30 layers, 1 thread, cache-hot: 5 rows in one
// tile 14.2 ms, in 4 + 1 17.3; 8 rows in 4 + 4 21.8, in 6 + 2 about 23.7.
template <int TYPE>
void group_rows(const uint8_t* group, int64_t nb, const Rounded& x, int64_t tokens, float* y, int64_t n_out, int rows) {
  constexpr int MOST = 6;
  const int64_t tiles = (tokens + MOST - 1) / MOST;
  for (int64_t i = 0, t = 0; i < tiles; ++i) {
    const int64_t size = (tokens - t) / (tiles - i);  // the rest, shared evenly by the tiles left
    switch (size) {
      case 1: group_tile<TYPE, 1>(group, nb, x, t, y, n_out, rows); break;
      case 2: group_tile<TYPE, 2>(group, nb, x, t, y, n_out, rows); break;
      case 3: group_tile<TYPE, 3>(group, nb, x, t, y, n_out, rows); break;
      case 4: group_tile<TYPE, 4>(group, nb, x, t, y, n_out, rows); break;
      case 5: group_tile<TYPE, 5>(group, nb, x, t, y, n_out, rows); break;
      case 6: group_tile<TYPE, 6>(group, nb, x, t, y, n_out, rows); break;
    }
    t += size;
  }
}

void group_rows(const uint8_t* group, int type, int64_t nb, const Rounded& x, int64_t tokens, float* y, int64_t n_out,
                int rows) {
  switch (type) {
#define CASE(TYPE) case TYPE: return group_rows<TYPE>(group, nb, x, tokens, y, n_out, rows);
    SPECDEC_TYPES(CASE)
#undef CASE
  }
}

#endif  // AVX2

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECDEC_AVX512 1

// with_crumbs, two groups to a vector (crumbs: the two groups' bytes widened).
template <int W>
inline __m512i with_crumbs(__m512i w, __m512i crumbs) {
  const __m512i both = _mm512_set1_epi16(0x30);
  const __m512i bits = W < 2 ? _mm512_and_si512(_mm512_slli_epi16(crumbs, 4 - 2 * W), both)
                       : _mm512_and_si512(W == 2 ? crumbs : _mm512_srli_epi16(crumbs, 2), both);
  return _mm512_sub_epi16(_mm512_or_si512(w, bits), _mm512_set1_epi16(32));
}

inline __m512i pair_of_512(const int16_t* a) {  // two activations, in every 32-bit lane
  int32_t v;
  std::memcpy(&v, a, 4);
  return _mm512_set1_epi32(v);
}

// Two groups' 16 rows (g0's 8, then g1's) against activation rows t0 .. t0 + T - 1: the
// AVX2 tile's arithmetic, two groups to a vector. Each 32-lane multiply-add is one
// instruction (vpdpwssd) that adds into its sums; A sets of sums per token keep short
// tiles from waiting on that instruction's latency (the sets are added at the block's
// end: integers, exact in any order).
template <int TYPE, int T, int A = (T == 1 ? 4 : T <= 3 ? 2 : 1)>
void pair_tile(const uint8_t* g0, const uint8_t* g1, int64_t nb, const Rounded& x, int64_t t0, float* y,
               int64_t n_out, int rows) {
  constexpr int bytes = block_group_bytes(TYPE), ints_at = ints_offset(TYPE);
  const int64_t k = nb * QK;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  auto f16s = [](const uint8_t* q0, const uint8_t* q1) {  // 8 float16 of each group
    return _mm512_cvtph_ps(_mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(q1),
                                               reinterpret_cast<const __m128i*>(q0)));
  };
  auto bytes_16 = [](const uint8_t* q0, const uint8_t* q1, bool is_signed) {  // 8 bytes of each group
    int64_t lo, hi;
    std::memcpy(&lo, q0, 8);
    std::memcpy(&hi, q1, 8);
    const __m128i v = _mm_set_epi64x(hi, lo);
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
  };
  __m512 d, neg_d_min;  // a K type's superblock: its d (and -d_min) of the 16 rows
  const __m512i nibbles = _mm512_set1_epi16(15);
  // A plane's bit of each lane (the two groups' words: a 32-bit mask) added where it is set.
  auto with_planes = [](__m512i w, const uint8_t* p0, const uint8_t* p1, int pair) {
    for (int plane = 0; plane < planes(TYPE); ++plane) {
      const __mmask32 bits = static_cast<__mmask32>(plane_word(p0, TYPE, plane, pair)) |
                             static_cast<__mmask32>(plane_word(p1, TYPE, plane, pair)) << 16;
      w = _mm512_mask_add_epi16(w, bits, w, _mm512_set1_epi16(static_cast<short>(16 << plane)));
    }
    return w;
  };
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p0 = block_of(g0, TYPE, b);
    const uint8_t* p1 = block_of(g1, TYPE, b);
    prefetch_ahead<bytes>(p0);
    prefetch_ahead<bytes>(p1);
    __m512i sums[A][T], first[T];  // first: Q6_K's columns 0-15
    for (int s = 0; s < A; ++s)
      for (int t = 0; t < T; ++t) sums[s][t] = _mm512_setzero_si512();
    for (int chunk = 0; chunk < 4; ++chunk) {  // 8 columns: four pairs
      if (TYPE == Q6_K && chunk == 2)
        for (int t = 0; t < T; ++t) {
          first[t] = sums[0][t];
          for (int s = 1; s < A; ++s) first[t] = _mm512_add_epi32(first[t], sums[s][t]);
          for (int s = 0; s < A; ++s) sums[s][t] = _mm512_setzero_si512();
        }
      const int16_t* a = x.a.data() + t0 * k + b * QK + 8 * chunk;
      const uint8_t* i0 = p0 + ints_at + (bytes_q(TYPE) ? 64 : 32) * chunk;
      const uint8_t* i1 = p1 + ints_at + (bytes_q(TYPE) ? 64 : 32) * chunk;
      if constexpr (bytes_q(TYPE)) {
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const __m256i bytes = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(i1 + 16 * j),
                                                    reinterpret_cast<const __m128i*>(i0 + 16 * j));
          const __m512i w = TYPE == Q8_0 ? _mm512_cvtepi8_epi16(bytes) : _mm512_cvtepu8_epi16(bytes);
          for (int t = 0; t < T; ++t)
            sums[j % A][t] = _mm512_dpwssd_epi32(sums[j % A][t], w, pair_of_512(a + t * k + 2 * j));
        }
      } else {
        // Bytes 0-15 of a chunk hold pair 0 in their low nibbles and pair 2 in their high
        // ones, bytes 16-31 pairs 1 and 3: each byte widened to a 16-bit lane (one shuffle
        // for two pairs' 16 rows), the nibbles are a mask and a shift apart. The shuffles
        // were what bound a one-token pass (compute alone, cache-hot: 31.6 -> 38.4 GB/s).
        __m512i high_bits;
        if constexpr (crumbs(TYPE))
          high_bits = _mm512_cvtepu8_epi16(
              _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(p1 + planes_offset(TYPE) + 16 * chunk),
                                  reinterpret_cast<const __m128i*>(p0 + planes_offset(TYPE) + 16 * chunk)));
        auto half_of = [&](auto half_) {  // bytes 0-15 of the chunk, or 16-31
          constexpr int half = decltype(half_)::value;
          const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(i1 + 16 * half),
                                                                     reinterpret_cast<const __m128i*>(i0 + 16 * half)));
          __m512i low = _mm512_and_si512(v, nibbles), high = _mm512_srli_epi16(v, 4);
          if constexpr (crumbs(TYPE)) {
            low = with_crumbs<half>(low, high_bits);
            high = with_crumbs<half + 2>(high, high_bits);
          } else if constexpr (planes(TYPE) > 0) {
            low = with_planes(low, p0, p1, 4 * chunk + half);
            high = with_planes(high, p0, p1, 4 * chunk + half + 2);
          }
          for (int t = 0; t < T; ++t)
            sums[half % A][t] = _mm512_dpwssd_epi32(sums[half % A][t], low, pair_of_512(a + t * k + 2 * half));
          for (int t = 0; t < T; ++t)
            sums[(half + 2) % A][t] =
                _mm512_dpwssd_epi32(sums[(half + 2) % A][t], high, pair_of_512(a + t * k + 2 * (half + 2)));
        };
        half_of(std::integral_constant<int, 0>()), half_of(std::integral_constant<int, 1>());
      }
    }
    for (int s = 1; s < A; ++s)
      for (int t = 0; t < T; ++t) sums[0][t] = _mm512_add_epi32(sums[0][t], sums[s][t]);
    __m512 d0, d1, m;
    if constexpr (!k_quant(TYPE)) {
      d0 = d1 = f16s(p0, p1);
      m = has_min(TYPE) ? f16s(p0 + 2 * ROWS, p1 + 2 * ROWS)
          : _mm512_mul_ps(d0, _mm512_set1_ps(TYPE == Q5_0 ? -16.0f : -8.0f));
    } else {
      if (b % super_blocks(TYPE) == 0) {  // converted once a superblock
        const uint8_t* s0 = super_of(g0, TYPE, b);
        const uint8_t* s1 = super_of(g1, TYPE, b);
        d = f16s(s0, s1);
        if constexpr (TYPE != Q6_K) neg_d_min = _mm512_xor_ps(_mm512_set1_ps(-0.0f), f16s(s0 + 2 * ROWS, s1 + 2 * ROWS));
      }
      d0 = _mm512_mul_ps(d, bytes_16(p0, p1, TYPE == Q6_K));
      d1 = TYPE == Q6_K ? _mm512_mul_ps(d, bytes_16(p0 + ROWS, p1 + ROWS, true)) : d0;
      m = TYPE == Q6_K ? d0 : _mm512_mul_ps(neg_d_min, bytes_16(p0 + ROWS, p1 + ROWS, false));  // -(d_min m)
    }
    for (int t = 0; t < T; ++t) {
      const int64_t i = (t0 + t) * nb + b;
      const __m512 scale = _mm512_set1_ps(x.scale[i]);
      if constexpr (TYPE == Q6_K)
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(first[t]), _mm512_mul_ps(d0, scale), acc[t]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[0][t]), _mm512_mul_ps(d1, scale), acc[t]);
      if constexpr (offset_step(TYPE)) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.scaled_sum[i]), acc[t]);
    }
  }
  const __mmask16 real = static_cast<__mmask16>((1u << rows) - 1);
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * n_out, real, acc[t]);
}

// Tiles of up to eight activation rows, as even as can be. The default target's 30 layers'
// products, one thread, one run: 5 rows 8.2 ms, 9 rows (4 + 5) 13.3, 17 rows 24.9, against
// 12.0, 23.9 and 39.7 on the AVX2 path (tiles of up to six).
template <int TYPE>
void pair_rows(const uint8_t* g0, const uint8_t* g1, int64_t nb, const Rounded& x, int64_t tokens, float* y,
               int64_t n_out, int rows) {
  constexpr int MOST = 8;
  const int64_t tiles = (tokens + MOST - 1) / MOST;
  for (int64_t i = 0, t = 0; i < tiles; ++i) {
    const int64_t size = (tokens - t) / (tiles - i);
    switch (size) {
      case 1: pair_tile<TYPE, 1>(g0, g1, nb, x, t, y, n_out, rows); break;
      case 2: pair_tile<TYPE, 2>(g0, g1, nb, x, t, y, n_out, rows); break;
      case 3: pair_tile<TYPE, 3>(g0, g1, nb, x, t, y, n_out, rows); break;
      case 4: pair_tile<TYPE, 4>(g0, g1, nb, x, t, y, n_out, rows); break;
      case 5: pair_tile<TYPE, 5>(g0, g1, nb, x, t, y, n_out, rows); break;
      case 6: pair_tile<TYPE, 6>(g0, g1, nb, x, t, y, n_out, rows); break;
      case 7: pair_tile<TYPE, 7>(g0, g1, nb, x, t, y, n_out, rows); break;
      case 8: pair_tile<TYPE, 8>(g0, g1, nb, x, t, y, n_out, rows); break;
    }
    t += size;
  }
}

void pair_rows(const uint8_t* g0, const uint8_t* g1, int type, int64_t nb, const Rounded& x, int64_t tokens, float* y,
               int64_t n_out, int rows) {
  switch (type) {
#define CASE(TYPE) case TYPE: return pair_rows<TYPE>(g0, g1, nb, x, tokens, y, n_out, rows);
    SPECDEC_TYPES(CASE)
#undef CASE
  }
}
#endif  // AVX-512

// Portable: the same arithmetic, one lane.

void round_row_portable(const float* x, int64_t k, int16_t* a, float* scale, float* scaled_sum) {
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

void group_rows_portable(const uint8_t* group, int type, int64_t nb, const Rounded& x, int64_t tokens, float* y,
                         int64_t n_out, int rows) {
  for (int64_t t = 0; t < tokens; ++t)
    for (int r = 0; r < rows; ++r) {
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = block_of(group, type, b);
        const int16_t* a = x.a.data() + (t * nb + b) * QK;
        int32_t sums[2] = {0, 0};  // columns 0-15, 16-31
        for (int c = 0; c < QK; ++c) sums[c / 16] += packed_int(p, type, r, c) * a[c];
        float d0, d1, m;
        block_scales(super_of(group, type, b), p, type, r, d0, d1, m);
        const float s = x.scale[t * nb + b];
        if (type == Q6_K) {
          acc = std::fma(static_cast<float>(sums[0]), d0 * s, acc);
          acc = std::fma(static_cast<float>(sums[1]), d1 * s, acc);
        } else {
          acc = std::fma(static_cast<float>(sums[0] + sums[1]), d0 * s, acc);
        }
        if (offset_step(type)) acc = std::fma(m, x.scaled_sum[t * nb + b], acc);
      }
      y[t * n_out + r] = acc;
    }
}

enum Isa { PORTABLE, AVX2, AVX512 };
const char* const ISA_NAMES[] = {"portable", "avx2", "avx512_vnni"};

constexpr Isa widest() {
#if defined(SPECDEC_AVX512)
  return AVX512;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return AVX2;
#else
  return PORTABLE;
#endif
}

std::atomic<Isa> chosen{widest()};  // set by set_isa, read by each matmul (on any thread)

}  // namespace

// The paths this build has, narrowest first.
std::vector<std::string> isas() {
  return std::vector<std::string>(ISA_NAMES, ISA_NAMES + widest() + 1);
}

// Makes `matmul` take the path named (one of `isas()`; the widest is the default, and the
// others exist to be compared with it); -> the path it took before.
std::string set_isa(const std::string& name) {
  const std::string before = ISA_NAMES[chosen.load()];
  for (int i = 0; i <= widest(); ++i)
    if (name == ISA_NAMES[i]) {
      chosen.store(static_cast<Isa>(i));
      return before;
    }
  TORCH_CHECK(false, "no path ", name, " in this build (it has ", c10::Join(", ", isas()), ")");
}

// The file's blocks [N, K / file_weights * file_bytes] uint8 -> the packed layout
// [ceil(N / 8), group_stride(K / 32)].
torch::Tensor pack(torch::Tensor w, int64_t type) {
  check_type(type);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8, "w must be [N, bytes] uint8");
  w = w.contiguous();
  const int bytes = file_bytes(type);
  TORCH_CHECK(w.size(1) % bytes == 0, "rows of ", w.size(1), " bytes are not whole blocks");
  const int64_t N = w.size(0), nb = w.size(1) / bytes * (file_weights(type) / QK), groups = (N + ROWS - 1) / ROWS;
  auto out = torch::zeros({groups, group_stride(type, nb)}, w.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int r = n % ROWS;
    const uint8_t* row = wp + n * w.size(1);
    uint8_t* group = op + (n / ROWS) * out.size(1);
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* super = const_cast<uint8_t*>(super_of(group, type, b));
      uint8_t* dst = const_cast<uint8_t*>(block_of(group, type, b));
      if (!k_quant(type)) {
        const uint8_t* src = row + b * bytes;
        std::memcpy(dst + 2 * r, src, 2);                                        // d
        if (has_min(type)) std::memcpy(dst + 2 * ROWS + 2 * r, src + 2, 2);      // m
      } else {
        const uint8_t* src = row + b / 8 * bytes;
        const int s = b % 8;
        if (type == Q6_K) {
          std::memcpy(super + 2 * r, src + 208, 2);                              // d
          dst[r] = src[192 + 2 * s], dst[ROWS + r] = src[192 + 2 * s + 1];       // sc of columns 0-15, 16-31
        } else {
          std::memcpy(super + 2 * r, src, 2);                                    // d
          std::memcpy(super + 2 * ROWS + 2 * r, src + 2, 2);                     // d_min
          k_scale_min(src + 4, s, dst[r], dst[ROWS + r]);                        // sc, m
        }
      }
      for (int c = 0; c < QK; ++c) {
        bool high;
        uint8_t& byte = dst[ints_offset(type) + packed_index(type, r, c, high)];
        const int q = file_q(row, type, b, c);
        byte = bytes_q(type) ? static_cast<uint8_t>(q) : high ? (byte | (q & 15) << 4) : (byte | (q & 15));
        if (crumbs(type)) {
          dst[crumb_index(type, r, c)] |= static_cast<uint8_t>((q >> 4 & 3) << (2 * (c / 2 % 4)));
          continue;
        }
        for (int plane = 0; plane < planes(type); ++plane)
          if ((q >> (4 + plane)) & 1) {
            uint8_t* word = dst + planes_offset(type) + 2 * (QK / 2 * plane + c / 2);
            const int lane = 2 * r + c % 2;
            word[lane / 8] |= static_cast<uint8_t>(1 << (lane % 8));  // little-endian, as plane_word reads it
          }
      }
    }
  }
  return out;
}

// x: M rows of K float32; w: the packed blocks of N rows (pack), `groups` groups of
// `stride` bytes -> y: M rows of N float32, each ldy floats after the one before (a
// product of several block types writes each type's columns of one row). For callers
// that hold their own buffers (a whole pass in one call: layer_cpu.cpp); `matmul` checks
// the shapes for it.
void matmul_rows(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t groups, int64_t stride,
                 int64_t type, int64_t N, float* yp, int64_t ldy) {
  const int64_t nb = K / QK;
  Rounded rounded(M, K);
  const Isa isa = chosen.load();
  for (int64_t t = 0; t < M; ++t) {
    int16_t* a = rounded.a.data() + t * K;
    float *scale = rounded.scale.data() + t * nb, *scaled_sum = rounded.scaled_sum.data() + t * nb;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (isa != PORTABLE) {
      round_row(xp + t * K, K, a, scale, scaled_sum);
      continue;
    }
#endif
    round_row_portable(xp + t * K, K, a, scale, scaled_sum);
  }
  auto rows_of = [&](int64_t g) { return static_cast<int>(std::min<int64_t>(ROWS, N - g * ROWS)); };
  // Pairs of groups of output rows are split between threads.
  at::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = 2 * begin; g < std::min(2 * end, groups); g += 2) {
#if defined(SPECDEC_AVX512)
      if (isa == AVX512 && g + 1 < groups) {
        pair_rows(wp + g * stride, wp + (g + 1) * stride, type, nb, rounded, M, yp + g * ROWS, ldy,
                  ROWS + rows_of(g + 1));
        continue;
      }
#endif
      for (int64_t h = g; h < std::min(g + 2, groups); ++h) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        if (isa != PORTABLE) {
          group_rows(wp + h * stride, type, nb, rounded, M, yp + h * ROWS, ldy, rows_of(h));
          continue;
        }
#endif
        group_rows_portable(wp + h * stride, type, nb, rounded, M, yp + h * ROWS, ldy, rows_of(h));
      }
    }
  });
}

// The packed blocks w hold N rows of x's K columns: a check for `matmul_rows`' callers.
void check_packed(const torch::Tensor& w, int64_t type, int64_t K, int64_t N) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w must be packed blocks");
  check_type(type);
  TORCH_CHECK(K % file_weights(type) == 0 && w.size(1) == group_stride(type, K / QK) &&
              w.size(0) == (N + ROWS - 1) / ROWS, "w's packed blocks do not cover ", N, " rows of ", K, " columns");
}

// x: [M, K] float32; w: the packed blocks of N rows (pack) -> [M, N] float32.
torch::Tensor matmul(torch::Tensor x, torch::Tensor w, int64_t type, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  check_packed(w, type, K, N);
  auto y = torch::empty({M, N}, x.options());
  matmul_rows(x.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), w.size(0), w.size(1), type, N, y.data_ptr<float>(),
              N);
  return y;
}

// Rows `ids` of the packed blocks of N rows, de-quantized: [len(ids), K] float32 (an
// embedding lookup): weight = q * d + m, as gguf's reference code computes it (the
// types' own formulas, block_scales' d and m, each product and sum rounded once).
torch::Tensor dequantize(torch::Tensor w, int64_t type, int64_t N, torch::Tensor ids) {
  check_type(type);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w must be packed blocks");
  TORCH_CHECK(w.size(1) % super_bytes(type) == 0 && w.size(0) == (N + ROWS - 1) / ROWS, "w does not hold ", N,
              " packed rows");
  ids = ids.to(torch::kLong).contiguous();
  const int64_t nb = w.size(1) / super_bytes(type) * super_blocks(type), K = nb * QK, n = ids.numel();
  auto out = torch::empty({n, K}, torch::dtype(torch::kFloat32));
  const int64_t* ip = ids.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "row ", ip[i], " out of range");
    const int r = ip[i] % ROWS;
    const uint8_t* group = w.data_ptr<uint8_t>() + (ip[i] / ROWS) * w.size(1);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = block_of(group, type, b);
      float d0, d1, m;
      block_scales(super_of(group, type, b), p, type, r, d0, d1, m);
      for (int c = 0; c < QK; ++c) {
        const int q = packed_int(p, type, r, c);  // Q6_K's: q - 32
        const float d = c < 16 ? d0 : d1;
        // q * d is exact in float32 but for K types' d sc (rounded once, as numpy's)
        o[i * K + b * QK + c] = has_min(type) || type == Q4_K || type == Q5_K ? q * d + m
                              : type == Q4_0 ? (q - 8) * d : type == Q5_0 ? (q - 16) * d : q * d;
      }
    }
  }
  return out;
}
