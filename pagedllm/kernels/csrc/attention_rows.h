// The paged attention kernel's inner loops over cache rows (paged_attention_cpu.cpp): scores of
// queries against 8 or 16 keys, softmax numerators, and weighted sums of value rows, for any row
// format of row_formats.h. Each query's sum runs in an order fixed by the code, never by which
// other queries or keys share the call: a token's output does not depend on how a step is split.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_types.h"
#include "vec_math.h"

namespace pagedllm_cpu {
// Internal linkage, as when these loops lived in paged_attention_cpu.cpp (their one includer):
// GCC then inlines them as it did there (with external linkage it kept several out of line).
namespace {

constexpr int64_t kLanes = FloatVec8::kLanes;  // head_dim is a multiple of it
constexpr int64_t kPrefetchRows = 48;  // how far ahead rows are fetched: a request's blocks lie
                                       // anywhere in the cache, so the hardware cannot guess them

// Ask for a cache row (up to 256 bytes: 64 bfloat16 or float32 values) before it is needed: into
// L1 (prefetcht0) or, to_l2, into L2 (prefetcht1). Which reads a step's scattered rows faster
// differs by host, so the caller times it (attention/row_prefetch.py); the results are the same
// either way.
inline void prefetch_row(const uint8_t* row, int64_t row_bytes, bool to_l2) {
  for (int64_t offset = 0; offset < row_bytes; offset += 64) {
    if (to_l2) __builtin_prefetch(row + offset, 0, 2);
    else __builtin_prefetch(row + offset, 0, 3);
  }
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

// q . rows[i] for 8 rows at once: eight independent multiply-add chains, then one
// transpose-and-add that leaves row i's sum in lane i (no horizontal sum per row). Every row's
// sum takes the same path whatever its lane, so a score does not depend on which 8 keys it was
// computed with: that is what makes a row's output independent of how a step is split.
template <typename Row>
inline FloatVec8 dot8(const float* q, const uint8_t* const* rows, int64_t head_dim) {
  FloatVec8 acc[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) acc[i] = FloatVec8::zero();
  for (int64_t d = 0; d < head_dim; d += kLanes) {
    const FloatVec8 q8 = FloatVec8::load(q + d);
    for (int64_t i = 0; i < kLanes; ++i) acc[i] = FloatVec8::fma(q8, Row::load8(rows[i], d), acc[i]);
  }
  return FloatVec8::sum_each(acc);
}

// acc[g] += sum_t weights[g][t] * rows[t] for Group queries, 8 output floats at a time with the
// Group accumulators in registers: each row chunk is loaded once for all of them. A query's sum
// runs over t in order, continuing from what acc holds, whatever Group is and however its keys
// are cut into calls: so it does not depend on the queries it was grouped with.
template <typename Row, int64_t Group>
void weighted_sum(const float* const* weights, const uint8_t* const* rows, int64_t len, int64_t head_dim,
                  float* const* acc_rows, bool to_l2) {
  for (int64_t d = 0; d < head_dim; d += kLanes) {
    FloatVec8 acc[Group];
    for (int64_t g = 0; g < Group; ++g) acc[g] = FloatVec8::load(acc_rows[g] + d);
    for (int64_t t = 0; t < len; ++t) {
      if (d == 0 && t + kPrefetchRows < len) prefetch_row(rows[t + kPrefetchRows], Row::bytes(head_dim), to_l2);
      const FloatVec8 x = Row::load8(rows[t], d);
      for (int64_t g = 0; g < Group; ++g) acc[g] = FloatVec8::fma(FloatVec8::broadcast(weights[g][t]), x, acc[g]);
    }
    for (int64_t g = 0; g < Group; ++g) acc[g].store(acc_rows[g] + d);
  }
}

template <typename Row>
void weighted_sum_up_to_8(const float* const* weights, const uint8_t* const* rows, int64_t len, int64_t head_dim,
                          int64_t group, float* const* acc_rows, bool to_l2) {
  switch (group) {
    case 1: weighted_sum<Row, 1>(weights, rows, len, head_dim, acc_rows, to_l2); break;
    case 2: weighted_sum<Row, 2>(weights, rows, len, head_dim, acc_rows, to_l2); break;
    case 3: weighted_sum<Row, 3>(weights, rows, len, head_dim, acc_rows, to_l2); break;
    case 4: weighted_sum<Row, 4>(weights, rows, len, head_dim, acc_rows, to_l2); break;
    case 5: weighted_sum<Row, 5>(weights, rows, len, head_dim, acc_rows, to_l2); break;
    case 6: weighted_sum<Row, 6>(weights, rows, len, head_dim, acc_rows, to_l2); break;
    case 7: weighted_sum<Row, 7>(weights, rows, len, head_dim, acc_rows, to_l2); break;
    default: weighted_sum<Row, 8>(weights, rows, len, head_dim, acc_rows, to_l2);
  }
}

// 16 lanes (AVX-512), where head_dim is a multiple of 64 (this CPU has it and the model allows
// it). Rows that are not float32 are first widened into float32 buffers, once per task, so the
// queries that share them read plain floats (and the multiply-adds take them straight from memory).

// q . rows[i] for 8 float32 rows: 16 floats per multiply-add, each row's lanes folded to 8 and
// then summed by the same transpose-and-add as dot8: every row's sum takes the same path.
inline FloatVec8 dot8_wide(const float* q, const float* const* rows, int64_t head_dim) {
  FloatVec16 acc[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) acc[i] = FloatVec16::zero();
  for (int64_t d = 0; d < head_dim; d += 16) {
    const FloatVec16 q16 = FloatVec16::load(q + d);
    for (int64_t i = 0; i < kLanes; ++i) acc[i] = FloatVec16::fma(q16, FloatVec16::load(rows[i] + d), acc[i]);
  }
  FloatVec8 folded[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) folded[i] = fold8(acc[i]);
  return FloatVec8::sum_each(folded);
}

// acc[g] += sum_t weights[g][t] * rows[t] for Group <= 4 queries, 64 output floats at a time with
// 4 x Group accumulators in registers; each query's sum runs over t in order, from what acc holds.
// Rows are read through Row (widened as loaded), or as float32 rows already widened.
template <typename Row, int64_t Group>
void weighted_sum_wide(const float* const* weights, const uint8_t* const* rows, int64_t len, int64_t head_dim,
                       float* const* acc_rows, bool to_l2) {
  for (int64_t d = 0; d < head_dim; d += 64) {
    FloatVec16 acc[Group][4];
    for (int64_t g = 0; g < Group; ++g)
      for (int64_t c = 0; c < 4; ++c) acc[g][c] = FloatVec16::load(acc_rows[g] + d + 16 * c);
    for (int64_t t = 0; t < len; ++t) {
      if (d == 0 && t + kPrefetchRows < len) prefetch_row(rows[t + kPrefetchRows], Row::bytes(head_dim), to_l2);
      FloatVec16 x[4];
      for (int64_t c = 0; c < 4; ++c) x[c] = Row::load16(rows[t], d + 16 * c);
      for (int64_t g = 0; g < Group; ++g) {
        const FloatVec16 w = FloatVec16::broadcast(weights[g][t]);
        for (int64_t c = 0; c < 4; ++c) acc[g][c] = FloatVec16::fma(w, x[c], acc[g][c]);
      }
    }
    for (int64_t g = 0; g < Group; ++g)
      for (int64_t c = 0; c < 4; ++c) acc[g][c].store(acc_rows[g] + d + 16 * c);
  }
}

template <typename Row>
void weighted_sum_wide_up_to_4(const float* const* weights, const uint8_t* const* rows, int64_t len,
                               int64_t head_dim, int64_t group, float* const* acc_rows, bool to_l2) {
  switch (group) {
    case 1: weighted_sum_wide<Row, 1>(weights, rows, len, head_dim, acc_rows, to_l2); break;
    case 2: weighted_sum_wide<Row, 2>(weights, rows, len, head_dim, acc_rows, to_l2); break;
    case 3: weighted_sum_wide<Row, 3>(weights, rows, len, head_dim, acc_rows, to_l2); break;
    default: weighted_sum_wide<Row, 4>(weights, rows, len, head_dim, acc_rows, to_l2);
  }
}

// Widen n rows into `buffer` (n x head_dim float32) and point `out` at them.
template <typename Row>
void widen_rows(const uint8_t* const* rows, int64_t n, int64_t head_dim, std::vector<float>& buffer,
                std::vector<const uint8_t*>& out, bool to_l2) {
  buffer.resize(n * head_dim);
  out.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    if (i + kPrefetchRows < n) prefetch_row(rows[i + kPrefetchRows], Row::bytes(head_dim), to_l2);
    float* dst = buffer.data() + i * head_dim;
    for (int64_t d = 0; d < head_dim; d += 16) Row::load16(rows[i], d).store(dst + d);
    out[i] = reinterpret_cast<const uint8_t*>(dst);
  }
}

// BFloat16PairRow's kernels, on Pairs (Bf16PairVec): templates, so that only AVX512-BF16 builds,
// where that row format is chosen, instantiate them.

// 16 bfloat16 rows as pairs, key-minor: tile[p * 16 + k] holds values 2p and 2p + 1 of row k, so
// one load gives a pair of dimensions for 16 keys, and scores need no sum across lanes.
template <typename Pairs>
inline void transpose_rows16(const uint8_t* const* rows, int64_t head_dim, uint32_t* tile) {
  for (int64_t c = 0; c < head_dim / 32; ++c) {
    Pairs r[16];
    for (int i = 0; i < 16; ++i) r[i] = Pairs::load(rows[i] + 64 * c);
    Pairs::transpose16(r);
    for (int i = 0; i < 16; ++i) r[i].store(tile + (16 * c + i) * 16);
  }
}

// Scores of Q bfloat16 queries against 16 keys (a transposed tile), one key per lane: the
// query's pair p broadcast, one dpbf16ps per pair into 4 chains (p mod 4), summed as
// (c0 + c1) + (c2 + c3). Each (query, key) score is the same whatever Q, lane or tile it is in.
template <typename Pairs, int Q>
inline void scores16_bf16(const uint32_t* const* query_pairs, const uint32_t* tile, int64_t num_pairs, FloatVec16* out) {
  FloatVec16 acc[Q][4];
  for (int j = 0; j < Q; ++j)
    for (int c = 0; c < 4; ++c) acc[j][c] = FloatVec16::zero();
  for (int64_t p = 0; p < num_pairs; p += 4) {
    for (int c = 0; c < 4; ++c) {
      const Pairs k = Pairs::load(tile + (p + c) * 16);
      for (int j = 0; j < Q; ++j) acc[j][c] = Pairs::dot(acc[j][c], Pairs::broadcast(query_pairs[j][p + c]), k);
    }
  }
  for (int j = 0; j < Q; ++j)
    out[j] = FloatVec16::add(FloatVec16::add(acc[j][0], acc[j][1]), FloatVec16::add(acc[j][2], acc[j][3]));
}

// acc[g] += sum_t weights[g][t] * rows[t] for Group <= 4 queries, rows taken in pairs (t, t + 1):
// their values interleaved, the pair's two bfloat16 weights broadcast, one dpbf16ps per 16
// outputs. An odd len's last row pairs with a row of zeros (its weight is 0 too: the weights past
// a query's keys are), so nothing of another row enters, not even 0 x inf. 64 outputs at a time,
// 4 x Group accumulators in registers, kept in the interleaved order: output d of a 64-block sits
// at bf16_sum_slot(d) (put back at the end).
alignas(64) constexpr uint8_t kZeroRow[128] = {};  // 64 bfloat16 zeros

template <typename Pairs, int64_t Group>
void weighted_sum_bf16(const uint32_t* const* weight_pairs, const uint8_t* const* rows, int64_t len,
                       int64_t head_dim, float* const* acc_rows, bool to_l2) {
  for (int64_t t = 0; t < std::min(len, kPrefetchRows); ++t) prefetch_row(rows[t], 2 * head_dim, to_l2);
  for (int64_t d = 0; d < head_dim; d += 64) {
    FloatVec16 acc[Group][4];
    for (int64_t g = 0; g < Group; ++g)
      for (int64_t c = 0; c < 4; ++c) acc[g][c] = FloatVec16::load(acc_rows[g] + d + 16 * c);
    for (int64_t t = 0; t < len; t += 2) {
      if (t + kPrefetchRows < len) {
        prefetch_row(rows[t + kPrefetchRows] + 2 * d, 128, to_l2);
        prefetch_row(rows[t + kPrefetchRows + 1 < len ? t + kPrefetchRows + 1 : t + kPrefetchRows] + 2 * d, 128, to_l2);
      }
      const uint8_t* a = rows[t] + 2 * d;
      const uint8_t* b = t + 1 < len ? rows[t + 1] + 2 * d : kZeroRow;
      const Pairs a0 = Pairs::load(a), a1 = Pairs::load(a + 64);
      const Pairs b0 = Pairs::load(b), b1 = Pairs::load(b + 64);
      const Pairs x[4] = {Pairs::interleave_low(a0, b0), Pairs::interleave_high(a0, b0), Pairs::interleave_low(a1, b1),
                          Pairs::interleave_high(a1, b1)};
      for (int64_t g = 0; g < Group; ++g) {
        const Pairs w = Pairs::broadcast(weight_pairs[g][t / 2]);
        for (int64_t c = 0; c < 4; ++c) acc[g][c] = Pairs::dot(acc[g][c], w, x[c]);
      }
    }
    for (int64_t g = 0; g < Group; ++g)
      for (int64_t c = 0; c < 4; ++c) acc[g][c].store(acc_rows[g] + d + 16 * c);
  }
}

template <typename Pairs>
void weighted_sum_bf16_up_to_4(const uint32_t* const* weight_pairs, const uint8_t* const* rows, int64_t len,
                               int64_t head_dim, int64_t group, float* const* acc_rows, bool to_l2) {
  switch (group) {
    case 1: weighted_sum_bf16<Pairs, 1>(weight_pairs, rows, len, head_dim, acc_rows, to_l2); break;
    case 2: weighted_sum_bf16<Pairs, 2>(weight_pairs, rows, len, head_dim, acc_rows, to_l2); break;
    case 3: weighted_sum_bf16<Pairs, 3>(weight_pairs, rows, len, head_dim, acc_rows, to_l2); break;
    default: weighted_sum_bf16<Pairs, 4>(weight_pairs, rows, len, head_dim, acc_rows, to_l2);
  }
}

// Where weighted_sum_bf16 keeps output d (0..63) of a 64-block: unpacklo/hi_epi16 interleave the
// 4 low / 4 high values of each 8-value lane, so accumulator c holds, in slot k, output
// 32 (c / 2) + 8 (k / 4) + 4 (c % 2) + k % 4.
inline int64_t bf16_sum_slot(int64_t d) {
  const int64_t within = d % 32, c = (d / 32) * 2 + (within % 8) / 4, k = (within / 8) * 4 + within % 4;
  return 16 * c + k;
}

}  // namespace
}  // namespace pagedllm_cpu
