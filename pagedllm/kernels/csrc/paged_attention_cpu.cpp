// Attention read straight from the paged KV cache, on CPU: decodes and prefill chunks alike.
//
// Every query token of a step, of every request, attends the keys of its own request up to its
// own position, all of them read from the cache where they lie (a step writes its K/V first):
// no gather, no padding, no mask. A task is one KV head and a tile of up to 16 consecutive
// tokens of one request; all the tile's queries (tokens x the query heads sharing the KV head)
// share each key and value row as it is loaded. Scores go 8 keys at a time (8 independent
// multiply-add chains), softmax is vectorized, and values are summed 8 floats at a time with one
// accumulator per query kept in registers.
//
// Each query's arithmetic (its scores, softmax and weighted sum, all in float32, in the same
// order) is the same whatever tile or step it is computed in, so a token's output does not depend
// on how the prompt was chunked, whether a prefix came from the cache, or what else was batched:
// those paths agree bit for bit. A bfloat16 / float16 row is widened as it is read; an 8-bit row
// likewise, with its scale applied to the sums, not to each value (a quarter of float32's bytes).
// A bfloat16 model with a bfloat16 cache, on a CPU with AVX512-BF16, is not widened at all: its
// scores and weighted sums run on dpbf16ps (bfloat16 products summed in float32; the softmax
// weights rounded to bfloat16 for the weighted sum), about twice as fast (BFloat16PairRow).
// AVX2 + FMA (+ F16C) paths where the compiler targets them (-march=native), plain loops elsewhere.
// Rows are prefetched a few ahead: a request's blocks lie anywhere in the cache.
//
// Shapes: query [num_tokens, num_heads, head_dim] float32 / bfloat16 / float16 (widened as read,
// the output rounded back once), each request's tokens contiguous;
// k_cache / v_cache [num_blocks, block_size, num_kv_heads, row] with row = head_dim (float32,
// bfloat16, float16) or head_dim + 2 (int8 / fp8 values, then a float16 scale); block_tables
// [num_seqs, max_blocks], query_start_loc [num_seqs + 1] (request s has tokens
// query_start_loc[s] .. query_start_loc[s + 1]) and seq_lens [num_seqs] (its keys once this step's
// are written), int64. Returns [num_tokens, num_heads, head_dim] in the query's dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include "vec_math.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1
#else
#define PAGEDLLM_AVX2 0
#endif
#if PAGEDLLM_AVX2 && defined(__AVX512F__)
#define PAGEDLLM_AVX512 1
#else
#define PAGEDLLM_AVX512 0
#endif
#if PAGEDLLM_AVX512 && defined(__AVX512BF16__)
#define PAGEDLLM_AVX512BF16 1
#else
#define PAGEDLLM_AVX512BF16 0
#endif

namespace {

using pagedllm_cpu::exp_nonpositive;

constexpr int64_t kLanes = 8;  // one AVX2 register of floats; head_dim is a multiple of it
constexpr int64_t kPrefetchRows = 48;  // how far ahead rows are fetched: a request's blocks lie
                                       // anywhere in the cache, so the hardware cannot guess them

// Ask for a cache row (up to 256 bytes: 64 bfloat16 or float32 values) before it is needed.
inline void prefetch_row(const uint8_t* row, int64_t row_bytes) {
  for (int64_t offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(row + offset);
}

// Lane-wise partial sums, so the compiler vectorizes without reordering any single sum.
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {};
  for (int64_t i = 0; i < n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += a[i + j] * b[i + j];
  float sum = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) sum += lanes[j];
  return sum;
}

inline void add_scaled(float* acc, float weight, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += weight * x[i];
}

// Softmax numerators in place, exp(x - max(x)); returns their sum, or NaN when a score is
// NaN or infinite (as SDPA's softmax would give), with the numerators zeroed.
inline float softmax_numerators(float* x, int64_t n) {
  const int64_t whole = n - n % kLanes;
  float lanes[kLanes], finite_check[kLanes] = {};  // x - x: 0 for finite x, NaN otherwise
  std::fill(lanes, lanes + kLanes, x[0]);
  for (int64_t t = 0; t < whole; t += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) {
      lanes[j] = x[t + j] > lanes[j] ? x[t + j] : lanes[j];
      finite_check[j] += x[t + j] - x[t + j];
    }
  float max_value = *std::max_element(lanes, lanes + kLanes), check = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) check += finite_check[j];
  for (int64_t t = whole; t < n; ++t) {
    max_value = std::max(max_value, x[t]);
    check += x[t] - x[t];
  }
  if (!(check == 0.f)) {
    std::fill(x, x + n, 0.f);
    return std::numeric_limits<float>::quiet_NaN();
  }
  std::fill(lanes, lanes + kLanes, 0.f);
  for (int64_t t = 0; t < whole; t += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += (x[t + j] = exp_nonpositive(x[t + j] - max_value));
  float sum = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) sum += lanes[j];
  for (int64_t t = whole; t < n; ++t) sum += (x[t] = exp_nonpositive(x[t] - max_value));
  return sum;
}

// A float32 cache row is read where it lies.
struct FloatRow {
  static int64_t bytes(int64_t head_dim) { return head_dim * 4; }
  static const float* values(const uint8_t* row, int64_t /*head_dim*/, float* /*buffer*/) {
    return reinterpret_cast<const float*>(row);
  }
  static float scale(const uint8_t* /*row*/, int64_t /*head_dim*/) { return 1.f; }
#if PAGEDLLM_AVX2
  static __m256 load8(const uint8_t* row, int64_t d) { return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + d); }
#endif
#if PAGEDLLM_AVX512
  static __m512 load16(const uint8_t* row, int64_t d) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + d);
  }
#endif
};

// A 16-bit float row (bfloat16 or float16), widened to float32 as it is read.
template <typename T>
struct HalfWidthRow {
  static int64_t bytes(int64_t head_dim) { return head_dim * 2; }
  static const float* values(const uint8_t* row, int64_t head_dim, float* buffer) {
    const T* x = reinterpret_cast<const T*>(row);
    for (int64_t d = 0; d < head_dim; ++d) buffer[d] = static_cast<float>(x[d]);
    return buffer;
  }
  static float scale(const uint8_t* /*row*/, int64_t /*head_dim*/) { return 1.f; }
#if PAGEDLLM_AVX2
  static __m256 load8(const uint8_t* row, int64_t d) {
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d * 2));
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      // a bfloat16 is the top half of a float32
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
    } else {
      return _mm256_cvtph_ps(halves);
    }
  }
