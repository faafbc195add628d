// Attention read straight from the paged KV cache, on CPU: decodes and prefill chunks alike.
//
// Every query token of a step, of every request, attends the keys of its own request up to its
// own position, all of them read from the cache where they lie (a step writes its K/V first):
// no gather, no padding, no mask. A task is one KV head and either a tile of up to 16 consecutive
// tokens of one prefill or the decodes of requests that share their first block; all the task's
// queries (tokens x the query heads sharing the KV head) share each key and value row as it is
// loaded, so a cached prefix is read once per task. The entry point validates the inputs, plans
// the tasks, and dispatches on the cache's row format (validate, plan, dispatch below). Scores go 8 keys at a time (8 independent
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
// Written in cpu_types.h's vectors (AVX-512, AVX2 or plain loops, as the build targets with
// -march=native); the cache's row formats are row_formats.h's, the loops over rows attention_rows.h's.
// Rows are prefetched a few ahead: a request's blocks lie anywhere in the cache. Into L1, or into
// L2 where prefetch_to_l2 says (the caller times which is faster on its host).
//
// Shapes: query [num_tokens, num_heads, head_dim] float32 / bfloat16 / float16 (widened as read,
// the output rounded back once), each request's tokens contiguous;
// k_cache / v_cache [num_blocks, block_size, num_kv_heads, row] with row = head_dim (float32,
// bfloat16, float16) or head_dim + 2 (int8 / fp8 values, then a float16 scale); block_tables
// [num_seqs, max_blocks], query_start_loc [num_seqs + 1] (request s has tokens
// query_start_loc[s] .. query_start_loc[s + 1]) and seq_lens [num_seqs] (its keys once this step's
// are written), int64; window (0: none) keeps each query to its last `window` keys, itself
// included (a sliding-window layer: key positions p - window < k <= p, as Hugging Face masks).
// Returns [num_tokens, num_heads, head_dim] in the query's dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "attention_rows.h"
#include "cpu_types.h"
#include "ops.h"
#include "row_formats.h"
#include "vec_math.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

