// The kernels' entry points that a decode step calls many times over, for python_bindings.cpp:
// called through pybind11, a call costs less than through torch.ops' dispatcher, and a decode step
// makes a dozen such calls a layer (docs/benchmarks/vs_llama_cpp.md, "A decode step beyond its
// weights"). Each is the function its file registers with torch.ops (same arguments, same checks);
// the files say what they compute.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace pagedllm_ops {

// torch.ops' dispatcher refuses tensors on another device before a CPU kernel sees them; a
// direct call checks for itself (a kernel would read device memory as host memory).
inline void require_cpu(const char* op, std::initializer_list<std::reference_wrapper<const at::Tensor>> tensors) {
  for (const at::Tensor& t : tensors)
    TORCH_CHECK(!t.defined() || t.device().is_cpu(), op, ": CPU tensors only, not one on ", t.device());
}

inline const at::Tensor& or_undefined(const std::optional<at::Tensor>& t) {
  static const at::Tensor undefined;
  return t.has_value() ? *t : undefined;
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, bool prefetch_to_l2, int64_t window);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor rms_norm_heads_(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight, int64_t num_heads,
                           int64_t num_kv_heads, double eps);
at::Tensor rotary_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& slot_mapping, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           int64_t num_heads, int64_t num_kv_heads);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up);
at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t n, int64_t k,
                        const std::optional<at::Tensor>& bias, int64_t stream_ahead);
at::Tensor moe_quant_linear(const at::Tensor& x, const std::vector<at::Tensor>& packed, const at::Tensor& offsets,
                            int64_t stream_ahead);
at::Tensor argmax_rows(const at::Tensor& logits);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_align(const at::Tensor& topk_ids,
                                                                                 const at::Tensor& topk_weights,
                                                                                 int64_t num_experts);
at::Tensor lora_add_(at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                     const at::Tensor& groups, const at::Tensor& ranks, const at::Tensor& part_offsets);
at::Tensor gguf_rows(const at::Tensor& raw, const at::Tensor& ids, const std::string& format, int64_t k);

}  // namespace pagedllm_ops