#endif
#if PAGEDLLM_AVX512
  static __m512 load16(const uint8_t* row, int64_t d) {
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d * 2));
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
    } else {
      return _mm512_cvtph_ps(halves);
    }
  }
#endif
};

// A bfloat16 row read by a bfloat16 model on a CPU with AVX512-BF16: scores and weighted sums go
// through dpbf16ps (products of bfloat16 pairs summed into float32) on the rows where they lie,
// nothing widened. The softmax weights are rounded to bfloat16 for the weighted sum, as PyTorch's
// CPU SDPA does for bfloat16. Used where head_dim % 64 == 0 and the block size is even (rows are
// taken in pairs from a block boundary).
struct BFloat16PairRow : HalfWidthRow<c10::BFloat16> {};

// Every float8 value by its byte, filled when the library loads (no guard on each use).
template <typename T>
const std::array<float, 256> kFloat8Values = [] {
  std::array<float, 256> values;
  for (int i = 0; i < 256; ++i) values[i] = static_cast<float>(c10::bit_cast<T>(static_cast<uint8_t>(i)));
  return values;
}();

// An 8-bit row: head_dim values of T, then a float16 scale, x_d = value_d * scale. The values
// are widened once into a small buffer that the query heads sharing the row then read; the
// scale moves out of the sums (q . x = scale * (q . values)).
template <typename T>
struct QuantizedRow {
  // float8 widens through a 256-entry table: c10's conversion works bit by bit, ~20x slower.
  static float widen(uint8_t byte) {
    if constexpr (std::is_same_v<T, int8_t>) {
      return static_cast<float>(static_cast<int8_t>(byte));
    } else {
      return kFloat8Values<T>[byte];
    }
  }
  static int64_t bytes(int64_t head_dim) { return head_dim + 2; }
  static const float* values(const uint8_t* row, int64_t head_dim, float* buffer) {
    for (int64_t d = 0; d < head_dim; ++d) buffer[d] = widen(row[d]);
    return buffer;
  }
  static float scale(const uint8_t* row, int64_t head_dim) {
    c10::Half scale;
    std::memcpy(&scale, row + head_dim, sizeof(scale));
    return static_cast<float>(scale);
  }
#if PAGEDLLM_AVX2
  static __m256 load8(const uint8_t* row, int64_t d) {
    if constexpr (std::is_same_v<T, int8_t>) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d));
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    } else {
      alignas(32) float widened[kLanes];
      for (int64_t j = 0; j < kLanes; ++j) widened[j] = widen(row[d + j]);
      return _mm256_load_ps(widened);
    }
  }
#endif
#if PAGEDLLM_AVX512
  static __m512 load16(const uint8_t* row, int64_t d) {
    if constexpr (std::is_same_v<T, int8_t>) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
    } else {
      alignas(64) float widened[16];
      for (int64_t j = 0; j < 16; ++j) widened[j] = widen(row[d + j]);
      return _mm512_load_ps(widened);
    }
  }
#endif
};

#if PAGEDLLM_AVX2
// q . rows[i] for 8 rows at once: eight independent multiply-add chains, then one
// transpose-and-add that leaves row i's sum in lane i (no horizontal sum per row). Every row's
// sum takes the same path whatever its lane, so a score does not depend on which 8 keys it was
// computed with: that is what makes a row's output independent of how a step is split.
template <typename Row>
inline __m256 dot8(const float* q, const uint8_t* const* rows, int64_t head_dim) {
  __m256 acc[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += kLanes) {
    const __m256 q8 = _mm256_loadu_ps(q + d);
    for (int64_t i = 0; i < kLanes; ++i) acc[i] = _mm256_fmadd_ps(q8, Row::load8(rows[i], d), acc[i]);
  }
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  // s0123 = [rows 0-3, lanes 0-3 summed | rows 0-3, lanes 4-7 summed]; likewise s4567
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// acc[g] += sum_t weights[g][t] * rows[t] for Group queries, 8 output floats at a time with the
// Group accumulators in registers: each row chunk is loaded once for all of them. A query's sum
// runs over t in order, continuing from what acc holds, whatever Group is and however its keys
// are cut into calls: so it does not depend on the queries it was grouped with.
template <typename Row, int64_t Group>
void weighted_sum(const float* const* weights, const uint8_t* const* rows, int64_t len, int64_t head_dim,
                  float* const* acc_rows) {
  for (int64_t d = 0; d < head_dim; d += kLanes) {
    __m256 acc[Group];
    for (int64_t g = 0; g < Group; ++g) acc[g] = _mm256_loadu_ps(acc_rows[g] + d);
    for (int64_t t = 0; t < len; ++t) {
      if (d == 0 && t + kPrefetchRows < len) prefetch_row(rows[t + kPrefetchRows], Row::bytes(head_dim));
      const __m256 x = Row::load8(rows[t], d);
      for (int64_t g = 0; g < Group; ++g) acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(weights[g][t]), x, acc[g]);
    }
    for (int64_t g = 0; g < Group; ++g) _mm256_storeu_ps(acc_rows[g] + d, acc[g]);
  }
}

template <typename Row>
void weighted_sum_up_to_8(const float* const* weights, const uint8_t* const* rows, int64_t len, int64_t head_dim,
                          int64_t group, float* const* acc_rows) {
  switch (group) {
    case 1: weighted_sum<Row, 1>(weights, rows, len, head_dim, acc_rows); break;
    case 2: weighted_sum<Row, 2>(weights, rows, len, head_dim, acc_rows); break;
    case 3: weighted_sum<Row, 3>(weights, rows, len, head_dim, acc_rows); break;
    case 4: weighted_sum<Row, 4>(weights, rows, len, head_dim, acc_rows); break;
    case 5: weighted_sum<Row, 5>(weights, rows, len, head_dim, acc_rows); break;
    case 6: weighted_sum<Row, 6>(weights, rows, len, head_dim, acc_rows); break;
    case 7: weighted_sum<Row, 7>(weights, rows, len, head_dim, acc_rows); break;
    default: weighted_sum<Row, 8>(weights, rows, len, head_dim, acc_rows);
  }
}
#endif

