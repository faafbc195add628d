// Layer steps of a model on CPU (float32, bfloat16 or float16), each one pass instead of several
// PyTorch ops (and their dispatch, which at small batches costs more than the arithmetic):
//
// add_rms_norm: residual add + RMSNorm, in one pass per row.
//
// In PyTorch ops this is up to nine calls per norm (add, widen, square, mean, add eps, rsqrt, scale,
// narrow, times weight), each a pass over the activations and a dispatch: at a decode step of 8
// requests the 61 norms of a 30-layer model spent more time in dispatch than in arithmetic. The
// arithmetic follows Hugging Face's LlamaRMSNorm: the residual sum rounded to the model dtype,
// h = float(x), h * rsqrt(mean(h^2) + eps) rounded to the model dtype, times the weight, rounded.
// Only the order in which the squares are summed differs (8 partial sums), a float32 rounding:
// hidden by the last rounding to a 16-bit dtype most of the time, a few float32 roundings in a
// float32 model (greedy tokens still Hugging Face's: tests/model/test_correctness_hf.py).
//
// x, residual: [num_tokens, hidden] (residual None: the first norm); weight: [hidden].
// Returns (normed, x + residual) in x's dtype.
//
// silu_and_mul, gelu_tanh_and_mul: the MLP's act(gate) * up from the fused gate_up projection, one
// pass instead of a split, the activation and a multiply (three passes over [num_tokens, 2 x
// intermediate]).
//
// rotary_write_kv: below.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops.h"
#include "vec_math.h"

#include <cmath>
#include <tuple>
#include <vector>

namespace {

// One row normed: out = weight * (row * rsqrt(mean(row^2) + eps)), out may be the row itself.
template <typename T>
inline void rms_norm_row(const T* row, const T* weight, T* out, int64_t hidden, float eps) {
  float lanes[8] = {};
  int64_t i = 0;
  for (; i + 8 <= hidden; i += 8)
    for (int64_t j = 0; j < 8; ++j) {
      const float h = static_cast<float>(row[i + j]);
      lanes[j] += h * h;
    }
  float sum = 0.f;
  for (int64_t j = 0; j < 8; ++j) sum += lanes[j];
  for (; i < hidden; ++i) sum += static_cast<float>(row[i]) * static_cast<float>(row[i]);
  const float inv_rms = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  for (int64_t k = 0; k < hidden; ++k) {
    const T normed = static_cast<T>(static_cast<float>(row[k]) * inv_rms);
    out[k] = static_cast<T>(static_cast<float>(weight[k]) * static_cast<float>(normed));
  }
}

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
      rms_norm_row(sr, weight, out + r * hidden, hidden, eps);
    }
  });
}

// rms_norm_heads_: Qwen3's and Gemma 3's norms of each query and key head, in place on the fused
// qkv projection [num_tokens, (num_heads + 2 num_kv_heads) * head_dim]: each head's row normed as
// add_rms_norm norms a row (the same bits), q heads by q_weight, k heads by k_weight, values
// untouched. Replaces a split, two reshapes, two norms and a concatenation per layer.
template <typename T>
void rms_norm_heads_rows(T* qkv, const T* q_weight, const T* k_weight, int64_t num_tokens, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, float eps) {
  const int64_t heads = num_heads + num_kv_heads, row_stride = (num_heads + 2 * num_kv_heads) * head_dim;
  at::parallel_for(0, num_tokens * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t token = i / heads, head = i % heads;
      T* row = qkv + token * row_stride + head * head_dim;
      rms_norm_row(row, head < num_heads ? q_weight : k_weight, row, head_dim, eps);
    }
  });
}

at::Tensor rms_norm_heads_(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
                           int64_t num_heads, int64_t num_kv_heads, double eps) {
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "qkv: float32, bfloat16 or float16");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && q_weight.dim() == 1 && q_weight.sizes() == k_weight.sizes(),
              "q_weight, k_weight: [head_dim] each");
  const int64_t head_dim = q_weight.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "qkv: contiguous [num_tokens, (num_heads + 2 num_kv_heads) * head_dim]");
  TORCH_CHECK(q_weight.scalar_type() == dtype && k_weight.scalar_type() == dtype && q_weight.is_contiguous() &&
                  k_weight.is_contiguous(),
              "q_weight, k_weight: contiguous, of qkv's dtype");
  auto run = [&](auto zero) {
    using T = decltype(zero);
    rms_norm_heads_rows<T>(qkv.data_ptr<T>(), q_weight.data_ptr<T>(), k_weight.data_ptr<T>(), qkv.size(0),
                           num_heads, num_kv_heads, head_dim, static_cast<float>(eps));
  };
  if (dtype == at::kFloat) run(float{});
  else if (dtype == at::kBFloat16) run(c10::BFloat16{});
  else run(c10::Half{});
  return qkv;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [num_tokens, hidden]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "x: float32, bfloat16 or float16");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1) && weight.is_contiguous(),
              "weight: [hidden] of x's dtype");
  const bool has_residual = residual.has_value();
  TORCH_CHECK(!has_residual || (residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                                residual->is_contiguous()),
              "residual: None, or contiguous like x");
  at::Tensor out = at::empty_like(x);
  at::Tensor summed = has_residual ? at::empty_like(x) : x;
  auto run = [&](auto zero) {
    using T = decltype(zero);
    add_rms_norm_rows<T>(x.data_ptr<T>(), has_residual ? residual->data_ptr<T>() : nullptr, weight.data_ptr<T>(),
                         out.data_ptr<T>(), summed.data_ptr<T>(), x.size(0), x.size(1), static_cast<float>(eps));
  };
  if (x.scalar_type() == at::kFloat) run(float{});
  else if (x.scalar_type() == at::kBFloat16) run(c10::BFloat16{});
  else run(c10::Half{});
  return {out, summed};
}

