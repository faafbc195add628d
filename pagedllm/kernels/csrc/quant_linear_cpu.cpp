// A linear layer on quantized weights (4 or 8 bits, GGUF's kinds), for decode steps on CPU:
// llama.cpp's arithmetic in few_rows_linear's layout.
//
// The weight W [N, K] comes in one generic form, blocks of 32 along K:
//   W[n, k] = scales[n, k / 32] * q[n, k] + mins[n, k / 32]   (q: 0..15 for 4 bits, -128..127 for 8)
// and stays quantized: a decode step streams every weight once, so its bytes are the time. Each
// activation row is quantized per 32-block as llama.cpp's Q8_0 (dx = max|x| / 127, quants
// round(x / dx), ties to even), the block's byte products summed exactly in int32 (vpdpbusd),
// then per block in float32:
//   acc += (scale * dx) * sum(q * xq) + min * (dx * sum(xq))
// Where every min is a whole multiple of its scale (min = -z * scale: Q4_0's z = 8, Q8_0's 0),
// the min is folded into the integer sum instead (sum((q - z) * xq), exact) and not stored.
// Per-token mode (a W8A8 checkpoint's scheme: 8 bits, one scale per column, activations quantized
// per row with dynamic scales, as vLLM computes it): one dx for the whole row, the integer sums run
// over all of K (at most K x 255 x 128: exact in int32 for K <= 65536) and are scaled once,
//   out = (scale * dx) * sum(q * xq)
// which drops the per-block float work that bounds the tiles on prompts.
// Each output is its own row's sum over the blocks in order, whatever rows share the call; then
// the bias, and for bfloat16 x one rounding.
//
// Layout (pack_quant_linear): a 64-byte header (PackedHeader), then groups of 4 panels of 16
// output columns (N padded to a multiple of 64 with zero weights), each group one stream of
// 32-blocks, so that a thread reads its groups front to back:
//
//   block b of a group:  8-bit: 8 steps s, each [panel 0 | panel 1 | panel 2 | panel 3] of 64 bytes,
//                               a panel's = [column 0: k 4s..4s+3 | column 1: the same | ...] (q + 128)
//                        4-bit: 4 nibble groups g laid out the same: low nibbles step g, high g + 4
//                        then the 64 columns' float16 scales, then (where not folded) their mins
//
// so a 64-byte load feeds one vpdpbusd per activation row for 16 columns and 4 k (the row's 4
// quants broadcast), one column per lane, no sums across lanes. (Panels each a stream of their
// own read more slowly: 1-row 4-bit products took ~30% longer on Zen 5.) Bytes per weight: 4-bit
// 4.5 (5 with mins), 8-bit 8.5 (9). float16 keeps GGUF's Q4_0/Q4_1/Q8_0 scales and mins exactly
// (they are float16 there); others (Q4_K's d * sc) are rounded to the nearest float16: a relative
// error of 2^-11 at most (2^-25 absolute below float16's normal range, 6.1e-5), far below 4 bits'.
//
// pack_quant_linear(q [N, K] int8, scales [N, K / 32] float32, mins same or None, bits, per_token) -> uint8 blob
// quant_linear(x [M, K] float32 or bfloat16, packed, bits, n, k, bias [N] or None, stream_ahead) -> [M, N],
// x's dtype (stream_ahead: how far ahead the weights are prefetched, 0: by the hardware alone)
// moe_quant_linear(x [M, K], packed [G], offsets [G + 1] int64, stream_ahead) -> [M, N]: rows
// offsets[g] .. offsets[g + 1] of x times weight g (a step's experts, its rows grouped by expert)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_types.h"
#include "ops.h"
#include "quant_linear_layout.h"
#include "row_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using pagedllm_cpu::Bf16PairVec;
using pagedllm_cpu::FloatVec16;

// 16 int32 lanes with AVX512-VNNI, else 8 (AVX-VNNI or AVX2); none without AVX2.
using QuadVec =
    std::conditional_t<pagedllm_cpu::kHasAvx512Vnni, pagedllm_cpu::ByteQuadVec16, pagedllm_cpu::ByteQuadVec8>;
using QuantFloat = std::conditional_t<pagedllm_cpu::kHasAvx512Vnni, FloatVec16, pagedllm_cpu::FloatVec8>;
constexpr bool kHasQuant = pagedllm_cpu::kHasAvx2;
using namespace pagedllm_quant;

bool available() { return kHasQuant; }

// z where every min is exactly -z * its scale (|z| <= 255); none where they are not.
std::optional<int64_t> folded_zero_point(const at::Tensor& scales, const at::Tensor& mins) {
  const at::Tensor s = scales.to(at::kDouble), m = mins.to(at::kDouble);
  const at::Tensor nonzero = s.ne(0).flatten().nonzero();
  if (nonzero.numel() == 0) return std::nullopt;
  const int64_t i = nonzero[0][0].item<int64_t>();
  const double z = -m.flatten()[i].item<double>() / s.flatten()[i].item<double>();
  if (z != std::nearbyint(z) || std::fabs(z) > 255) return std::nullopt;
  if (!m.eq(s * -z).all().item<bool>()) return std::nullopt;
  return static_cast<int64_t>(z);
}