#if PAGEDLLM_AVX512
// AVX-512, where head_dim is a multiple of 64 (this CPU has it and the model allows it). Rows
// that are not float32 are first widened into float32 buffers, once per task, so the queries
// that share them read plain floats (and the multiply-adds take them straight from memory).

// The 16 lanes of each of 8 accumulators summed, sum i in lane i: each folded to 8 lanes, then
// the same transpose-and-add as dot8, so every row's sum takes the same path.
inline __m256 sum_lanes8(const __m512* acc) {
  __m256 half[kLanes];
  for (int64_t i = 0; i < kLanes; ++i)
    half[i] = _mm256_add_ps(_mm512_castps512_ps256(acc[i]), _mm512_extractf32x8_ps(acc[i], 1));
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(half[0], half[1]), _mm256_hadd_ps(half[2], half[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(half[4], half[5]), _mm256_hadd_ps(half[6], half[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// q . rows[i] for 8 float32 rows: 16 floats per multiply-add, each row's lanes folded to 8 and
// then summed by the same transpose-and-add as dot8: every row's sum takes the same path.
inline __m256 dot8_avx512(const float* q, const float* const* rows, int64_t head_dim) {
  __m512 acc[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 16) {
    const __m512 q16 = _mm512_loadu_ps(q + d);
    for (int64_t i = 0; i < kLanes; ++i) acc[i] = _mm512_fmadd_ps(q16, _mm512_loadu_ps(rows[i] + d), acc[i]);
  }
  return sum_lanes8(acc);
}

// acc[g] += sum_t weights[g][t] * rows[t] for Group <= 4 queries, 64 output floats at a time with
// 4 x Group accumulators in registers; each query's sum runs over t in order, from what acc holds.
// Rows are read through Row (widened as loaded), or as float32 rows already widened.
template <typename Row, int64_t Group>
void weighted_sum_avx512(const float* const* weights, const uint8_t* const* rows, int64_t len, int64_t head_dim,
                         float* const* acc_rows) {
  for (int64_t d = 0; d < head_dim; d += 64) {
    __m512 acc[Group][4];
    for (int64_t g = 0; g < Group; ++g)
      for (int64_t c = 0; c < 4; ++c) acc[g][c] = _mm512_loadu_ps(acc_rows[g] + d + 16 * c);
    for (int64_t t = 0; t < len; ++t) {
      if (d == 0 && t + kPrefetchRows < len) prefetch_row(rows[t + kPrefetchRows], Row::bytes(head_dim));
      __m512 x[4];
      for (int64_t c = 0; c < 4; ++c) x[c] = Row::load16(rows[t], d + 16 * c);
      for (int64_t g = 0; g < Group; ++g) {
        const __m512 w = _mm512_set1_ps(weights[g][t]);
        for (int64_t c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(w, x[c], acc[g][c]);
      }
    }
    for (int64_t g = 0; g < Group; ++g)
      for (int64_t c = 0; c < 4; ++c) _mm512_storeu_ps(acc_rows[g] + d + 16 * c, acc[g][c]);
  }
}

template <typename Row>
void weighted_sum_avx512_up_to_4(const float* const* weights, const uint8_t* const* rows, int64_t len,
                                 int64_t head_dim, int64_t group, float* const* acc_rows) {
  switch (group) {
    case 1: weighted_sum_avx512<Row, 1>(weights, rows, len, head_dim, acc_rows); break;
    case 2: weighted_sum_avx512<Row, 2>(weights, rows, len, head_dim, acc_rows); break;
    case 3: weighted_sum_avx512<Row, 3>(weights, rows, len, head_dim, acc_rows); break;
    default: weighted_sum_avx512<Row, 4>(weights, rows, len, head_dim, acc_rows);
  }
}

// Widen n rows into `buffer` (n x head_dim float32) and point `out` at them.
template <typename Row>
void widen_rows(const uint8_t* const* rows, int64_t n, int64_t head_dim, std::vector<float>& buffer,
                std::vector<const uint8_t*>& out) {
  buffer.resize(n * head_dim);
  out.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    if (i + kPrefetchRows < n) prefetch_row(rows[i + kPrefetchRows], Row::bytes(head_dim));
    float* dst = buffer.data() + i * head_dim;
    for (int64_t d = 0; d < head_dim; d += 16) _mm512_storeu_ps(dst + d, Row::load16(rows[i], d));
    out[i] = reinterpret_cast<const uint8_t*>(dst);
  }
}
#endif


#if PAGEDLLM_AVX512BF16
using pagedllm_cpu::as_bf16x32;

// exp_nonpositive, 16 lanes at a time: the same clamp, rounding and polynomial (its last step
// grouped as fma(p r, r, r + 1), so not always bit for bit the scalar's; each path uses only one).
inline __m512 exp16_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 round = _mm512_set1_ps(12582912.f);
  const __m512 k = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), round), round);
  const __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(exponent));
}

// 16 rows of 16 int32 each, transposed in registers: r[c] then holds element c of every row.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // in each 128-bit block b: elements 4b, 4b+1 / 4b+2, 4b+3 of 2 rows
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + j], block b: element 4b + j of rows 4i .. 4i + 3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  __m512i out[16];
  for (int j = 0; j < 4; ++j) {  // the 128-bit blocks of r[j], r[4 + j], r[8 + j], r[12 + j], transposed
    const __m512i e = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), f = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i g = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44), h = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    out[j] = _mm512_shuffle_i32x4(e, g, 0x88);
    out[4 + j] = _mm512_shuffle_i32x4(e, g, 0xDD);
    out[8 + j] = _mm512_shuffle_i32x4(f, h, 0x88);
    out[12 + j] = _mm512_shuffle_i32x4(f, h, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = out[i];
}

// 16 bfloat16 rows as pairs, key-minor: tile[p * 16 + k] holds values 2p and 2p + 1 of row k, so
// one load gives a pair of dimensions for 16 keys, and scores need no sum across lanes.
inline void transpose_rows16(const uint8_t* const* rows, int64_t head_dim, uint32_t* tile) {
  for (int64_t c = 0; c < head_dim / 32; ++c) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows[i] + 64 * c);
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(tile + (16 * c + i) * 16, r[i]);
  }
}

