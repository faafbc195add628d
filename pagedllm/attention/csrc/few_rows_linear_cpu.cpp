// A linear layer for the few rows of a decode step, on CPU: bfloat16 on CPUs with AVX512-BF16,
// float32 with AVX2 + FMA.
//
// A decode step multiplies a handful of activation rows by every weight of the model: the time
// goes into streaming the weights from memory, and a general GEMM (oneDNN) reaches about two
// thirds of the machine's bandwidth there, less as the rows grow. Here the weight is packed once,
// at load, into panels of output columns (16 for bfloat16, 8 for float32) whose inputs lie one
// after the other: a step reads each panel front to back, one load per input (a pair of inputs
// for bfloat16) for all the panel's columns. Each load feeds one multiply-add per activation row
// (the row's input broadcast; for bfloat16 a dpbf16ps: products of bfloat16 pairs summed in
// float32), one output column per lane, no sums across lanes. Several rows and panels share the
// loads, their sums in registers; more rows go a tile at a time over the same panels while they
// are still in cache. Each output is summed over its inputs in order, in float32, then gets its
// bias and (bfloat16) is rounded once, as oneDNN does it, in another order.
//
// pack_few_rows(weight [N, K]) -> bfloat16: [N / 16, K / 2, 16] int32 (pairs; N % 16 == 0, K even);
//                                 float32: [N / 8, K, 8] float32 (N % 8 == 0).
// few_rows_linear(x [M, K], packed, bias [N] or empty) -> [M, N], in x's dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_FEW_ROWS_F32 1
#else
#define PAGEDLLM_FEW_ROWS_F32 0
#endif
#if PAGEDLLM_FEW_ROWS_F32 && defined(__AVX512F__) && defined(__AVX512BF16__)
#define PAGEDLLM_FEW_ROWS_BF16 1
#else
#define PAGEDLLM_FEW_ROWS_BF16 0
#endif

namespace {

bool few_rows_linear_available(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? PAGEDLLM_FEW_ROWS_BF16 : dtype == at::kFloat ? PAGEDLLM_FEW_ROWS_F32 : false;
}

bool available(const std::string& dtype) {
  return few_rows_linear_available(dtype == "bfloat16" ? at::kBFloat16 : dtype == "float32" ? at::kFloat : at::kByte);
}

// Output columns per panel and inputs per step of the packed layout.
int64_t panel_columns(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 16 : 8; }
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

#if PAGEDLLM_FEW_ROWS_F32
template <int M, int P>
void tile_f32(const TileArgs<float>& a) {
  const float* x = static_cast<const float*>(a.x);
  const float* panels = static_cast<const float*>(a.panels);
  __m256 acc[M][P];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < P; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < a.steps; ++k) {
    __m256 w[P];
    for (int j = 0; j < P; ++j) {
      const float* at = panels + j * a.panel_stride + k * 8;
      _mm_prefetch(reinterpret_cast<const char*>(at + 32 * 8), _MM_HINT_T0);  // 1 KiB ahead
      w[j] = _mm256_loadu_ps(at);
    }
    for (int m = 0; m < M; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * a.x_stride + k);
      for (int j = 0; j < P; ++j) acc[m][j] = _mm256_fmadd_ps(xb, w[j], acc[m][j]);
    }
  }
  for (int j = 0; j < P; ++j) {
    const __m256 b = a.bias == nullptr ? _mm256_setzero_ps() : _mm256_loadu_ps(a.bias + j * 8);
    for (int m = 0; m < M; ++m) _mm256_storeu_ps(a.out + m * a.out_stride + j * 8, _mm256_add_ps(acc[m][j], b));
  }
}
#endif

#if PAGEDLLM_FEW_ROWS_BF16
inline __m512bh as_bf16x32(__m512i x) {
  __m512bh y;
  std::memcpy(&y, &x, sizeof(y));
  return y;
}

template <int M, int P>
void tile_bf16(const TileArgs<c10::BFloat16>& a) {
  const int32_t* x = static_cast<const int32_t*>(a.x);
  const int32_t* panels = static_cast<const int32_t*>(a.panels);
  __m512 acc[M][P];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < P; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < a.steps; ++p) {
    __m512bh w[P];
    for (int j = 0; j < P; ++j) {
      const int32_t* at = panels + j * a.panel_stride + p * 16;
      _mm_prefetch(reinterpret_cast<const char*>(at + 16 * 16), _MM_HINT_T0);  // 1 KiB ahead
      w[j] = as_bf16x32(_mm512_loadu_si512(at));
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh xb = as_bf16x32(_mm512_set1_epi32(x[m * a.x_stride + p]));
      for (int j = 0; j < P; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, w[j]);
    }
  }
  for (int j = 0; j < P; ++j) {
    const __m512 b = a.bias == nullptr
                         ? _mm512_setzero_ps()
                         : _mm512_castsi512_ps(_mm512_slli_epi32(
                               _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bias + j * 16))), 16));
    for (int m = 0; m < M; ++m) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][j], b));
      std::memcpy(a.out + m * a.out_stride + j * 16, &rounded, sizeof(rounded));
    }
  }
}
#endif