at::Tensor as_float16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.isfinite().all().item<bool>() && t.abs().max().item<float>() <= 65504.f, "pack_quant_linear: ",
              name, " must be finite and within float16's range (|x| <= 65504), as they are stored in float16");
  return t.to(at::kHalf);
}

at::Tensor pack_quant_linear(const at::Tensor& q, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                             int64_t bits, bool per_token) {
  TORCH_CHECK(bits == 4 || bits == 8, "pack_quant_linear: bits must be 4 or 8, not ", bits);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "pack_quant_linear: q must be an int8 [N, K] tensor, not ",
              q.scalar_type(), " ", q.sizes());
  const int64_t n = q.size(0), k = q.size(1), blocks = k / kBlock;
  TORCH_CHECK(n > 0 && k > 0 && k % kBlock == 0, "pack_quant_linear: K must be a positive multiple of 32, not ", k);
  for (const at::Tensor* t : {&scales, mins.has_value() ? &*mins : nullptr}) {
    if (t == nullptr) continue;
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == n && t->size(1) == blocks,
                "pack_quant_linear: scales and mins must be float32 [N, K / 32] = [", n, ", ", blocks, "], not ",
                t->scalar_type(), " ", t->sizes());
  }
  if (bits == 4) {
    TORCH_CHECK(q.min().item<int>() >= 0 && q.max().item<int>() <= 15, "pack_quant_linear: 4-bit q must be 0..15");
  }
  int64_t zero_point = 0;
  bool has_mins = mins.has_value() && mins->ne(0).any().item<bool>();
  if (has_mins) {
    const auto z = folded_zero_point(scales, *mins);
    has_mins = !z.has_value();
    zero_point = z.value_or(0);
  }
  TORCH_CHECK(!per_token || (bits == 8 && !has_mins && k <= 65536 && scales.eq(scales.narrow(1, 0, 1)).all().item<bool>()),
              "pack_quant_linear: per-token activations take 8-bit weights with one scale per column (the same in "
              "every block), no mins other than a whole zero point, and K <= 65536");
  const int64_t groups = num_groups(n), padded = groups * kGroupCols;
  const at::Tensor qp = at::constant_pad_nd(q, {0, 0, 0, padded - n});
  at::Tensor w;
  if (bits == 8) {  // [groups, panels, columns, blocks, 8 steps, 4] -> [groups, blocks, steps, panels, columns, 4]
    const at::Tensor u = (qp.to(at::kShort) + 128).to(at::kByte);
    w = u.view({groups, kGroupPanels, kPanelCols, blocks, 8, 4}).permute({0, 3, 4, 1, 2, 5});
  } else {  // k 0..15 of a block in the low nibbles, 16..31 in the high ones
    const at::Tensor halves = qp.to(at::kByte).view({groups, kGroupPanels, kPanelCols, blocks, 2, 4, 4});
    const at::Tensor bytes = halves.select(4, 0).bitwise_or(halves.select(4, 1).bitwise_left_shift(4));
    w = bytes.permute({0, 3, 4, 1, 2, 5});
  }
  w = w.reshape({groups, blocks, weight_bytes(bits)});
  auto params_of = [&](const at::Tensor& t, const char* name) {  // [N, blocks] -> [groups, blocks, 64] float16
    const at::Tensor padded_t = at::constant_pad_nd(as_float16(t, name), {0, 0, 0, padded - n});
    return padded_t.view({groups, kGroupCols, blocks}).permute({0, 2, 1});
  };
  at::Tensor params = params_of(scales, "scales");
  if (has_mins) params = at::cat({params, params_of(*mins, "mins")}, 2);
  params = params.contiguous().view(at::kByte);
  at::Tensor header = at::zeros({kHeaderBytes}, q.options().dtype(at::kByte));
  const PackedHeader h{{}, bits, n, k, zero_point, has_mins ? 1 : 0, per_token ? 1 : 0};
  std::memcpy(header.data_ptr(), &h, sizeof(h));
  std::memcpy(header.data_ptr(), kMagic, sizeof(kMagic));
  return at::cat({header, at::cat({w, params}, 2).flatten()});
}

// Each row of x quantized per 32-block: quants [K] int8, dx [blocks], dx * sum(quants) [blocks]
// and the integer sums' start, -offset * sum(quants) [blocks]; per token, one dx for the row (in
// every block's place) and the start of the whole row's sum (likewise). Laid out for the tiles: rows in
// tiles of tile_height (the last one h < tile_height rows), each tile's rows interleaved per
// block (4 quants at a time) so that a tile reads them at fixed offsets from one pointer:
//   quants of tile t (first row r0, h rows), block b:  [8 steps][h rows][4 quants] at r0 * K + b * 32 h
//   dx, dx_sums, starts of tile t, block b:            [h rows] at r0 * blocks + b * h
struct QuantRows {
  const int8_t* quants;  // [rows, k]
  const float *dx, *dx_sums;  // [rows, blocks]
  const int32_t* starts;  // [rows, blocks]
  int64_t k, tile_height;
};