// rotary_write_kv: rotate the queries and keys of a fused qkv projection (Hugging Face's
// rotate-half, as rotary.py computes it: x * cos + roll(x) * signed_sin, each product and the sum
// rounded to the model dtype, so the result is bit for bit PyTorch's), write keys and values into
// their cache slots, and return the rotated queries. Replaces a multiply, a roll, a multiply, an
// add and two index copies per layer.
//
// qkv: [num_tokens, (num_heads + 2 num_kv_heads) * head_dim]; cos, signed_sin: [num_tokens, head_dim];
// slot_mapping: [num_tokens] int64; k_cache / v_cache: [num_blocks, block_size, num_kv_heads,
// head_dim] of the model dtype. Returns queries [num_tokens, num_heads, head_dim].
// Each product rounded before the sum, in float32 too: no fused multiply-add here.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
inline T rotate(T x, T rolled, T cos, T signed_sin) {
  const T a = static_cast<T>(static_cast<float>(x) * static_cast<float>(cos));
  const T b = static_cast<T>(static_cast<float>(rolled) * static_cast<float>(signed_sin));
  return static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
}

template <typename T>
void rotary_write_kv_rows(const T* qkv, const T* cos, const T* sin, const int64_t* slots, T* q_out, T* k_cache,
                          T* v_cache, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2, row = (num_heads + 2 * num_kv_heads) * head_dim;
  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* x = qkv + t * row;
      const T* c = cos + t * head_dim;
      const T* s = sin + t * head_dim;
      T* k_slot = k_cache + slots[t] * num_kv_heads * head_dim;
      T* v_slot = v_cache + slots[t] * num_kv_heads * head_dim;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        const T* xh = x + h * head_dim;
        T* out = h < num_heads ? q_out + (t * num_heads + h) * head_dim : k_slot + (h - num_heads) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d)
          out[d] = rotate(xh[d], xh[d < half ? d + half : d - half], c[d], s[d]);
      }
      const T* v = x + (num_heads + num_kv_heads) * head_dim;
      for (int64_t i = 0; i < num_kv_heads * head_dim; ++i) v_slot[i] = v[i];
    }
  });
}

#pragma GCC pop_options

at::Tensor rotary_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& slot_mapping, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           int64_t num_heads, int64_t num_kv_heads) {
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "qkv: float32, bfloat16 or float16");
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv: contiguous [num_tokens, row]");
  const int64_t num_tokens = qkv.size(0), head_dim = k_cache.size(3);
  TORCH_CHECK(head_dim % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "qkv: row size");
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == num_tokens * head_dim && sin.numel() == num_tokens * head_dim,
              "cos, sin: contiguous [num_tokens, head_dim] of qkv's dtype");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == num_kv_heads,
              "k_cache, v_cache: contiguous [num_blocks, block_size, num_kv_heads, head_dim] of qkv's dtype");
  const at::Tensor slots = slot_mapping.contiguous();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == num_tokens, "slot_mapping: [num_tokens] int64");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slot_data[t] >= 0 && slot_data[t] < num_slots, "slot_mapping[", t, "] is not a slot of the cache");
  at::Tensor q = at::empty({num_tokens, num_heads, head_dim}, qkv.options());
  auto run = [&](auto zero) {
    using T = decltype(zero);
    rotary_write_kv_rows<T>(qkv.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), slot_data, q.data_ptr<T>(),
                            k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), num_tokens, num_heads, num_kv_heads,
                            head_dim);
  };
  if (dtype == at::kFloat) run(float{});
  else if (dtype == at::kBFloat16) run(c10::BFloat16{});
  else run(c10::Half{});
  return q;
}

// sigmoid(z) from exp(-|z|), so the exponent is never positive
inline float sigmoid(float z) {
  const float e = pagedllm_cpu::exp_nonpositive(-std::fabs(z));
  return (z >= 0.f ? 1.f : e) / (1.f + e);
}

