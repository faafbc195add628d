// GGUF's block formats packed straight into quant_linear's layout (quant_linear_layout.h), in one
// pass over the file's bytes on every core: no codes, scales or mins are spelled out in between,
// so a model's load costs a read of its file, not several passes over a byte per weight.
//
// pack_gguf_linear(raw [N, row bytes] uint8: the tensor's rows as stored, format, k) -> the blob
// pack_quant_linear would give for the same weights (tests compare the two byte for byte):
//   Q4_0  18 bytes per 32: float16 d, 16 bytes of codes      W = d * q - 8 d  (the 8 folded: z = 8)
//   Q4_1  20 bytes per 32: float16 d, float16 m, 16 bytes   W = d * q + m
//   Q8_0  34 bytes per 32: float16 d, 32 int8 codes          W = d * q
//   Q4_K 144 bytes per 256: float16 d and dmin, 12 bytes of 6-bit factors (sc, m) per sub-block of
//        32, 128 bytes of codes in 4 runs of 32 whose low halves are one sub-block, high the next
//                                                            W = (d sc) q - (dmin m)
//   Q5_K 176 bytes per 256: as Q4_K, with 32 bytes of fifth bits before the codes: 5-bit codes
//        held as 8-bit ones, without loss
//   Q6_K 210 bytes per 256: 6-bit codes with an int8 scale per 16 values, a float16 d last: its
//        values quantized again to 8 bits per 32 (symmetric, round to nearest even), as
//        model/gguf_weights.py reads it: a rounding far below the format's own
//
// gguf_rows(raw, ids [M] int64, format, k) -> rows ids of such a tensor as float32 [M, k] (an
// embedding's lookup), each value (q - zero point) * scale + min from the same blocks as packed:
// the product is exact (a code of at most 8 bits times a scale of at most 17), so the value is
// the one rounding of the sum, as BlockQuantized.dequantize computes it.
// Q4_0's and Q4_1's 16 bytes hold codes k and k + 16 in byte k's low and high halves: exactly the
// 4-bit layout's pairing, so their bytes are copied as they are.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops.h"
#include "quant_linear_layout.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