// QuantRows' storage. A decode step makes a hundred calls of a few rows each: their buffers are kept
// by the calling thread from call to call (allocating them each time cost more than quantizing a
// row); a prompt's, up to tens of MiB, are freed after their call.
constexpr int64_t kKeptQuantBytes = 1 << 20;
struct QuantBuffers {
  std::vector<int8_t> quants;
  std::vector<float> dx, dx_sums;
  std::vector<int32_t> starts;
};

// The calling thread's kept buffers: one set for every bit width and layout
QuantBuffers& kept_quant_buffers() {
  thread_local QuantBuffers kept;
  return kept;
}

template <typename FVec, typename T>
void quantize_row(const T* x, int64_t blocks, int64_t h, int32_t offset, bool per_token, int8_t* quants, float* dx,
                  float* dx_sums, int32_t* starts) {
  constexpr int64_t kVecs = kBlock / FVec::kLanes;
  float row_d = 0.f;
  if (per_token) {
    FVec amax = FVec::zero();
    for (int64_t i = 0; i < blocks * kVecs; ++i) amax = FVec::max(amax, FVec::load(x + i * FVec::kLanes).abs());
    row_d = amax.reduce_max() / 127.f;
  }
  int32_t row_start = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    FVec v[kVecs], amax = FVec::zero();
    for (int64_t i = 0; i < kVecs; ++i) {
      v[i] = FVec::load(x + b * kBlock + i * FVec::kLanes);
      amax = FVec::max(amax, v[i].abs());
    }
    const float d = per_token ? row_d : amax.reduce_max() / 127.f;
    FVec sum = FVec::zero();  // whole numbers: exact
    const FVec dv = FVec::broadcast(d);
    int8_t block[kBlock];
    for (int64_t i = 0; i < kVecs; ++i) {
      const FVec q = d == 0.f ? FVec::zero() : FVec::div(v[i], dv).round();
      q.store_int8(block + i * FVec::kLanes);
      sum = FVec::add(sum, q);
    }
    for (int64_t s = 0; s < kBlock / 4; ++s) std::memcpy(quants + b * kBlock * h + s * 4 * h, block + 4 * s, 4);
    const float total = sum.reduce_add();
    dx[b * h] = d, dx_sums[b * h] = d * total, starts[b * h] = -offset * static_cast<int32_t>(total);
    row_start += starts[b * h];
  }
  if (per_token) {
    for (int64_t b = 0; b < blocks; ++b) starts[b * h] = row_start;
  }
}

template <typename FVec>
QuantRows quantize_rows(const at::Tensor& x, int32_t offset, bool per_token, int64_t tile_height,
                        QuantBuffers& buffers) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock, x_stride = x.stride(0);
  buffers.quants.resize(rows * k);
  buffers.dx.resize(rows * blocks);
  buffers.dx_sums.resize(rows * blocks);
  buffers.starts.resize(rows * blocks);
  int8_t* const quants = buffers.quants.data();
  float *const dx = buffers.dx.data(), *const dx_sums = buffers.dx_sums.data();
  int32_t* const starts = buffers.starts.data();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* const x_data = x.data_ptr();
  const int64_t grain = std::max<int64_t>(1, 32768 / k);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t first = row / tile_height * tile_height, h = std::min(tile_height, rows - first);
      const int64_t i = row - first;  // the row's place in its tile
      auto quantize = [&](const auto* xr) {
        quantize_row<FVec>(xr + row * x_stride, blocks, h, offset, per_token, quants + first * k + 4 * i,
                           dx + first * blocks + i, dx_sums + first * blocks + i, starts + first * blocks + i);
      };
      if (bf16) quantize(static_cast<const c10::BFloat16*>(x_data));
      else quantize(static_cast<const float*>(x_data));
    }
  });
  return QuantRows{quants, dx, dx_sums, starts, k, tile_height};
}

// One tile's rows, columns and blocks (a run of `blocks` from the first one the pointers are at):
// quants and per-block values in QuantRows' layout for a tile of M rows, its group
// (blocks of block_stride bytes) and first panel there, bias (float32, padded to whole groups)
// and out [M][N] (stride out_stride) at the tile's first column; cols: the columns from there on
// that are inside N. Where the blocks are not all of K, the sums carry over in sums [M][64] at
// the tile's first column: read unless the run is K's first, written unless it is K's last.
struct TileArgs {
  const int8_t* quants;
  const float* dx;
  const float* dx_sums;
  const int32_t* starts;
  const uint8_t* group;
  int64_t first_panel, block_stride, blocks;
  float* sums;
  bool resumes, finishes;
  int64_t stream_ahead, next_run;  // prefetch distances: into L1 streaming (next_run 0; none if 0), else into L2
  const float* bias;
  void* out;
  bool out_bf16;
  int64_t out_stride, cols;
};

