// How fast one core of this host issues the instructions the projection kernels are made of, and
// the ceilings that follow for prompts (many rows, compute-bound).
//
//     gcc -O2 -march=native benchmarks/cpu_peak.c -o /tmp/cpu_peak && /tmp/cpu_peak
//
// Each loop runs independent chains (enough to hide the latencies), single-threaded, the fastest
// of 7 rounds; rates in G instructions per second on one core.
//
// With AVX512-VNNI and AVX512-BF16, int8 against bfloat16:
//   vpdpbusd        64 int8 multiply-adds: the integer kernel's dot products (quant_linear)
//   vdpbf16ps       32 bfloat16 multiply-adds: oneDNN's and few_rows_linear's on this CPU
//   vfmadd231ps     16 float32 multiply-adds
//   one 32-block    8 vpdpbusd then, as quant_linear does per row and 16 columns, a convert, a
//                   multiply (scale x dx) and a multiply-add: the work a 32-block's exact result asks
// The "block" rate, as int8 multiply-adds, is the most the integer kernel can reach on prompts;
// the vdpbf16ps rate the most a bfloat16 GEMM can. Their ratio bounds what 4- and 8-bit weights
// can win over bfloat16 where prompts dominate the time.
//
// With AVX2 and no VNNI (what the integer kernel's byte products are made of there, 256 bits):
//   4-bit step      vpmaddubsw + vpaddw: 32 int8 multiply-adds summed in int16 (a 4-bit code
//                   times an int8 quant never overflows 8 such steps)
//   8-bit step      vpabsb, vpsignb, vpmaddubsw, vpmaddwd, vpaddd: 32 int8 multiply-adds of
//                   signed codes, widened to int32 at every step (two products may not share int16)
//   vfmadd231ps     8 float32 multiply-adds
// as multiply-adds per second: the most quant_linear's prompt tiles can reach per core
// (benchmarks/quant_linear.py prints what they do), and a float32 GEMM's ceiling beside them.
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

enum { kChains = 12 };
static const long kIters = 20000000;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// name(): instructions per second of kChains independent chains acc = STEP(acc, w, x); the
// chains' sum goes to a sink, so that the compiler keeps them all
#define CHAINS_RATE(name, Acc, Operand, acc_init, w_init, x_init, STEP, sum)  \
  static double name(void) {                                                  \
    Acc acc[kChains];                                                         \
    Operand w = w_init, x = x_init;                                           \
    for (int i = 0; i < kChains; ++i) acc[i] = acc_init(i);                   \
    const double t = now();                                                   \
    for (long n = 0; n < kIters; ++n) {                                       \
      _Pragma("GCC unroll 12") for (int i = 0; i < kChains; ++i) acc[i] = STEP(acc[i], w, x); \
      __asm__ volatile("" : "+v"(w));                                         \
    }                                                                         \
    const double rate = kIters * kChains / (now() - t) / 1e9;                 \
    float sink = 0.f;                                                         \
    for (int i = 0; i < kChains; ++i) sink += sum(acc[i]);                    \
    __asm__ volatile("" : : "x"(sink));                                       \
    return rate;                                                              \
  }

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
static inline __m512i int_lanes(int i) { return _mm512_set1_epi32(i); }
static inline __m512 float_lanes(int i) { return _mm512_set1_ps((float)i); }
static inline float int_sum(__m512i v) { return (float)_mm512_reduce_add_epi32(v); }

CHAINS_RATE(dpbusd_rate, __m512i, __m512i, int_lanes, _mm512_set1_epi8(3), _mm512_set1_epi8(5), _mm512_dpbusd_epi32,
            int_sum)
CHAINS_RATE(dpbf16_rate, __m512, __m512bh, float_lanes, (__m512bh)_mm512_set1_epi16(0x3f80),
            (__m512bh)_mm512_set1_epi16(0x3f80), _mm512_dpbf16_ps, _mm512_reduce_add_ps)
CHAINS_RATE(fma_rate, __m512, __m512, float_lanes, _mm512_set1_ps(0.999f), _mm512_set1_ps(1e-3f), _mm512_fmadd_ps,
            _mm512_reduce_add_ps)