// The shapes each dtype's tiles take: up to kTileRows rows; with few rows (<= kFewRows) kWide
// panels at a time, else kNarrow (the sums, M x P registers, must fit with the loads: 32
// registers with AVX-512, 16 with AVX2).
struct Bf16Tiles {
  using T = c10::BFloat16;
  static constexpr int64_t kCols = 16, kTileRows = 8, kFewRows = 4, kWide = 4, kNarrow = 3;
  template <int P>
  static void run(int64_t m, const TileArgs<T>& a) {
#if PAGEDLLM_FEW_ROWS_BF16
    switch (m) {
      case 1: tile_bf16<1, P>(a); break;
      case 2: tile_bf16<2, P>(a); break;
      case 3: tile_bf16<3, P>(a); break;
      case 4: tile_bf16<4, P>(a); break;
      case 5: tile_bf16<5, P>(a); break;
      case 6: tile_bf16<6, P>(a); break;
      case 7: tile_bf16<7, P>(a); break;
      default: tile_bf16<8, P>(a);
    }
#else
    (void)m, (void)a;
#endif
  }
};

struct F32Tiles {
  using T = float;
  static constexpr int64_t kCols = 8, kTileRows = 6, kFewRows = 4, kWide = 3, kNarrow = 2;
  template <int P>
  static void run(int64_t m, const TileArgs<T>& a) {
#if PAGEDLLM_FEW_ROWS_F32
    switch (m) {
      case 1: tile_f32<1, P>(a); break;
      case 2: tile_f32<2, P>(a); break;
      case 3: tile_f32<3, P>(a); break;
      case 4: tile_f32<4, P>(a); break;
      case 5: tile_f32<5, P>(a); break;
      default: tile_f32<6, P>(a);
    }
#else
    (void)m, (void)a;
#endif
  }
};

// Threads take groups of panels; each group runs every row tile over its panels.
template <typename Tiles>
void run_panels(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias, at::Tensor& out) {
  using T = typename Tiles::T;
  const int64_t rows = x.size(0), num_panels = packed.size(0), steps = packed.size(1), n = out.size(1);
  const int64_t cols = Tiles::kCols, panel_stride = steps * cols;
  const int64_t per_group = rows <= Tiles::kFewRows ? Tiles::kWide : Tiles::kNarrow;
  const int64_t num_groups = (num_panels + per_group - 1) / per_group;
  const char* x_data = static_cast<const char*>(x.data_ptr());
  const int64_t x_row_bytes = x.size(1) * x.element_size();
  const int64_t x_stride = steps;  // in steps (a float, or a pair of bfloat16)
  const char* panels = static_cast<const char*>(packed.data_ptr());
  const int64_t panel_bytes = panel_stride * packed.element_size();
  const T* bias_data = bias.numel() > 0 ? bias.data_ptr<T>() : nullptr;
  T* out_data = out.data_ptr<T>();
  at::parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * per_group, count = std::min(per_group, num_panels - first);
      for (int64_t r = 0; r < rows; r += Tiles::kTileRows) {  // later rows read the panels from cache
        const int64_t m = std::min(Tiles::kTileRows, rows - r);
        for (int64_t done = 0; done < count;) {
          const int64_t panel = first + done, left = count - done;
          const TileArgs<T> args{x_data + r * x_row_bytes, x_stride, panels + panel * panel_bytes, panel_stride, steps,
                                 bias_data == nullptr ? nullptr : bias_data + panel * cols,
                                 out_data + r * n + panel * cols, n};
          if (left >= Tiles::kWide && per_group == Tiles::kWide) {
            Tiles::template run<Tiles::kWide>(m, args), done += Tiles::kWide;
          } else if (left >= Tiles::kNarrow) {
            Tiles::template run<Tiles::kNarrow>(m, args), done += Tiles::kNarrow;
          } else {
            Tiles::template run<1>(m, args), done += 1;
          }
        }
      }
    }
  });
}

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kBFloat16 || dtype == at::kFloat), "x: [M, K] bfloat16 or float32");
  TORCH_CHECK(few_rows_linear_available(dtype), "few_rows_linear: this build has no kernel for ", dtype);
  const int64_t cols = panel_columns(dtype), per_step = inputs_per_step(dtype);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == (dtype == at::kBFloat16 ? at::kInt : at::kFloat) &&
                  packed.is_contiguous() && packed.size(2) == cols && packed.size(1) * per_step == x.size(1),
              "packed: pack_few_rows of a [N, K] weight of x's dtype");
  const int64_t n = packed.size(0) * cols;
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == dtype && bias.numel() == n && bias.is_contiguous()),
              "bias: empty, or [N] of x's dtype");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  if (dtype == at::kBFloat16) run_panels<Bf16Tiles>(xc, packed, bias, out);
  else run_panels<F32Tiles>(xc, packed, bias, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("few_rows_linear_available(str dtype) -> bool", &available);
  m.def("pack_few_rows(Tensor weight) -> Tensor");
  m.impl("pack_few_rows", c10::DispatchKey::CPU, &pack_few_rows);
  m.def("few_rows_linear(Tensor x, Tensor packed, Tensor bias) -> Tensor");
  m.impl("few_rows_linear", c10::DispatchKey::CPU, &few_rows_linear);
}