// n (<= lanes) outputs of one row from r, rounded once to bfloat16 where out is (Pairs: only
// AVX512-BF16 builds have it)
template <typename FVec, typename Pairs = Bf16PairVec>
void store_row(const TileArgs& a, int64_t at, FVec r, int64_t n) {
  if (!a.out_bf16) {
    float* p = static_cast<float*>(a.out) + at;
    return n == FVec::kLanes ? r.store(p) : r.store_first(p, n);
  }
  c10::BFloat16* p = static_cast<c10::BFloat16*>(a.out) + at;
  c10::BFloat16 rounded[FVec::kLanes];
  if constexpr (pagedllm_cpu::kHasAvx512Bf16 && FVec::kLanes == 16) {
    Pairs::store_rounded(n == 16 ? p : rounded, r);
    if (n == 16) return;
  } else {
    float lanes[FVec::kLanes];
    r.store(lanes);
    for (int64_t i = 0; i < n; ++i) rounded[i] = c10::BFloat16(lanes[i]);
  }
  std::copy(rounded, rounded + n, p);
}

// M rows times P panels (V vectors of lanes), all blocks: per block the integer sums of M x V
// vectors, then M x V float multiply-adds; per token, the integer sums go on over the blocks (carried
// between runs of blocks as int32 in `sums`) and are scaled once at the end.
template <typename Quads, typename FVec, int Bits, bool HasMins, bool PerToken, int M, int P>
void tile(const TileArgs& a) {
  static_assert(!PerToken || (Bits == 8 && !HasMins), "per-token activations take 8-bit weights without mins");
  constexpr int64_t L = Quads::kLanes, V = P * kPanelCols / L, kStepBytes = kGroupPanels * 64;
  // Vectors summed at a time: all V, but half where one row's 8 (AVX2, 4 panels) would not fit the
  // 16 registers beside their accumulators: the block's bytes are still read in one pass, in order.
  constexpr int64_t H = L == 8 && M == 1 && V == 8 ? 4 : V;
  const uint8_t* w[V];  // vector v's 64-byte-step slices, steps kStepBytes apart
  const c10::Half* params[V];
  for (int64_t v = 0; v < V; ++v) {
    const int64_t col = a.first_panel * kPanelCols + v * L;  // in the group
    w[v] = a.group + col / kPanelCols * 64 + col % kPanelCols * 4;
    params[v] = reinterpret_cast<const c10::Half*>(a.group + kGroupPanels * Bits * 64) + col;
  }
  FVec acc[M][V];
  Quads sums[M][V];
  [[maybe_unused]] constexpr int kMcaKind = PerToken ? 2 : HasMins ? 1 : 0;  // llvm-mca's name: no mins, mins, per token
  for (int m = 0; m < M; ++m) {
    for (int64_t v = 0; v < V; ++v) {
      float* carried = a.sums + m * kGroupCols + v * L;
      if constexpr (PerToken) sums[m][v] = a.resumes ? Quads::load(carried) : Quads::broadcast(a.starts[m]);
      else acc[m][v] = a.resumes ? FVec::load(carried) : FVec::zero();
    }
  }
  for (int64_t b = 0; b < a.blocks; ++b) {
    PAGEDLLM_MCA_BEGIN("quant_linear", Bits, kMcaKind, M, P);
    const int8_t* x = a.quants + b * kBlock * M;
    auto sum_vectors = [&](auto first) {  // vectors c .. c + H: the block's sums, then their scaling
      constexpr int64_t c = decltype(first)::value;
      if constexpr (!PerToken) {
        for (int m = 0; m < M; ++m) {
          const Quads start = Quads::broadcast(a.starts[b * M + m]);
          for (int64_t v = c; v < c + H; ++v) sums[m][v] = Bits == 8 ? start : Quads::nibble_start(start);
        }
      }
      auto step = [&](const Quads* weights, int64_t k) {  // k: the step's first input in the block
        for (int m = 0; m < M; ++m) {
          const Quads xq = Quads::broadcast_quad(x + k * M + 4 * m);
          for (int64_t v = 0; v < H; ++v) {
            sums[m][c + v] = Bits == 8 ? Quads::dot_q8(sums[m][c + v], weights[v], xq)
                                       : Quads::dot_nibbles(sums[m][c + v], weights[v], xq);
          }
        }
      };
#pragma GCC unroll 8
      for (int64_t g = 0; g < Bits; ++g) {  // 8-bit: 8 steps; 4-bit: 4 loads, 2 steps each
        Quads loaded[H];
        for (int64_t v = 0; v < H; ++v) {
          const uint8_t* at = w[c + v] + b * a.block_stride + g * kStepBytes;
          if constexpr (!pagedllm_cpu::kMcaModel) {
            if (a.next_run != 0) __builtin_prefetch(at + a.next_run, 0, 2);
            else if (a.stream_ahead != 0) __builtin_prefetch(at + a.stream_ahead, 0, 3);
          }
          loaded[v] = Quads::load(at);
        }
        if constexpr (Bits == 8) {
          step(loaded, 4 * g);
        } else {
          Quads nibbles[H];
          for (int64_t v = 0; v < H; ++v) nibbles[v] = loaded[v].low_nibbles();
          step(nibbles, 4 * g);
          for (int64_t v = 0; v < H; ++v) nibbles[v] = loaded[v].high_nibbles();
          step(nibbles, 16 + 4 * g);
        }
      }
      if constexpr (PerToken) return;
      if constexpr (Bits == 4) {
        for (int m = 0; m < M; ++m) {
          const Quads start = Quads::broadcast(a.starts[b * M + m]);
          for (int64_t v = c; v < c + H; ++v) sums[m][v] = Quads::nibble_sums(sums[m][v], start);
        }
      }
      FVec scales[H];
      for (int64_t v = 0; v < H; ++v) scales[v] = FVec::load(params[c + v] + b * a.block_stride / 2);
      for (int m = 0; m < M; ++m) {
        const FVec dx = FVec::broadcast(a.dx[b * M + m]);
        for (int64_t v = 0; v < H; ++v) {
          acc[m][c + v] = FVec::fma(sums[m][c + v].to_float(), FVec::mul(scales[v], dx), acc[m][c + v]);
        }
      }
      if constexpr (HasMins) {
        FVec mins[H];
        for (int64_t v = 0; v < H; ++v) mins[v] = FVec::load(params[c + v] + b * a.block_stride / 2 + kGroupCols);
        for (int m = 0; m < M; ++m) {
          const FVec dx_sum = FVec::broadcast(a.dx_sums[b * M + m]);
          for (int64_t v = 0; v < H; ++v) acc[m][c + v] = FVec::fma(mins[v], dx_sum, acc[m][c + v]);
        }
      }
    };
    sum_vectors(std::integral_constant<int64_t, 0>{});
    if constexpr (H < V) sum_vectors(std::integral_constant<int64_t, H>{});
    PAGEDLLM_MCA_END("quant_linear", Bits, kMcaKind, M, P);
  }
  if (!a.finishes) {
    for (int m = 0; m < M; ++m) {
      for (int64_t v = 0; v < V; ++v) {
        float* carried = a.sums + m * kGroupCols + v * L;
        if constexpr (PerToken) sums[m][v].store(carried);
        else acc[m][v].store(carried);
      }
    }
    return;
  }
  if constexpr (PerToken) {  // every block holds the column's scale and the row's dx: the first's
    for (int m = 0; m < M; ++m) {
      const FVec dx = FVec::broadcast(a.dx[m]);
      for (int64_t v = 0; v < V; ++v) acc[m][v] = FVec::mul(sums[m][v].to_float(), FVec::mul(FVec::load(params[v]), dx));
    }
  }
  for (int64_t v = 0; v < V && v * L < a.cols; ++v) {
    const FVec bias = a.bias == nullptr ? FVec::zero() : FVec::load(a.bias + v * L);
    const int64_t n = std::min(L, a.cols - v * L);
    for (int m = 0; m < M; ++m) store_row(a, m * a.out_stride + v * L, FVec::add(acc[m][v], bias), n);
  }
}

