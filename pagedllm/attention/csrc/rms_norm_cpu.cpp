// Residual add + RMSNorm of a 16-bit (bfloat16 / float16) model on CPU, in one pass per row.
//
// In PyTorch ops this is nine calls per norm (add, widen, square, mean, add eps, rsqrt, scale,
// narrow, times weight), each a pass over the activations and a dispatch: at a decode step of 8
// requests the 61 norms of a 30-layer model spent more time in dispatch than in arithmetic. The
// arithmetic follows Hugging Face's LlamaRMSNorm: the residual sum rounded to the model dtype,
// h = float(x), h * rsqrt(mean(h^2) + eps) rounded to the model dtype, times the weight, rounded.
// Only the order in which the squares are summed differs (8 partial sums), a float32 rounding.
//
// x, residual: [num_tokens, hidden] (residual may be empty: the first norm); weight: [hidden].
// Returns (normed, x + residual) in x's dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

namespace {

template <typename T>
void add_rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* summed, int64_t num_rows,
                       int64_t hidden, float eps) {
  at::parallel_for(0, num_rows, 32, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      T* sr = summed + r * hidden;
      if (residual != nullptr) {
        const T* rr = residual + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) sr[i] = static_cast<T>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
      } else if (sr != xr) {
        for (int64_t i = 0; i < hidden; ++i) sr[i] = xr[i];
      }
      float lanes[8] = {};
      int64_t i = 0;
      for (; i + 8 <= hidden; i += 8)
        for (int64_t j = 0; j < 8; ++j) {
          const float h = static_cast<float>(sr[i + j]);
          lanes[j] += h * h;
        }
      float sum = 0.f;
      for (int64_t j = 0; j < 8; ++j) sum += lanes[j];
      for (; i < hidden; ++i) sum += static_cast<float>(sr[i]) * static_cast<float>(sr[i]);
      const float inv_rms = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      T* o = out + r * hidden;
      for (int64_t k = 0; k < hidden; ++k) {
        const T normed = static_cast<T>(static_cast<float>(sr[k]) * inv_rms);
        o[k] = static_cast<T>(static_cast<float>(weight[k]) * static_cast<float>(normed));
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [num_tokens, hidden]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "x: bfloat16 or float16");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1) && weight.is_contiguous(),
              "weight: [hidden] of x's dtype");
  const bool has_residual = residual.numel() > 0;
  TORCH_CHECK(!has_residual || (residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                                residual.is_contiguous()),
              "residual: empty, or contiguous like x");
  at::Tensor out = at::empty_like(x);
  at::Tensor summed = has_residual ? at::empty_like(x) : x;
  auto run = [&](auto zero) {
    using T = decltype(zero);
    add_rms_norm_rows<T>(x.data_ptr<T>(), has_residual ? residual.data_ptr<T>() : nullptr, weight.data_ptr<T>(),
                         out.data_ptr<T>(), summed.data_ptr<T>(), x.size(0), x.size(1), static_cast<float>(eps));
  };
  if (x.scalar_type() == at::kBFloat16) run(c10::BFloat16{});
  else run(c10::Half{});
  return {out, summed};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
}
