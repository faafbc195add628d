// A linear layer built for the few rows of a decode step, on CPU: bfloat16 on CPUs with
// AVX512-BF16, float32 with AVX2 + FMA (AVX-512 where the build has it).
//
// A decode step multiplies a handful of activation rows by every weight of the model: the time
// goes into streaming the weights from memory, and a general GEMM (oneDNN) reaches about two
// thirds of the machine's bandwidth there, less as the rows grow. Here the weight is packed once,
// at load, into panels of output columns (16; float32 with AVX2 only: 8) whose inputs lie one
// after the other: a step reads each panel front to back, one load per input (a pair of inputs
// for bfloat16) for all the panel's columns. Each load feeds one multiply-add per activation row
// (the row's input broadcast; for bfloat16 a dpbf16ps: products of bfloat16 pairs summed in
// float32), one output column per lane, no sums across lanes. Several rows and panels share the
// loads, their sums in registers; more rows go a tile at a time over the same panels while they
// are still in cache (prompts too: about oneDNN's speed there). Each output is its row's sum over
// the inputs in order, in float32, whatever other rows share the call; then its bias, and for
// bfloat16 one rounding, as oneDNN does it, in another order.
//
// pack_few_rows(weight [N, K]) -> bfloat16: [N / 16, K / 2, 16] int32 (pairs; N % 16 == 0, K even);
//                                 float32: [N / C, K, C] float32 (C = 16, or 8 with AVX2 only; N % C == 0).
// few_rows_linear(x [M, K], packed, bias [N] or None) -> [M, N], in x's dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_types.h"
#include "ops.h"
#include "row_blocks.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>

namespace {

using pagedllm_cpu::Bf16PairVec;
using pagedllm_cpu::FloatVec16;

// The float32 tiles' registers: 16 lanes with AVX-512, else 8 (AVX2).
using F32Vec = std::conditional_t<pagedllm_cpu::kHasAvx512, FloatVec16, pagedllm_cpu::FloatVec8>;
constexpr bool kHasF32 = pagedllm_cpu::kHasAvx2, kHasBf16 = pagedllm_cpu::kHasAvx512Bf16;

bool few_rows_linear_available(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? kHasBf16 : dtype == at::kFloat ? kHasF32 : false;
}

bool available(const std::string& dtype) {
  return few_rows_linear_available(dtype == "bfloat16" ? at::kBFloat16 : dtype == "float32" ? at::kFloat : at::kByte);
}

// Output columns per panel and inputs per step of the packed layout.
int64_t panel_columns(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 16 : F32Vec::kLanes; }
int64_t inputs_per_step(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 2 : 1; }

at::Tensor pack_few_rows(const at::Tensor& weight) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(weight.dim() == 2 && (dtype == at::kBFloat16 || dtype == at::kFloat), "weight: [N, K] bfloat16 or float32");
  const int64_t n = weight.size(0), k = weight.size(1), cols = panel_columns(dtype), per_step = inputs_per_step(dtype);
  TORCH_CHECK(n % cols == 0 && k % per_step == 0, "weight: N a multiple of ", cols, ", K of ", per_step);
  at::Tensor w = weight.contiguous();
  if (dtype == at::kBFloat16) w = w.view({n, k / 2, 2}).view(at::kInt).view({n, k / 2});  // pairs as one int32
  // [N / cols, cols, steps] -> [N / cols, steps, cols]
  return w.view({n / cols, cols, k / per_step}).transpose(1, 2).contiguous();
}

// One call's rows and panels: x rows [M][steps] (stride x_stride), panels [P][steps][cols]
// (stride panel_stride), out rows [M][cols P] (stride out_stride), bias [cols P] or null.
template <typename T>
struct TileArgs {
  const void* x;
  int64_t x_stride;
  const void* panels;
  int64_t panel_stride, steps;
  const T* bias;
  T* out;
  int64_t out_stride;
};