// The tiles' shapes, rows x panels (P divides a group's 4): up to kFewRows rows (a decode step)
// kFewTileRows x kWide, more kTileRows x kNarrow. The integer and float sums (2 M V registers)
// and a step's weights must fit in the registers: 32 with AVX-512, 16 with AVX2 (where a decode
// tile's 4 panels are summed two at a time: tile's H). A decode step streams fastest a whole group
// at a time, in order (measured on Zen 5 with AVX-512 and on Zen 1 with AVX2, where two passes over
// a group, two panels each, were the bound: docs/benchmarks/kernels_and_dispatch.md). From ~16
// rows on, the tiles are bound by the vector pipes that take both vpdpbusd and the float work
// (Zen 5: 6 x 2, 4 x 2 and 8 x 1 alike).
template <typename Quads, typename FVec, int Bits, bool HasMins, bool PerToken>
struct Tiles {
  static constexpr bool kWideRegs = Quads::kLanes == 16;
  static constexpr int64_t kFewRows = kWideRegs ? 8 : 2, kFewTileRows = kWideRegs ? 2 : 1, kWide = 4;
  static constexpr int64_t kTileRows = kWideRegs ? 6 : 2, kNarrow = kWideRegs ? 2 : 1;
  template <int M, int P>
  static void run(const TileArgs& a) {
    tile<Quads, FVec, Bits, HasMins, PerToken, M, P>(a);
  }
};

// Tiles::run<m, P>, for m = 1 .. M: only the shapes that run are compiled.
template <typename T, int P, int M>
void tile_rows(int64_t m, const TileArgs& a) {
  if constexpr (M > 1) {
    if (m < M) return tile_rows<T, P, M - 1>(m, a);
  }
  T::template run<M, P>(a);
}