// Scores of Q bfloat16 queries against 16 keys (a transposed tile), one key per lane: the
// query's pair p broadcast, one dpbf16ps per pair into 4 chains (p mod 4), summed as
// (c0 + c1) + (c2 + c3). Each (query, key) score is the same whatever Q, lane or tile it is in.
template <int Q>
inline void scores16_bf16(const uint32_t* const* query_pairs, const uint32_t* tile, int64_t num_pairs, __m512* out) {
  __m512 acc[Q][4];
  for (int j = 0; j < Q; ++j)
    for (int c = 0; c < 4; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < num_pairs; p += 4) {
    for (int c = 0; c < 4; ++c) {
      const __m512bh k = as_bf16x32(_mm512_loadu_si512(tile + (p + c) * 16));
      for (int j = 0; j < Q; ++j)
        acc[j][c] = _mm512_dpbf16_ps(acc[j][c], as_bf16x32(_mm512_set1_epi32(static_cast<int32_t>(query_pairs[j][p + c]))), k);
    }
  }
  for (int j = 0; j < Q; ++j) out[j] = _mm512_add_ps(_mm512_add_ps(acc[j][0], acc[j][1]), _mm512_add_ps(acc[j][2], acc[j][3]));
}

// acc[g] += sum_t weights[g][t] * rows[t] for Group <= 4 queries, rows taken in pairs (t, t + 1):
// their values interleaved, the pair's two bfloat16 weights broadcast, one dpbf16ps per 16
// outputs. An odd len's last row pairs with a row of zeros (its weight is 0 too: the weights past
// a query's keys are), so nothing of another row enters, not even 0 x inf. 64 outputs at a time, 4 x Group accumulators in registers, kept in
// the interleaved order: output d of a 64-block sits at bf16_sum_slot(d) (put back at the end).
alignas(64) constexpr uint8_t kZeroRow[128] = {};  // 64 bfloat16 zeros

template <int64_t Group>
void weighted_sum_bf16(const uint32_t* const* weight_pairs, const uint8_t* const* rows, int64_t len,
                       int64_t head_dim, float* const* acc_rows) {
  for (int64_t t = 0; t < std::min(len, kPrefetchRows); ++t) prefetch_row(rows[t], 2 * head_dim);
  for (int64_t d = 0; d < head_dim; d += 64) {
    __m512 acc[Group][4];
    for (int64_t g = 0; g < Group; ++g)
      for (int64_t c = 0; c < 4; ++c) acc[g][c] = _mm512_loadu_ps(acc_rows[g] + d + 16 * c);
    for (int64_t t = 0; t < len; t += 2) {
      if (t + kPrefetchRows < len) {
        prefetch_row(rows[t + kPrefetchRows] + 2 * d, 128);
        prefetch_row(rows[t + kPrefetchRows + 1 < len ? t + kPrefetchRows + 1 : t + kPrefetchRows] + 2 * d, 128);
      }
      const uint8_t* a = rows[t] + 2 * d;
      const uint8_t* b = t + 1 < len ? rows[t + 1] + 2 * d : kZeroRow;
      const __m512i a0 = _mm512_loadu_si512(a), a1 = _mm512_loadu_si512(a + 64);
      const __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 64);
      const __m512bh x[4] = {as_bf16x32(_mm512_unpacklo_epi16(a0, b0)), as_bf16x32(_mm512_unpackhi_epi16(a0, b0)),
                             as_bf16x32(_mm512_unpacklo_epi16(a1, b1)), as_bf16x32(_mm512_unpackhi_epi16(a1, b1))};
      for (int64_t g = 0; g < Group; ++g) {
        const __m512bh w = as_bf16x32(_mm512_set1_epi32(static_cast<int32_t>(weight_pairs[g][t / 2])));
        for (int64_t c = 0; c < 4; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], w, x[c]);
      }
    }
    for (int64_t g = 0; g < Group; ++g)
      for (int64_t c = 0; c < 4; ++c) _mm512_storeu_ps(acc_rows[g] + d + 16 * c, acc[g][c]);
  }
}

void weighted_sum_bf16_up_to_4(const uint32_t* const* weight_pairs, const uint8_t* const* rows, int64_t len,
                               int64_t head_dim, int64_t group, float* const* acc_rows) {
  switch (group) {
    case 1: weighted_sum_bf16<1>(weight_pairs, rows, len, head_dim, acc_rows); break;
    case 2: weighted_sum_bf16<2>(weight_pairs, rows, len, head_dim, acc_rows); break;
    case 3: weighted_sum_bf16<3>(weight_pairs, rows, len, head_dim, acc_rows); break;
    default: weighted_sum_bf16<4>(weight_pairs, rows, len, head_dim, acc_rows);
  }
}
#endif

// Where weighted_sum_bf16 keeps output d (0..63) of a 64-block: unpacklo/hi_epi16 interleave the
// 4 low / 4 high values of each 8-value lane, so accumulator c holds, in slot k, output
// 32 (c / 2) + 8 (k / 4) + 4 (c % 2) + k % 4.
inline int64_t bf16_sum_slot(int64_t d) {
  const int64_t within = d % 32, c = (d / 32) * 2 + (within % 8) / 4, k = (within / 8) * 4 + within % 4;
  return 16 * c + k;
}


// The same in plain loops (no AVX2), one query at a time.
template <typename Row>
void weighted_sum_plain(const float* const* weights, const uint8_t* const* rows, int64_t len, int64_t head_dim,
                        int64_t group, float* const* acc_rows, float* row_buffer) {
  for (int64_t t = 0; t < len; ++t) {
    const float* x = Row::values(rows[t], head_dim, row_buffer);
    for (int64_t g = 0; g < group; ++g) add_scaled(acc_rows[g], weights[g][t], x, head_dim);
  }
}

constexpr int64_t kTileRows = 16;  // query tokens of one sequence that share a task

// Query tokens of one sequence: first_row .. first_row + num_rows, attending first_len keys,
// then one more for each next token (causal; each token's own K/V is already in the cache).
struct Part {
  int64_t seq, first_row, num_rows, first_len;
};

// One task: a KV head and the query tokens of some parts (a prefill tile, or decodes of several
// requests), all their query heads for this KV head together. The keys are walked block index by
// block index; at each, the queries whose requests hold the same physical block share its rows,
// loaded (and widened) once: requests that share a cached prefix read it once per task.
//
// Every query's arithmetic is the same whatever it is grouped with and however its keys are cut:
// a score comes from dot8 whatever the 8 keys around it, the softmax runs over the query's whole
// row, and the weighted sum runs over its keys in order, continuing from block to block.
template <typename Row>
struct Attend {
  const void* query;  // float32, bfloat16 or float16, as query_type says; out likewise
  at::ScalarType query_type;
  const uint8_t *k_cache, *v_cache;
  const int64_t* block_tables;
  void* out;
  int64_t num_heads, num_kv_heads, head_dim, block_size, row_bytes, max_blocks;
  float scale;

