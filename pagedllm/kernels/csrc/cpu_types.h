// The kernels' vector types, and the one place their instruction set is chosen.
//
// PAGEDLLM_CPU_ISA comes from what the compiler targets (-march=native): 3 AVX-512 with BF16,
// 2 AVX-512, 1 AVX2 + FMA + F16C, 0 none. Every section below is keyed on it, and nothing else
// in the kernels tests an instruction set: they are written in these types and pick among their
// paths with the constants kHasAvx2 / kHasAvx512 / kHasAvx512Bf16.
//
//   FloatVec8    8 floats: one AVX2 register, else plain loops.
//   FloatVec16   16 floats: one AVX-512 register, else plain loops (the kernels take 16-lane paths
//                only where kHasAvx512; elsewhere these compile and are never reached).
//   Bf16PairVec  16 pairs of bfloat16 for dpbf16ps; AVX512-BF16 builds only (declared elsewhere,
//                reached only through templates instantiated there).
//   ByteQuadVec16 / ByteQuadVec8  16 / 8 int32 lanes, each summing the products of 4 unsigned
//                weight bytes and 4 signed activation bytes (vpdpbusd). PAGEDLLM_CPU_VNNI picks
//                how: 2 AVX512-VNNI (16 lanes), 1 AVX-VNNI (8 lanes), 0 AVX2's maddubs (8 lanes);
//                no AVX2: declared only, like Bf16PairVec.
//
// Each operation is one instruction or a fixed sequence of them, so a sum's order is the code's.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/bit_cast.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512BF16__) && \
    defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDLLM_CPU_ISA 3
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX2__) && \
    defined(__FMA__) && defined(__F16C__)
#define PAGEDLLM_CPU_ISA 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDLLM_CPU_ISA 1
#else
#define PAGEDLLM_CPU_ISA 0
#endif

// The byte dot products, beside the ladder above: AVX-512 without VNNI (Skylake-X) takes AVX2's.
#if PAGEDLLM_CPU_ISA >= 2 && defined(__AVX512VNNI__)
#define PAGEDLLM_CPU_VNNI 2
#elif PAGEDLLM_CPU_ISA >= 1 && defined(__AVXVNNI__)
#define PAGEDLLM_CPU_VNNI 1
#else
#define PAGEDLLM_CPU_VNNI 0
#endif

#if PAGEDLLM_CPU_ISA >= 1
#include <immintrin.h>
#endif

// A loop body marked for llvm-mca, named with four numbers (a tile's kind, rows, panels...): only
// where benchmarks/loop_model.py compiles to assembly with -DPAGEDLLM_MCA; nothing otherwise.
// kMcaModel (PAGEDLLM_MCA_MODEL): such a build, whose loops leave out what would branch inside
// them (the software prefetch: llvm-mca models a straight run of instructions).
#ifdef PAGEDLLM_MCA
#define PAGEDLLM_MCA_MODEL true
#define PAGEDLLM_MCA_MARK(what, name, a, b, c, d) \
  asm volatile("# LLVM-MCA-" what " " name "_%c0_%c1_%c2_%c3" ::"i"(a), "i"(b), "i"(c), "i"(d))
#define PAGEDLLM_MCA_BEGIN(name, a, b, c, d) PAGEDLLM_MCA_MARK("BEGIN", name, a, b, c, d)
#define PAGEDLLM_MCA_END(name, a, b, c, d) PAGEDLLM_MCA_MARK("END", name, a, b, c, d)
#else
#define PAGEDLLM_MCA_MODEL false
#define PAGEDLLM_MCA_BEGIN(name, a, b, c, d)
#define PAGEDLLM_MCA_END(name, a, b, c, d)
#endif

namespace pagedllm_cpu {

constexpr bool kMcaModel = PAGEDLLM_MCA_MODEL;
constexpr bool kHasAvx2 = PAGEDLLM_CPU_ISA >= 1;
constexpr bool kHasAvx512 = PAGEDLLM_CPU_ISA >= 2;
constexpr bool kHasAvx512Bf16 = PAGEDLLM_CPU_ISA >= 3;
constexpr bool kHasAvx512Vnni = PAGEDLLM_CPU_VNNI >= 2;

// N floats in plain loops: a width the instruction set has no register for.
template <int N>
struct ArrayVec {
  static constexpr int64_t kLanes = N;
  float v[N];