// One product's work, cut into tasks that threads take: a group of 64 columns over a block of rows
// each. A virtual base, so that one parallel region can run the tasks of several products of
// different bit widths (moe_quant_linear: a step's experts, one product each).
struct Tasks {
  virtual ~Tasks() = default;
  virtual int64_t count() const = 0;
  virtual int64_t sums_size() const = 0;  // floats of carried sums a task needs (0: none)
  virtual void run(int64_t task, float* sums) const = 0;
};

// Threads take groups, each running its row tiles over the group. Where there are a few (2-6),
// they take a run of blocks (~32 KiB) at a time: the first tile streams it from memory, the
// others read it from cache and prefetch the next run meanwhile (a decode step of 4-32 rows:
// 8-bit ~1.2-1.3x faster on Zen 5; with more tiles, runs were slower). A tile streaming from
// memory prefetches stream_ahead bytes ahead, or leaves it to the hardware (0): which is faster
// differs between hosts of one kind (a 1-row product on Zen 5: ~31 GB/s with 4 KiB on one core,
// ~25-27 without; on another, the other way round), so the caller times it
// (layers/linear_dispatch.py). The rows go in blocks where row_blocks.h says (a narrow weight's,
// to give every thread work; a prompt's, so that its quantized activations stay in cache).
template <typename T>
struct GroupTasks final : Tasks {
  QuantRows xq;
  const uint8_t* first_group;
  int64_t group_stride, block_stride, rows, n, groups, blocks, tile_height, tile_panels, block_rows, num_blocks,
      run_blocks, next_run, stream_ahead, out_bytes;
  bool few, in_runs, out_bf16;
  const float* bias;
  char* out_data;

  GroupTasks(const QuantRows& xq_, const at::Tensor& packed, int64_t group_stride_, const float* bias_,
             int64_t stream_ahead_, int64_t rows_, int64_t n_, void* out, bool out_bf16_)
      : xq(xq_), first_group(packed.data_ptr<uint8_t>() + kHeaderBytes), group_stride(group_stride_), rows(rows_),
        n(n_), stream_ahead(stream_ahead_), out_bf16(out_bf16_), bias(bias_), out_data(static_cast<char*>(out)) {
    groups = num_groups(n), blocks = xq.k / kBlock, block_stride = group_stride / blocks;
    few = rows <= T::kFewRows;
    tile_height = xq.tile_height, tile_panels = few ? T::kWide : T::kNarrow;
    const int64_t row_tiles = (rows + tile_height - 1) / tile_height;
    const int64_t split = pagedllm_cpu::num_row_blocks(row_tiles, tile_height * xq.k, groups, at::get_num_threads());
    block_rows = (row_tiles + split - 1) / split * tile_height;
    num_blocks = (rows + block_rows - 1) / block_rows;
    const int64_t tiles_per_task = (block_rows + tile_height - 1) / tile_height;
    in_runs = tiles_per_task > 1 && tiles_per_task <= 6;
    run_blocks = in_runs ? std::max<int64_t>(1, 32768 / block_stride) : blocks;
    next_run = run_blocks * block_stride;
    out_bytes = out_bf16 ? 2 : 4;
  }

  int64_t count() const override { return groups * num_blocks; }
  int64_t sums_size() const override { return run_blocks < blocks ? block_rows * kGroupCols : 0; }

  void run(int64_t task, float* sums) const override {
    const int64_t g = task % groups, row_block = task / groups;
    const int64_t row_begin = row_block * block_rows, row_end = std::min(rows, row_begin + block_rows);
    for (int64_t b = 0; b < blocks; b += run_blocks) {
      for (int64_t r = row_begin; r < row_end; r += tile_height) {
        const int64_t m = std::min(tile_height, row_end - r);
        for (int64_t panel = 0; panel < kGroupPanels; panel += tile_panels) {
          const int64_t col = g * kGroupCols + panel * kPanelCols;
          const TileArgs args{xq.quants + r * xq.k + b * kBlock * m, xq.dx + r * blocks + b * m,
                              xq.dx_sums + r * blocks + b * m, xq.starts + r * blocks + b * m,
                              first_group + g * group_stride + b * block_stride, panel, block_stride,
                              std::min(run_blocks, blocks - b),
                              sums + (r - row_begin) * kGroupCols + panel * kPanelCols, b > 0,
                              b + run_blocks >= blocks, stream_ahead,
                              r > row_begin && b + run_blocks < blocks ? next_run : 0,
                              bias == nullptr ? nullptr : bias + col,
                              out_data + (r * n + col) * out_bytes, out_bf16, n, n - col};
          if (few) tile_rows<T, T::kWide, T::kFewTileRows>(m, args);
          else tile_rows<T, T::kNarrow, T::kTileRows>(m, args);
        }
      }
    }
  }
};

