// LoRA adapters' low-rank products added to a projection's output, every adapter of a step in one
// call (lora/layers.py: punica's shrink and expand, the CPU way).
//
// lora_add_(out [T, O], x [T, I], a [S, P * R, I], b_t [S, R, O], groups [G, 3] int64 (slot, first
// row, end row), ranks [S] int64, part_offsets [P + 1] int64) -> out, where for each group g of
// slot s and rank r = ranks[s], and each part p of the projection (q, k, v of a fused qkv: output
// rows part_offsets[p] .. part_offsets[p + 1]):
//
//   shrink   t[row, p R + j] = x[row] . a[s, p R + j]                       j < r
//   expand   out[row, o] += sum over j < r of t[row, p R + j] b_t[s, j, o]   o in part p
//
// B is held transposed (b_t: rank rows) so the expand runs along the output: a block of outputs
// takes r vector multiply-adds a row, not a horizontal sum per output. A step's adapters are read
// once each: the shrink over the rows of A (every row of a group at once), the expand over blocks
// of outputs, each in one parallel region for all groups, so a call costs two regions whatever
// the number of adapters. The products are summed in float32 and out is rounded once. x, out, a
// and b_t share one dtype: float32 or bfloat16.

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

constexpr int64_t kRowsAtOnce = 4;  // rows of x dotted with one row of A per pass over it
constexpr int64_t kOutputBlock = 32;  // outputs an expand item computes: 4 vectors of 8

// result[i] = rows[i] . w for the n rows (stride ld), w of length len; w read once per 4 rows.
template <typename T>
void dot_rows(const float* rows, int64_t ld, int64_t n, const T* w, int64_t len, float* result, int64_t result_ld) {
  for (int64_t first = 0; first < n; first += kRowsAtOnce) {
    const int64_t m = std::min(kRowsAtOnce, n - first);
    FloatVec8 acc[kRowsAtOnce] = {FloatVec8::zero(), FloatVec8::zero(), FloatVec8::zero(), FloatVec8::zero()};
    int64_t c = 0;
    for (; c + 8 <= len; c += 8) {
      const FloatVec8 wv = FloatVec8::load(w + c);
      for (int64_t i = 0; i < m; ++i) acc[i] = FloatVec8::fma(wv, FloatVec8::load(rows + (first + i) * ld + c), acc[i]);
    }
    for (int64_t i = 0; i < m; ++i) {
      float sum = acc[i].reduce_add();
      for (int64_t cc = c; cc < len; ++cc) sum += static_cast<float>(w[cc]) * rows[(first + i) * ld + cc];
      result[(first + i) * result_ld] = sum;
    }
  }
}

struct Group {
  int64_t slot, first, end, rank;
};

template <typename T>
void lora_add_typed(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                    const std::vector<Group>& groups, const std::vector<int64_t>& offsets) {
  const int64_t in = x.size(1), num_out = out.size(1), parts = static_cast<int64_t>(offsets.size()) - 1;
  const int64_t max_rank = b.size(1), a_rows = a.size(1);
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
  // items of the shrink: (group, part, rank row), flattened
  std::vector<int64_t> item_start(groups.size() + 1, 0);
  for (size_t g = 0; g < groups.size(); ++g) item_start[g + 1] = item_start[g] + parts * groups[g].rank;
  at::parallel_for(0, item_start.back(), 8, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = std::upper_bound(item_start.begin(), item_start.end(), item) - item_start.begin() - 1;
      const Group& group = groups[g];
      const int64_t within = item - item_start[g], part = within / group.rank, j = within % group.rank;
      const int64_t column = part * max_rank + j;
      const T* a_row = a_data + (group.slot * a_rows + column) * in;
      dot_rows(xf.data() + base[g] * in, in, group.end - group.first, a_row, in, shrunk.data() + base[g] * a_rows + column,
               a_rows);
    }
  });
  // items of the expand: blocks of kOutputBlock outputs within a part
  std::vector<int64_t> block_start(parts + 1, 0);
  for (int64_t p = 0; p < parts; ++p)
    block_start[p + 1] = block_start[p] + (offsets[p + 1] - offsets[p] + kOutputBlock - 1) / kOutputBlock;
  at::parallel_for(0, block_start.back(), 4, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t part = std::upper_bound(block_start.begin(), block_start.end(), item) - block_start.begin() - 1;
      const int64_t o0 = offsets[part] + (item - block_start[part]) * kOutputBlock;
      const int64_t width = std::min(kOutputBlock, offsets[part + 1] - o0);
      for (size_t g = 0; g < groups.size(); ++g) {
        const Group& group = groups[g];
        const T* b_rows = b_data + group.slot * max_rank * num_out + o0;  // row j: + j * num_out
        for (int64_t i = 0; i < group.end - group.first; ++i) {
          const float* t = shrunk.data() + (base[g] + i) * a_rows + part * max_rank;
          T* out_row = out_data + (group.first + i) * num_out + o0;
          if (width == kOutputBlock) {
            FloatVec8 acc[4] = {FloatVec8::zero(), FloatVec8::zero(), FloatVec8::zero(), FloatVec8::zero()};
            for (int64_t j = 0; j < group.rank; ++j) {
              const FloatVec8 tj = FloatVec8::broadcast(t[j]);
              for (int v = 0; v < 4; ++v) acc[v] = FloatVec8::fma(tj, FloatVec8::load(b_rows + j * num_out + 8 * v), acc[v]);
            }
            float sums[kOutputBlock];
            for (int v = 0; v < 4; ++v) acc[v].store(sums + 8 * v);
            for (int64_t o = 0; o < kOutputBlock; ++o) out_row[o] = static_cast<T>(static_cast<float>(out_row[o]) + sums[o]);
          } else {  // a part's last, narrower block
            for (int64_t o = 0; o < width; ++o) {
              float sum = 0.f;
              for (int64_t j = 0; j < group.rank; ++j) sum += t[j] * static_cast<float>(b_rows[j * num_out + o]);
              out_row[o] = static_cast<T>(static_cast<float>(out_row[o]) + sum);
            }
          }
        }
      }
    }
  });
}

at::Tensor& lora_add_(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                      const at::Tensor& groups, const at::Tensor& ranks, const at::Tensor& part_offsets) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && a.dim() == 3 && b.dim() == 3, "lora_add_: out and x must be 2-D, a and b_t 3-D");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && a.is_contiguous() && b.is_contiguous(),
              "lora_add_: out, x, a and b_t must be contiguous");
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && out.scalar_type() == dtype &&
                  a.scalar_type() == dtype && b.scalar_type() == dtype,
              "lora_add_: out, x, a and b_t must all be float32 or all bfloat16");
  const int64_t rows = x.size(0), in = x.size(1), num_out = out.size(1), slots = a.size(0), max_rank = b.size(1);
  TORCH_CHECK(out.size(0) == rows && a.size(2) == in && b.size(0) == slots && b.size(2) == num_out,
              "lora_add_: shapes do not agree: out ", out.sizes(), ", x ", x.sizes(), ", a ", a.sizes(), ", b_t ", b.sizes());
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
  for (int64_t p = 0; p < parts; ++p) TORCH_CHECK(offsets[p] <= offsets[p + 1], "lora_add_: part_offsets must ascend");
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
