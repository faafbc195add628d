// LoRA adapters' low-rank products added to a projection's output, every adapter of a step in one
// call (lora/layers.py: punica's shrink and expand, the CPU way).
//
// lora_add_(out [T, O], x [T, I], a [S, P * R, I], b [S, NB, R, 32], groups [G, 3] int64 (slot,
// first row, end row), ranks [S] int64, part_offsets [P + 1] int64) -> out, where for each group
// of slot s and rank r = ranks[s], and each part p of the projection (q, k, v of a fused qkv:
// output rows part_offsets[p] .. part_offsets[p + 1]):
//
//   shrink   t[row, p R + j] = x[row] . a[s, p R + j]                     j < r
//   expand   out[row, o] += sum over j < r of t[row, p R + j] B[s, j, o]   o in part p
//
// B is held in blocks of 32 outputs, rank rows within a block (cpu_ops.lora_output_blocks: each
// part's outputs from its own first block, its last block padded with zeros): an expand item
// reads one block, R x 32 values in a row of memory, and takes r vector multiply-adds a row of x,
// no horizontal sums. A step's adapters are read once each: the shrink over the rows of A (every
// row of a group at once), the expand over the blocks, each in one parallel region for all
// groups, so a call costs two regions whatever the number of adapters. The adapters stream from
// memory in pieces of a few KB a thread, too short for the hardware's prefetchers to ramp up on:
// the kernel asks for what it reads next itself. Products are summed in float32 and out is
// rounded once. x, out, a and b share one dtype: float32 or bfloat16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_types.h"
#include "ops.h"