  // A run of keys that the same queries read from the same rows: one group of requests sharing
  // blocks (or one request alone) over consecutive block indices.
  struct Segment {
    int64_t begin, end;  // keys
    std::vector<int64_t> ids;  // the queries reading them
  };

  // one task's working memory, reused from task to task on a thread
  struct Work {
    std::vector<float> scores, accs, inv_sums, row_buffer, k_widened, v_widened, row_scales, query_floats;
    std::vector<int64_t> lens, seqs, rows, heads, group_of, previous_group_of, run_starts, leaders, leader_blocks;
    std::vector<const float*> queries, weights;
    std::vector<const uint16_t*> queries_bf16;  // BFloat16PairRow: the queries where they lie
    std::vector<uint16_t> weights_bf16;  // BFloat16PairRow: the softmax weights, rounded
    std::vector<const uint32_t*> weight_pairs, query_pairs;
    std::vector<uint32_t> tile;
    std::vector<int64_t> active;
    std::vector<float*> acc_rows;
    std::vector<const uint8_t*> k_rows, v_rows, k_wide, v_wide;
    std::vector<Segment> segments;
  };

  void run(int64_t kv_head, const Part* parts, int64_t num_parts, Work& w) const {
    const int64_t group = num_heads / num_kv_heads;
    w.lens.clear(), w.seqs.clear(), w.rows.clear(), w.heads.clear(), w.queries.clear(), w.queries_bf16.clear();
    int64_t max_len = 0;
    for (int64_t p = 0; p < num_parts; ++p)
      for (int64_t r = 0; r < parts[p].num_rows; ++r)
        for (int64_t g = 0; g < group; ++g) {
          w.lens.push_back(parts[p].first_len + r);
          w.seqs.push_back(parts[p].seq);
          w.rows.push_back(parts[p].first_row + r);
          w.heads.push_back(kv_head * group + g);
          max_len = std::max(max_len, w.lens.back());
        }
    const int64_t num_queries = static_cast<int64_t>(w.lens.size());
    // queries as float32: read in place, or widened (16-bit models) into the task's buffer
    w.query_floats.resize(query_type == at::kFloat ? 0 : num_queries * head_dim);
    for (int64_t q = 0; q < num_queries; ++q) {
      const int64_t offset = (w.rows[q] * num_heads + w.heads[q]) * head_dim;
      if constexpr (std::is_same_v<Row, BFloat16PairRow>) {  // read as bfloat16, where it lies
        w.queries_bf16.push_back(static_cast<const uint16_t*>(query) + offset);
        continue;
      }
      if (query_type == at::kFloat) {
        w.queries.push_back(static_cast<const float*>(query) + offset);
        continue;
      }
      float* dst = w.query_floats.data() + q * head_dim;
      for (int64_t d = 0; d < head_dim; ++d)
        dst[d] = query_type == at::kBFloat16 ? static_cast<float>(static_cast<const c10::BFloat16*>(query)[offset + d])
                                             : static_cast<float>(static_cast<const c10::Half*>(query)[offset + d]);
      w.queries.push_back(dst);
    }
    const int64_t stride = (max_len + 15) / 16 * 16 + 16;  // room for a last dot8 or 16-key tile
    w.scores.resize(num_queries * stride);  // every key up to a query's length is scored; past it, zeroed below
    w.accs.assign(num_queries * head_dim, 0.f);
    w.row_buffer.resize(head_dim);
    segment(max_len, w);
    for (const Segment& seg : w.segments) {
      segment_rows(kv_head, seg, w);
      score_block(seg.ids, seg.begin, seg.end, w, stride);
    }
    w.inv_sums.resize(num_queries);
    if constexpr (std::is_same_v<Row, BFloat16PairRow>) {
      softmax_to_bf16(num_queries, stride, w);
    } else {
      for (int64_t q = 0; q < num_queries; ++q) {
        float* s = w.scores.data() + q * stride;
        w.inv_sums[q] = 1.f / softmax_numerators(s, w.lens[q]);
        std::fill(s + w.lens[q], s + stride, 0.f);  // no weight past the query's own keys
      }
    }
    for (const Segment& seg : w.segments) {  // in key order: each query's sum continues in order
      segment_rows(kv_head, seg, w);
      sum_block(seg.ids, seg.begin, seg.end, w, stride);
    }
    for (int64_t q = 0; q < num_queries; ++q) {  // written in the query's dtype (rounded once)
      const int64_t offset = (w.rows[q] * num_heads + w.heads[q]) * head_dim;
      const float* acc = w.accs.data() + q * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {
        const int64_t slot = std::is_same_v<Row, BFloat16PairRow> ? d / 64 * 64 + bf16_sum_slot(d % 64) : d;
        const float value = acc[slot] * w.inv_sums[q];
        if (query_type == at::kFloat) static_cast<float*>(out)[offset + d] = value;
        else if (query_type == at::kBFloat16) static_cast<c10::BFloat16*>(out)[offset + d] = c10::BFloat16(value);
        else static_cast<c10::Half*>(out)[offset + d] = c10::Half(value);
      }
    }
  }