// float32: as tile_bf16, one input per step instead of a pair
template <int M, int P>
void tile_f32(const TileArgs<float>& a) {
  constexpr int64_t lanes = F32Vec::kLanes;
  const float* x = static_cast<const float*>(a.x);
  const float* panels = static_cast<const float*>(a.panels);
  F32Vec acc[M][P];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < P; ++j) acc[m][j] = F32Vec::zero();
  for (int64_t k = 0; k < a.steps; ++k) {
    PAGEDLLM_MCA_BEGIN("few_rows", 32, lanes, M, P);
    F32Vec w[P];
    for (int j = 0; j < P; ++j) {
      const float* at = panels + j * a.panel_stride + k * lanes;
      __builtin_prefetch(at + 256);  // 1 KiB ahead
      w[j] = F32Vec::load(at);
    }
    for (int m = 0; m < M; ++m) {
      const F32Vec xb = F32Vec::broadcast(x[m * a.x_stride + k]);
      for (int j = 0; j < P; ++j) acc[m][j] = F32Vec::fma(xb, w[j], acc[m][j]);
    }
    PAGEDLLM_MCA_END("few_rows", 32, lanes, M, P);
  }
  for (int j = 0; j < P; ++j) {
    const F32Vec b = a.bias == nullptr ? F32Vec::zero() : F32Vec::load(a.bias + j * lanes);
    for (int m = 0; m < M; ++m) F32Vec::add(acc[m][j], b).store(a.out + m * a.out_stride + j * lanes);
  }
}

// bfloat16, on Pairs (Bf16PairVec): a template, so that only AVX512-BF16 builds instantiate it.
template <typename Pairs, int M, int P>
void tile_bf16(const TileArgs<c10::BFloat16>& a) {
  const char* x = static_cast<const char*>(a.x);  // rows of pairs, not always 4-byte aligned
  const int32_t* panels = static_cast<const int32_t*>(a.panels);
  FloatVec16 acc[M][P];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < P; ++j) acc[m][j] = FloatVec16::zero();
  for (int64_t p = 0; p < a.steps; ++p) {
    PAGEDLLM_MCA_BEGIN("few_rows", 16, 16, M, P);
    Pairs w[P];
    for (int j = 0; j < P; ++j) {
      const int32_t* at = panels + j * a.panel_stride + p * 16;
      __builtin_prefetch(at + 16 * 16);  // 1 KiB ahead
      w[j] = Pairs::load(at);
    }
    for (int m = 0; m < M; ++m) {
      uint32_t pair;
      std::memcpy(&pair, x + (m * a.x_stride + p) * 4, sizeof(pair));
      const Pairs xb = Pairs::broadcast(pair);
      for (int j = 0; j < P; ++j) acc[m][j] = Pairs::dot(acc[m][j], xb, w[j]);
    }
    PAGEDLLM_MCA_END("few_rows", 16, 16, M, P);
  }
  for (int j = 0; j < P; ++j) {
    const FloatVec16 b = a.bias == nullptr ? FloatVec16::zero() : FloatVec16::load(a.bias + j * 16);
    for (int m = 0; m < M; ++m) Pairs::store_rounded(a.out + m * a.out_stride + j * 16, FloatVec16::add(acc[m][j], b));
  }
}

// The shapes each dtype's tiles take: up to kTileRows rows; with few rows (<= kFewRows) kWide
// panels at a time, else kNarrow (the sums, M x P registers, must fit with the loads: 32
// registers with AVX-512, 16 with AVX2).
struct Bf16Tiles {
  using T = c10::BFloat16;
  static constexpr int64_t kCols = 16, kTileRows = 8, kFewRows = 4, kWide = 4, kNarrow = 3;
  template <int M, int P>
  static void tile(const TileArgs<T>& a) {
    if constexpr (kHasBf16) tile_bf16<Bf16PairVec, M, P>(a);
  }
};

struct F32Tiles {
  using T = float;
  static constexpr bool kWideRegs = F32Vec::kLanes == 16;  // AVX-512
  static constexpr int64_t kCols = F32Vec::kLanes, kTileRows = kWideRegs ? 8 : 6, kFewRows = 4;
  static constexpr int64_t kWide = kWideRegs ? 4 : 3, kNarrow = kWideRegs ? 3 : 2;
  template <int M, int P>
  static void tile(const TileArgs<T>& a) {
    tile_f32<M, P>(a);
  }
};

// Tiles::tile<m, P>, for m = 1 .. M: only the shapes that run are compiled.
template <typename Tiles, int P, int M>
void tile_rows(int64_t m, const TileArgs<typename Tiles::T>& a) {
  if constexpr (M > 1) {
    if (m < M) return tile_rows<Tiles, P, M - 1>(m, a);
  }
  Tiles::template tile<M, P>(a);
}