  static ArrayVec broadcast(float x) {
    ArrayVec r;
    std::fill(r.v, r.v + N, x);
    return r;
  }
  static ArrayVec zero() { return broadcast(0.f); }
  template <typename T>  // float, c10::BFloat16, c10::Half or int8_t
  static ArrayVec load(const T* p) {
    ArrayVec r;
    for (int i = 0; i < N; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  // the first n lanes from p, the others from rest
  static ArrayVec load_first(const float* p, int64_t n, ArrayVec rest) {
    for (int i = 0; i < N && i < n; ++i) rest.v[i] = p[i];
    return rest;
  }
  void store(float* p) const { std::copy(v, v + N, p); }
  ArrayVec keep_first(int64_t n) const {  // lanes from n on zeroed
    ArrayVec r = *this;
    for (int64_t i = std::max<int64_t>(n, 0); i < N; ++i) r.v[i] = 0.f;
    return r;
  }

  template <typename F>
  static ArrayVec map(ArrayVec a, ArrayVec b, F f) {
    for (int i = 0; i < N; ++i) a.v[i] = f(a.v[i], b.v[i]);
    return a;
  }
  static ArrayVec add(ArrayVec a, ArrayVec b) { return map(a, b, [](float x, float y) { return x + y; }); }
  static ArrayVec sub(ArrayVec a, ArrayVec b) { return map(a, b, [](float x, float y) { return x - y; }); }
  static ArrayVec mul(ArrayVec a, ArrayVec b) { return map(a, b, [](float x, float y) { return x * y; }); }
  static ArrayVec div(ArrayVec a, ArrayVec b) { return map(a, b, [](float x, float y) { return x / y; }); }
  static ArrayVec max(ArrayVec a, ArrayVec b) { return map(a, b, [](float x, float y) { return x > y ? x : y; }); }
  ArrayVec abs() const { return map(*this, *this, [](float x, float) { return std::fabs(x); }); }
  ArrayVec round() const {  // to the nearest whole number, ties to even (the default rounding mode)
    return map(*this, *this, [](float x, float) { return std::nearbyint(x); });
  }
  void store_int8(int8_t* p) const {  // lanes holding whole numbers in int8's range
    for (int i = 0; i < N; ++i) p[i] = static_cast<int8_t>(v[i]);
  }
  void store_first(float* p, int64_t n) const { std::copy(v, v + std::min<int64_t>(n, N), p); }
  static ArrayVec fma(ArrayVec a, ArrayVec b, ArrayVec c) {  // a * b + c
    for (int i = 0; i < N; ++i) c.v[i] += a.v[i] * b.v[i];
    return c;
  }
  static ArrayVec fnmadd(ArrayVec a, ArrayVec b, ArrayVec c) {  // c - a * b
    for (int i = 0; i < N; ++i) c.v[i] -= a.v[i] * b.v[i];
    return c;
  }
  static ArrayVec pow2(ArrayVec k) {  // 2^k for whole k in float's normal range
    for (int i = 0; i < N; ++i) k.v[i] = c10::bit_cast<float>((static_cast<int32_t>(std::nearbyint(k.v[i])) + 127) << 23);
    return k;
  }
  static ArrayVec select(uint32_t mask, ArrayVec a, ArrayVec b) {  // lane i from a where bit i is set
    for (int i = 0; i < N; ++i) b.v[i] = (mask >> i) & 1 ? a.v[i] : b.v[i];
    return b;
  }
  static uint32_t greater(ArrayVec a, ArrayVec b) {
    uint32_t mask = 0;
    for (int i = 0; i < N; ++i) mask |= uint32_t{a.v[i] > b.v[i]} << i;
    return mask;
  }
  static uint32_t nan_lanes(ArrayVec a) {
    uint32_t mask = 0;
    for (int i = 0; i < N; ++i) mask |= uint32_t{std::isnan(a.v[i])} << i;
    return mask;
  }
  float reduce_add() const {
    float sum = 0.f;
    for (float x : v) sum += x;
    return sum;
  }
  float reduce_max() const { return *std::max_element(v, v + N); }
  // lane i: the sum of acc[i]'s 8 lanes, in the order FloatVec8's AVX2 transpose-and-add takes
  static ArrayVec sum_each(const ArrayVec* acc) {
    static_assert(N == 8);
    ArrayVec r;
    for (int i = 0; i < 8; ++i) {
      const float* a = acc[i].v;
      r.v[i] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    }
    return r;
  }
};

#if PAGEDLLM_CPU_ISA >= 1
struct FloatVec8 {
  static constexpr int64_t kLanes = 8;
  __m256 v;

  static FloatVec8 zero() { return {_mm256_setzero_ps()}; }
  static FloatVec8 broadcast(float x) { return {_mm256_set1_ps(x)}; }
  static FloatVec8 load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static FloatVec8 load(const c10::BFloat16* p) {  // a bfloat16 is the top half of a float32
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16))};
  }
  static FloatVec8 load(const c10::Half* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
  static FloatVec8 load(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store_first(float* p, int64_t n) const {
    float lanes[8];
    store(lanes);
    std::copy(lanes, lanes + std::min<int64_t>(n, 8), p);
  }
  void store_int8(int8_t* p) const {  // lanes holding whole numbers in int8's range
    const __m256i i = _mm256_cvtps_epi32(v);
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(words, words));
  }
  static FloatVec8 add(FloatVec8 a, FloatVec8 b) { return {_mm256_add_ps(a.v, b.v)}; }
  static FloatVec8 mul(FloatVec8 a, FloatVec8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
  static FloatVec8 div(FloatVec8 a, FloatVec8 b) { return {_mm256_div_ps(a.v, b.v)}; }
  static FloatVec8 max(FloatVec8 a, FloatVec8 b) { return {_mm256_max_ps(a.v, b.v)}; }
  static FloatVec8 fma(FloatVec8 a, FloatVec8 b, FloatVec8 c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  FloatVec8 abs() const { return {_mm256_andnot_ps(_mm256_set1_ps(-0.f), v)}; }
  FloatVec8 round() const { return {_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  float reduce_add() const {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
  float reduce_max() const {
    const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
  }
  // lane i: the sum of acc[i]'s 8 lanes, one transpose-and-add for all 8 (no horizontal sum per
  // vector), every lane's sum in the same order
  static FloatVec8 sum_each(const FloatVec8* acc) {
    // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0].v, acc[1].v), _mm256_hadd_ps(acc[2].v, acc[3].v));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4].v, acc[5].v), _mm256_hadd_ps(acc[6].v, acc[7].v));
    // s0123 = [vectors 0-3, lanes 0-3 summed | vectors 0-3, lanes 4-7 summed]; likewise s4567
    return {_mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31))};
  }
};
#else
using FloatVec8 = ArrayVec<8>;
#endif

#if PAGEDLLM_CPU_ISA >= 2
struct FloatVec16 {
  static constexpr int64_t kLanes = 16;
  __m512 v;

  static FloatVec16 zero() { return {_mm512_setzero_ps()}; }
  static FloatVec16 broadcast(float x) { return {_mm512_set1_ps(x)}; }
  static FloatVec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static FloatVec16 load(const c10::BFloat16* p) {
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16))};
  }
  static FloatVec16 load(const c10::Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
  static FloatVec16 load(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  static FloatVec16 load_first(const float* p, int64_t n, FloatVec16 rest) {
    return {_mm512_mask_loadu_ps(rest.v, first_lanes(n), p)};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store_first(float* p, int64_t n) const { _mm512_mask_storeu_ps(p, first_lanes(n), v); }
  void store_int8(int8_t* p) const {  // lanes holding whole numbers in int8's range
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
  }
  FloatVec16 keep_first(int64_t n) const { return {_mm512_maskz_mov_ps(first_lanes(n), v)}; }
  static FloatVec16 add(FloatVec16 a, FloatVec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
  static FloatVec16 sub(FloatVec16 a, FloatVec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
  static FloatVec16 mul(FloatVec16 a, FloatVec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static FloatVec16 div(FloatVec16 a, FloatVec16 b) { return {_mm512_div_ps(a.v, b.v)}; }
  FloatVec16 abs() const { return {_mm512_abs_ps(v)}; }
  FloatVec16 round() const { return {_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  static FloatVec16 max(FloatVec16 a, FloatVec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
  static FloatVec16 fma(FloatVec16 a, FloatVec16 b, FloatVec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static FloatVec16 fnmadd(FloatVec16 a, FloatVec16 b, FloatVec16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
  static FloatVec16 pow2(FloatVec16 k) {
    const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k.v), _mm512_set1_epi32(127)), 23);
    return {_mm512_castsi512_ps(exponent)};
  }
  static FloatVec16 select(uint32_t mask, FloatVec16 a, FloatVec16 b) {
    return {_mm512_mask_mov_ps(b.v, static_cast<__mmask16>(mask), a.v)};
  }
  static uint32_t greater(FloatVec16 a, FloatVec16 b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ); }
  static uint32_t nan_lanes(FloatVec16 a) { return _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q); }
  float reduce_add() const { return _mm512_reduce_add_ps(v); }
  float reduce_max() const { return _mm512_reduce_max_ps(v); }

 private:
  static __mmask16 first_lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }
};

// Lanes i and i + 8 added: the 8 partial sums of a 16-lane accumulator.
inline FloatVec8 fold8(FloatVec16 x) {
  return {_mm256_add_ps(_mm512_castps512_ps256(x.v), _mm512_extractf32x8_ps(x.v, 1))};
}
#else
using FloatVec16 = ArrayVec<16>;

inline FloatVec8 fold8(const FloatVec16& x) {
  float folded[8];
  for (int i = 0; i < 8; ++i) folded[i] = x.v[i] + x.v[i + 8];
  return FloatVec8::load(folded);
}
#endif

#if PAGEDLLM_CPU_ISA >= 3
struct Bf16PairVec {
  __m512i v;

  static Bf16PairVec load(const void* p) { return {_mm512_loadu_si512(p)}; }
  static Bf16PairVec broadcast(uint32_t pair) { return {_mm512_set1_epi32(static_cast<int32_t>(pair))}; }
  void store(void* p) const { _mm512_storeu_si512(p, v); }
  // a's and b's bfloat16 values interleaved, from the low / high 4 of each 8-value lane
  static Bf16PairVec interleave_low(Bf16PairVec a, Bf16PairVec b) { return {_mm512_unpacklo_epi16(a.v, b.v)}; }
  static Bf16PairVec interleave_high(Bf16PairVec a, Bf16PairVec b) { return {_mm512_unpackhi_epi16(a.v, b.v)}; }
  // acc + a . b per float lane: each lane's pair of products summed in float32
  static FloatVec16 dot(FloatVec16 acc, Bf16PairVec a, Bf16PairVec b) {
    return {_mm512_dpbf16_ps(acc.v, as_bf16(a.v), as_bf16(b.v))};
  }
  // 16 floats rounded to bfloat16 (nearest even), stored
  static void store_rounded(void* p, FloatVec16 x) {
    const __m256bh rounded = _mm512_cvtneps_pbh(x.v);
    std::memcpy(p, &rounded, sizeof(rounded));
  }
  // 16 vectors of 16 pairs, transposed: r[c] then holds pair c of every vector
  static void transpose16(Bf16PairVec* r) {
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {  // in each 128-bit block b: elements 4b, 4b+1 / 4b+2, 4b+3 of 2 rows
      t[2 * i] = _mm512_unpacklo_epi32(r[2 * i].v, r[2 * i + 1].v);
      t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i].v, r[2 * i + 1].v);
    }
    __m512i u[16];
    for (int i = 0; i < 4; ++i) {  // u[4i + j], block b: element 4b + j of rows 4i .. 4i + 3
      u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; ++j) {  // the 128-bit blocks of u[j], u[4 + j], u[8 + j], u[12 + j], transposed
      const __m512i e = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), f = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
      const __m512i g = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44), h = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
      r[j].v = _mm512_shuffle_i32x4(e, g, 0x88);
      r[4 + j].v = _mm512_shuffle_i32x4(e, g, 0xDD);
      r[8 + j].v = _mm512_shuffle_i32x4(f, h, 0x88);
      r[12 + j].v = _mm512_shuffle_i32x4(f, h, 0xDD);
    }
  }

 private:
  static __m512bh as_bf16(__m512i x) {  // the same bits, as the type dpbf16ps takes
    __m512bh y;
    std::memcpy(&y, &x, sizeof(y));
    return y;
  }
};
#else
struct Bf16PairVec;
#endif

// The byte dot products of the quantized projections: weights as unsigned bytes (4-bit ones below
// 16, 8-bit ones offset by 128), activations as signed bytes in -127..127, sums exact in int32.
// dot_q8's sum depends on the instruction: kQ8Offset says by how much (VNNI sums u * s, offset
// 128 included; AVX2's maddubs would saturate on that, so it takes llama.cpp's sign trick and
// sums (u - 128) * s), for the caller to start from -kQ8Offset * sum(s).
// A 32-block's nibble products (8 steps) are summed from nibble_start(start), and
// nibble_sums(acc, start) is then start + their sum: VNNI adds in int32 throughout; AVX2 keeps
// pairs in int16 (at most 8 x 2 x 15 x 127 = 30,480: no saturation) and widens them once.
#if PAGEDLLM_CPU_VNNI >= 2
struct ByteQuadVec16 {
  static constexpr int64_t kLanes = 16;
  static constexpr int32_t kQ8Offset = 128;
  __m512i v;

  static ByteQuadVec16 load(const void* p) { return {_mm512_loadu_si512(p)}; }
  void store(void* p) const { _mm512_storeu_si512(p, v); }
  static ByteQuadVec16 broadcast(int32_t x) { return {_mm512_set1_epi32(x)}; }
  static ByteQuadVec16 broadcast_quad(const int8_t* p) {  // the 4 bytes at p, in every lane
    int32_t quad;
    std::memcpy(&quad, p, sizeof(quad));
    return broadcast(quad);
  }
  ByteQuadVec16 low_nibbles() const { return {_mm512_and_si512(v, _mm512_set1_epi8(0x0F))}; }
  ByteQuadVec16 high_nibbles() const { return {_mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F))}; }
  // acc + each lane's 4 products u * s (u < 16)
  static ByteQuadVec16 dot_nibbles(ByteQuadVec16 acc, ByteQuadVec16 u, ByteQuadVec16 s) {
    return {_mm512_dpbusd_epi32(acc.v, u.v, s.v)};
  }
  // acc + each lane's 4 products u * s (u = q + 128 for a signed weight byte q)
  static ByteQuadVec16 nibble_start(ByteQuadVec16 start) { return start; }
  static ByteQuadVec16 nibble_sums(ByteQuadVec16 acc, ByteQuadVec16) { return acc; }
  static ByteQuadVec16 dot_q8(ByteQuadVec16 acc, ByteQuadVec16 u, ByteQuadVec16 s) { return dot_nibbles(acc, u, s); }
  FloatVec16 to_float() const { return {_mm512_cvtepi32_ps(v)}; }
};
#else
struct ByteQuadVec16;
#endif