  // Cuts the task's keys into segments: at each block index, the queries whose requests hold the
  // same physical block there form a group; consecutive block indices with the same groups make
  // one segment per group. A request's queries are adjacent (a run, with non-decreasing lengths),
  // so requests are compared, not queries.
  void segment(int64_t max_len, Work& w) const {
    const int64_t num_queries = static_cast<int64_t>(w.lens.size());
    const int64_t num_blocks = (max_len + block_size - 1) / block_size;
    w.run_starts.clear();
    for (int64_t q = 0; q < num_queries; ++q)
      if (q == 0 || w.seqs[q] != w.seqs[q - 1]) w.run_starts.push_back(q);
    w.run_starts.push_back(num_queries);
    w.segments.clear();
    w.previous_group_of.assign(num_queries, -2);
    size_t open_from = 0;  // the segments of the previous block index, which may grow
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t begin = b * block_size;
      w.group_of.assign(num_queries, -1);  // the group's first query; -1: past its keys
      w.leaders.clear();
      w.leader_blocks.clear();
      for (size_t i = 0; i + 1 < w.run_starts.size(); ++i) {
        int64_t first = w.run_starts[i];
        const int64_t run_end = w.run_starts[i + 1];
        while (first < run_end && w.lens[first] <= begin) ++first;
        if (first == run_end) continue;
        const int64_t block = block_tables[w.seqs[first] * max_blocks + b];
        const auto index = std::find(w.leader_blocks.begin(), w.leader_blocks.end(), block) - w.leader_blocks.begin();
        if (index == static_cast<int64_t>(w.leader_blocks.size())) {
          w.leader_blocks.push_back(block);
          w.leaders.push_back(first);
        }
        const int64_t leader = w.leaders[index];
        for (int64_t r = first; r < run_end; ++r) w.group_of[r] = leader;
      }
      if (b > 0 && w.group_of == w.previous_group_of) {  // same groups: their segments grow
        for (size_t i = open_from; i < w.segments.size(); ++i)
          w.segments[i].end = std::min(begin + block_size, group_max_len(w.segments[i].ids, w));
        continue;
      }
      open_from = w.segments.size();
      for (int64_t leader : w.leaders) {
        Segment seg{begin, 0, {}};
        for (int64_t r = leader; r < num_queries; ++r)
          if (w.group_of[r] == leader) seg.ids.push_back(r);
        seg.end = std::min(begin + block_size, group_max_len(seg.ids, w));
        w.segments.push_back(std::move(seg));
      }
      std::swap(w.group_of, w.previous_group_of);
    }
  }

  // BFloat16PairRow: each query's softmax numerators, 16 at a time, rounded to bfloat16 (nearest
  // even) for weighted_sum_bf16, zero past its keys; 1 / their sum in inv_sums (NaN, with zero
  // weights, when a score is NaN or infinite, as SDPA gives it).
  static void softmax_to_bf16(int64_t num_queries, int64_t stride, Work& w) {
#if PAGEDLLM_AVX512BF16
    w.weights_bf16.resize(num_queries * stride);
    for (int64_t q = 0; q < num_queries; ++q) {
      const float* x = w.scores.data() + q * stride;
      uint16_t* out = w.weights_bf16.data() + q * stride;
      const int64_t len = w.lens[q];
      __m512 max16 = _mm512_set1_ps(x[0]), check = _mm512_setzero_ps();  // x - x: 0 when finite
      for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 in = len - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - t)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(max16, in, x + t);
        max16 = _mm512_max_ps(max16, v);
        check = _mm512_add_ps(check, _mm512_sub_ps(v, v));
      }
      if (!(_mm512_reduce_add_ps(check) == 0.f)) {
        std::fill(out, out + stride, uint16_t{0});
        w.inv_sums[q] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const __m512 max_value = _mm512_set1_ps(_mm512_reduce_max_ps(max16));
      __m512 sum = _mm512_setzero_ps();
      int64_t t = 0;
      for (; t < len; t += 16) {
        const __mmask16 in = len - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - t)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(in, exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, x + t), max_value)));
        sum = _mm512_add_ps(sum, e);
        const __m256bh rounded = _mm512_cvtneps_pbh(e);
        std::memcpy(out + t, &rounded, sizeof(rounded));
      }
      std::fill(out + t, out + stride, uint16_t{0});
      w.inv_sums[q] = 1.f / _mm512_reduce_add_ps(sum);
    }
#else
    (void)num_queries, (void)stride, (void)w;
