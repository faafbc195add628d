// The kernels' entry points that a decode step calls many times over, for python_bindings.cpp:
// called through pybind11, a call costs about a microsecond less than through torch.ops' dispatcher,
// which a 26-layer model pays ~13 times a layer per token. Each is the function its file
// registers with torch.ops (same arguments, same checks); the files say what they compute.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

namespace pagedllm_ops {

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
at::Tensor argmax_rows(const at::Tensor& logits);
at::Tensor gguf_rows(const at::Tensor& raw, const at::Tensor& ids, const std::string& format, int64_t k);

}  // namespace pagedllm_ops