namespace {

using pagedllm_cpu::FloatVec8;

constexpr int64_t kOutputBlock = 32;  // outputs an expand item computes: 4 vectors of 8
constexpr int64_t kARows = 4;         // rows of A a shrink item reads, each once, for all its group's rows

// result[i * result_ld + k] = rows[i] . w[k] for the n rows (stride ld) and the w_count <= 4 rows
// of w (stride len): a tile of 2 rows by 4 w rows at a time, 8 independent sums summed across
// lanes together (sum_each). Tiles past n or w_count repeat a row and are not kept.
template <typename T>
void dot_tile(const float* rows, int64_t ld, int64_t n, const T* w, int64_t w_count, int64_t len, float* result,
              int64_t result_ld) {
  const T* w_row[kARows];
  for (int64_t k = 0; k < kARows; ++k) w_row[k] = w + std::min(k, w_count - 1) * len;
  const int64_t vector_end = len - len % 8;
  for (int64_t first = 0; first < n; first += 2) {
    const float* x0 = rows + first * ld;
    const float* x1 = first + 1 < n ? x0 + ld : x0;
    // eight sums in registers by name: an array indexed in a loop would live in memory
    FloatVec8 a0 = FloatVec8::zero(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t c = 0; c < vector_end; c += 8) {
      const FloatVec8 xa = FloatVec8::load(x0 + c), xb = FloatVec8::load(x1 + c);
      const FloatVec8 w0 = FloatVec8::load(w_row[0] + c), w1 = FloatVec8::load(w_row[1] + c);
      const FloatVec8 w2 = FloatVec8::load(w_row[2] + c), w3 = FloatVec8::load(w_row[3] + c);
      a0 = FloatVec8::fma(w0, xa, a0), a1 = FloatVec8::fma(w1, xa, a1);
      a2 = FloatVec8::fma(w2, xa, a2), a3 = FloatVec8::fma(w3, xa, a3);
      b0 = FloatVec8::fma(w0, xb, b0), b1 = FloatVec8::fma(w1, xb, b1);
      b2 = FloatVec8::fma(w2, xb, b2), b3 = FloatVec8::fma(w3, xb, b3);
    }
    const FloatVec8 acc[8] = {a0, a1, a2, a3, b0, b1, b2, b3};
    float sums[8];
    FloatVec8::sum_each(acc).store(sums);
    for (int64_t i = 0; i < 2 && first + i < n; ++i) {
      const float* x = i == 0 ? x0 : x1;
      for (int64_t k = 0; k < w_count; ++k) {
        float sum = sums[i * kARows + k];
        for (int64_t c = vector_end; c < len; ++c) sum += static_cast<float>(w_row[k][c]) * x[c];
        result[(first + i) * result_ld + k] = sum;
      }
    }
  }
}

// 8 floats stored as T: float as is, bfloat16 rounded to nearest even as c10::BFloat16 rounds
// (a NaN stays a NaN).
inline void store8(float* p, FloatVec8 v) { v.store(p); }
inline void store8(c10::BFloat16* p, FloatVec8 v) {
#if PAGEDLLM_CPU_ISA >= 1
  const __m256i bits = _mm256_castps_si256(v.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v.v, v.v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
#else
  float lanes[8];
  v.store(lanes);
  for (int i = 0; i < 8; ++i) p[i] = static_cast<c10::BFloat16>(lanes[i]);
#endif
}

constexpr int64_t kPrefetchRows = 8;    // the shrink asks for the A rows this far ahead of the ones it reads
constexpr int64_t kPrefetchBlocks = 1;  // the expand, for the B block this far ahead

// Ask for `bytes` from p on into the caches: a call's adapters stream from memory in pieces too
// short (a few KB a thread) for the hardware's prefetchers to ramp up on.
inline void prefetch_ahead(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(c + offset, 0, 3);
}

struct Group {
  int64_t slot, first, end, rank;
};

template <typename T>
void lora_add_typed(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                    const std::vector<Group>& groups, const std::vector<int64_t>& offsets) {
  const int64_t in = x.size(1), num_out = out.size(1), parts = static_cast<int64_t>(offsets.size()) - 1;
  const int64_t max_rank = b.size(2), a_rows = a.size(1);
  const T* x_data = x.data_ptr<T>();
  const T* a_data = a.data_ptr<T>();
  const T* b_data = b.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  // the groups' rows of x as float32, one after another (row index: a group's base + its row)
  std::vector<int64_t> base(groups.size() + 1, 0);
  for (size_t g = 0; g < groups.size(); ++g) base[g + 1] = base[g] + groups[g].end - groups[g].first;
  std::vector<float> xf(base.back() * in);
  for (size_t g = 0; g < groups.size(); ++g)
    for (int64_t row = groups[g].first; row < groups[g].end; ++row)
      for (int64_t c = 0; c < in; ++c)
        xf[(base[g] + row - groups[g].first) * in + c] = static_cast<float>(x_data[row * in + c]);
  std::vector<float> shrunk(base.back() * a_rows, 0.f);  // [rows, P R]
  // items of the shrink: (group, part, block of kARows rank rows), flattened
  std::vector<int64_t> item_start(groups.size() + 1, 0);
  for (size_t g = 0; g < groups.size(); ++g)
    item_start[g + 1] = item_start[g] + parts * ((groups[g].rank + kARows - 1) / kARows);
  at::parallel_for(0, item_start.back(), 4, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = std::upper_bound(item_start.begin(), item_start.end(), item) - item_start.begin() - 1;
      const Group& group = groups[g];
      const int64_t blocks = (group.rank + kARows - 1) / kARows, within = item - item_start[g];
      const int64_t part = within / blocks, j = within % blocks * kARows;
      const int64_t column = part * max_rank + j;
      const T* a_rows_here = a_data + (group.slot * a_rows + column) * in;
      prefetch_ahead(a_rows_here + kPrefetchRows * in, std::min(kARows, group.rank - j) * in * sizeof(T));
      dot_tile(xf.data() + base[g] * in, in, group.end - group.first, a_rows_here, std::min(kARows, group.rank - j), in,
               shrunk.data() + base[g] * a_rows + column, a_rows);
    }
  });
  // items of the expand: blocks of kOutputBlock outputs, each part's from its own first block
  std::vector<int64_t> block_start(parts + 1, 0);
  for (int64_t p = 0; p < parts; ++p)
    block_start[p + 1] = block_start[p] + (offsets[p + 1] - offsets[p] + kOutputBlock - 1) / kOutputBlock;
  const int64_t num_blocks = block_start.back(), block_values = max_rank * kOutputBlock;
  at::parallel_for(0, num_blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t part = std::upper_bound(block_start.begin(), block_start.end(), block) - block_start.begin() - 1;
      const int64_t o0 = offsets[part] + (block - block_start[part]) * kOutputBlock;
      const int64_t width = std::min(kOutputBlock, offsets[part + 1] - o0);
      for (size_t g = 0; g < groups.size(); ++g) {
        const Group& group = groups[g];
        const T* b_block = b_data + (group.slot * num_blocks + block) * block_values;  // rank row j: + j * 32
        prefetch_ahead(b_block + kPrefetchBlocks * block_values, group.rank * kOutputBlock * sizeof(T));
        const int64_t n = group.end - group.first;
        for (int64_t first = 0; first < n; first += 2) {  // two rows a pass: each B vector read once for both
          const float* t0 = shrunk.data() + (base[g] + first) * a_rows + part * max_rank;
          const float* t1 = first + 1 < n ? t0 + a_rows : t0;
          // eight sums in registers by name: an array indexed in a loop would live in memory
          FloatVec8 a0 = FloatVec8::zero(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
          for (int64_t j = 0; j < group.rank; ++j) {
            const FloatVec8 s0 = FloatVec8::broadcast(t0[j]), s1 = FloatVec8::broadcast(t1[j]);
            const T* w = b_block + j * kOutputBlock;
            const FloatVec8 w0 = FloatVec8::load(w), w1 = FloatVec8::load(w + 8);
            const FloatVec8 w2 = FloatVec8::load(w + 16), w3 = FloatVec8::load(w + 24);
            a0 = FloatVec8::fma(s0, w0, a0), a1 = FloatVec8::fma(s0, w1, a1);
            a2 = FloatVec8::fma(s0, w2, a2), a3 = FloatVec8::fma(s0, w3, a3);
            b0 = FloatVec8::fma(s1, w0, b0), b1 = FloatVec8::fma(s1, w1, b1);
            b2 = FloatVec8::fma(s1, w2, b2), b3 = FloatVec8::fma(s1, w3, b3);
          }
          const FloatVec8 acc[8] = {a0, a1, a2, a3, b0, b1, b2, b3};
          for (int64_t i = 0; i < 2 && first + i < n; ++i) {
            T* cell = out_data + (group.first + first + i) * num_out + o0;
            if (width == kOutputBlock) {
              for (int v = 0; v < 4; ++v)
                store8(cell + 8 * v, FloatVec8::add(FloatVec8::load(cell + 8 * v), acc[4 * i + v]));
            } else {  // a part's last block: its first `width` outputs only
              float sums[kOutputBlock];
              for (int v = 0; v < 4; ++v) acc[4 * i + v].store(sums + 8 * v);
              for (int64_t o = 0; o < width; ++o) cell[o] = static_cast<T>(static_cast<float>(cell[o]) + sums[o]);
            }
          }
        }
      }
    }
  });
}