#endif
  }

  static int64_t group_max_len(const std::vector<int64_t>& ids, const Work& w) {
    int64_t len = 0;
    for (int64_t q : ids) len = std::max(len, w.lens[q]);
    return len;
  }

  // Key and value rows of a segment, read through its first query's block table (the others in
  // it hold the same blocks there); k_rows padded to a multiple of 8 with its last row.
  void segment_rows(int64_t kv_head, const Segment& seg, Work& w) const {
    const int64_t token_stride = num_kv_heads * row_bytes, block_stride = block_size * token_stride;
    const int64_t keys_at_once = std::is_same_v<Row, BFloat16PairRow> ? 16 : kLanes;
    const int64_t n = seg.end - seg.begin, padded = (n + keys_at_once - 1) / keys_at_once * keys_at_once;
    const int64_t* table = block_tables + w.seqs[seg.ids[0]] * max_blocks;
    w.k_rows.resize(padded);
    w.v_rows.resize(n);
    // segments start on a block boundary: one table lookup per block
    for (int64_t i = 0, b = seg.begin / block_size; i < n; ++b) {
      const int64_t offset = table[b] * block_stride + kv_head * row_bytes;
      for (int64_t slot = 0; slot < block_size && i < n; ++slot, ++i) {
        w.k_rows[i] = k_cache + offset + slot * token_stride;
        w.v_rows[i] = v_cache + offset + slot * token_stride;
      }
    }
    std::fill(w.k_rows.begin() + n, w.k_rows.end(), w.k_rows[n - 1]);
  }

  void score_block(const std::vector<int64_t>& ids, int64_t begin, int64_t end, Work& w, int64_t stride) const {
    const int64_t padded = static_cast<int64_t>(w.k_rows.size());
#if PAGEDLLM_AVX512BF16
    if constexpr (std::is_same_v<Row, BFloat16PairRow>) {  // 16 keys at a time, transposed once
      const __m512 scales = _mm512_set1_ps(scale);
      for (int64_t i = 0; i < std::min(padded, kPrefetchRows); ++i) prefetch_row(w.k_rows[i], row_bytes);
      w.tile.resize(head_dim * 8);
      for (int64_t t = 0; t < padded; t += 16) {
        for (int64_t i = t + kPrefetchRows; i < std::min(padded, t + kPrefetchRows + 16); ++i)
          prefetch_row(w.k_rows[i], row_bytes);
        w.query_pairs.clear();
        w.active.clear();
        for (int64_t q : ids)
          if (begin + t < w.lens[q]) {  // keys past a query's own are skipped
            w.active.push_back(q);
            w.query_pairs.push_back(reinterpret_cast<const uint32_t*>(w.queries_bf16[q]));
          }
        if (w.active.empty()) continue;
        transpose_rows16(w.k_rows.data() + t, head_dim, w.tile.data());
        const int64_t num_active = static_cast<int64_t>(w.active.size());
        for (int64_t j = 0; j < num_active; j += 4) {
          const int64_t count = std::min<int64_t>(4, num_active - j);
          const uint32_t* const* queries = w.query_pairs.data() + j;
          __m512 dots[4];
          switch (count) {
            case 1: scores16_bf16<1>(queries, w.tile.data(), head_dim / 2, dots); break;
            case 2: scores16_bf16<2>(queries, w.tile.data(), head_dim / 2, dots); break;
            case 3: scores16_bf16<3>(queries, w.tile.data(), head_dim / 2, dots); break;
            default: scores16_bf16<4>(queries, w.tile.data(), head_dim / 2, dots);
          }
          for (int64_t c = 0; c < count; ++c)
            _mm512_storeu_ps(w.scores.data() + w.active[j + c] * stride + begin + t, _mm512_mul_ps(dots[c], scales));
        }
      }
      return;
    }
#endif
    w.row_scales.resize(padded);
    for (int64_t i = 0; i < padded; ++i) w.row_scales[i] = Row::scale(w.k_rows[i], head_dim) * scale;
#if PAGEDLLM_AVX2
    const uint8_t* const* rows = w.k_rows.data();
    bool widened = false;
#if PAGEDLLM_AVX512
    if (head_dim % 64 == 0) {  // read as float32 rows, widened once for every query here
      if constexpr (!std::is_same_v<Row, FloatRow>) widen_rows<Row>(w.k_rows.data(), padded, head_dim, w.k_widened, w.k_wide);
      else w.k_wide = w.k_rows;
      rows = w.k_wide.data();
      widened = true;
    }
#endif
    for (int64_t t = 0; t < padded; t += kLanes) {
      if (!widened)
        for (int64_t i = t + kPrefetchRows; i < std::min(padded, t + kPrefetchRows + kLanes); ++i)
          prefetch_row(rows[i], Row::bytes(head_dim));
      const __m256 scales = _mm256_loadu_ps(w.row_scales.data() + t);
      for (int64_t q : ids) {
        if (begin + t >= w.lens[q]) continue;  // keys past this query's own
#if PAGEDLLM_AVX512
        const __m256 dots = widened ? dot8_avx512(w.queries[q], reinterpret_cast<const float* const*>(rows + t), head_dim)
                                    : dot8<Row>(w.queries[q], rows + t, head_dim);
#else
        const __m256 dots = dot8<Row>(w.queries[q], rows + t, head_dim);
#endif
        _mm256_storeu_ps(w.scores.data() + q * stride + begin + t, _mm256_mul_ps(dots, scales));
      }
    }
    (void)widened;
#else
    for (int64_t t = 0; t < end - begin; ++t) {
      const float* k = Row::values(w.k_rows[t], head_dim, w.row_buffer.data());
      for (int64_t q : ids)
        if (begin + t < w.lens[q]) w.scores[q * stride + begin + t] = dot(w.queries[q], k, head_dim) * w.row_scales[t];
    }
#endif
  }

  void sum_block(const std::vector<int64_t>& ids, int64_t begin, int64_t end, Work& w, int64_t stride) const {
    const int64_t n = end - begin, num = static_cast<int64_t>(ids.size());
    // 8-bit rows: their scale goes onto the weights
    if constexpr (!std::is_same_v<Row, FloatRow> && !std::is_same_v<Row, HalfWidthRow<c10::BFloat16>> &&
                  !std::is_same_v<Row, HalfWidthRow<c10::Half>> && !std::is_same_v<Row, BFloat16PairRow>) {
      for (int64_t i = 0; i < n; ++i) {
        const float v_scale = Row::scale(w.v_rows[i], head_dim);
        for (int64_t q : ids) w.scores[q * stride + begin + i] *= v_scale;
      }
    }
    w.weights.resize(num);
    w.acc_rows.resize(num);
    for (int64_t j = 0; j < num; ++j) {
      w.weights[j] = w.scores.data() + ids[j] * stride + begin;
      w.acc_rows[j] = w.accs.data() + ids[j] * head_dim;
    }
#if PAGEDLLM_AVX512BF16
    if constexpr (std::is_same_v<Row, BFloat16PairRow>) {  // begin is even: pairs start on it
      w.weight_pairs.resize(num);
      for (int64_t j = 0; j < num; ++j)
        w.weight_pairs[j] = reinterpret_cast<const uint32_t*>(w.weights_bf16.data() + ids[j] * stride + begin);
      for (int64_t j = 0; j < num; j += 4)
        weighted_sum_bf16_up_to_4(w.weight_pairs.data() + j, w.v_rows.data(), n, head_dim, std::min<int64_t>(4, num - j),
                                  w.acc_rows.data() + j);
      return;
    }
#endif
#if PAGEDLLM_AVX512
    if (head_dim % 64 == 0) {
      const bool widen = num > 4 && !std::is_same_v<Row, FloatRow>;  // several passes read them
      if (widen) widen_rows<Row>(w.v_rows.data(), n, head_dim, w.v_widened, w.v_wide);
      for (int64_t j = 0; j < num; j += 4) {
        const int64_t count = std::min<int64_t>(4, num - j);
        if (widen)
          weighted_sum_avx512_up_to_4<FloatRow>(w.weights.data() + j, w.v_wide.data(), n, head_dim, count,
                                                w.acc_rows.data() + j);
        else
          weighted_sum_avx512_up_to_4<Row>(w.weights.data() + j, w.v_rows.data(), n, head_dim, count,
                                           w.acc_rows.data() + j);
      }
      return;
    }
#endif
#if PAGEDLLM_AVX2
    for (int64_t j = 0; j < num; j += kLanes)
      weighted_sum_up_to_8<Row>(w.weights.data() + j, w.v_rows.data(), n, head_dim, std::min(kLanes, num - j),
                                w.acc_rows.data() + j);
#else
    weighted_sum_plain<Row>(w.weights.data(), w.v_rows.data(), n, head_dim, num, w.acc_rows.data(),
                            w.row_buffer.data());
#endif
  }
};