// SiLU: x * sigmoid(x). Below -87 exp(-x) overflows in float32 and PyTorch's x / (1 + exp(-x)) is
// -0 (NaN at -inf).
struct Silu {
  static float apply(float x) { return x * (x < -87.f ? 0.f : sigmoid(x)); }
};

// GELU, tanh approximation (PyTorch's approximate="tanh", Gemma's gelu_pytorch_tanh):
// 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3), computed as x * sigmoid(2u), the
// same number within a rounding or so. Past |x| = 10 the result is x or 0, as PyTorch's.
struct GeluTanh {
  static float apply(float x) {
    if (x > 10.f) return x;
    if (x < -10.f) return 0.f * x;
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return x * sigmoid(2.f * u);
  }
};

// act(gate) * up as Hugging Face's gated MLPs compute it in the model dtype: the activation in
// float32, rounded to the dtype, times up in float32, rounded. gate_up: [num_tokens, 2 *
// intermediate], gate first.
template <typename Act, typename T>
void act_and_mul_rows(const T* gate_up, T* out, int64_t num_rows, int64_t intermediate) {
  at::parallel_for(0, num_rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * intermediate;
      const T* up = gate + intermediate;
      T* o = out + r * intermediate;
      for (int64_t i = 0; i < intermediate; ++i) {
        const T activated = static_cast<T>(Act::apply(static_cast<float>(gate[i])));
        o[i] = static_cast<T>(static_cast<float>(activated) * static_cast<float>(up[i]));
      }
    }
  });
}

template <typename Act>
at::Tensor act_and_mul(const at::Tensor& gate_up) {
  const auto dtype = gate_up.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "gate_up: float32, bfloat16 or float16");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up: contiguous [num_tokens, 2 * intermediate]");
  const int64_t intermediate = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), intermediate}, gate_up.options());
  if (dtype == at::kFloat)
    act_and_mul_rows<Act>(gate_up.data_ptr<float>(), out.data_ptr<float>(), gate_up.size(0), intermediate);
  else if (dtype == at::kBFloat16)
    act_and_mul_rows<Act>(gate_up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), gate_up.size(0),
                          intermediate);
  else
    act_and_mul_rows<Act>(gate_up.data_ptr<c10::Half>(), out.data_ptr<c10::Half>(), gate_up.size(0), intermediate);
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> pagedllm_ops::add_rms_norm(const at::Tensor& x,
                                                              const std::optional<at::Tensor>& residual,
                                                              const at::Tensor& weight, double eps) {
  require_cpu("add_rms_norm", {x, or_undefined(residual), weight});
  return ::add_rms_norm(x, residual, weight, eps);
}
at::Tensor pagedllm_ops::rms_norm_heads_(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
                                         int64_t num_heads, int64_t num_kv_heads, double eps) {
  require_cpu("rms_norm_heads_", {qkv, q_weight, k_weight});
  return ::rms_norm_heads_(qkv, q_weight, k_weight, num_heads, num_kv_heads, eps);
}
at::Tensor pagedllm_ops::rotary_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                         const at::Tensor& slot_mapping, const at::Tensor& k_cache,
                                         const at::Tensor& v_cache, int64_t num_heads, int64_t num_kv_heads) {
  require_cpu("rotary_write_kv", {qkv, cos, sin, slot_mapping, k_cache, v_cache});
  return ::rotary_write_kv(qkv, cos, sin, slot_mapping, k_cache, v_cache, num_heads, num_kv_heads);
}
at::Tensor pagedllm_ops::silu_and_mul(const at::Tensor& gate_up) {
  require_cpu("silu_and_mul", {gate_up});
  return act_and_mul<Silu>(gate_up);
}
at::Tensor pagedllm_ops::gelu_tanh_and_mul(const at::Tensor& gate_up) {
  require_cpu("gelu_tanh_and_mul", {gate_up});
  return act_and_mul<GeluTanh>(gate_up);
}

namespace {
// The levels this build was compiled for (cpu_types.h): [PAGEDLLM_CPU_ISA, PAGEDLLM_CPU_VNNI].
std::vector<int64_t> instruction_sets() { return {PAGEDLLM_CPU_ISA, PAGEDLLM_CPU_VNNI}; }
}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("instruction_sets() -> int[]", &instruction_sets);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &act_and_mul<Silu>);
  m.def("gelu_tanh_and_mul(Tensor gate_up) -> Tensor");
  m.impl("gelu_tanh_and_mul", c10::DispatchKey::CPU, &act_and_mul<GeluTanh>);
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_heads_(Tensor(a!) qkv, Tensor q_weight, Tensor k_weight, int num_heads, int num_kv_heads, "
        "float eps) -> Tensor(a!)");
  m.impl("rms_norm_heads_", c10::DispatchKey::CPU, &rms_norm_heads_);
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.def("rotary_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, int num_heads, int num_kv_heads) -> Tensor");
  m.impl("rotary_write_kv", c10::DispatchKey::CPU, &rotary_write_kv);
}