// Threads take groups of panels, each running its row tiles over the group's panels (later
// tiles read them from cache); the rows in blocks where row_blocks.h says, each block a task of
// its own.
template <typename Tiles>
void run_panels(const at::Tensor& x, const at::Tensor& packed, const at::Tensor* bias, at::Tensor& out) {
  using T = typename Tiles::T;
  constexpr int64_t kTileRows = Tiles::kTileRows;
  const int64_t rows = x.size(0), num_panels = packed.size(0), steps = packed.size(1), n = out.size(1);
  const int64_t cols = Tiles::kCols, panel_stride = steps * cols;
  const bool few = rows <= Tiles::kFewRows;
  const int64_t per_group = few ? Tiles::kWide : Tiles::kNarrow;
  const int64_t num_groups = (num_panels + per_group - 1) / per_group;
  const int64_t row_tiles = (rows + kTileRows - 1) / kTileRows;
  const char* x_data = static_cast<const char*>(x.data_ptr());
  const int64_t x_row_bytes = x.size(1) * x.element_size();
  const int64_t blocks =
      pagedllm_cpu::num_row_blocks(row_tiles, kTileRows * x_row_bytes, num_groups, at::get_num_threads());
  const int64_t block_rows = (row_tiles + blocks - 1) / blocks * kTileRows;
  const int64_t num_blocks = (rows + block_rows - 1) / block_rows;
  const int64_t x_stride = steps;  // in steps (a float, or a pair of bfloat16)
  const char* panels = static_cast<const char*>(packed.data_ptr());
  const int64_t panel_bytes = panel_stride * packed.element_size();
  const T* bias_data = bias == nullptr ? nullptr : bias->data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  at::parallel_for(0, num_groups * num_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task % num_groups, block = task / num_groups;
      const int64_t first = g * per_group, count = std::min(per_group, num_panels - first);
      const int64_t block_end = std::min(rows, (block + 1) * block_rows);
      for (int64_t r = block * block_rows; r < block_end; r += kTileRows) {
        const int64_t m = std::min(kTileRows, block_end - r);
        for (int64_t done = 0; done < count;) {
          const int64_t panel = first + done, left = count - done;
          const TileArgs<T> args{x_data + r * x_row_bytes, x_stride, panels + panel * panel_bytes, panel_stride, steps,
                                 bias_data == nullptr ? nullptr : bias_data + panel * cols,
                                 out_data + r * n + panel * cols, n};
          if (few && left >= Tiles::kWide) {
            tile_rows<Tiles, Tiles::kWide, Tiles::kFewRows>(m, args), done += Tiles::kWide;
          } else if (left >= Tiles::kNarrow) {
            tile_rows<Tiles, Tiles::kNarrow, kTileRows>(m, args), done += Tiles::kNarrow;
          } else {
            tile_rows<Tiles, 1, kTileRows>(m, args), done += 1;
          }
        }
      }
    }
  });
}

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kBFloat16 || dtype == at::kFloat), "x: [M, K] bfloat16 or float32");
  TORCH_CHECK(few_rows_linear_available(dtype), "few_rows_linear: this build has no kernel for ", dtype);
  const int64_t cols = panel_columns(dtype), per_step = inputs_per_step(dtype);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == (dtype == at::kBFloat16 ? at::kInt : at::kFloat) &&
                  packed.is_contiguous() && packed.size(2) == cols && packed.size(1) * per_step == x.size(1),
              "packed: pack_few_rows of a [N, K] weight of x's dtype");
  const int64_t n = packed.size(0) * cols;
  const at::Tensor* b = bias.has_value() && bias->defined() && bias->numel() > 0 ? &*bias : nullptr;
  TORCH_CHECK(b == nullptr || (b->scalar_type() == dtype && b->numel() == n && b->is_contiguous()),
              "bias: None, or [N] of x's dtype");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  if (dtype == at::kBFloat16) run_panels<Bf16Tiles>(xc, packed, b, out);
  else run_panels<F32Tiles>(xc, packed, b, out);
  return out;
}

}  // namespace

at::Tensor pagedllm_ops::few_rows_linear(const at::Tensor& x, const at::Tensor& packed,
                                         const std::optional<at::Tensor>& bias) {
  require_cpu("few_rows_linear", {x, packed, or_undefined(bias)});
  return ::few_rows_linear(x, packed, bias);
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("few_rows_linear_available(str dtype) -> bool", &available);
  m.def("pack_few_rows(Tensor weight) -> Tensor");
  m.impl("pack_few_rows", c10::DispatchKey::CPU, &pack_few_rows);
  m.def("few_rows_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.impl("few_rows_linear", c10::DispatchKey::CPU, &few_rows_linear);
}