at::Tensor& lora_add_(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                      const at::Tensor& groups, const at::Tensor& ranks, const at::Tensor& part_offsets) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && a.dim() == 3, "lora_add_: out and x must be 2-D, a 3-D");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && a.is_contiguous() && b.is_contiguous(),
              "lora_add_: out, x, a and b must be contiguous");
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && out.scalar_type() == dtype &&
                  a.scalar_type() == dtype && b.scalar_type() == dtype,
              "lora_add_: out, x, a and b must all be float32 or all bfloat16");
  TORCH_CHECK(b.dim() == 4 && b.size(3) == kOutputBlock, "lora_add_: b must be [slots, blocks, max rank, ", kOutputBlock,
              "], not ", b.sizes());
  const int64_t rows = x.size(0), in = x.size(1), num_out = out.size(1), slots = a.size(0), max_rank = b.size(2);
  TORCH_CHECK(out.size(0) == rows && a.size(2) == in && b.size(0) == slots,
              "lora_add_: shapes do not agree: out ", out.sizes(), ", x ", x.sizes(), ", a ", a.sizes(), ", b ", b.sizes());
  TORCH_CHECK(groups.dim() == 2 && groups.size(1) == 3 && groups.scalar_type() == at::kLong && groups.is_contiguous(),
              "lora_add_: groups must be contiguous int64 [G, 3]");
  TORCH_CHECK(ranks.dim() == 1 && ranks.size(0) == slots && ranks.scalar_type() == at::kLong && ranks.is_contiguous(),
              "lora_add_: ranks must be contiguous int64 [slots]");
  TORCH_CHECK(part_offsets.dim() == 1 && part_offsets.size(0) >= 2 && part_offsets.scalar_type() == at::kLong &&
                  part_offsets.is_contiguous(),
              "lora_add_: part_offsets must be contiguous int64 [parts + 1]");
  const int64_t parts = part_offsets.size(0) - 1;
  TORCH_CHECK(a.size(1) == parts * max_rank, "lora_add_: a has ", a.size(1), " rows a slot, not parts x max rank ",
              parts * max_rank);
  const int64_t* offset_data = part_offsets.data_ptr<int64_t>();
  std::vector<int64_t> offsets(offset_data, offset_data + parts + 1);
  TORCH_CHECK(offsets.front() == 0 && offsets.back() == num_out, "lora_add_: part_offsets must run from 0 to ", num_out);
  int64_t blocks = 0;
  for (int64_t p = 0; p < parts; ++p) {
    TORCH_CHECK(offsets[p] <= offsets[p + 1], "lora_add_: part_offsets must ascend");
    blocks += (offsets[p + 1] - offsets[p] + kOutputBlock - 1) / kOutputBlock;
  }
  TORCH_CHECK(b.size(1) == blocks, "lora_add_: b has ", b.size(1), " blocks a slot; the parts take ", blocks);
  const int64_t* group_data = groups.data_ptr<int64_t>();
  const int64_t* rank_data = ranks.data_ptr<int64_t>();
  std::vector<Group> kept;
  for (int64_t g = 0; g < groups.size(0); ++g) {
    const int64_t slot = group_data[3 * g], first = group_data[3 * g + 1], end = group_data[3 * g + 2];
    TORCH_CHECK(slot >= 0 && slot < slots && first >= 0 && first <= end && end <= rows, "lora_add_: group ", g,
                " (slot ", slot, ", rows ", first, "..", end, ") is outside ", slots, " slots and ", rows, " rows");
    const int64_t rank = rank_data[slot];
    TORCH_CHECK(rank >= 0 && rank <= max_rank, "lora_add_: slot ", slot, "'s rank ", rank, " is outside 0..", max_rank);
    if (rank > 0 && end > first) kept.push_back({slot, first, end, rank});
  }
  if (kept.empty()) return out;
  if (dtype == at::kFloat)
    lora_add_typed<float>(out, x, a, b, kept, offsets);
  else
    lora_add_typed<c10::BFloat16>(out, x, a, b, kept, offsets);
  return out;
}

}  // namespace

at::Tensor pagedllm_ops::lora_add_(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                                   const at::Tensor& groups, const at::Tensor& ranks, const at::Tensor& part_offsets) {
  require_cpu("lora_add_", {out, x, a, b, groups, ranks, part_offsets});
  return ::lora_add_(out, x, a, b, groups, ranks, part_offsets);
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def(
      "lora_add_(Tensor(a!) out, Tensor x, Tensor a, Tensor b, Tensor groups, Tensor ranks, Tensor part_offsets) -> "
      "Tensor(a!)");
  m.impl("lora_add_", c10::DispatchKey::CPU, &lora_add_);
}