#if PAGEDLLM_CPU_ISA >= 1
struct ByteQuadVec8 {
  static constexpr int64_t kLanes = 8;
  static constexpr int32_t kQ8Offset = PAGEDLLM_CPU_VNNI >= 1 ? 128 : 0;
  __m256i v;

  static ByteQuadVec8 load(const void* p) { return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))}; }
  void store(void* p) const { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static ByteQuadVec8 broadcast(int32_t x) { return {_mm256_set1_epi32(x)}; }
  static ByteQuadVec8 broadcast_quad(const int8_t* p) {
    int32_t quad;
    std::memcpy(&quad, p, sizeof(quad));
    return broadcast(quad);
  }
  ByteQuadVec8 low_nibbles() const { return {_mm256_and_si256(v, _mm256_set1_epi8(0x0F))}; }
  ByteQuadVec8 high_nibbles() const { return {_mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F))}; }
#if PAGEDLLM_CPU_VNNI >= 1
  static ByteQuadVec8 nibble_start(ByteQuadVec8 start) { return start; }
  static ByteQuadVec8 dot_nibbles(ByteQuadVec8 acc, ByteQuadVec8 u, ByteQuadVec8 s) {
#if PAGEDLLM_CPU_VNNI >= 2
    return {_mm256_dpbusd_epi32(acc.v, u.v, s.v)};
#else
    return {_mm256_dpbusd_avx_epi32(acc.v, u.v, s.v)};
#endif
  }
  static ByteQuadVec8 nibble_sums(ByteQuadVec8 acc, ByteQuadVec8) { return acc; }