using namespace pagedllm_cpu;

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
  bool prefetch_to_l2;  // rows prefetched into L2 rather than L1 (attention_rows.h's prefetch_row)
  int64_t window;  // keys a query attends, counting back from its own; 0: all

  // A run of keys that the same queries read from the same rows: one group of requests sharing
  // blocks (or one request alone) over consecutive block indices.
  struct Segment {
    int64_t begin, end;  // keys
    std::vector<int64_t> ids;  // the queries reading them
  };

  // one task's working memory, reused from task to task on a thread
  struct Work {
    std::vector<float> scores, accs, inv_sums, k_widened, v_widened, row_scales, query_floats;
    std::vector<int64_t> lens, firsts, seqs, rows, heads, group_of, previous_group_of, run_starts, leaders, leader_blocks;
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
    const int64_t stride = prepare(kv_head, parts, num_parts, w);
    for (const Segment& seg : w.segments) {
      segment_rows(kv_head, seg, w);
      score_block(seg.ids, seg.begin, w, stride);
    }
    normalize(stride, w);
    for (const Segment& seg : w.segments) {  // in key order: each query's sum continues in order
      segment_rows(kv_head, seg, w);
      sum_block(seg.ids, seg.begin, seg.end, w, stride, 0, head_dim);
    }
    write_out(w);
  }

  // Whether run_split can cut this task's output rows: by 64 values.
  bool splits() const { return head_dim % 64 == 0; }

  // run() for a task alone on the machine (one decode of a model with one KV head, say), its
  // work cut over `num_threads` with every value computed as run() computes it: the scores by
  // ranges of keys (a key's score does not depend on its neighbours), the softmax whole, the
  // weighted sums by ranges of 64 output values (each runs over the keys in order, as in run()).
  void run_split(int64_t kv_head, const Part* parts, int64_t num_parts, Work& w, int64_t num_threads) const {
    const int64_t stride = prepare(kv_head, parts, num_parts, w);
    const int64_t num_queries = static_cast<int64_t>(w.lens.size());
    const int64_t max_len = *std::max_element(w.lens.begin(), w.lens.end());
    const int64_t unit = std::lcm<int64_t>(16, block_size);  // cuts on tile and block boundaries
    const int64_t units = (max_len + unit - 1) / unit, key_chunks = std::min(num_threads, units);
    at::parallel_for(0, key_chunks, 1, [&](int64_t begin, int64_t end) {
      thread_local Work local;  // kept from call to call: a decode's attention is a few microseconds
      share_queries(w, local);
      local.scores.resize(w.scores.size());
      for (int64_t c = begin; c < end; ++c) {
        const int64_t k0 = units * c / key_chunks * unit, k1 = std::min(max_len, units * (c + 1) / key_chunks * unit);
        for (const Segment& seg : w.segments) {
          const Segment part{std::max(seg.begin, k0), std::min(seg.end, k1), seg.ids};
          if (part.begin >= part.end) continue;
          segment_rows(kv_head, part, local);
          score_block(part.ids, part.begin, local, stride);
        }
        for (int64_t q = 0; q < num_queries; ++q)
          std::copy(local.scores.begin() + q * stride + k0, local.scores.begin() + q * stride + k1,
                    w.scores.begin() + q * stride + k0);
      }
    });
    normalize(stride, w);
    const int64_t dim_units = head_dim / 64, dim_chunks = std::min(num_threads, dim_units);
    at::parallel_for(0, dim_chunks, 1, [&](int64_t begin, int64_t end) {
      thread_local Work local;
      share_queries(w, local);
      local.weights_bf16 = w.weights_bf16;
      local.accs.assign(w.accs.size(), 0.f);
      for (int64_t c = begin; c < end; ++c) {
        const int64_t d0 = dim_units * c / dim_chunks * 64, d1 = dim_units * (c + 1) / dim_chunks * 64;
        local.scores = w.scores;  // afresh: sum_block scales them by 8-bit rows' scales
        for (const Segment& seg : w.segments) {
          segment_rows(kv_head, seg, local);
          sum_block(seg.ids, seg.begin, seg.end, local, stride, d0, d1 - d0);
        }
        for (int64_t q = 0; q < num_queries; ++q)
          std::copy(local.accs.begin() + q * head_dim + d0, local.accs.begin() + q * head_dim + d1,
                    w.accs.begin() + q * head_dim + d0);
      }
    });
    write_out(w);
  }

  // What score_block and sum_block read of a task's queries, for another thread's Work.
  static void share_queries(const Work& from, Work& to) {
    to.lens = from.lens, to.firsts = from.firsts, to.seqs = from.seqs;
    to.queries = from.queries, to.queries_bf16 = from.queries_bf16;
  }

  // The task's queries, its key segments and its buffers; returns the scores' row stride.
  int64_t prepare(int64_t kv_head, const Part* parts, int64_t num_parts, Work& w) const {
    const int64_t group = num_heads / num_kv_heads;
    w.lens.clear(), w.firsts.clear(), w.seqs.clear(), w.rows.clear(), w.heads.clear(), w.queries.clear(), w.queries_bf16.clear();
    int64_t max_len = 0;
    for (int64_t p = 0; p < num_parts; ++p)
      for (int64_t r = 0; r < parts[p].num_rows; ++r)
        for (int64_t g = 0; g < group; ++g) {
          w.lens.push_back(parts[p].first_len + r);
          w.firsts.push_back(window > 0 ? std::max<int64_t>(0, w.lens.back() - window) : 0);
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
      if constexpr (Row::kIsPairs) {  // read as bfloat16, where it lies
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
    segment(max_len, w);
    return stride;
  }

  // The scores as softmax weights (1 / their sum in inv_sums), zero outside each query's window.
  void normalize(int64_t stride, Work& w) const {
    const int64_t num_queries = static_cast<int64_t>(w.lens.size());
    w.inv_sums.resize(num_queries);
    if constexpr (Row::kIsPairs) {
      softmax_to_bf16(num_queries, stride, w);
    } else {
      for (int64_t q = 0; q < num_queries; ++q) {
        float* s = w.scores.data() + q * stride;
        const int64_t first = w.firsts[q];
        w.inv_sums[q] = 1.f / softmax_numerators(s + first, w.lens[q] - first);
        std::fill(s, s + first, 0.f);  // no weight before the query's window
        std::fill(s + w.lens[q], s + stride, 0.f);  // nor past its own keys
      }
    }
  }

  // Each query's weighted sum over its inv_sums, written in the query's dtype (rounded once).
  void write_out(const Work& w) const {
    const int64_t num_queries = static_cast<int64_t>(w.lens.size());
    for (int64_t q = 0; q < num_queries; ++q) {
      const int64_t offset = (w.rows[q] * num_heads + w.heads[q]) * head_dim;
      const float* acc = w.accs.data() + q * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {
        const int64_t slot = Row::kIsPairs ? d / 64 * 64 + bf16_sum_slot(d % 64) : d;
        const float value = acc[slot] * w.inv_sums[q];
        if (query_type == at::kFloat) static_cast<float*>(out)[offset + d] = value;
        else if (query_type == at::kBFloat16) static_cast<c10::BFloat16*>(out)[offset + d] = c10::BFloat16(value);
        else static_cast<c10::Half*>(out)[offset + d] = c10::Half(value);
      }
    }
  }

  // Cuts the task's keys into segments: at each block index, the queries that attend keys there
  // and whose requests hold the same physical block there form a group; consecutive block indices with the same groups make
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
        int64_t last = run_end;  // queries whose window starts past this block drop out
        while (last > first && w.firsts[last - 1] >= begin + block_size) --last;
        if (first == last) continue;
        const int64_t block = block_tables[w.seqs[first] * max_blocks + b];
        const auto index = std::find(w.leader_blocks.begin(), w.leader_blocks.end(), block) - w.leader_blocks.begin();
        if (index == static_cast<int64_t>(w.leader_blocks.size())) {
          w.leader_blocks.push_back(block);
          w.leaders.push_back(first);
        }
        const int64_t leader = w.leaders[index];
        for (int64_t r = first; r < last; ++r) w.group_of[r] = leader;
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
  // even) for weighted_sum_bf16, zero outside its window; 1 / their sum in inv_sums (NaN, with zero
  // weights, when a score is NaN or infinite, as SDPA gives it).
  static void softmax_to_bf16(int64_t num_queries, int64_t stride, Work& w) {
    using V = FloatVec16;
    w.weights_bf16.resize(num_queries * stride);
    for (int64_t q = 0; q < num_queries; ++q) {
      const int64_t first = w.firsts[q], len = w.lens[q] - first;
      const float* x = w.scores.data() + q * stride + first;
      uint16_t* const row = w.weights_bf16.data() + q * stride;
      std::fill(row, row + first, uint16_t{0});
      uint16_t* out = row + first;
      V max16 = V::broadcast(x[0]), check = V::zero();  // x - x: 0 when finite
      for (int64_t t = 0; t < len; t += 16) {
        const V v = V::load_first(x + t, len - t, max16);
        max16 = V::max(max16, v);
        check = V::add(check, V::sub(v, v));
      }
      if (!(check.reduce_add() == 0.f)) {
        std::fill(out, row + stride, uint16_t{0});
        w.inv_sums[q] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const V max_value = V::broadcast(max16.reduce_max());
      V sum = V::zero();
      int64_t t = 0;
      for (; t < len; t += 16) {
        const V e = exp_nonpositive(V::sub(V::load_first(x + t, len - t, V::zero()), max_value)).keep_first(len - t);
        sum = V::add(sum, e);
        Row::Pairs::store_rounded(out + t, e);
      }
      std::fill(out + t, row + stride, uint16_t{0});
      w.inv_sums[q] = 1.f / sum.reduce_add();
    }
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
    const int64_t keys_at_once = Row::kIsPairs ? 16 : kLanes;
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

  void score_block(const std::vector<int64_t>& ids, int64_t begin, Work& w, int64_t stride) const {
    if constexpr (Row::kIsPairs) score_tiles(ids, begin, w, stride);
    else score_rows(ids, begin, w, stride);
  }

  // 8 keys at a time: dot8, or dot8_wide on rows widened to float32 once for every query here
  void score_rows(const std::vector<int64_t>& ids, int64_t begin, Work& w, int64_t stride) const {
    const int64_t padded = static_cast<int64_t>(w.k_rows.size());
    w.row_scales.resize(padded);
    for (int64_t i = 0; i < padded; ++i) w.row_scales[i] = Row::scale(w.k_rows[i], head_dim) * scale;
    const bool widened = kHasAvx512 && head_dim % 64 == 0;
    if (widened) {
      if constexpr (Row::kIsFloat32) w.k_wide = w.k_rows;
      else widen_rows<Row>(w.k_rows.data(), padded, head_dim, w.k_widened, w.k_wide, prefetch_to_l2);
    }
    const uint8_t* const* rows = widened ? w.k_wide.data() : w.k_rows.data();
    for (int64_t t = 0; t < padded; t += kLanes) {
      if (!widened)
        for (int64_t i = t + kPrefetchRows; i < std::min(padded, t + kPrefetchRows + kLanes); ++i)
          prefetch_row(rows[i], Row::bytes(head_dim), prefetch_to_l2);
      const FloatVec8 scales = FloatVec8::load(w.row_scales.data() + t);
      for (int64_t q : ids) {
        if (begin + t >= w.lens[q] || begin + t + kLanes <= w.firsts[q]) continue;  // outside its window
        const FloatVec8 dots = widened ? dot8_wide(w.queries[q], reinterpret_cast<const float* const*>(rows + t), head_dim)
                                       : dot8<Row>(w.queries[q], rows + t, head_dim);
        FloatVec8::mul(dots, scales).store(w.scores.data() + q * stride + begin + t);
      }
    }
  }

  // BFloat16PairRow: 16 keys at a time, transposed once
  void score_tiles(const std::vector<int64_t>& ids, int64_t begin, Work& w, int64_t stride) const {
    using Pairs = typename Row::Pairs;
    const int64_t padded = static_cast<int64_t>(w.k_rows.size());
    const FloatVec16 scales = FloatVec16::broadcast(scale);
    for (int64_t i = 0; i < std::min(padded, kPrefetchRows); ++i) prefetch_row(w.k_rows[i], row_bytes, prefetch_to_l2);
    w.tile.resize(head_dim * 8);
    for (int64_t t = 0; t < padded; t += 16) {
      for (int64_t i = t + kPrefetchRows; i < std::min(padded, t + kPrefetchRows + 16); ++i)
        prefetch_row(w.k_rows[i], row_bytes, prefetch_to_l2);
      w.query_pairs.clear();
      w.active.clear();
      for (int64_t q : ids)
        if (begin + t < w.lens[q] && begin + t + 16 > w.firsts[q]) {  // keys outside its window are skipped
          w.active.push_back(q);
          w.query_pairs.push_back(reinterpret_cast<const uint32_t*>(w.queries_bf16[q]));
        }
      if (w.active.empty()) continue;
      transpose_rows16<Pairs>(w.k_rows.data() + t, head_dim, w.tile.data());
      const int64_t num_active = static_cast<int64_t>(w.active.size());
      for (int64_t j = 0; j < num_active; j += 4) {
        const int64_t count = std::min<int64_t>(4, num_active - j);
        const uint32_t* const* queries = w.query_pairs.data() + j;
        FloatVec16 dots[4];
        switch (count) {
          case 1: scores16_bf16<Pairs, 1>(queries, w.tile.data(), head_dim / 2, dots); break;
          case 2: scores16_bf16<Pairs, 2>(queries, w.tile.data(), head_dim / 2, dots); break;
          case 3: scores16_bf16<Pairs, 3>(queries, w.tile.data(), head_dim / 2, dots); break;
          default: scores16_bf16<Pairs, 4>(queries, w.tile.data(), head_dim / 2, dots);
        }
        for (int64_t c = 0; c < count; ++c)
          FloatVec16::mul(dots[c], scales).store(w.scores.data() + w.active[j + c] * stride + begin + t);
      }
    }
  }

  // The weighted sums of output values d0 .. d0 + dims (the whole row: 0, head_dim; a cut of it:
  // multiples of 64) over this segment's keys.
  void sum_block(const std::vector<int64_t>& ids, int64_t begin, int64_t end, Work& w, int64_t stride, int64_t d0,
                 int64_t dims) const {
    const int64_t n = end - begin, num = static_cast<int64_t>(ids.size());
    if constexpr (Row::kIsScaled) {  // 8-bit rows: their scale goes onto the weights
      for (int64_t i = 0; i < n; ++i) {
        const float v_scale = Row::scale(w.v_rows[i], head_dim);
        for (int64_t q : ids) w.scores[q * stride + begin + i] *= v_scale;
      }
    }
    if (d0 > 0)
      for (const uint8_t*& row : w.v_rows) row += Row::offset(d0);
    w.weights.resize(num);
    w.acc_rows.resize(num);
    for (int64_t j = 0; j < num; ++j) {
      w.weights[j] = w.scores.data() + ids[j] * stride + begin;
      w.acc_rows[j] = w.accs.data() + ids[j] * head_dim + d0;
    }
    if constexpr (Row::kIsPairs) {  // begin is even: pairs start on it
      w.weight_pairs.resize(num);
      for (int64_t j = 0; j < num; ++j)
        w.weight_pairs[j] = reinterpret_cast<const uint32_t*>(w.weights_bf16.data() + ids[j] * stride + begin);
      for (int64_t j = 0; j < num; j += 4)
        weighted_sum_bf16_up_to_4<typename Row::Pairs>(w.weight_pairs.data() + j, w.v_rows.data(), n, dims,
                                                       std::min<int64_t>(4, num - j), w.acc_rows.data() + j,
                                                       prefetch_to_l2);
    } else if (kHasAvx512 && head_dim % 64 == 0) {
      const bool widen = num > 4 && !Row::kIsFloat32;  // several passes read them
      if (widen) widen_rows<Row>(w.v_rows.data(), n, dims, w.v_widened, w.v_wide, prefetch_to_l2);
      for (int64_t j = 0; j < num; j += 4) {
        const int64_t count = std::min<int64_t>(4, num - j);
        if (widen)
          weighted_sum_wide_up_to_4<FloatRow>(w.weights.data() + j, w.v_wide.data(), n, dims, count,
                                              w.acc_rows.data() + j, prefetch_to_l2);
        else
          weighted_sum_wide_up_to_4<Row>(w.weights.data() + j, w.v_rows.data(), n, dims, count,
                                         w.acc_rows.data() + j, prefetch_to_l2);
      }
    } else {
      for (int64_t j = 0; j < num; j += kLanes)
        weighted_sum_up_to_8<Row>(w.weights.data() + j, w.v_rows.data(), n, dims, std::min(kLanes, num - j),
                                  w.acc_rows.data() + j, prefetch_to_l2);
    }
  }
};

// tasks: the parts of each task, as [first, last) ranges of `parts`; one task per range and KV head.
// Fewer tasks than threads, all decodes (one request on a model with one KV head): each task in
// turn, cut over the threads, where its rows allow; the values are the same either way.
template <typename Row>
void attend(const Attend<Row>& attend, const std::vector<Part>& parts, const std::vector<int64_t>& task_starts) {
  const int64_t num_tasks = static_cast<int64_t>(task_starts.size()) - 1, num_threads = at::get_num_threads();
  const bool all_decodes = std::all_of(parts.begin(), parts.end(), [](const Part& part) { return part.num_rows == 1; });
  if (num_tasks * attend.num_kv_heads < num_threads && all_decodes && attend.splits()) {
    thread_local typename Attend<Row>::Work work;  // a lone decode's: small, kept from call to call
    for (int64_t task = 0; task < num_tasks * attend.num_kv_heads; ++task) {
      const int64_t kv_head = task / num_tasks, i = task % num_tasks;
      attend.run_split(kv_head, parts.data() + task_starts[i], task_starts[i + 1] - task_starts[i], work, num_threads);
    }
    return;
  }
  at::parallel_for(0, num_tasks * attend.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    typename Attend<Row>::Work work;
    for (int64_t task = begin; task < end; ++task) {
      // head-major, so each thread's share of tasks spans short and long sequences alike
      const int64_t kv_head = task / num_tasks, i = task % num_tasks;
      attend.run(kv_head, parts.data() + task_starts[i], task_starts[i + 1] - task_starts[i], work);
    }
  });
}

// BFloat16PairRow where this build has AVX512-BF16 (elsewhere pair_rows is false and this unused).
using PairRowWhereBuilt = std::conditional_t<kHasAvx512Bf16, BFloat16PairRow, UnscaledRow<c10::BFloat16>>;

// The step's shapes, once its inputs are checked.
struct Shapes {
  int64_t num_tokens, num_heads, head_dim, num_kv_heads, block_size, num_seqs;
};

// Validate: dtypes, shapes, and that every row the kernel will read lies inside the cache (lengths
// within the table, block ids within the cache, each sequence's query tokens within the query and
// within its own length). The tensors are contiguous (the caller's copies).
Shapes validate(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                const at::Tensor& starts, const at::Tensor& lens, int64_t window) {
  const auto query_type = query.scalar_type();
  TORCH_CHECK((query_type == at::kFloat || query_type == at::kBFloat16 || query_type == at::kHalf) && query.dim() == 3,
              "query: [num_tokens, num_heads, head_dim] float32, bfloat16 or float16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache: contiguous [num_blocks, block_size, num_kv_heads, row], same shape");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && starts.scalar_type() == at::kLong,
              "block_tables, query_start_loc and seq_lens: int64");
  TORCH_CHECK(window >= 0, "window: 0 (none) or the keys a query attends");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache: [num_blocks, block_size, num_kv_heads, row] of one dtype");
  const Shapes shapes{query.size(0), query.size(1), query.size(2), k_cache.size(2), k_cache.size(1), lens.numel()};
  TORCH_CHECK(shapes.num_kv_heads > 0 && shapes.head_dim % kLanes == 0 && shapes.num_heads % shapes.num_kv_heads == 0,
              "head_dim % 8 and num_heads % num_kv_heads");
  const auto cache_type = k_cache.scalar_type();
  const bool quantized = cache_type != at::kFloat && cache_type != at::kBFloat16 && cache_type != at::kHalf;
  TORCH_CHECK(k_cache.size(3) == shapes.head_dim + (quantized ? 2 : 0),
              "k_cache rows: head_dim values, plus 2 scale bytes when 8-bit");
  const int64_t num_seqs = shapes.num_seqs;
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs && starts.numel() == num_seqs + 1,
              "block_tables: [num_seqs, max_blocks]; query_start_loc: [num_seqs + 1]; seq_lens: [num_seqs]");
  const int64_t max_len = tables.size(1) * shapes.block_size, num_blocks = k_cache.size(0);
  const int64_t* lens_data = lens.data_ptr<int64_t>();
  const int64_t* starts_data = starts.data_ptr<int64_t>();
  const int64_t* tables_data = tables.data_ptr<int64_t>();
  TORCH_CHECK(starts_data[0] == 0 && starts_data[num_seqs] == shapes.num_tokens,
              "query_start_loc must run 0 .. num_tokens");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = starts_data[s + 1] - starts_data[s], len = lens_data[s];
    TORCH_CHECK(rows >= 1 && rows <= len, "sequence ", s, ": ", rows, " query tokens for ", len, " keys");
    TORCH_CHECK(len <= max_len, "seq_lens[", s, "] = ", len, " is past the block table's ", max_len, " slots");
    for (int64_t b = 0; b * shapes.block_size < len; ++b) {
      const int64_t block_id = tables_data[s * tables.size(1) + b];
      TORCH_CHECK(block_id >= 0 && block_id < num_blocks, "block_tables[", s, "][", b, "] = ", block_id,
                  " is not a block of the cache");
    }
  }
  return shapes;
}