namespace {

using namespace pagedllm_quant;

enum class Format { kQ4_0, kQ4_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K };

struct FormatInfo {
  Format format;
  int64_t block_values, block_bytes, bits, zero_point;
  bool has_mins;
};

FormatInfo format_info(const std::string& name) {
  if (name == "Q4_0") return {Format::kQ4_0, 32, 18, 4, 8, false};
  if (name == "Q4_1") return {Format::kQ4_1, 32, 20, 4, 0, true};
  if (name == "Q8_0") return {Format::kQ8_0, 32, 34, 8, 0, false};
  if (name == "Q4_K") return {Format::kQ4_K, 256, 144, 4, 0, true};
  if (name == "Q5_K") return {Format::kQ5_K, 256, 176, 8, 0, true};
  if (name == "Q6_K") return {Format::kQ6_K, 256, 210, 8, 0, false};
  TORCH_CHECK(false, "pack_gguf_linear: no packer for GGUF format ", name, " (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)");
}

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One 32-block of one row as the layout holds it: 4-bit, byte j = codes j | codes j + 16 << 4
// (16 bytes); 8-bit, byte j = code j + 128 (32 bytes); its scale and min.
struct Block32 {
  uint8_t bytes[32];
  float scale, min;
};

// Sub-block j's 6-bit scale and min factors from a K-quant's 12 bytes (llama.cpp's get_scale_min_k4).
void k_scale_min(const uint8_t* s, int64_t j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Block b (of 32) of a row of raw bytes.
void read_block(const FormatInfo& f, const uint8_t* row, int64_t b, Block32& out) {
  switch (f.format) {
    case Format::kQ4_0:
    case Format::kQ4_1: {
      const uint8_t* block = row + b * f.block_bytes;
      std::memcpy(out.bytes, block + f.block_bytes - 16, 16);
      out.scale = half_at(block);
      out.min = f.format == Format::kQ4_1 ? half_at(block + 2) : 0.f;
      return;
    }
    case Format::kQ8_0: {
      const uint8_t* block = row + b * f.block_bytes;
      for (int i = 0; i < 32; ++i) out.bytes[i] = block[2 + i] ^ 0x80;
      out.scale = half_at(block);
      out.min = 0.f;
      return;
    }
    case Format::kQ4_K:
    case Format::kQ5_K: {
      const uint8_t* super = row + b / 8 * f.block_bytes;
      const int64_t j = b % 8;
      int sc, m;
      k_scale_min(super + 4, j, sc, m);
      out.scale = half_at(super) * static_cast<float>(sc);
      out.min = -(half_at(super + 2) * static_cast<float>(m));
      if (f.format == Format::kQ4_K) {
        const uint8_t* run = super + 16 + j / 2 * 32;
        for (int i = 0; i < 16; ++i) {
          out.bytes[i] = j % 2 == 0 ? (run[i] & 0x0F) | (run[i + 16] << 4) : (run[i] >> 4) | (run[i + 16] & 0xF0);
        }
      } else {  // 5-bit codes 0..31: 4 low bits as Q4_K's, the fifth bit j of qh[i]
        const uint8_t *qh = super + 16, *run = super + 48 + j / 2 * 32;
        for (int i = 0; i < 32; ++i) {
          const int low = j % 2 == 0 ? run[i] & 0x0F : run[i] >> 4;
          out.bytes[i] = static_cast<uint8_t>((low | (((qh[i] >> j) & 1) << 4)) ^ 0x80);
        }
      }
      return;
    }
    case Format::kQ6_K: {  // 16 values per scale, so quantized again to 8 bits per 32 (read_gguf's _widened)
      const uint8_t* super = row + b / 8 * f.block_bytes;
      const uint8_t *ql = super, *qh = super + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(super + 192);
      const float d = half_at(super + 208);
      float values[32], amax = 0.f;
      for (int t = 0; t < 32; ++t) {
        const int v = static_cast<int>(b % 8) * 32 + t, half = v / 128, i = v % 128;
        const int low = (ql[half * 64 + i % 64] >> (4 * (i / 64))) & 0x0F;
        const int high = (qh[half * 32 + i % 32] >> (2 * (i / 32))) & 0x03;
        const float scale = d * static_cast<float>(scales[v / 16]);
        values[t] = scale * static_cast<float>((low | (high << 4)) - 32);
        amax = std::max(amax, std::fabs(values[t]));
      }
      out.scale = amax / 127.f;
      const float inverse = out.scale > 0.f ? 1.f / out.scale : 0.f;
      for (int t = 0; t < 32; ++t) {
        const float code = std::min(127.f, std::max(-128.f, std::nearbyint(values[t] * inverse)));
        out.bytes[t] = static_cast<uint8_t>(static_cast<int>(code) + 128);
      }
      out.min = 0.f;
      return;
    }
  }
}

c10::Half to_half(float value, const char* name) {
  TORCH_CHECK(std::isfinite(value) && std::fabs(value) <= 65504.f, "pack_gguf_linear: ", name,
              " must be finite and within float16's range (|x| <= 65504), as they are stored in float16");
  return c10::Half(value);
}

at::Tensor pack_gguf_linear(const at::Tensor& raw, const std::string& format, int64_t k) {
  const FormatInfo f = format_info(format);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous(),
              "pack_gguf_linear: raw must be a contiguous uint8 [N, row bytes] tensor, not ", raw.scalar_type(), " ",
              raw.sizes());
  const int64_t n = raw.size(0);
  TORCH_CHECK(n > 0 && k > 0 && k % f.block_values == 0 && raw.size(1) == k / f.block_values * f.block_bytes,
              "pack_gguf_linear: ", format, " rows of ", k, " values take ", k / f.block_values * f.block_bytes,
              " bytes, not ", raw.size(1), " (k must be a multiple of ", f.block_values, ")");
  const int64_t blocks = k / kBlock, groups = num_groups(n);
  const int64_t wbytes = weight_bytes(f.bits), stride = wbytes + param_bytes(f.has_mins);
  const int64_t gbytes = group_bytes(f.bits, k, f.has_mins);
  at::Tensor packed = at::empty({kHeaderBytes + groups * gbytes}, raw.options());
  uint8_t* out = packed.data_ptr<uint8_t>();
  std::memset(out, 0, kHeaderBytes);
  const PackedHeader h{{}, f.bits, n, k, f.zero_point, f.has_mins ? 1 : 0};
  std::memcpy(out, &h, sizeof(h));
  std::memcpy(out, kMagic, sizeof(kMagic));
  const uint8_t* rows = raw.data_ptr<uint8_t>();
  const int64_t row_bytes = raw.size(1);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    Block32 block;
    for (int64_t g = begin; g < end; ++g) {
      uint8_t* group = out + kHeaderBytes + g * gbytes;
      for (int64_t col = 0; col < kGroupCols; ++col) {
        const int64_t row = g * kGroupCols + col, panel = col / kPanelCols, lane = col % kPanelCols;
        for (int64_t b = 0; b < blocks; ++b) {
          if (row < n) {
            read_block(f, rows + row * row_bytes, b, block);
          } else {  // padding: zero weights
            std::memset(block.bytes, f.bits == 4 ? 0 : 0x80, sizeof(block.bytes));
            block.scale = block.min = 0.f;
          }
          // step s of the block: bytes 4s..4s+3 of the row, for its column of its panel
          uint8_t* weights = group + b * stride + panel * 64 + lane * 4;
          for (int s = 0; s < f.bits; ++s) std::memcpy(weights + s * 256, block.bytes + 4 * s, 4);
          c10::Half* params = reinterpret_cast<c10::Half*>(group + b * stride + wbytes);
          params[col] = to_half(block.scale, "scales");
          if (f.has_mins) params[kGroupCols + col] = to_half(block.min, "mins");
        }
      }
    }
  });
  return packed;
}