// Every task of every product, in one parallel region: a thread takes a run of consecutive tasks,
// so products of equal size (a step's experts) share the threads evenly.
void run_tasks(const std::vector<std::unique_ptr<Tasks>>& products) {
  std::vector<int64_t> ends;  // each product's tasks end here, counted over all products
  int64_t total = 0, sums_size = 0;
  for (const auto& p : products) {
    ends.push_back(total += p->count());
    sums_size = std::max(sums_size, p->sums_size());
  }
  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(sums_size);
    for (int64_t task = begin; task < end; ++task) {
      const auto i = std::upper_bound(ends.begin(), ends.end(), task) - ends.begin();
      products[i]->run(task - (i == 0 ? 0 : ends[i - 1]), sums.data());
    }
  });
}

// What depends on the instruction set's vector types (Quads, FVec: template parameters, so that
// builds without AVX2, where they are only declared, never instantiate this): the tile shapes,
// the same for every bit width; the activations' offset for a weight; a product's tasks.
template <typename Quads = QuadVec, typename FVec = QuantFloat>
struct Kinds {
  template <int Bits, bool HasMins, bool PerToken = false>
  using T = Tiles<Quads, FVec, Bits, HasMins, PerToken>;

  static int64_t tile_height(int64_t rows) {
    using Any = T<4, false>;
    return rows <= Any::kFewRows ? Any::kFewTileRows : Any::kTileRows;
  }

  static int32_t offset(const PackedHeader& h) {
    return static_cast<int32_t>(h.zero_point) + (h.bits == 8 ? Quads::kQ8Offset : 0);
  }

  // The product's tasks for its header's kind (bits, mins, per token), over quantized rows xq
  static std::unique_ptr<Tasks> tasks(const PackedHeader& h, const QuantRows& xq, const at::Tensor& packed,
                                      const float* bias, int64_t stream_ahead, int64_t rows, void* out,
                                      bool out_bf16) {
    auto make = [&](auto tiles) -> std::unique_ptr<Tasks> {
      return std::make_unique<GroupTasks<decltype(tiles)>>(xq, packed, group_bytes(h.bits, h.k, h.has_mins != 0),
                                                           bias, stream_ahead, rows, h.n, out, out_bf16);
    };
    if (h.bits == 4) return h.has_mins ? make(T<4, true>{}) : make(T<4, false>{});
    if (h.per_token) return make(T<8, false, true>{});
    return h.has_mins ? make(T<8, true>{}) : make(T<8, false>{});
  }
};

template <typename K = Kinds<>>
void run(const at::Tensor& x, const PackedHeader& h, const at::Tensor& packed, const float* bias, int64_t stream_ahead,
         at::Tensor& out) {
  if constexpr (kHasQuant) {
    QuantBuffers fresh;
    QuantBuffers& buffers = x.size(0) * x.size(1) <= kKeptQuantBytes ? kept_quant_buffers() : fresh;
    const QuantRows xq =
        quantize_rows<QuantFloat>(x, K::offset(h), h.per_token != 0, K::tile_height(x.size(0)), buffers);
    std::vector<std::unique_ptr<Tasks>> products;
    products.push_back(
        K::tasks(h, xq, packed, bias, stream_ahead, x.size(0), out.data_ptr(), out.scalar_type() == at::kBFloat16));
    run_tasks(products);
  }
}

// A packed weight's header, checked against the blob's size
PackedHeader checked_header(const char* op, const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 1 && packed.is_contiguous() &&
                  packed.numel() >= kHeaderBytes && std::memcmp(packed.data_ptr(), kMagic, sizeof(kMagic)) == 0,
              op, ": packed must be what pack_quant_linear returned");
  PackedHeader h;
  std::memcpy(&h, packed.data_ptr(), sizeof(h));
  TORCH_CHECK((h.bits == 4 || h.bits == 8) && h.n > 0 && h.k > 0 && h.k % kBlock == 0 &&
                  packed.numel() == kHeaderBytes + num_groups(h.n) * group_bytes(h.bits, h.k, h.has_mins != 0),
              op, ": packed has the wrong size for its header");
  return h;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t n, int64_t k,
                        const std::optional<at::Tensor>& bias, int64_t stream_ahead) {
  TORCH_CHECK(kHasQuant, "quant_linear: this CPU build has no quantized kernel (it needs AVX2)");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16) && x.size(1) == k,
              "quant_linear: x must be float32 or bfloat16 [M, K = ", k, "], not ", dtype, " ", x.sizes());
  const PackedHeader h = checked_header("quant_linear", packed);
  TORCH_CHECK(h.bits == bits && h.n == n && h.k == k, "quant_linear: packed holds a ", h.bits, "-bit [", h.n, ", ", h.k,
              "] weight, called with bits=", bits, ", n=", n, ", k=", k);
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == n,
                "quant_linear: bias must be None or [N = ", n, "] of x's dtype, not ", bias->scalar_type(), " ",
                bias->sizes());
    bias_f = at::constant_pad_nd(bias->to(at::kFloat), {0, num_groups(n) * kGroupCols - n}).contiguous();
  }
  const at::Tensor xr = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  TORCH_CHECK(stream_ahead >= 0 && stream_ahead <= (1 << 20), "quant_linear: stream_ahead must be 0..1 MiB, not ",
              stream_ahead);
  run(xr, h, packed, b, stream_ahead, out);
  return out;
}