// The step's parts and its tasks ([first, last) ranges of parts), for attend().
struct Plan {
  std::vector<Part> parts;
  std::vector<int64_t> task_starts{0};
};

// Plan: a prefill is cut into tiles of kTileRows consecutive tokens, a task each. Decodes that
// share their first block (a cached prefix) go side by side; a task takes such requests up to a
// size that leaves about 4 tasks per thread (each task reads a shared prefix once); a request that
// shares nothing is a task of its own.
Plan plan(const at::Tensor& tables, const at::Tensor& starts, const at::Tensor& lens) {
  const int64_t num_seqs = lens.numel(), table_stride = tables.size(1);
  const int64_t* lens_data = lens.data_ptr<int64_t>();
  const int64_t* starts_data = starts.data_ptr<int64_t>();
  const int64_t* tables_data = tables.data_ptr<int64_t>();
  Plan plan;
  std::vector<int64_t> decodes;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t first = starts_data[s], rows = starts_data[s + 1] - first, len = lens_data[s];
    if (rows == 1) {
      decodes.push_back(s);
      continue;
    }
    for (int64_t r = 0; r < rows; r += kTileRows) {
      plan.parts.push_back({s, first + r, std::min(kTileRows, rows - r), len - rows + r + 1});
      plan.task_starts.push_back(static_cast<int64_t>(plan.parts.size()));
    }
  }
  std::stable_sort(decodes.begin(), decodes.end(), [&](int64_t a, int64_t b) {
    return tables_data[a * table_stride] < tables_data[b * table_stride];
  });
  const int64_t num_decodes = static_cast<int64_t>(decodes.size());
  const int64_t max_chunk = std::max<int64_t>(1, num_decodes / (4 * at::get_num_threads()));
  for (int64_t i = 0, in_chunk = 0; i < num_decodes; ++i) {
    const int64_t seq = decodes[i];
    const bool shares = i > 0 && tables_data[seq * table_stride] == tables_data[decodes[i - 1] * table_stride];
    if (i > 0 && (!shares || in_chunk == max_chunk)) {
      plan.task_starts.push_back(static_cast<int64_t>(plan.parts.size()));
      in_chunk = 0;
    }
    plan.parts.push_back({seq, starts_data[seq], 1, lens_data[seq]});
    ++in_chunk;
  }
  if (num_decodes) plan.task_starts.push_back(static_cast<int64_t>(plan.parts.size()));
  return plan;
}