// tasks: the parts of each task, as [first, last) ranges of `parts`; one task per range and KV head.
template <typename Row>
void attend(const Attend<Row>& attend, const std::vector<Part>& parts, const std::vector<int64_t>& task_starts) {
  const int64_t num_tasks = static_cast<int64_t>(task_starts.size()) - 1;
  at::parallel_for(0, num_tasks * attend.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    typename Attend<Row>::Work work;
    for (int64_t task = begin; task < end; ++task) {
      // head-major, so each thread's share of tasks spans short and long sequences alike
      const int64_t kv_head = task / num_tasks, i = task % num_tasks;
      attend.run(kv_head, parts.data() + task_starts[i], task_starts[i + 1] - task_starts[i], work);
    }
  });
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale) {
  const auto query_type = query.scalar_type();
  TORCH_CHECK((query_type == at::kFloat || query_type == at::kBFloat16 || query_type == at::kHalf) && query.dim() == 3,
              "query: [num_tokens, num_heads, head_dim] float32, bfloat16 or float16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache: contiguous [num_blocks, block_size, num_kv_heads, row], same shape");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong,
              "block_tables, query_start_loc and seq_lens: int64");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache: [num_blocks, block_size, num_kv_heads, row] of one dtype");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(num_kv_heads > 0 && head_dim % kLanes == 0 && num_heads % num_kv_heads == 0,
              "head_dim % 8 and num_heads % num_kv_heads");
  const auto cache_type = k_cache.scalar_type();
  const bool quantized = cache_type != at::kFloat && cache_type != at::kBFloat16 && cache_type != at::kHalf;
  TORCH_CHECK(k_cache.size(3) == head_dim + (quantized ? 2 : 0),
              "k_cache rows: head_dim values, plus 2 scale bytes when 8-bit");
  const at::Tensor q = query.contiguous(), tables = block_tables.contiguous();
  const at::Tensor starts = query_start_loc.contiguous(), lens = seq_lens.contiguous();
  const int64_t num_seqs = lens.numel();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs && starts.numel() == num_seqs + 1,
              "block_tables: [num_seqs, max_blocks]; query_start_loc: [num_seqs + 1]; seq_lens: [num_seqs]");
  // Every row read must lie inside the cache: lengths within the table, block ids within the
  // cache, each sequence's query tokens within the query and its own length.
  const int64_t max_len = tables.size(1) * block_size, num_blocks = k_cache.size(0);
  const int64_t* lens_data = lens.data_ptr<int64_t>();
  const int64_t* starts_data = starts.data_ptr<int64_t>();
  const int64_t* tables_data = tables.data_ptr<int64_t>();
  TORCH_CHECK(starts_data[0] == 0 && starts_data[num_seqs] == num_tokens, "query_start_loc must run 0 .. num_tokens");
  std::vector<Part> parts;
  std::vector<int64_t> task_starts{0}, decodes;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t first = starts_data[s], rows = starts_data[s + 1] - first, len = lens_data[s];
    TORCH_CHECK(rows >= 1 && rows <= len, "sequence ", s, ": ", rows, " query tokens for ", len, " keys");
    TORCH_CHECK(len <= max_len, "seq_lens[", s, "] = ", len, " is past the block table's ", max_len, " slots");
    for (int64_t b = 0; b * block_size < len; ++b) {
      const int64_t block_id = tables_data[s * tables.size(1) + b];
      TORCH_CHECK(block_id >= 0 && block_id < num_blocks, "block_tables[", s, "][", b, "] = ", block_id,
                  " is not a block of the cache");
    }
    if (rows == 1) {
      decodes.push_back(s);
      continue;
    }
    for (int64_t r = 0; r < rows; r += kTileRows) {  // a prefill: tiles of consecutive tokens
      parts.push_back({s, first + r, std::min(kTileRows, rows - r), len - rows + r + 1});
      task_starts.push_back(static_cast<int64_t>(parts.size()));
    }
  }
  // Decodes: requests that share their first block (a cached prefix) side by side; a task takes
  // requests that share it, up to a size that leaves about 4 tasks per thread (each task reads a
  // shared prefix once); a request that shares nothing is a task of its own.
  const int64_t table_stride = tables.size(1);
  std::stable_sort(decodes.begin(), decodes.end(), [&](int64_t a, int64_t b) {
    return tables_data[a * table_stride] < tables_data[b * table_stride];
  });
  const int64_t num_decodes = static_cast<int64_t>(decodes.size());
  const int64_t max_chunk = std::max<int64_t>(1, num_decodes / (4 * at::get_num_threads()));
  for (int64_t i = 0, in_chunk = 0; i < num_decodes; ++i) {
    const int64_t seq = decodes[i];
    const bool shares = i > 0 && tables_data[seq * table_stride] == tables_data[decodes[i - 1] * table_stride];
    if (i > 0 && (!shares || in_chunk == max_chunk)) {
      task_starts.push_back(static_cast<int64_t>(parts.size()));
      in_chunk = 0;
    }
    parts.push_back({seq, starts_data[seq], 1, lens_data[seq]});
    ++in_chunk;
  }
  if (num_decodes) task_starts.push_back(static_cast<int64_t>(parts.size()));
  at::Tensor out = at::empty_like(q);
  const bool pair_rows = PAGEDLLM_AVX512BF16 && query_type == at::kBFloat16 && head_dim % 64 == 0 && block_size % 2 == 0;
  const int64_t row_bytes = k_cache.size(3) * k_cache.element_size();
  auto run = [&](auto row_kind) {
    using Row = decltype(row_kind);
    const Attend<Row> attend_tasks{q.data_ptr(),
                                   query_type,
                                   static_cast<const uint8_t*>(k_cache.data_ptr()),
                                   static_cast<const uint8_t*>(v_cache.data_ptr()),
                                   tables_data,
                                   out.data_ptr(),
                                   num_heads,
                                   num_kv_heads,
                                   head_dim,
                                   block_size,
                                   row_bytes,
                                   tables.size(1),
                                   static_cast<float>(scale)};
    attend<Row>(attend_tasks, parts, task_starts);
  };
  switch (cache_type) {
    case at::kFloat: run(FloatRow{}); break;
    case at::kBFloat16:
      if (pair_rows) run(BFloat16PairRow{});
      else run(HalfWidthRow<c10::BFloat16>{});
      break;
    case at::kHalf: run(HalfWidthRow<c10::Half>{}); break;
    case at::kChar: run(QuantizedRow<int8_t>{}); break;
    case at::kFloat8_e4m3fn: run(QuantizedRow<c10::Float8_e4m3fn>{}); break;
    case at::kFloat8_e5m2: run(QuantizedRow<c10::Float8_e5m2>{}); break;
    default: TORCH_CHECK(false, "paged_attention: no kernel for a ", cache_type, " cache");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedllm, m) {
  m.def("paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
}
