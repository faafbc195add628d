// The KV cache's row formats, as the attention kernel reads them. A row is one token's keys (or
// values) for one KV head: head_dim values, and for 8-bit formats a float16 scale after them
// (x_d = value_d * scale). Each format says:
//   bytes(head_dim)        a row's size in the cache
//   offset(d)              where value d starts in a row
//   scale(row, head_dim)   its scale (1 where there is none); the kernel applies it to sums, not
//                          to each value (q . x = scale * (q . values))
//   load8 / load16(row, d) values d .. d + 7 / d + 15 as float32
//   kIsFloat32             the values are float32 already (nothing to widen)
//   kIsScaled              scale() can differ from 1
//   kIsPairs               read as bfloat16 pairs by dpbf16ps, never widened (BFloat16PairRow)
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <c10/util/bit_cast.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_types.h"

namespace pagedllm_cpu {

// A row of float32, bfloat16 or float16 values, widened to float32 as it is read.
template <typename T>
struct UnscaledRow {
  static constexpr bool kIsFloat32 = std::is_same_v<T, float>, kIsScaled = false, kIsPairs = false;
  static int64_t bytes(int64_t head_dim) { return head_dim * static_cast<int64_t>(sizeof(T)); }
  static int64_t offset(int64_t d) { return d * static_cast<int64_t>(sizeof(T)); }
  static float scale(const uint8_t* /*row*/, int64_t /*head_dim*/) { return 1.f; }
  static FloatVec8 load8(const uint8_t* row, int64_t d) { return FloatVec8::load(reinterpret_cast<const T*>(row) + d); }
  static FloatVec16 load16(const uint8_t* row, int64_t d) { return FloatVec16::load(reinterpret_cast<const T*>(row) + d); }
};

using FloatRow = UnscaledRow<float>;

// A bfloat16 row read by a bfloat16 model on a CPU with AVX512-BF16: scores and weighted sums go
// through dpbf16ps (products of bfloat16 pairs summed into float32) on the rows where they lie,
// nothing widened. Used where head_dim % 64 == 0 and the block size is even (rows are taken in
// pairs from a block boundary); only AVX512-BF16 builds instantiate the code that reads Pairs.
struct BFloat16PairRow : UnscaledRow<c10::BFloat16> {
  static constexpr bool kIsPairs = true;
  using Pairs = Bf16PairVec;
};

// head_dim 8-bit values, then a float16 scale.
struct ScaledRow {
  static constexpr bool kIsFloat32 = false, kIsScaled = true, kIsPairs = false;
  static int64_t bytes(int64_t head_dim) { return head_dim + 2; }
  static int64_t offset(int64_t d) { return d; }
  static float scale(const uint8_t* row, int64_t head_dim) {
    c10::Half scale;
    std::memcpy(&scale, row + head_dim, sizeof(scale));
    return static_cast<float>(scale);
  }
};

struct Int8Row : ScaledRow {
  static FloatVec8 load8(const uint8_t* row, int64_t d) { return FloatVec8::load(reinterpret_cast<const int8_t*>(row) + d); }
  static FloatVec16 load16(const uint8_t* row, int64_t d) {
    return FloatVec16::load(reinterpret_cast<const int8_t*>(row) + d);
  }
};

// Every float8 value by its byte, filled when the library loads (no guard on each use): c10's
// conversion works bit by bit, ~20x slower.
template <typename T>
const std::array<float, 256> kFloat8Values = [] {
  std::array<float, 256> values;
  for (int i = 0; i < 256; ++i) values[i] = static_cast<float>(c10::bit_cast<T>(static_cast<uint8_t>(i)));
  return values;
}();

// float8 (e4m3fn or e5m2), widened through the table.
template <typename T>
struct Float8Row : ScaledRow {
  template <typename Vec>
  static Vec load(const uint8_t* row, int64_t d) {
    alignas(64) float widened[Vec::kLanes];
    for (int64_t j = 0; j < Vec::kLanes; ++j) widened[j] = kFloat8Values<T>[row[d + j]];
    return Vec::load(widened);
  }
  static FloatVec8 load8(const uint8_t* row, int64_t d) { return load<FloatVec8>(row, d); }
  static FloatVec16 load16(const uint8_t* row, int64_t d) { return load<FloatVec16>(row, d); }
};

}  // namespace pagedllm_cpu