// BFloat16PairRow where this build has AVX512-BF16 (elsewhere pair_rows is false and this unused).
using PairRowWhereBuilt = std::conditional_t<kHasAvx512Bf16, BFloat16PairRow, UnscaledRow<c10::BFloat16>>;

// Dispatch: the row format of the cache (and, for bfloat16 on AVX512-BF16, the paired rows) picks
// the instantiation of attend() that runs the plan.
void dispatch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
              const Shapes& shapes, const Plan& plan, double scale, bool prefetch_to_l2, int64_t window,
              at::Tensor& out) {
  const auto query_type = q.scalar_type();
  const bool pair_rows = kHasAvx512Bf16 && query_type == at::kBFloat16 && shapes.head_dim % 64 == 0 &&
                         shapes.block_size % 2 == 0;
  const int64_t row_bytes = k_cache.size(3) * k_cache.element_size();
  auto run = [&](auto row_kind) {
    using Row = decltype(row_kind);
    const Attend<Row> attend_tasks{q.data_ptr(),
                                   query_type,
                                   static_cast<const uint8_t*>(k_cache.data_ptr()),
                                   static_cast<const uint8_t*>(v_cache.data_ptr()),
                                   tables.data_ptr<int64_t>(),
                                   out.data_ptr(),
                                   shapes.num_heads,
                                   shapes.num_kv_heads,
                                   shapes.head_dim,
                                   shapes.block_size,
                                   row_bytes,
                                   tables.size(1),
                                   static_cast<float>(scale),
                                   prefetch_to_l2,
                                   window};
    attend<Row>(attend_tasks, plan.parts, plan.task_starts);
  };
  const auto cache_type = k_cache.scalar_type();
  switch (cache_type) {
    case at::kFloat: run(FloatRow{}); break;
    case at::kBFloat16:
      if (pair_rows) run(PairRowWhereBuilt{});
      else run(UnscaledRow<c10::BFloat16>{});
      break;
    case at::kHalf: run(UnscaledRow<c10::Half>{}); break;
    case at::kChar: run(Int8Row{}); break;
    case at::kFloat8_e4m3fn: run(Float8Row<c10::Float8_e4m3fn>{}); break;
    case at::kFloat8_e5m2: run(Float8Row<c10::Float8_e5m2>{}); break;
    default: TORCH_CHECK(false, "paged_attention: no kernel for a ", cache_type, " cache");
  }
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, bool prefetch_to_l2, int64_t window) {
  const at::Tensor q = query.contiguous(), tables = block_tables.contiguous();
  const at::Tensor starts = query_start_loc.contiguous(), lens = seq_lens.contiguous();
  const Shapes shapes = validate(q, k_cache, v_cache, tables, starts, lens, window);
  at::Tensor out = at::empty_like(q);
  dispatch(q, k_cache, v_cache, tables, shapes, plan(tables, starts, lens), scale, prefetch_to_l2, window, out);
  return out;
}

}  // namespace

at::Tensor pagedllm_ops::paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                         const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                         const at::Tensor& seq_lens, double scale, bool prefetch_to_l2, int64_t window) {
  require_cpu("paged_attention", {query, k_cache, v_cache, block_tables, query_start_loc, seq_lens});
  return ::paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, prefetch_to_l2,
                           window);
}

TORCH_LIBRARY(pagedllm, m) {
  m.def("paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, bool prefetch_to_l2=False, int window=0) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
}
