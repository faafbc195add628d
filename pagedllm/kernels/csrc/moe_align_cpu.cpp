// A mixture-of-experts step's (token, expert) pairs grouped by expert, for the grouped expert
// kernel (moe_quant_linear): in PyTorch a sort, a unique, a floor division, an index, a cumsum, a
// pad and the inverse permutation sorted again, ~10 small ops whose dispatch cost a 1-token decode
// step ~0.15 ms a layer, more than the integer work they do. One pass here, a counting sort.
//
// moe_align(topk_ids [T, K] int64, topk_weights [T, K] float, num_experts) ->
//   (experts [G] int64: the experts any pair chose, ascending;
//    offsets [G + 1] int64: experts[g]'s pairs are rows offsets[g] .. offsets[g + 1];
//    pair_tokens [T * K] int64: each grouped pair's token;
//    pair_weights [T * K, 1]: each grouped pair's weight;
//    where [T * K] int64: token t's pairs at where[t * K .. t * K + K), ascending)
// Pairs of one expert keep their token order (a stable sort), and a token's pairs come back in
// ascending position, that is ascending expert: the order in which the caller sums them.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "ops.h"

namespace {

using Aligned = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Aligned moe_align(const at::Tensor& topk_ids, const at::Tensor& topk_weights, int64_t num_experts) {
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.scalar_type() == at::kLong,
              "moe_align: topk_ids must be int64 [tokens, top_k], not ", topk_ids.scalar_type(), " ",
              topk_ids.sizes());
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && at::isFloatingType(topk_weights.scalar_type()),
              "moe_align: topk_weights must be float of topk_ids' shape ", topk_ids.sizes(), ", not ",
              topk_weights.scalar_type(), " ", topk_weights.sizes());
  TORCH_CHECK(num_experts > 0 && num_experts <= (int64_t{1} << 20), "moe_align: num_experts must be 1..2^20, not ",
              num_experts);
  const int64_t tokens = topk_ids.size(0), top_k = topk_ids.size(1), pairs = tokens * top_k;
  const at::Tensor ids_c = topk_ids.contiguous();
  const at::Tensor weights_c = topk_weights.contiguous();
  const int64_t* ids = ids_c.data_ptr<int64_t>();

  std::vector<int64_t> count(num_experts, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < num_experts, "moe_align: expert id ", ids[p], " is not in 0..",
                num_experts - 1);
    ++count[ids[p]];
  }
  int64_t groups = 0;
  for (int64_t e = 0; e < num_experts; ++e) groups += count[e] > 0;

  const auto long_options = topk_ids.options().dtype(at::kLong);
  at::Tensor experts = at::empty({groups}, long_options), offsets = at::empty({groups + 1}, long_options);
  at::Tensor pair_tokens = at::empty({pairs}, long_options), where = at::empty({pairs}, long_options);
  at::Tensor pair_weights = at::empty({pairs, 1}, weights_c.options());
  int64_t* expert_out = experts.data_ptr<int64_t>();
  int64_t* offset_out = offsets.data_ptr<int64_t>();
  std::vector<int64_t> next(num_experts);  // where an expert's next pair goes
  offset_out[0] = 0;
  for (int64_t e = 0, g = 0, at_row = 0; e < num_experts; ++e) {
    next[e] = at_row;
    if (count[e] == 0) continue;
    at_row += count[e];
    expert_out[g] = e;
    offset_out[++g] = at_row;
  }
  int64_t* token_out = pair_tokens.data_ptr<int64_t>();
  int64_t* where_out = where.data_ptr<int64_t>();
  std::vector<int64_t> order(pairs);  // grouped position -> pair
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t position = next[ids[p]]++;
    order[position] = p;
    token_out[position] = p / top_k;
    where_out[p] = position;
  }
  for (int64_t t = 0; t < tokens; ++t) std::sort(where_out + t * top_k, where_out + (t + 1) * top_k);

  const int64_t item = static_cast<int64_t>(weights_c.element_size());
  const char* weight_in = static_cast<const char*>(weights_c.data_ptr());
  char* weight_out = static_cast<char*>(pair_weights.data_ptr());
  for (int64_t position = 0; position < pairs; ++position)
    std::memcpy(weight_out + position * item, weight_in + order[position] * item, item);
  return {experts, offsets, pair_tokens, pair_weights, where};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> pagedllm_ops::moe_align(
    const at::Tensor& topk_ids, const at::Tensor& topk_weights, int64_t num_experts) {
  require_cpu("moe_align", {topk_ids, topk_weights});
  return ::moe_align(topk_ids, topk_weights, num_experts);
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("moe_align(Tensor topk_ids, Tensor topk_weights, int num_experts) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.impl("moe_align", c10::DispatchKey::CPU, &moe_align);
}
