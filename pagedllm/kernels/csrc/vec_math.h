// Small math shared by the CPU kernels, written branch-free so loops over it vectorize.
#pragma once

#include <c10/util/bit_cast.h>

#include <cstdint>

#include "cpu_types.h"

namespace pagedllm_cpu {

// exp(x) for the softmax's x - max <= 0: 2^k * p(r) with Cephes' expf polynomial (~1 ulp),
// branch-free so loops over it vectorize. x is clamped above float's smallest normal, since a
// subnormal weight would only slow every product it enters.
inline float exp_nonpositive(float x) {
  x = x > -87.f ? x : -87.f;
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding and removing it rounds to an integer
  const float k = (x * 1.44269504088896341f + kRound) - kRound;
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * c10::bit_cast<float>((static_cast<int32_t>(k) + 127) << 23);
}

// The same, 16 lanes at a time: the same clamp, rounding and polynomial (its last step grouped
// as fma(p r, r, r + 1), so not always bit for bit the scalar's; each path uses only one).
inline FloatVec16 exp_nonpositive(FloatVec16 x) {
  using V = FloatVec16;
  x = V::max(x, V::broadcast(-87.f));
  const V round = V::broadcast(12582912.f);
  const V k = V::sub(V::fma(x, V::broadcast(1.44269504088896341f), round), round);
  const V r = V::fma(k, V::broadcast(2.12194440e-4f), V::fnmadd(k, V::broadcast(0.693359375f), x));
  V p = V::broadcast(1.9875691500e-4f);
  p = V::fma(p, r, V::broadcast(1.3981999507e-3f));
  p = V::fma(p, r, V::broadcast(8.3334519073e-3f));
  p = V::fma(p, r, V::broadcast(4.1665795894e-2f));
  p = V::fma(p, r, V::broadcast(1.6666665459e-1f));
  p = V::fma(p, r, V::broadcast(5.0000001201e-1f));
  p = V::fma(V::mul(p, r), r, V::add(r, V::broadcast(1.f)));
  return V::mul(p, V::pow2(k));
}

}  // namespace pagedllm_cpu