at::Tensor gguf_rows(const at::Tensor& raw, const at::Tensor& ids, const std::string& format, int64_t k) {
  const FormatInfo f = format_info(format);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() && k > 0 &&
                  k % f.block_values == 0 && raw.size(1) == k / f.block_values * f.block_bytes,
              "gguf_rows: raw must be contiguous uint8 [V, ", k / f.block_values * f.block_bytes, "] for ", format,
              " rows of ", k, " values");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "gguf_rows: ids must be int64 [M]");
  const at::Tensor index = ids.contiguous();
  const int64_t m = index.size(0), vocab = raw.size(0), row_bytes = raw.size(1), blocks = k / kBlock;
  const int64_t* id = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < vocab, "gguf_rows: id ", id[i], " is not a row of the ", vocab);
  at::Tensor out = at::empty({m, k}, raw.options().dtype(at::kFloat));
  float* values = out.data_ptr<float>();
  const uint8_t* rows = raw.data_ptr<uint8_t>();
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    Block32 block;
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t b = 0; b < blocks; ++b) {
        read_block(f, rows + id[i] * row_bytes, b, block);
        float* v = values + i * k + b * kBlock;
        for (int j = 0; j < kBlock; ++j) {
          const int q = f.bits == 4 ? (j < 16 ? block.bytes[j] & 0x0F : block.bytes[j - 16] >> 4)
                                    : static_cast<int>(block.bytes[j]) - 128;
          v[j] = static_cast<float>(q - f.zero_point) * block.scale + block.min;
        }
      }
    }
  });
  return out;
}

}  // namespace

at::Tensor pagedllm_ops::gguf_rows(const at::Tensor& raw, const at::Tensor& ids, const std::string& format, int64_t k) {
  require_cpu("gguf_rows", {raw, ids});
  return ::gguf_rows(raw, ids, format, k);
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("gguf_rows(Tensor raw, Tensor ids, str format, int k) -> Tensor");
  m.impl("gguf_rows", c10::DispatchKey::CPU, &gguf_rows);
  m.def("pack_gguf_linear(Tensor raw, str format, int k) -> Tensor");
  m.impl("pack_gguf_linear", c10::DispatchKey::CPU, &pack_gguf_linear);
}