#else
  static ByteQuadVec8 nibble_start(ByteQuadVec8) { return {_mm256_setzero_si256()}; }
  static ByteQuadVec8 dot_nibbles(ByteQuadVec8 acc, ByteQuadVec8 u, ByteQuadVec8 s) {
    return {_mm256_add_epi16(acc.v, _mm256_maddubs_epi16(u.v, s.v))};
  }
  static ByteQuadVec8 nibble_sums(ByteQuadVec8 acc, ByteQuadVec8 start) {
    return {_mm256_add_epi32(start.v, _mm256_madd_epi16(acc.v, _mm256_set1_epi16(1)))};
  }
#endif
  static ByteQuadVec8 dot_q8(ByteQuadVec8 acc, ByteQuadVec8 u, ByteQuadVec8 s) {
#if PAGEDLLM_CPU_VNNI >= 1
    return dot_nibbles(acc, u, s);
#else  // |q| * (s with q's sign): pairs at most 2 * 128 * 127, within int16
    const __m256i q = _mm256_xor_si256(u.v, _mm256_set1_epi8(static_cast<char>(0x80)));
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(s.v, q));
    return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))};
#endif
  }
  FloatVec8 to_float() const { return {_mm256_cvtepi32_ps(v)}; }
};
#else
struct ByteQuadVec8;
#endif

}  // namespace pagedllm_cpu