// vpdpbusd issued per second inside whole 32-blocks, shaped as quant_linear's prompt tile: 6 rows
// x 2 vectors of 16 columns, 8 vpdpbusd each per block, then per row and vector a convert, a
// multiply (the columns' scales x the row's dx, broadcast from memory) and a multiply-add
static double block_rate(void) {
  enum { kRows = 6, kVecs = 2 };
  static float dx[kRows] = {0.5f, 0.25f, 0.125f, 1.f, 2.f, 4.f}, columns[kVecs * 16];
  for (int c = 0; c < kVecs * 16; ++c) columns[c] = 1e-3f * (c + 1);  // each column its own scale
  __m512 acc[kRows][kVecs], scale[kVecs] = {_mm512_loadu_ps(columns), _mm512_loadu_ps(columns + 16)};
  __asm__ volatile("" : "+v"(scale[0]), "+v"(scale[1]));
  __m512i w[kVecs] = {_mm512_set1_epi8(3), _mm512_set1_epi8(7)}, x = _mm512_set1_epi8(5);
  for (int m = 0; m < kRows; ++m)
    for (int v = 0; v < kVecs; ++v) acc[m][v] = _mm512_setzero_ps();
  const long blocks = kIters / 8;
  const double t = now();
  for (long n = 0; n < blocks; ++n) {
    __m512i sums[kRows][kVecs];
#pragma GCC unroll 6
    for (int m = 0; m < kRows; ++m)
#pragma GCC unroll 2
      for (int v = 0; v < kVecs; ++v) sums[m][v] = _mm512_set1_epi32(m);
#pragma GCC unroll 8
    for (int step = 0; step < 8; ++step) {
#pragma GCC unroll 6
      for (int m = 0; m < kRows; ++m)
#pragma GCC unroll 2
        for (int v = 0; v < kVecs; ++v) sums[m][v] = _mm512_dpbusd_epi32(sums[m][v], w[v], x);
      __asm__ volatile("" : "+v"(x));
    }
#pragma GCC unroll 6
    for (int m = 0; m < kRows; ++m) {
      const __m512 row_dx = _mm512_set1_ps(dx[m]);
#pragma GCC unroll 2
      for (int v = 0; v < kVecs; ++v)
        acc[m][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[m][v]), _mm512_mul_ps(scale[v], row_dx), acc[m][v]);
    }
    __asm__ volatile("" : : "m"(dx) : "memory");
  }
  const double rate = blocks * 8 * kRows * kVecs / (now() - t) / 1e9;
  float sink = 0.f;
  for (int m = 0; m < kRows; ++m)
    for (int v = 0; v < kVecs; ++v) sink += _mm512_reduce_add_ps(acc[m][v]);
  __asm__ volatile("" : : "x"(sink));
  return rate;
}

static double max(double a, double b) { return a > b ? a : b; }

int main(void) {
  // Rounds in turn, the fastest of each kind: on a host shared with other work a core's speed
  // moves from one second to the next, and what is wanted is what the core can do.
  double dpbusd = 0, dpbf16 = 0, fma = 0, block = 0;
  for (int round = 0; round < 7; ++round) {
    dpbusd = max(dpbusd, dpbusd_rate());
    dpbf16 = max(dpbf16, dpbf16_rate());
    fma = max(fma, fma_rate());
    block = max(block, block_rate());
  }
  printf("one core, G instructions/s: vpdpbusd %.2f, vdpbf16ps %.2f, vfmadd231ps %.2f\n", dpbusd, dpbf16, fma);
  printf("vpdpbusd inside 32-blocks (with the float work): %.2f G/s, %.0f%% of its peak\n", block,
         100 * block / dpbusd);
  printf("multiply-adds per core, G/s: int8 peak %.0f, int8 in 32-blocks %.0f, bfloat16 peak %.0f\n", 64 * dpbusd,
         64 * block, 32 * dpbf16);
  printf("ceiling of int8 over bfloat16 on prompts: %.2fx (peak against peak: %.2fx)\n", 64 * block / (32 * dpbf16),
         64 * dpbusd / (32 * dpbf16));
  return 0;
}
#elif defined(__AVX2__)
static inline __m256i int16_lanes(int i) { return _mm256_set1_epi16((short)i); }
static inline __m256i int32_lanes(int i) { return _mm256_set1_epi32(i); }
static inline __m256 float8_lanes(int i) { return _mm256_set1_ps((float)i); }
static inline float lanes_sum(__m256i v) {
  int lanes[8];
  _mm256_storeu_si256((__m256i*)lanes, v);
  float sum = 0.f;
  for (int i = 0; i < 8; ++i) sum += (float)lanes[i];
  return sum;
}
static inline float float_sum(__m256 v) {
  float lanes[8];
  _mm256_storeu_ps(lanes, v);
  float sum = 0.f;
  for (int i = 0; i < 8; ++i) sum += lanes[i];
  return sum;
}
// The chain's own sum as the quants (x unused): the products must differ from chain to chain, or
// the compiler computes one and adds it twelve times
static inline __m256i nibble_step(__m256i acc, __m256i w, __m256i x) {
  (void)x;
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, acc));
}
static inline __m256i q8_step(__m256i acc, __m256i w, __m256i x) {
  (void)x;
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(acc, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

CHAINS_RATE(nibble_rate, __m256i, __m256i, int16_lanes, _mm256_set1_epi8(3), _mm256_set1_epi8(5), nibble_step,
            lanes_sum)
CHAINS_RATE(q8_rate, __m256i, __m256i, int32_lanes, _mm256_set1_epi8(-3), _mm256_set1_epi8(5), q8_step, lanes_sum)
CHAINS_RATE(fma_rate, __m256, __m256, float8_lanes, _mm256_set1_ps(0.999f), _mm256_set1_ps(1e-3f), _mm256_fmadd_ps,
            float_sum)

static double max(double a, double b) { return a > b ? a : b; }

int main(void) {
  double nibble = 0, q8 = 0, fma = 0;  // the fastest of rounds taken in turn, as above
  for (int round = 0; round < 7; ++round) {
    nibble = max(nibble, nibble_rate());
    q8 = max(q8, q8_rate());
    fma = max(fma, fma_rate());
  }
  printf("one core, G steps/s: 4-bit step %.2f, 8-bit step %.2f, vfmadd231ps %.2f\n", nibble, q8, fma);
  printf("multiply-adds per core, G/s: int8 4-bit step %.1f, int8 8-bit step %.1f, float32 %.1f\n", 32 * nibble,
         32 * q8, 8 * fma);
  return 0;
}
#else
#error "cpu_peak.c measures AVX512-VNNI + AVX512-BF16 or AVX2 cores"
#endif