// A step's experts (vLLM's fused_moe, llama.cpp's mul_mat_id): x's rows grouped by expert, rows
// offsets[g] .. offsets[g + 1] times weight g; every expert's tasks in one parallel region, so the
// experts of one token share the threads and each weight is read once whatever rows it has.
template <typename K = Kinds<>>
void run_experts(const at::Tensor& x, const std::vector<PackedHeader>& headers, at::TensorList packed,
                 const int64_t* offsets, int64_t stream_ahead, at::Tensor& out) {
  if constexpr (kHasQuant) {
    const auto groups = static_cast<int64_t>(headers.size());
    std::vector<QuantBuffers> buffers(groups);  // a few rows each: quantized in the calling thread
    std::vector<std::unique_ptr<Tasks>> products;
    const bool out_bf16 = out.scalar_type() == at::kBFloat16;
    char* const out_data = static_cast<char*>(out.data_ptr());
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t rows = offsets[g + 1] - offsets[g];
      if (rows == 0) continue;
      const PackedHeader& h = headers[g];
      const QuantRows xq = quantize_rows<QuantFloat>(x.narrow(0, offsets[g], rows), K::offset(h), h.per_token != 0,
                                                     K::tile_height(rows), buffers[g]);
      void* const rows_out = out_data + offsets[g] * h.n * out.element_size();
      products.push_back(K::tasks(h, xq, packed[g], nullptr, stream_ahead, rows, rows_out, out_bf16));
    }
    run_tasks(products);
  }
}

at::Tensor moe_quant_linear(const at::Tensor& x, at::TensorList packed, const at::Tensor& offsets,
                            int64_t stream_ahead) {
  TORCH_CHECK(kHasQuant, "moe_quant_linear: this CPU build has no quantized kernel (it needs AVX2)");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16),
              "moe_quant_linear: x must be float32 or bfloat16 [M, K], not ", dtype, " ", x.sizes());
  const auto groups = static_cast<int64_t>(packed.size());
  TORCH_CHECK(groups > 0, "moe_quant_linear: no weights");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.size(0) == groups + 1 &&
                  offsets.is_contiguous(),
              "moe_quant_linear: offsets must be int64 [", groups + 1, "] (one more than the weights)");
  const int64_t* const at_row = offsets.data_ptr<int64_t>();
  TORCH_CHECK(at_row[0] == 0 && at_row[groups] == x.size(0),
              "moe_quant_linear: offsets must run from 0 to x's rows (", x.size(0), ")");
  std::vector<PackedHeader> headers;
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK(at_row[g + 1] >= at_row[g], "moe_quant_linear: offsets must not decrease");
    headers.push_back(checked_header("moe_quant_linear", packed[g]));
    TORCH_CHECK(headers[g].k == x.size(1) && headers[g].n == headers[0].n, "moe_quant_linear: weight ", g, " is [",
                headers[g].n, ", ", headers[g].k, "], not [", headers[0].n, ", ", x.size(1), "] as x and weight 0 say");
  }
  TORCH_CHECK(stream_ahead >= 0 && stream_ahead <= (1 << 20),
              "moe_quant_linear: stream_ahead must be 0..1 MiB, not ", stream_ahead);
  const at::Tensor xr = x.is_contiguous() ? x : x.contiguous();
  at::Tensor out = at::empty({x.size(0), headers[0].n}, x.options());
  if (x.size(0) > 0) run_experts(xr, headers, packed, at_row, stream_ahead, out);
  return out;
}

}  // namespace

at::Tensor pagedllm_ops::quant_linear(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t n,
                                      int64_t k, const std::optional<at::Tensor>& bias, int64_t stream_ahead) {
  require_cpu("quant_linear", {x, packed, or_undefined(bias)});
  return ::quant_linear(x, packed, bits, n, k, bias, stream_ahead);
}

at::Tensor pagedllm_ops::moe_quant_linear(const at::Tensor& x, const std::vector<at::Tensor>& packed,
                                          const at::Tensor& offsets, int64_t stream_ahead) {
  require_cpu("moe_quant_linear", {x, offsets});
  for (const at::Tensor& p : packed) require_cpu("moe_quant_linear", {p});
  return ::moe_quant_linear(x, packed, offsets, stream_ahead);
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("quant_linear_available() -> bool", &available);
  m.def("pack_quant_linear(Tensor q, Tensor scales, Tensor? mins, int bits, bool per_token=False) -> Tensor");
  m.impl("pack_quant_linear", c10::DispatchKey::CPU, &pack_quant_linear);
  m.def("quant_linear(Tensor x, Tensor packed, int bits, int n, int k, Tensor? bias, int stream_ahead=4096) -> Tensor");
  m.impl("quant_linear", c10::DispatchKey::CPU, &quant_linear);
  m.def("moe_quant_linear(Tensor x, Tensor[] packed, Tensor offsets, int stream_ahead=4096) -> Tensor");
  m.impl("moe_quant_linear", c10::DispatchKey::CPU, &moe_quant_linear);
}
