// quant_linear's packed weight layout (described in quant_linear_cpu.cpp), shared by the packers:
// pack_quant_linear (from codes, scales and mins) and pack_gguf_linear (from GGUF's own blocks).
#pragma once

#include <cstdint>

namespace pagedllm_quant {

constexpr int64_t kBlock = 32, kPanelCols = 16, kGroupPanels = 4, kGroupCols = 64, kHeaderBytes = 64;

struct PackedHeader {
  char magic[8];
  int64_t bits, n, k;
  int64_t zero_point;  // z: every min is -z * its scale, folded into the integer sums
  int64_t has_mins;    // 1: float16 mins stored after each block's scales
  int64_t per_token;   // 1: activations quantized per row, not per block; one scale per column (8 bits)
};
constexpr char kMagic[8] = "pqlin01";

// Bytes of a group's 32-block: weights, then params (all multiples of 64).
inline int64_t weight_bytes(int64_t bits) { return kGroupPanels * bits * 64; }
inline int64_t param_bytes(bool has_mins) { return kGroupCols * 2 * (has_mins ? 2 : 1); }
inline int64_t group_bytes(int64_t bits, int64_t k, bool has_mins) {
  return k / kBlock * (weight_bytes(bits) + param_bytes(has_mins));
}
inline int64_t num_groups(int64_t n) { return (n + kGroupCols - 1) / kGroupCols; }

}  // namespace pagedllm_quant
