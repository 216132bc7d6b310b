// relaylm's exact kernels: every reduction's order is written here, so a row's result is a
// function of that row's inputs alone, whatever rows share the call, whatever the thread count,
// and whichever code path (AVX512-VNNI or portable) computes it.
//
// The rules that make that hold:
// - Matmuls multiply int8 activations (quantized per block of 32 inputs) by 4- or 8-bit weights
//   (groups of 32 inputs, a scale and an optional minimum each). A group's products are summed as
//   int32, which is exact in any order; the float epilogue per group and the sum over groups run
//   in one fixed sequence per output element (see `group_term`).
// - Each output element (matmul), each query (attention) and each row (norms, softmax sums) is
//   computed start to end by one thread; threads only split the work between elements.
// - Vector code computes each lane with exactly the scalar code's operations (explicit FMA in
//   both, -ffp-contract=off, no fast-math), so the portable path gives the same bits.
// - Row reductions in floating point (norms, block sums) use 16 lanes, element k in lane k % 16,
//   combined by the halving tree of `tree16`.
// - exp is ours (`exp_fixed`), not libm's, so vector and scalar code agree.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/python.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define RELAYLM_X86 1
#endif

// The portable code's hot functions are compiled twice, for x86-64-v3 (AVX2, FMA) and for the
// baseline, and the copy the CPU runs is chosen when the library loads. Both are the same
// operations in the same order (no contraction, -ffp-contract=off; no reassociation; std::fma is
// fused in either), so they give the same bits: the v3 copy only uses wider instructions where the
// compiler finds element-wise work or integer sums, and a fused multiply-add instruction instead
// of libm's call. CPUs without AVX-512 VNNI (the vector path below) run the v3 copy.
#if defined(RELAYLM_X86) && defined(__GNUC__) && !defined(__clang__)
#define PORTABLE_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PORTABLE_CLONES
#endif

namespace relaylm_exact {

constexpr int kGroup = 32;  // inputs per quantization group (weights and activations)
constexpr int kLanes = 16;
// Work (multiply-adds) below which a parallel region costs more than it saves: a one-row step's
// small matmuls run on one thread, the head and batches on all. Never changes a result's bits.
constexpr int64_t kMinParallelWork = int64_t{1} << 16;

static inline int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kMinParallelWork / std::max<int64_t>(1, work_per_item));
}

// ---------------------------------------------------------------- shared scalar definitions

static inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// Round to nearest even, NaN kept quiet (as c10::BFloat16 does).
static inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  uint32_t rounding = ((bits >> 16) & 1u) + 0x7FFFu;
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

constexpr float kExpLow = -87.0f;
constexpr float kExpHigh = 88.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = -0.693359375f;
constexpr float kLn2Lo = 2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f;
constexpr float kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

// e^x: x clamped to [-87, 88], n = rint(x log2 e), r = x - n ln 2 (two steps), a degree-6
// polynomial in r, times 2^n; 0 below -87.
static inline float exp_fixed(float x) {
  float c = std::fmin(std::fmax(x, kExpLow), kExpHigh);
  float n = std::nearbyint(c * kLog2e);
  float r = std::fma(n, kLn2Hi, c);
  r = std::fma(n, kLn2Lo, r);
  float p = kP0;
  p = std::fma(p, r, kP1);
  p = std::fma(p, r, kP2);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r, kP5);
  float r2 = r * r;
  p = std::fma(p, r2, r);
  p = p + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  float out = p * scale;
  return x < kExpLow ? 0.0f : out;
}

// Lanes [0, h) += lanes [h, 2h) for h = 8, 4, 2, 1.
static inline float tree16(float* lanes) {
  for (int h = 8; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) lanes[i] = lanes[i] + lanes[i + h];
  return lanes[0];
}

// One group's contribution to an output element: the activations' d times the weights'
// scale * (integer dot - zero * activation sum) [+ min * activation sum].
static inline float group_term(int32_t dot, int32_t act_sum, int zero, float d, float scale, float mn,
                               bool has_min) {
  float t = scale * static_cast<float>(dot - zero * act_sum);
  if (has_min) t = t + mn * static_cast<float>(act_sum);
  return d * t;
}

static inline float load_as_float(const void* base, int64_t i, bool is_bf16) {
  return is_bf16 ? bf16_to_float(static_cast<const uint16_t*>(base)[i]) : static_cast<const float*>(base)[i];
}

static inline void store_from_float(void* base, int64_t i, float v, bool is_bf16) {
  if (is_bf16)
    static_cast<uint16_t*>(base)[i] = float_to_bf16(v);
  else
    static_cast<float*>(base)[i] = v;
}

// ---------------------------------------------------------------- activation prologue + quantization

enum Prologue : int64_t { kNone = 0, kRmsNorm = 1, kSiluMul = 2 };

struct RowQuant {
  int8_t* q;       // [groups * 32]
  float* d;        // [groups]
  int32_t* sums;   // [groups]
};

// The row's activations (after the prologue) in fp32, into `act` [k_in].
PORTABLE_CLONES static void prologue_scalar(const void* x, bool is_bf16, int64_t k_in, Prologue kind, const void* norm_w,
                            bool norm_bf16, float eps, float* act) {
  if (kind == kSiluMul) {
    for (int64_t k = 0; k < k_in; ++k) {
      float g = load_as_float(x, k, is_bf16), u = load_as_float(x, k_in + k, is_bf16);
      float e = exp_fixed(-g);
      act[k] = (g / (1.0f + e)) * u;
    }
    return;
  }
  for (int64_t k = 0; k < k_in; ++k) act[k] = load_as_float(x, k, is_bf16);
  if (kind == kRmsNorm) {
    float lanes[kLanes] = {0};
    for (int64_t k = 0; k < k_in; ++k) lanes[k % kLanes] = std::fma(act[k], act[k], lanes[k % kLanes]);
    float mean = tree16(lanes) / static_cast<float>(k_in);
    float inv = 1.0f / std::sqrt(mean + eps);
    for (int64_t k = 0; k < k_in; ++k) act[k] = (act[k] * inv) * load_as_float(norm_w, k, norm_bf16);
  }
}

// Blocks of 32: d = amax / 127, q = rint(a * (127 / amax)), sums exact. Inputs past k_in are 0.
PORTABLE_CLONES static void quantize_scalar(const float* act, int64_t k_in, int64_t groups, RowQuant out) {
  for (int64_t g = 0; g < groups; ++g) {
    float amax = 0.0f;
    for (int j = 0; j < kGroup; ++j) {
      int64_t k = g * kGroup + j;
      if (k < k_in) amax = std::fmax(amax, std::fabs(act[k]));
    }
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    out.d[g] = amax / 127.0f;
    int32_t sum = 0;
    for (int j = 0; j < kGroup; ++j) {
      int64_t k = g * kGroup + j;
      float v = k < k_in ? std::nearbyint(act[k] * inv) : 0.0f;
      v = std::fmin(std::fmax(v, -127.0f), 127.0f);
      out.q[k] = static_cast<int8_t>(v);
      sum += static_cast<int32_t>(v);
    }
    out.sums[g] = sum;
  }
}

#ifdef RELAYLM_X86
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))

AVX512_TARGET static inline __m512 v_load_as_float(const void* base, int64_t i, bool is_bf16, __mmask16 m) {
  if (is_bf16) {
    __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(base) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_maskz_loadu_ps(m, static_cast<const float*>(base) + i);
}

AVX512_TARGET static inline __m256i v_float_to_bf16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  __m512i out = _mm512_srli_epi32(rounded, 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  out = _mm512_mask_mov_epi32(out, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(out);
}

AVX512_TARGET static inline void v_store_from_float(void* base, int64_t i, __m512 v, bool is_bf16, __mmask16 m) {
  if (is_bf16)
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(base) + i, m, v_float_to_bf16(v));
  else
    _mm512_mask_storeu_ps(static_cast<float*>(base) + i, m, v);
}

AVX512_TARGET static inline __m512 v_exp_fixed(__m512 x) {
  __m512 c = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLow)), _mm512_set1_ps(kExpHigh));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Hi), c);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  __m512 out = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  __mmask16 low = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLow), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(out, low, _mm512_setzero_ps());
}

// tree16 on a vector's lanes.
AVX512_TARGET static inline float v_tree16(__m512 v) {
  __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  __m128 d = _mm_add_ss(c, _mm_shuffle_ps(c, c, 1));
  return _mm_cvtss_f32(d);
}

static inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1u);
}

AVX512_TARGET static void prologue_avx512(const void* x, bool is_bf16, int64_t k_in, Prologue kind,
                                          const void* norm_w, bool norm_bf16, float eps, float* act) {
  if (kind == kSiluMul) {
    for (int64_t k = 0; k < k_in; k += kLanes) {
      __mmask16 m = tail_mask(k_in - k);
      __m512 g = v_load_as_float(x, k, is_bf16, m), u = v_load_as_float(x, k_in + k, is_bf16, m);
      __m512 e = v_exp_fixed(_mm512_sub_ps(_mm512_setzero_ps(), g));
      __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
      _mm512_mask_storeu_ps(act + k, m, _mm512_mul_ps(s, u));
    }
    return;
  }
  __m512 lanes = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_in; k += kLanes) {
    __mmask16 m = tail_mask(k_in - k);
    __m512 v = v_load_as_float(x, k, is_bf16, m);
    _mm512_mask_storeu_ps(act + k, m, v);
    lanes = _mm512_mask3_fmadd_ps(v, v, lanes, m);
  }
  if (kind != kRmsNorm) return;
  float mean = v_tree16(lanes) / static_cast<float>(k_in);
  __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int64_t k = 0; k < k_in; k += kLanes) {
    __mmask16 m = tail_mask(k_in - k);
    __m512 v = _mm512_maskz_loadu_ps(m, act + k);
    __m512 w = v_load_as_float(norm_w, k, norm_bf16, m);
    _mm512_mask_storeu_ps(act + k, m, _mm512_mul_ps(_mm512_mul_ps(v, inv), w));
  }
}

AVX512_TARGET static void quantize_avx512(const float* act, int64_t k_in, int64_t groups, RowQuant out) {
  for (int64_t g = 0; g < groups; ++g) {
    int64_t k = g * kGroup;
    __mmask16 m0 = k < k_in ? tail_mask(k_in - k) : 0, m1 = k + kLanes < k_in ? tail_mask(k_in - k - kLanes) : 0;
    __m512 a0 = _mm512_maskz_loadu_ps(m0, act + k), a1 = _mm512_maskz_loadu_ps(m1, act + k + kLanes);
    __m512 absmax = _mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1));
    float amax = _mm512_reduce_max_ps(absmax);  // a max: exact in any order
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    out.d[g] = amax / 127.0f;
    __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    __m512 r0 = _mm512_roundscale_ps(_mm512_mul_ps(a0, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r1 = _mm512_roundscale_ps(_mm512_mul_ps(a1, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i q0 = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(r0, lo), hi));
    __m512i q1 = _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(r1, lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q + k), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q + k + kLanes), _mm512_cvtepi32_epi8(q1));
    out.sums[g] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));  // integers: exact
  }
}
#endif

static bool use_avx512(bool scalar) {
#ifdef RELAYLM_X86
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma");
  return has && !scalar;
#else
  (void)scalar;
  return false;
#endif
}

// ---------------------------------------------------------------- quantized matmul
//
// Weight layout (unsigned values u, w = scale * (u - zero) [+ min]), for blocks of 16 outputs:
//   bits 8: [out/16][groups][8 quads][16 outputs][4 inputs]          one byte per value
//   bits 4: [out/16][groups][4 quads][16 outputs][4 inputs], the byte holding quad j's value in
//           its low nibble and quad j + 4's in its high nibble
//   scales, mins: [out/16][groups][16 outputs], float32, or float16 where every value is one
//   exactly (a GGUF's Q4_0/Q4_1/Q8_0 scales are): the same numbers in fewer bytes to read;
//   or factored, as a GGUF's Q4_K stores them: uint8 factors, each group's scale
//   super_scales[out/16][groups/8][16] * scales[...] (a float16 number times an integer below 64:
//   exact in float32, so the same number as a float32 scale holding the product), mins likewise

struct PackedWeight {
  const uint8_t* data;
  const void* scales;
  const void* mins;  // null: none
  bool half;         // scales and mins are float16
  int zero;
  int bits;
  int64_t groups;
  const float* super_scales = nullptr;  // given: scales and mins are factored (uint8)
  const float* super_mins = nullptr;
};

// Where group g of a block keeps its 16 lanes' factors, and their super-block's numbers.
struct FactorsAt {
  int64_t at, super_at;
};

static inline FactorsAt factors_at(const PackedWeight& w, int64_t block, int64_t g) {
  return {(block * w.groups + g) * kLanes, (block * (w.groups / 8) + g / 8) * kLanes};
}

// A factored weight's 16 lane scales (and mins) of group g of a block, as float32: each one
// product, super * float(factor); the vector paths form the same products 16 or 8 at a time.
static inline void factored_lanes(const PackedWeight& w, int64_t block, int64_t g, float* scale, float* mn) {
  const FactorsAt f = factors_at(w, block, g);
  const uint8_t* sc = static_cast<const uint8_t*>(w.scales) + f.at;
  for (int lane = 0; lane < kLanes; ++lane) scale[lane] = w.super_scales[f.super_at + lane] * static_cast<float>(sc[lane]);
  if (w.mins) {
    const uint8_t* m = static_cast<const uint8_t*>(w.mins) + f.at;
    for (int lane = 0; lane < kLanes; ++lane) mn[lane] = w.super_mins[f.super_at + lane] * static_cast<float>(m[lane]);
  }
}

static inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

static inline float scale_at(const void* base, int64_t i, bool half) {
  return half ? half_to_float(static_cast<const uint16_t*>(base)[i]) : static_cast<const float*>(base)[i];
}

static inline int weight_value(const PackedWeight& w, int64_t block, int64_t g, int quad, int lane, int byte) {
  if (w.bits == 8) {
    return w.data[(((block * w.groups + g) * 8 + quad) * kLanes + lane) * 4 + byte];
  }
  uint8_t packed = w.data[(((block * w.groups + g) * 4 + (quad & 3)) * kLanes + lane) * 4 + byte];
  return quad < 4 ? (packed & 0x0F) : (packed >> 4);
}

// After the groups: + bias, then residual + (in that order), then one rounding to the output dtype.
struct Epilogue {
  const float* bias;     // null: none
  const void* residual;  // [rows, n_out] in the output's dtype; null: none
};

// One group's integer dot per output lane (integer sums: the same in any order).
template <int kBits>
static inline int weight_at(const uint8_t* data, int quad, int i) {
  if (kBits == 8) return data[quad * kLanes * 4 + i];
  uint8_t packed = data[(quad & 3) * kLanes * 4 + i];
  return quad < 4 ? (packed & 0x0F) : (packed >> 4);
}

template <int kBits>
static inline void group_dots_scalar(const uint8_t* data, const int8_t* xq, int32_t* dot) {
  for (int lane = 0; lane < kLanes; ++lane) {
    int32_t sum = 0;
    for (int quad = 0; quad < 8; ++quad)
      for (int byte = 0; byte < 4; ++byte)
        sum += weight_at<kBits>(data, quad, lane * 4 + byte) * static_cast<int32_t>(xq[quad * 4 + byte]);
    dot[lane] = sum;
  }
}

#ifdef RELAYLM_X86
// The same dots with AVX2 (CPUs without the AVX-512 path): a quad's 64 weights widened to 16 bits
// and multiplied by the quad's 4 activations, adjacent products summed into 32 bits (no
// saturation: |255 * 128| * 2 fits), two partial sums per lane, added at the end.
template <int kBits>
__attribute__((target("avx2"))) static void group_dots_avx2(const uint8_t* data, const int8_t* xq, int32_t* dot) {
  __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int quad = 0; quad < 8; ++quad) {
    int32_t xword;
    std::memcpy(&xword, xq + quad * 4, 4);
    __m256i x16 = _mm256_cvtepi8_epi16(_mm_set1_epi32(xword));
    const uint8_t* base = data + (kBits == 8 ? quad : (quad & 3)) * kLanes * 4;
    for (int c = 0; c < 4; ++c) {
      __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 16 * c));
      if (kBits == 4) {
        __m128i nibbles = quad < 4 ? bytes : _mm_srli_epi16(bytes, 4);
        bytes = _mm_and_si128(nibbles, _mm_set1_epi8(0x0F));
      }
      acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_cvtepu8_epi16(bytes), x16));
    }
  }
  int32_t partial[32];
  for (int c = 0; c < 4; ++c) _mm256_storeu_si256(reinterpret_cast<__m256i*>(partial + 8 * c), acc[c]);
  for (int lane = 0; lane < kLanes; ++lane) dot[lane] = partial[2 * lane] + partial[2 * lane + 1];
}
#endif

template <int kBits>
static inline void group_dots(const uint8_t* data, const int8_t* xq, int32_t* dot) {
#ifdef RELAYLM_X86
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) {
    group_dots_avx2<kBits>(data, xq, dot);
    return;
  }
#endif
  group_dots_scalar<kBits>(data, xq, dot);
}

// Every output lane's integer dots first (integer sums: exact in any order), laid out so the
// inner loops run over a quad's 16 lanes x 4 inputs, which are contiguous; then each lane's groups
// in order, exactly as one lane at a time would add them.
PORTABLE_CLONES static void matmul_block_scalar(const PackedWeight& w, int64_t block, const RowQuant* rows,
                                                int64_t num_rows, int64_t n_out, Epilogue epi, void* out,
                                                int64_t out_stride, bool out_bf16) {
  const float* bias = epi.bias;
  for (int64_t r = 0; r < num_rows; ++r) {
    float acc[kLanes];
    for (int lane = 0; lane < kLanes; ++lane) acc[lane] = 0.0f;
    for (int64_t g = 0; g < w.groups; ++g) {
      int32_t dot[kLanes];
      const int8_t* xq = rows[r].q + g * kGroup;
      if (w.bits == 8) {
        group_dots<8>(w.data + (block * w.groups + g) * 8 * kLanes * 4, xq, dot);
      } else {
        group_dots<4>(w.data + (block * w.groups + g) * 4 * kLanes * 4, xq, dot);
      }
      const int64_t s0 = (block * w.groups + g) * kLanes;
      float scale[kLanes], mn[kLanes];
      if (w.super_scales) {
        factored_lanes(w, block, g, scale, mn);
      } else {
        for (int lane = 0; lane < kLanes; ++lane) {
          scale[lane] = scale_at(w.scales, s0 + lane, w.half);
          mn[lane] = w.mins ? scale_at(w.mins, s0 + lane, w.half) : 0.0f;
        }
      }
      for (int lane = 0; lane < kLanes; ++lane)
        acc[lane] = acc[lane] + group_term(dot[lane], rows[r].sums[g], w.zero, rows[r].d[g], scale[lane],
                                           w.mins ? mn[lane] : 0.0f, w.mins != nullptr);
    }
    for (int lane = 0; lane < kLanes; ++lane) {
      int64_t n = block * kLanes + lane;
      if (n >= n_out) break;
      float value = acc[lane];
      if (bias) value = value + bias[n];
      if (epi.residual) value = load_as_float(epi.residual, r * out_stride + n, out_bf16) + value;
      store_from_float(out, r * out_stride + n, value, out_bf16);
    }
  }
}

#ifdef RELAYLM_X86
// The AVX2 matmul (CPUs without the AVX-512 path): `matmul_block_scalar`'s operations on 8 lanes at
// a time, and several rows per pass over a block's weights, so each quad's weights are loaded and
// widened once for all of them. The integer dots are group_dots_avx2's; each lane's float terms
// are group_term's, in the same order (no FMA: -ffp-contract=off, and the target has none).
#define AVX2_TARGET __attribute__((target("avx2,f16c")))

AVX2_TARGET static inline void load_scales_avx2(const void* base, int64_t i, bool half, __m256* lanes) {
  if (half) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + i;
    lanes[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lanes[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  } else {
    lanes[0] = _mm256_loadu_ps(static_cast<const float*>(base) + i);
    lanes[1] = _mm256_loadu_ps(static_cast<const float*>(base) + i + 8);
  }
}

// factored_lanes' products for one of scales or mins, lanes 0-7 and 8-15.
AVX2_TARGET static inline void factored_lanes_avx2(const float* super, const uint8_t* factors, __m256* lanes) {
  for (int h = 0; h < 2; ++h) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(factors + 8 * h));
    lanes[h] = _mm256_mul_ps(_mm256_loadu_ps(super + 8 * h), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
  }
}

// Lanes 0-7 and 8-15 of a group's dots from the four per-4-lane partial-pair accumulators.
AVX2_TARGET static inline void finish_dots_avx2(const __m256i* part, __m256i* dot) {
  // hadd gives lanes [0 1 4 5 | 2 3 6 7]; the 64-bit permute puts them in order.
  dot[0] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(part[0], part[1]), _MM_SHUFFLE(3, 1, 2, 0));
  dot[1] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(part[2], part[3]), _MM_SHUFFLE(3, 1, 2, 0));
}

// A group's integer dots of 8-bit weights, lanes 0-7 and 8-15: the weights widened to 16 bits.
template <int R>
AVX2_TARGET static inline void group_dots8_avx2(const uint8_t* data, const RowQuant* rows, int64_t g,
                                                __m256i (*dot)[2]) {
  __m256i part[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) part[r][c] = _mm256_setzero_si256();
  for (int quad = 0; quad < 8; ++quad) {
    const uint8_t* base = data + quad * kLanes * 4;
    __m256i w16[4];
    for (int c = 0; c < 4; ++c)
      w16[c] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 16 * c)));
    for (int r = 0; r < R; ++r) {
      int32_t xword;
      std::memcpy(&xword, rows[r].q + g * kGroup + quad * 4, 4);
      __m256i x16 = _mm256_cvtepi8_epi16(_mm_set1_epi32(xword));
      for (int c = 0; c < 4; ++c) part[r][c] = _mm256_add_epi32(part[r][c], _mm256_madd_epi16(w16[c], x16));
    }
  }
  for (int r = 0; r < R; ++r) finish_dots_avx2(part[r], dot[r]);
}

// A group's integer dots of 4-bit weights, lanes 0-7 and 8-15. The weights (0..15) are unsigned
// bytes as they stand and the activations (-127..127) signed bytes, so each pair sum of maddubs
// (at most 2 * 15 * 127 in size) and the eight of them a lane adds in 16 bits (at most 30,480)
// are exact; one madd with ones then adds each lane's 16-bit sums into its 32-bit dot.
template <int R>
AVX2_TARGET static inline void group_dots4_avx2(const uint8_t* data, const RowQuant* rows, int64_t g,
                                                __m256i (*dot)[2]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i sum16[R][2];
  for (int r = 0; r < R; ++r) sum16[r][0] = sum16[r][1] = _mm256_setzero_si256();
  for (int quad = 0; quad < 4; ++quad) {  // low nibbles: inputs of quad, high: of quad + 4
    const uint8_t* base = data + quad * kLanes * 4;
    __m256i low[2], high[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 32 * h));
      low[h] = _mm256_and_si256(bytes, nibble);
      high[h] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
    }
    for (int r = 0; r < R; ++r) {
      int32_t a, b;
      std::memcpy(&a, rows[r].q + g * kGroup + quad * 4, 4);
      std::memcpy(&b, rows[r].q + g * kGroup + (quad + 4) * 4, 4);
      const __m256i xa = _mm256_set1_epi32(a), xb = _mm256_set1_epi32(b);
      for (int h = 0; h < 2; ++h)
        sum16[r][h] = _mm256_add_epi16(
            sum16[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(low[h], xa), _mm256_maddubs_epi16(high[h], xb)));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) dot[r][h] = _mm256_madd_epi16(sum16[r][h], ones);
}

template <int kBits, int R>
AVX2_TARGET static inline void matmul_rows_avx2(const PackedWeight& w, int64_t block, const RowQuant* rows,
                                                __m256* acc) {
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* data = w.data + (block * w.groups + g) * kBits * kLanes * 4;
    __m256i dots[R][2];
    if (kBits == 4)
      group_dots4_avx2<R>(data, rows, g, dots);
    else
      group_dots8_avx2<R>(data, rows, g, dots);
    const int64_t s = (block * w.groups + g) * kLanes;
    __m256 scale[2], mn[2];
    if (w.super_scales) {
      const FactorsAt f = factors_at(w, block, g);
      factored_lanes_avx2(w.super_scales + f.super_at, static_cast<const uint8_t*>(w.scales) + f.at, scale);
      if (w.mins) factored_lanes_avx2(w.super_mins + f.super_at, static_cast<const uint8_t*>(w.mins) + f.at, mn);
    } else {
      load_scales_avx2(w.scales, s, w.half, scale);
      if (w.mins) load_scales_avx2(w.mins, s, w.half, mn);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i* dot = dots[r];
      const int32_t sum = rows[r].sums[g];
      const __m256i zero_sum = _mm256_set1_epi32(w.zero * sum);
      const __m256 d = _mm256_set1_ps(rows[r].d[g]);
      for (int h = 0; h < 2; ++h) {
        __m256 t = _mm256_mul_ps(scale[h], _mm256_cvtepi32_ps(_mm256_sub_epi32(dot[h], zero_sum)));
        if (w.mins) t = _mm256_add_ps(t, _mm256_mul_ps(mn[h], _mm256_set1_ps(static_cast<float>(sum))));
        acc[2 * r + h] = _mm256_add_ps(acc[2 * r + h], _mm256_mul_ps(d, t));
      }
    }
  }
}

// One row's 16 sums, then the scalar epilogue (bias, residual, store), as matmul_block_scalar's.
AVX2_TARGET static inline void store_row_avx2(const __m256* acc, int64_t block, int64_t r, int64_t n_out,
                                              Epilogue epi, void* out, int64_t out_stride, bool out_bf16) {
  float sums[kLanes];
  _mm256_storeu_ps(sums, acc[0]);
  _mm256_storeu_ps(sums + 8, acc[1]);
  for (int lane = 0; lane < kLanes; ++lane) {
    int64_t n = block * kLanes + lane;
    if (n >= n_out) break;
    float value = sums[lane];
    if (epi.bias) value = value + epi.bias[n];
    if (epi.residual) value = load_as_float(epi.residual, r * out_stride + n, out_bf16) + value;
    store_from_float(out, r * out_stride + n, value, out_bf16);
  }
}

template <int kBits>
AVX2_TARGET static void matmul_block_avx2(const PackedWeight& w, int64_t block, const RowQuant* rows,
                                          int64_t num_rows, int64_t n_out, Epilogue epi, void* out,
                                          int64_t out_stride, bool out_bf16) {
  constexpr int kRows = 3;
  int64_t r = 0;
  for (; r + kRows <= num_rows; r += kRows) {
    __m256 acc[2 * kRows];
    for (auto& a : acc) a = _mm256_setzero_ps();
    matmul_rows_avx2<kBits, kRows>(w, block, rows + r, acc);
    for (int i = 0; i < kRows; ++i) store_row_avx2(acc + 2 * i, block, r + i, n_out, epi, out, out_stride, out_bf16);
  }
  for (; r < num_rows; ++r) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    matmul_rows_avx2<kBits, 1>(w, block, rows + r, acc);
    store_row_avx2(acc, block, r, n_out, epi, out, out_stride, out_bf16);
  }
}

static bool use_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}
#endif

// Whether the matmul's AVX2 code runs here (where the AVX-512 code does not).
static bool any_avx2() {
#ifdef RELAYLM_X86
  return use_avx2();
#else
  return false;
#endif
}

#ifdef RELAYLM_X86
AVX512_TARGET static inline __m512 load_scales(const void* base, int64_t i, bool half) {
  if (half) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i)));
  return _mm512_loadu_ps(static_cast<const float*>(base) + i);
}

// factored_lanes' products for one of scales or mins, 16 lanes at once.
AVX512_TARGET static inline __m512 factored_lanes_avx512(const float* super, const uint8_t* factors) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(factors));
  return _mm512_mul_ps(_mm512_loadu_ps(super), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)));
}

template <int R>
AVX512_TARGET static inline void matmul_rows_avx512(const PackedWeight& w, int64_t block, const RowQuant* rows,
                                                    __m512* acc) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    if (w.bits == 8) {
      const uint8_t* base = w.data + (block * w.groups + g) * 8 * 64;
      for (int quad = 0; quad < 8; ++quad) {
        __m512i wv = _mm512_loadu_si512(base + quad * 64);
        for (int r = 0; r < R; ++r) {
          int32_t a;
          std::memcpy(&a, rows[r].q + g * kGroup + quad * 4, 4);
          dot[r] = _mm512_dpbusd_epi32(dot[r], wv, _mm512_set1_epi32(a));
        }
      }
    } else {
      const uint8_t* base = w.data + (block * w.groups + g) * 4 * 64;
      for (int quad = 0; quad < 4; ++quad) {
        __m512i packed = _mm512_loadu_si512(base + quad * 64);
        __m512i low = _mm512_and_si512(packed, nibble);
        __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
        for (int r = 0; r < R; ++r) {
          int32_t a, b;
          std::memcpy(&a, rows[r].q + g * kGroup + quad * 4, 4);
          std::memcpy(&b, rows[r].q + g * kGroup + (quad + 4) * 4, 4);
          dot[r] = _mm512_dpbusd_epi32(dot[r], low, _mm512_set1_epi32(a));
          dot[r] = _mm512_dpbusd_epi32(dot[r], high, _mm512_set1_epi32(b));
        }
      }
    }
    int64_t s = (block * w.groups + g) * kLanes;
    __m512 scale, mn = _mm512_setzero_ps();
    if (w.super_scales) {
      const FactorsAt f = factors_at(w, block, g);
      scale = factored_lanes_avx512(w.super_scales + f.super_at, static_cast<const uint8_t*>(w.scales) + f.at);
      if (w.mins) mn = factored_lanes_avx512(w.super_mins + f.super_at, static_cast<const uint8_t*>(w.mins) + f.at);
    } else {
      scale = load_scales(w.scales, s, w.half);
      if (w.mins) mn = load_scales(w.mins, s, w.half);
    }
    for (int r = 0; r < R; ++r) {
      int32_t sum = rows[r].sums[g];
      __m512i centred = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(w.zero * sum));
      __m512 t = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(centred));
      if (w.mins) t = _mm512_add_ps(t, _mm512_mul_ps(mn, _mm512_set1_ps(static_cast<float>(sum))));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_set1_ps(rows[r].d[g]), t));
    }
  }
}

AVX512_TARGET static void matmul_block_avx512(const PackedWeight& w, int64_t block, const RowQuant* rows,
                                              int64_t num_rows, int64_t n_out, Epilogue epi, void* out,
                                              int64_t out_stride, bool out_bf16) {
  const float* bias = epi.bias;
  int64_t n0 = block * kLanes;
  __mmask16 m = tail_mask(n_out - n0);
  __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + n0) : _mm512_setzero_ps();
  int64_t r = 0;
  for (; r + 4 <= num_rows; r += 4) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    matmul_rows_avx512<4>(w, block, rows + r, acc);
    for (int i = 0; i < 4; ++i) {
      __m512 v = bias ? _mm512_add_ps(acc[i], b) : acc[i];
      if (epi.residual) v = _mm512_add_ps(v_load_as_float(epi.residual, (r + i) * out_stride + n0, out_bf16, m), v);
      v_store_from_float(out, (r + i) * out_stride + n0, v, out_bf16, m);
    }
  }
  for (; r < num_rows; ++r) {
    __m512 acc[1] = {_mm512_setzero_ps()};
    matmul_rows_avx512<1>(w, block, rows + r, acc);
    __m512 v = bias ? _mm512_add_ps(acc[0], b) : acc[0];
    if (epi.residual) v = _mm512_add_ps(v_load_as_float(epi.residual, r * out_stride + n0, out_bf16, m), v);
    v_store_from_float(out, r * out_stride + n0, v, out_bf16, m);
  }
}
#endif

// A matrix's rows after the prologue, quantized as a matmul's input (one group of 32 at a time).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sums;
  std::vector<RowQuant> rows;

  QuantizedRows(int64_t num_rows, int64_t groups)
      : q(num_rows * groups * kGroup), d(num_rows * groups), sums(num_rows * groups), rows(num_rows) {
    for (int64_t r = 0; r < num_rows; ++r)
      rows[r] = RowQuant{q.data() + r * groups * kGroup, d.data() + r * groups, sums.data() + r * groups};
  }
};

// One row's activations after the prologue, quantized: the vector code where `vec`, else the
// portable code (the same bits). `act` holds k_in floats.
static void quantize_row(const void* x, bool is_bf16, int64_t k_in, Prologue kind, const void* norm_w, bool norm_bf16,
                         float eps, bool vec, float* act, int64_t groups, RowQuant out) {
#ifdef RELAYLM_X86
  if (vec) {
    prologue_avx512(x, is_bf16, k_in, kind, norm_w, norm_bf16, eps, act);
    quantize_avx512(act, k_in, groups, out);
    return;
  }
#else
  (void)vec;
#endif
  prologue_scalar(x, is_bf16, k_in, kind, norm_w, norm_bf16, eps, act);
  quantize_scalar(act, k_in, groups, out);
}

// One output block of `num_rows` rows (output row r at out + r * out_stride) on the code this
// call runs: AVX-512 where `vec`, AVX2 where `avx2`, else the portable code (the same bits).
static void matmul_block_any(const PackedWeight& w, int64_t block, const RowQuant* rows, int64_t num_rows,
                             int64_t n_out, Epilogue epi, void* out, int64_t out_stride, bool out_bf16, bool vec,
                             bool avx2) {
#ifdef RELAYLM_X86
  if (vec) {
    matmul_block_avx512(w, block, rows, num_rows, n_out, epi, out, out_stride, out_bf16);
    return;
  }
  if (avx2) {
    if (w.bits == 8)
      matmul_block_avx2<8>(w, block, rows, num_rows, n_out, epi, out, out_stride, out_bf16);
    else
      matmul_block_avx2<4>(w, block, rows, num_rows, n_out, epi, out, out_stride, out_bf16);
    return;
  }
#else
  (void)vec;
  (void)avx2;
#endif
  matmul_block_scalar(w, block, rows, num_rows, n_out, epi, out, out_stride, out_bf16);
}

// A packed weight's tensors checked against its shape and gathered into a PackedWeight; `keep`
// holds the contiguous tensors it points into.
static PackedWeight packed_weight(const at::Tensor& weight, const at::Tensor& scales,
                                  const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& super_scales,
                                  const c10::optional<at::Tensor>& super_mins, int64_t zero, int64_t bits,
                                  int64_t n_out, int64_t k_in, std::vector<at::Tensor>& keep) {
  TORCH_CHECK(bits == 4 || bits == 8, "qlinear: 4 or 8 bits");
  const int64_t groups = (k_in + kGroup - 1) / kGroup, blocks = (n_out + kLanes - 1) / kLanes;
  at::Tensor weight_c = weight.contiguous(), scales_c = scales.contiguous();
  TORCH_CHECK(weight_c.scalar_type() == at::kByte && weight_c.numel() == blocks * groups * kGroup * kLanes * bits / 8,
              "qlinear: packed weight size");
  const bool half = scales_c.scalar_type() == at::kHalf;
  const bool factored = super_scales.has_value();
  TORCH_CHECK(half || scales_c.scalar_type() == (factored ? at::kByte : at::kFloat),
              "qlinear: float32 or float16 scales, or uint8 factors of super_scales");
  TORCH_CHECK(scales_c.numel() == blocks * groups * kLanes, "qlinear: scales [blocks, groups, 16]");
  at::Tensor mins_c;
  if (mins.has_value()) mins_c = mins->contiguous();
  TORCH_CHECK(!mins.has_value() || (mins_c.scalar_type() == scales_c.scalar_type() && mins_c.numel() == scales_c.numel()),
              "qlinear: mins as scales");
  PackedWeight w{weight_c.data_ptr<uint8_t>(), scales_c.data_ptr(), mins.has_value() ? mins_c.data_ptr() : nullptr,
                 half, static_cast<int>(zero), static_cast<int>(bits), groups};
  keep.insert(keep.end(), {weight_c, scales_c});
  if (mins.has_value()) keep.push_back(mins_c);
  if (factored) {
    TORCH_CHECK(groups % 8 == 0 && super_scales->scalar_type() == at::kFloat &&
                    super_scales->numel() == blocks * (groups / 8) * kLanes,
                "qlinear: super_scales float32 [blocks, groups / 8, 16]");
    TORCH_CHECK(mins.has_value() == super_mins.has_value() &&
                    (!super_mins.has_value() || (super_mins->scalar_type() == at::kFloat &&
                                                 super_mins->numel() == super_scales->numel())),
                "qlinear: factored mins need super_mins as super_scales");
    at::Tensor super_scales_c = super_scales->contiguous();
    w.super_scales = super_scales_c.data_ptr<float>();
    keep.push_back(super_scales_c);
    if (super_mins.has_value()) {
      at::Tensor super_mins_c = super_mins->contiguous();
      w.super_mins = super_mins_c.data_ptr<float>();
      keep.push_back(super_mins_c);
    }
  } else {
    TORCH_CHECK(!super_mins.has_value(), "qlinear: super_mins without super_scales");
  }
  return w;
}

// x [rows, k_in] (silu_mul: [rows, 2 * k_in]); out [rows, n_out] (viewed as x's leading dims by
// the callers). `lora` given: each row's LoRA update is added after (`add_lora`), from the same
// quantized activations.
struct LoraFactors;
static void add_lora(const LoraFactors& lora, const at::Tensor& group, const QuantizedRows& xq, int64_t k_in,
                     at::Tensor& out, bool scalar, bool portable);

static at::Tensor qlinear_rows(const at::Tensor& x_in, int64_t prologue, const c10::optional<at::Tensor>& norm_weight,
                               double eps, const at::Tensor& weight, const at::Tensor& scales,
                               const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& super_scales,
                               const c10::optional<at::Tensor>& super_mins, int64_t zero, int64_t bits, int64_t n_out,
                               int64_t k_in, const c10::optional<at::Tensor>& bias,
                               const c10::optional<at::Tensor>& residual, bool out_float32, bool scalar,
                               bool portable, const LoraFactors* lora, const at::Tensor* group) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat, "qlinear: bf16 or fp32 input");
  auto kind = static_cast<Prologue>(prologue);
  int64_t width = kind == kSiluMul ? 2 * k_in : k_in;
  TORCH_CHECK(x_in.size(-1) == width, "qlinear: input width ", x_in.size(-1), ", expected ", width);
  std::vector<at::Tensor> keep;
  const PackedWeight w = packed_weight(weight, scales, mins, super_scales, super_mins, zero, bits, n_out, k_in, keep);
  at::Tensor x = x_in.reshape({-1, width}).contiguous();
  int64_t num_rows = x.size(0);
  int64_t groups = w.groups;
  int64_t blocks = (n_out + kLanes - 1) / kLanes;
  bool is_bf16 = x.scalar_type() == at::kBFloat16;
  bool out_bf16 = !out_float32 && is_bf16;
  at::Tensor out = at::empty({num_rows, n_out}, x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  if (num_rows == 0) return out;

  at::Tensor norm_w;
  const void* norm_ptr = nullptr;
  bool norm_bf16 = false;
  if (kind == kRmsNorm) {
    TORCH_CHECK(norm_weight.has_value(), "qlinear: rms_norm needs its weight");
    norm_w = norm_weight->contiguous();
    norm_ptr = norm_w.data_ptr();
    norm_bf16 = norm_w.scalar_type() == at::kBFloat16;
  }
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();

  QuantizedRows xq(num_rows, groups);
  std::vector<RowQuant>& rows = xq.rows;
  const bool vec = use_avx512(scalar || portable), avx2 = !vec && !portable && any_avx2();
  const char* xp = static_cast<const char*>(x.data_ptr());
  const int64_t row_bytes = width * x.element_size();
  // Each row by one thread, each output block by one thread: the split never reaches a sum.
  at::parallel_for(0, num_rows, grain_for(width * 16), [&](int64_t begin, int64_t end) {
    std::vector<float> act(groups * kGroup);
    for (int64_t r = begin; r < end; ++r)
      quantize_row(xp + r * row_bytes, is_bf16, k_in, kind, norm_ptr, norm_bf16, static_cast<float>(eps), vec,
                   act.data(), groups, rows[r]);
  });
  at::Tensor residual_c;
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == out.scalar_type() && residual->numel() == num_rows * n_out,
                "qlinear: the residual has the output's dtype and shape");
    residual_c = residual->reshape({num_rows, n_out}).contiguous();
  }
  Epilogue epi{bias.has_value() ? bias_f.data_ptr<float>() : nullptr,
               residual.has_value() ? residual_c.data_ptr() : nullptr};
  void* out_ptr = out.data_ptr();
  at::parallel_for(0, blocks, grain_for(kLanes * groups * kGroup * num_rows), [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block)
      matmul_block_any(w, block, rows.data(), num_rows, n_out, epi, out_ptr, n_out, out_bf16, vec, avx2);
  });
  if (lora != nullptr) add_lora(*lora, *group, xq, k_in, out, scalar, portable);
  return out;
}

// LoRA: each row's low-rank update added to its output, out[r] += B_g (A_g x[r]) with g = group[r]
// (-1: none). A_g reads the row's activations as the base matmul quantized them: t = A_g x is
// computed as `qlinear` computes it with fp32 output. B_g is kept by parts (a joined projection's
// update is block-diagonal: q, k and v each read their own slice of t), in 8-bit columns: each
// block of 16 outputs has one float16 scale per column. Each output lane sums, for k in order,
// fma(q[n, k], t[k] * scale[k], acc) from 0; then out[n] + acc is rounded once to out's dtype.
// A row's values depend on that row alone, never on the rows or adapters beside it, nor on the
// threads; the vector and portable code compute each lane with the same operations.

// One part of B_g: outputs [n0, n0 + outs) read t[k0, k0 + rank).
struct LoraPart {
  int64_t n0, outs, k0, rank;
  const int8_t* data;      // [blocks][rank][16]
  const uint16_t* scales;  // [blocks][rank], float16
};

// One projection's factors for several adapters, checked and laid out once (every step of their
// requests reads them): A_g [rank_g, k_in] packed 8-bit in groups; B_g's parts as above, each
// part's values after the one before it in `b_data` and `b_scales`.
struct LoraFactors {
  std::vector<at::Tensor> keep;
  std::vector<PackedWeight> a;
  std::vector<std::vector<LoraPart>> b;
  std::vector<int64_t> ranks;
  int64_t k_in, n_out, max_rank = 1;

  LoraFactors(const std::vector<at::Tensor>& a_weights, const std::vector<at::Tensor>& a_scales,
              const std::vector<int64_t>& ranks_in, const std::vector<at::Tensor>& b_data,
              const std::vector<at::Tensor>& b_scales, const std::vector<std::vector<int64_t>>& b_parts,
              int64_t k_in_, int64_t n_out_)
      : ranks(ranks_in), k_in(k_in_), n_out(n_out_) {
    const size_t count = ranks.size();
    TORCH_CHECK(a_weights.size() == count && a_scales.size() == count && b_data.size() == count &&
                    b_scales.size() == count && b_parts.size() == count,
                "lora: A and B, with their scales and B's parts, per adapter");
    const int64_t groups = (k_in + kGroup - 1) / kGroup;
    for (size_t g = 0; g < count; ++g) {
      const int64_t rank = ranks[g], a_blocks = (rank + kLanes - 1) / kLanes;
      TORCH_CHECK(rank > 0, "lora: a positive rank");
      const at::Tensor& aw = a_weights[g];
      const at::Tensor& as = a_scales[g];
      TORCH_CHECK(aw.scalar_type() == at::kByte && aw.is_contiguous() && aw.numel() == a_blocks * groups * kGroup * kLanes,
                  "lora: A packed 8-bit, [rank, k_in]");
      TORCH_CHECK(as.is_contiguous() && (as.scalar_type() == at::kHalf || as.scalar_type() == at::kFloat) &&
                      as.numel() == a_blocks * groups * kLanes,
                  "lora: A's scales");
      a.push_back(PackedWeight{aw.data_ptr<uint8_t>(), as.data_ptr(), nullptr, as.scalar_type() == at::kHalf, 128, 8,
                               groups});
      const at::Tensor& bd = b_data[g];
      const at::Tensor& bsc = b_scales[g];
      TORCH_CHECK(bd.scalar_type() == at::kChar && bd.is_contiguous() && bsc.scalar_type() == at::kHalf &&
                      bsc.is_contiguous() && b_parts[g].size() % 4 == 0,
                  "lora: B in int8 columns with float16 scales, parts of four numbers");
      std::vector<LoraPart> parts;
      int64_t data_at = 0, scales_at = 0;
      for (size_t i = 0; i < b_parts[g].size(); i += 4) {
        LoraPart part{b_parts[g][i], b_parts[g][i + 1], b_parts[g][i + 2], b_parts[g][i + 3], nullptr, nullptr};
        TORCH_CHECK(part.n0 >= 0 && part.outs > 0 && part.n0 + part.outs <= n_out && part.k0 >= 0 && part.rank > 0 &&
                        part.k0 + part.rank <= rank,
                    "lora: a part of B outside the projection or the rank");
        const int64_t blocks = (part.outs + kLanes - 1) / kLanes;
        part.data = bd.data_ptr<int8_t>() + data_at;
        part.scales = reinterpret_cast<const uint16_t*>(bsc.data_ptr()) + scales_at;
        data_at += blocks * part.rank * kLanes;
        scales_at += blocks * part.rank;
        parts.push_back(part);
      }
      TORCH_CHECK(data_at == bd.numel() && scales_at == bsc.numel(), "lora: B's size is its parts'");
      b.push_back(std::move(parts));
      keep.insert(keep.end(), {aw, as, bd, bsc});
      max_rank = std::max(max_rank, rank);
    }
  }
};

// out[n0 + lane] += the block's update, for `lanes` (<= 16) outputs.
PORTABLE_CLONES static void lora_b_block_scalar(const int8_t* q, const uint16_t* scales, int64_t rank, const float* t,
                                                void* out, int64_t n0, int64_t lanes, bool out_bf16) {
  float acc[kLanes];
  for (int lane = 0; lane < kLanes; ++lane) acc[lane] = 0.0f;
  for (int64_t k = 0; k < rank; ++k) {
    const float coef = t[k] * half_to_float(scales[k]);
    for (int lane = 0; lane < kLanes; ++lane)
      acc[lane] = std::fma(static_cast<float>(q[k * kLanes + lane]), coef, acc[lane]);
  }
  for (int64_t lane = 0; lane < lanes; ++lane)
    store_from_float(out, n0 + lane, load_as_float(out, n0 + lane, out_bf16) + acc[lane], out_bf16);
}

#ifdef RELAYLM_X86
// NB blocks side by side (their FMA chains interleave); `lanes` of the last one. The products
// t[k] * scale are the portable code's, 16 at a time.
template <int NB>
AVX512_TARGET static void lora_b_blocks_avx512(const int8_t* q, const uint16_t* scales, int64_t rank, const float* t,
                                               void* out, int64_t n0, int64_t lanes, bool out_bf16) {
  __m512 acc[NB];
  alignas(64) float coef[NB][kLanes];
  for (int j = 0; j < NB; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < rank; k0 += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, rank - k0);
    const __mmask16 m = tail_mask(count);
    const __m512 tv = _mm512_maskz_loadu_ps(m, t + k0);
    for (int j = 0; j < NB; ++j)
      _mm512_store_ps(coef[j], _mm512_mul_ps(tv, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, scales + j * rank + k0))));
    for (int64_t k = 0; k < count; ++k) {
      for (int j = 0; j < NB; ++j) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (j * rank + k0 + k) * kLanes));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), _mm512_set1_ps(coef[j][k]), acc[j]);
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __mmask16 m = j == NB - 1 ? tail_mask(lanes) : static_cast<__mmask16>(0xFFFF);
    const int64_t at = n0 + j * kLanes;
    v_store_from_float(out, at, _mm512_add_ps(v_load_as_float(out, at, out_bf16, m), acc[j]), out_bf16, m);
  }
}
#endif

// out += B t for one row: every block of every part.
static void lora_b(const std::vector<LoraPart>& parts, const float* t, void* out, bool out_bf16, bool vec) {
  for (const LoraPart& part : parts) {
    const int64_t blocks = (part.outs + kLanes - 1) / kLanes;
    const float* tp = t + part.k0;
    auto lanes_of = [&](int64_t block) { return std::min<int64_t>(kLanes, part.outs - block * kLanes); };
    int64_t block = 0;
#ifdef RELAYLM_X86
    if (vec) {
      for (; block + 4 <= blocks; block += 4)
        lora_b_blocks_avx512<4>(part.data + block * part.rank * kLanes, part.scales + block * part.rank, part.rank, tp,
                                out, part.n0 + block * kLanes, lanes_of(block + 3), out_bf16);
      for (; block < blocks; ++block)
        lora_b_blocks_avx512<1>(part.data + block * part.rank * kLanes, part.scales + block * part.rank, part.rank, tp,
                                out, part.n0 + block * kLanes, lanes_of(block), out_bf16);
      continue;
    }
#endif
    for (; block < blocks; ++block)
      lora_b_block_scalar(part.data + block * part.rank * kLanes, part.scales + block * part.rank, part.rank, tp, out,
                          part.n0 + block * kLanes, lanes_of(block), out_bf16);
  }
}

static void add_lora(const LoraFactors& lora, const at::Tensor& group, const QuantizedRows& xq, int64_t k_in,
                     at::Tensor& out, bool scalar, bool portable) {
  const int64_t num_rows = out.size(0), n_out = out.size(1);
  const int64_t num_weights = static_cast<int64_t>(lora.ranks.size());
  TORCH_CHECK(lora.k_in == k_in && lora.n_out == n_out, "lora: the factors of another projection's shape");
  TORCH_CHECK(group.scalar_type() == at::kLong && group.is_contiguous() && group.numel() == num_rows,
              "lora: one int64 group per row");
  const int64_t* gp = group.data_ptr<int64_t>();
  for (int64_t r = 0; r < num_rows; ++r) TORCH_CHECK(gp[r] < num_weights, "lora: group out of range");
  const bool vec = use_avx512(scalar || portable), avx2 = !vec && !portable && any_avx2();
  const bool out_bf16 = out.scalar_type() == at::kBFloat16;
  char* out_base = static_cast<char*>(out.data_ptr());
  const int64_t row_bytes = n_out * out.element_size();
  // Each row by one thread: t = A x, then B t into the row.
  at::parallel_for(0, num_rows, grain_for(lora.max_rank * (k_in + n_out)), [&](int64_t begin, int64_t end) {
    std::vector<float> t(lora.max_rank);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t g = gp[r];
      if (g < 0) continue;
      const int64_t rank = lora.ranks[g];
      for (int64_t block = 0; block < (rank + kLanes - 1) / kLanes; ++block)
        matmul_block_any(lora.a[g], block, &xq.rows[r], 1, rank, Epilogue{nullptr, nullptr}, t.data(), rank, false, vec,
                         avx2);
      lora_b(lora.b[g], t.data(), out_base + r * row_bytes, out_bf16, vec);
    }
  });
}

at::Tensor qlinear(const at::Tensor& x_in, int64_t prologue, const c10::optional<at::Tensor>& norm_weight, double eps,
                   const at::Tensor& weight, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                   const c10::optional<at::Tensor>& super_scales, const c10::optional<at::Tensor>& super_mins,
                   int64_t zero, int64_t bits, int64_t n_out, int64_t k_in, const c10::optional<at::Tensor>& bias,
                   const c10::optional<at::Tensor>& residual, bool out_float32, bool scalar, bool portable) {
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = n_out;
  return qlinear_rows(x_in, prologue, norm_weight, eps, weight, scales, mins, super_scales, super_mins, zero, bits,
                      n_out, k_in, bias, residual, out_float32, scalar, portable, nullptr, nullptr)
      .view(out_shape);
}

// `qlinear`, then each row's LoRA update (`add_lora`): group [rows] (int64; -1: none) indexes
// the adapters of `lora`.
at::Tensor qlinear_lora(const at::Tensor& x_in, int64_t prologue, const c10::optional<at::Tensor>& norm_weight,
                        double eps, const at::Tensor& weight, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, const c10::optional<at::Tensor>& super_scales,
                        const c10::optional<at::Tensor>& super_mins, int64_t zero, int64_t bits, int64_t n_out,
                        int64_t k_in, const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                        bool out_float32, const LoraFactors& lora, const at::Tensor& group, bool scalar,
                        bool portable) {
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = n_out;
  return qlinear_rows(x_in, prologue, norm_weight, eps, weight, scales, mins, super_scales, super_mins, zero, bits,
                      n_out, k_in, bias, residual, out_float32, scalar, portable, &lora, &group)
      .view(out_shape);
}

// ---------------------------------------------------------------- attention
//
// q [rows, heads, queries, dim], k/v [rows, kv_heads, keys, dim] (any strides, dim contiguous),
// positions [rows, queries]: query (r, t) sees keys 0..positions[r, t]. Out [rows, queries, heads, dim].
// Per query: s_j = (sum over d, in order, by FMA from 0 of q_d k_jd) * scale; m = max s_j;
// p_j = exp_fixed(s_j - m); l = sum p_j in key order; o_d = sum p_j v_jd in key order (FMA); o_d / l.

struct AttnArgs {
  const char *q, *k, *v;
  int64_t q_row, q_head, q_pos;      // element strides
  int64_t k_row, k_head, k_pos;
  int64_t v_row, v_head, v_pos;
  bool bf16;
  const int64_t* positions;          // [rows, queries]
  int64_t queries, heads, kv_heads, dim, keys;
  float scale;
  char* out;                         // [rows, queries, heads, dim]
  uint64_t call;                     // this call's number: what a thread's fp32 copy of K and V is of
};

static inline float elem(const char* base, int64_t i, bool bf16) {
  return bf16 ? bf16_to_float(reinterpret_cast<const uint16_t*>(base)[i]) : reinterpret_cast<const float*>(base)[i];
}

static inline int64_t query_position(const AttnArgs& a, int64_t row, int64_t t) {
  int64_t p = a.positions[row * a.queries + t];
  return p < a.keys - 1 ? (p < 0 ? 0 : p) : a.keys - 1;
}

PORTABLE_CLONES static void attend_scalar(const AttnArgs& a, int64_t row, int64_t head, int64_t t) {
  int64_t kvh = head / (a.heads / a.kv_heads);
  int64_t last = query_position(a, row, t);
  int64_t qo = row * a.q_row + head * a.q_head + t * a.q_pos;
  std::vector<float> s(last + 1), o(a.dim, 0.0f);
  float m = -INFINITY;
  for (int64_t j = 0; j <= last; ++j) {
    int64_t ko = row * a.k_row + kvh * a.k_head + j * a.k_pos;
    float acc = 0.0f;
    for (int64_t d = 0; d < a.dim; ++d) acc = std::fma(elem(a.q, qo + d, a.bf16), elem(a.k, ko + d, a.bf16), acc);
    s[j] = acc * a.scale;
    m = std::fmax(m, s[j]);
  }
  float l = 0.0f;
  for (int64_t j = 0; j <= last; ++j) {
    float p = exp_fixed(s[j] - m);
    l = l + p;
    int64_t vo = row * a.v_row + kvh * a.v_head + j * a.v_pos;
    for (int64_t d = 0; d < a.dim; ++d) o[d] = std::fma(p, elem(a.v, vo + d, a.bf16), o[d]);
  }
  int64_t oo = ((row * a.queries + t) * a.heads + head) * a.dim;
  for (int64_t d = 0; d < a.dim; ++d) store_from_float(a.out, oo + d, o[d] / l, a.bf16);
}

// One (row, kv head)'s keys and values in fp32, [key][dim], for the vector code. A thread's items
// are consecutive (row, kv head, chunk) numbers, so it converts each (row, kv head) once per call,
// and only the keys its later items see beyond its earlier ones (a copy per item would read and
// write the whole cache again for every 16 queries of a long prompt). Padded to `padded` keys.
struct KvCopy {
  uint64_t call = 0;
  int64_t row = -1, kvh = -1, keys = 0;
  std::vector<float> k, v;
};

// One key's or value's `dim` elements as float32 (a bf16 is the top half of its float32: exact).
PORTABLE_CLONES static void widen_row(const char* base, int64_t offset, int64_t dim, bool bf16, float* out) {
  if (bf16) {
    const uint16_t* in = reinterpret_cast<const uint16_t*>(base) + offset;
    uint32_t* bits = reinterpret_cast<uint32_t*>(out);
    for (int64_t d = 0; d < dim; ++d) bits[d] = static_cast<uint32_t>(in[d]) << 16;
  } else {
    std::memcpy(out, reinterpret_cast<const float*>(base) + offset, dim * sizeof(float));
  }
}

static void copy_kv_row(const AttnArgs& a, int64_t row, int64_t kvh, int64_t keys, int64_t padded, KvCopy& copy) {
  const int64_t dim = a.dim;
  if (copy.call != a.call || copy.row != row || copy.kvh != kvh) {
    copy.call = a.call;
    copy.row = row;
    copy.kvh = kvh;
    copy.keys = 0;
  }
  if (static_cast<int64_t>(copy.k.size()) < padded * dim) copy.k.resize(padded * dim);
  if (static_cast<int64_t>(copy.v.size()) < padded * dim) copy.v.resize(padded * dim);
  for (int64_t j = copy.keys; j < keys; ++j) {
    const int64_t ko = row * a.k_row + kvh * a.k_head + j * a.k_pos, vo = row * a.v_row + kvh * a.v_head + j * a.v_pos;
    widen_row(a.k, ko, dim, a.bf16, copy.k.data() + j * dim);
    widen_row(a.v, vo, dim, a.bf16, copy.v.data() + j * dim);
  }
  copy.keys = std::max(copy.keys, keys);
  // Keys past `keys` are scored but their scores are never read (the loops after stop at `keys`).
}

static std::atomic<uint64_t> attention_calls{0};

#ifdef RELAYLM_X86
// Up to 16 queries of one kv head, one per lane; every lane runs attend_scalar's operations.
// Scores four keys at a time; then, a block of keys at a time, the weights (exp) and their sum,
// and every dimension's weighted values, so that a block's values are read from the L1 cache
// once for all dimensions. Each lane's sums still run over the keys in order.
constexpr int64_t kKeyBlock = 64;

template <int W>
AVX512_TARGET static inline void weigh_values_avx512(const float* weights, const float* vf, const __mmask16* visible,
                                                     int64_t n, int64_t dim, int64_t d0, float* o) {
  __m512 acc[W];
  for (int i = 0; i < W; ++i) acc[i] = _mm512_loadu_ps(o + (d0 + i) * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    const __m512 p = _mm512_loadu_ps(weights + j * kLanes);
    const float* v = vf + j * dim + d0;
    for (int i = 0; i < W; ++i) acc[i] = _mm512_mask3_fmadd_ps(p, _mm512_set1_ps(v[i]), acc[i], visible[j]);
  }
  for (int i = 0; i < W; ++i) _mm512_storeu_ps(o + (d0 + i) * kLanes, acc[i]);
}

AVX512_TARGET static void attend_avx512(const AttnArgs& a, int64_t row, int64_t kvh, const int64_t* lane_head,
                                        const int64_t* lane_t, int count) {
  const int64_t dim = a.dim;
  thread_local std::vector<float> qt, scores, o;
  thread_local KvCopy copy;
  if (static_cast<int64_t>(qt.size()) < dim * kLanes) qt.resize(dim * kLanes);
  std::fill(qt.begin(), qt.begin() + dim * kLanes, 0.0f);  // [dim][lane]
  alignas(64) int32_t last_lane[kLanes];
  int64_t last = 0;
  for (int i = 0; i < kLanes; ++i) {
    if (i < count) {
      int64_t qo = row * a.q_row + lane_head[i] * a.q_head + lane_t[i] * a.q_pos;
      for (int64_t d = 0; d < dim; ++d) qt[d * kLanes + i] = elem(a.q, qo + d, a.bf16);
      int64_t p = query_position(a, row, lane_t[i]);
      last_lane[i] = static_cast<int32_t>(p);
      last = p > last ? p : last;
    } else {
      last_lane[i] = -1;
    }
  }
  const __m512i last_v = _mm512_load_si512(last_lane);
  const int64_t keys = last + 1, padded = (keys + 3) / 4 * 4;
  copy_kv_row(a, row, kvh, keys, padded, copy);
  const float *kf = copy.k.data(), *vf = copy.v.data();
  if (static_cast<int64_t>(scores.size()) < padded * kLanes) scores.resize(padded * kLanes);
  const __m512 scale = _mm512_set1_ps(a.scale);  // scores: [key][lane]
  for (int64_t j = 0; j < padded; j += 4) {
    const float *k0 = kf + j * dim, *k1 = k0 + dim, *k2 = k1 + dim, *k3 = k2 + dim;
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      __m512 q = _mm512_loadu_ps(qt.data() + d * kLanes);
      s0 = _mm512_fmadd_ps(q, _mm512_set1_ps(k0[d]), s0);
      s1 = _mm512_fmadd_ps(q, _mm512_set1_ps(k1[d]), s1);
      s2 = _mm512_fmadd_ps(q, _mm512_set1_ps(k2[d]), s2);
      s3 = _mm512_fmadd_ps(q, _mm512_set1_ps(k3[d]), s3);
    }
    _mm512_storeu_ps(scores.data() + (j + 0) * kLanes, _mm512_mul_ps(s0, scale));
    _mm512_storeu_ps(scores.data() + (j + 1) * kLanes, _mm512_mul_ps(s1, scale));
    _mm512_storeu_ps(scores.data() + (j + 2) * kLanes, _mm512_mul_ps(s2, scale));
    _mm512_storeu_ps(scores.data() + (j + 3) * kLanes, _mm512_mul_ps(s3, scale));
  }
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < keys; ++j) {
    __mmask16 visible = _mm512_cmp_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(j)), last_v, _MM_CMPINT_LE);
    m = _mm512_mask_max_ps(m, visible, m, _mm512_loadu_ps(scores.data() + j * kLanes));
  }
  if (static_cast<int64_t>(o.size()) < dim * kLanes) o.resize(dim * kLanes);
  std::fill(o.begin(), o.begin() + dim * kLanes, 0.0f);  // [dim][lane]
  __mmask16 visible[kKeyBlock];
  __m512 l = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < keys; j0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, keys - j0);
    float* weights = scores.data() + j0 * kLanes;
    for (int64_t j = 0; j < n; ++j) {  // the weights in place of the scores, and their sum in key order
      visible[j] = _mm512_cmp_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(j0 + j)), last_v, _MM_CMPINT_LE);
      __m512 p = v_exp_fixed(_mm512_sub_ps(_mm512_loadu_ps(weights + j * kLanes), m));
      _mm512_storeu_ps(weights + j * kLanes, p);
      l = _mm512_mask_add_ps(l, visible[j], l, p);
    }
    const float* vb = vf + j0 * dim;
    int64_t d0 = 0;
    for (; d0 + 16 <= dim; d0 += 16) weigh_values_avx512<16>(weights, vb, visible, n, dim, d0, o.data());
    for (; d0 + 4 <= dim; d0 += 4) weigh_values_avx512<4>(weights, vb, visible, n, dim, d0, o.data());
    for (; d0 < dim; ++d0) weigh_values_avx512<1>(weights, vb, visible, n, dim, d0, o.data());
  }
  alignas(64) float lsum[kLanes];
  _mm512_store_ps(lsum, l);
  for (int i = 0; i < count; ++i) {
    int64_t oo = ((row * a.queries + lane_t[i]) * a.heads + lane_head[i]) * dim;
    for (int64_t d = 0; d < dim; ++d) store_from_float(a.out, oo + d, o[d * kLanes + i] / lsum[i], a.bf16);
  }
}

// 16 rows of 16 floats, transposed in place.
AVX512_TARGET static inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int h = 0; h < 16; h += 8) {
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// A few queries of one kv head (a decode step's, up to eight), keys sixteen at a time in the
// lanes: the same operations per (query, key) as attend_scalar, on keys transposed in registers.
// Four blocks of sixteen keys are scored at once, and up to four queries' weighted values are
// summed in one pass over the keys (each value read once for them all), so that several chains
// of dependent multiply-adds are in flight; each chain still runs in its own order.
constexpr int kFewBlocks = 4;

// What the few-query passes (AVX-512 and AVX2) start from: the queries as fp32 (q [count][dim]),
// each one's last key and the latest of them, and a thread's buffers for the scores and
// probabilities [count][width] (width: the keys padded to whole passes of kFewBlocks blocks of
// `lanes` keys) and for a pass's transposed keys.
struct FewQueries {
  std::vector<float> q, scores, p, kt;
  int64_t last[kLanes];
  int64_t last_max, width;
};

static FewQueries& few_queries(const AttnArgs& a, int64_t row, const int64_t* lane_head, const int64_t* lane_t,
                               int count, int64_t lanes) {
  thread_local FewQueries f;
  const int64_t dim = a.dim;
  if (static_cast<int64_t>(f.q.size()) < count * dim) f.q.resize(count * dim);
  f.last_max = 0;
  for (int c = 0; c < count; ++c) {
    int64_t qo = row * a.q_row + lane_head[c] * a.q_head + lane_t[c] * a.q_pos;
    for (int64_t d = 0; d < dim; ++d) f.q[c * dim + d] = elem(a.q, qo + d, a.bf16);
    f.last[c] = query_position(a, row, lane_t[c]);
    f.last_max = f.last[c] > f.last_max ? f.last[c] : f.last_max;
  }
  const int64_t span = kFewBlocks * lanes;
  f.width = (f.last_max + span) / span * span;
  if (static_cast<int64_t>(f.scores.size()) < count * f.width) f.scores.resize(count * f.width);
  if (static_cast<int64_t>(f.p.size()) < count * f.width) f.p.resize(count * f.width);
  if (static_cast<int64_t>(f.kt.size()) < kFewBlocks * dim * lanes) f.kt.resize(kFewBlocks * dim * lanes);
  return f;
}

template <int C, int CH>
AVX512_TARGET static inline void weigh_values_few_avx512(const AttnArgs& a, int64_t row, int64_t kvh,
                                                         const float* p, int64_t width, const int64_t* last,
                                                         float* l, __m512* o) {
  // Query c's sum runs over its keys 0..last[c] in order; a key past it adds nothing to c.
  int64_t last_max = 0;
  for (int c = 0; c < C; ++c) last_max = last[c] > last_max ? last[c] : last_max;
  __m512 acc[C][CH];
  for (int c = 0; c < C; ++c)
    for (int i = 0; i < CH; ++i) acc[c][i] = _mm512_setzero_ps();
  float sum[C];
  for (int c = 0; c < C; ++c) sum[c] = 0.0f;
  for (int64_t j = 0; j <= last_max; ++j) {
    const int64_t vo = row * a.v_row + kvh * a.v_head + j * a.v_pos;
    __m512 v[CH];
    for (int i = 0; i < CH; ++i) v[i] = v_load_as_float(a.v, vo + i * kLanes, a.bf16, 0xFFFF);
    for (int c = 0; c < C; ++c) {
      if (j > last[c]) continue;
      const float pj = p[c * width + j];
      sum[c] = sum[c] + pj;
      const __m512 pv = _mm512_set1_ps(pj);
      for (int i = 0; i < CH; ++i) acc[c][i] = _mm512_fmadd_ps(pv, v[i], acc[c][i]);
    }
  }
  for (int c = 0; c < C; ++c) {
    l[c] = sum[c];
    for (int i = 0; i < CH; ++i) o[c * CH + i] = acc[c][i];
  }
}

AVX512_TARGET static void attend_few_avx512(const AttnArgs& a, int64_t row, int64_t kvh, const int64_t* lane_head,
                                            const int64_t* lane_t, int count) {
  const int64_t dim = a.dim;
  auto& [q, scores, p, kt, last, last_max, width] = few_queries(a, row, lane_head, lane_t, count, kLanes);
  constexpr int64_t kSpan = kFewBlocks * kLanes;  // keys scored per pass
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t j0 = 0; j0 <= last_max; j0 += kSpan) {
    for (int b = 0; b < kFewBlocks; ++b) {  // kt[b][d][lane]: block b's keys, transposed
      const int64_t jb = j0 + b * kLanes;
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(kLanes, last_max + 1 - jb));
      for (int64_t dc = 0; dc < dim; dc += kLanes) {
        __m512 block[kLanes];
        for (int i = 0; i < kLanes; ++i)
          block[i] = i < n ? v_load_as_float(a.k, row * a.k_row + kvh * a.k_head + (jb + i) * a.k_pos + dc, a.bf16, 0xFFFF)
                           : _mm512_setzero_ps();
        transpose16(block);
        for (int i = 0; i < kLanes; ++i) _mm512_storeu_ps(kt.data() + (b * dim + dc + i) * kLanes, block[i]);
      }
    }
    for (int c = 0; c < count; ++c) {
      __m512 acc[kFewBlocks];
      for (int b = 0; b < kFewBlocks; ++b) acc[b] = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; ++d) {
        const __m512 qd = _mm512_set1_ps(q[c * dim + d]);
        for (int b = 0; b < kFewBlocks; ++b)
          acc[b] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kt.data() + (b * dim + d) * kLanes), acc[b]);
      }
      for (int b = 0; b < kFewBlocks; ++b)
        _mm512_storeu_ps(scores.data() + c * width + j0 + b * kLanes, _mm512_mul_ps(acc[b], scale));
    }
  }
  // Each query's maximum over its keys (any order gives the same maximum; a NaN score is passed
  // over, as std::fmax does), then its weights.
  float m[kLanes];
  for (int c = 0; c < count; ++c) {
    const float* s = scores.data() + c * width;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + kLanes <= last[c] + 1; j += kLanes) mv = _mm512_max_ps(_mm512_loadu_ps(s + j), mv);
    if (j <= last[c]) mv = _mm512_mask_max_ps(mv, tail_mask(last[c] + 1 - j), _mm512_loadu_ps(s + j), mv);
    m[c] = _mm512_reduce_max_ps(mv);
    for (int64_t k = 0; k <= last[c]; k += kLanes)
      _mm512_storeu_ps(p.data() + c * width + k, v_exp_fixed(_mm512_sub_ps(_mm512_loadu_ps(s + k), _mm512_set1_ps(m[c]))));
  }
  const int64_t chunks = dim / kLanes;
  float l[kLanes];
  __m512 o[16];
  auto finish = [&](int c, const __m512* oc) AVX512_TARGET {
    int64_t oo = ((row * a.queries + lane_t[c]) * a.heads + lane_head[c]) * dim;
    for (int64_t i = 0; i < chunks; ++i)
      v_store_from_float(a.out, oo + i * kLanes, _mm512_div_ps(oc[i], _mm512_set1_ps(l[c])), a.bf16, 0xFFFF);
  };
  // The weighted values four queries at a time (one pass over the values each).
  for (int g = 0; g < count; g += 4) {
    const int group = std::min(4, count - g);
#define RELAYLM_FEW(C, CH)                                                                       \
    if (group == C && chunks == CH) {                                                            \
      weigh_values_few_avx512<C, CH>(a, row, kvh, p.data() + g * width, width, last + g, l + g, o); \
      for (int c = 0; c < C; ++c) finish(g + c, o + c * CH);                                     \
      continue;                                                                                  \
    }
    RELAYLM_FEW(1, 4) RELAYLM_FEW(2, 4) RELAYLM_FEW(3, 4) RELAYLM_FEW(4, 4)
    RELAYLM_FEW(1, 8) RELAYLM_FEW(2, 8)
#undef RELAYLM_FEW
    for (int c = g; c < g + group; ++c) {  // other shapes: one query at a time
      const float* pc = p.data() + c * width;
      for (int64_t i = 0; i < chunks; ++i) o[i] = _mm512_setzero_ps();
      float sum = 0.0f;
      for (int64_t j = 0; j <= last[c]; ++j) {
        sum = sum + pc[j];
        __m512 pj = _mm512_set1_ps(pc[j]);
        int64_t vo = row * a.v_row + kvh * a.v_head + j * a.v_pos;
        for (int64_t i = 0; i < chunks; ++i)
          o[i] = _mm512_fmadd_ps(pj, v_load_as_float(a.v, vo + i * kLanes, a.bf16, 0xFFFF), o[i]);
      }
      l[c] = sum;
      finish(c, o);
    }
  }
}
#endif

#ifdef RELAYLM_X86
// The AVX2 attention (CPUs without the AVX-512 path): attend_avx512's passes on 8 query lanes
// (AVX2 has 16 vector registers), masks as blends. Each lane still runs attend_scalar's
// operations in its order; FMA as std::fma, and exp_fixed's steps.
#define AVX2_FMA_TARGET __attribute__((target("avx2,fma")))
constexpr int kLanes8 = 8;

AVX2_FMA_TARGET static inline __m256 v8_exp_fixed(__m256 x) {
  __m256 c = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLow)), _mm256_set1_ps(kExpHigh));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(kLn2Hi), c);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 out = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  __m256 low = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLow), _CMP_LT_OQ);
  return _mm256_blendv_ps(out, _mm256_setzero_ps(), low);
}

// Lane i sees key j where j <= last[i], that is last[i] > j - 1: all ones, or zeros.
AVX2_FMA_TARGET static inline __m256 visible_at(__m256i last, int64_t j) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(last, _mm256_set1_epi32(static_cast<int32_t>(j - 1))));
}

template <int W>
AVX2_FMA_TARGET static inline void weigh_values_avx2(const float* weights, const float* vf, const __m256* visible,
                                                     int64_t n, int64_t dim, int64_t d0, float* o) {
  __m256 acc[W];
  for (int i = 0; i < W; ++i) acc[i] = _mm256_loadu_ps(o + (d0 + i) * kLanes8);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 p = _mm256_loadu_ps(weights + j * kLanes8);
    const float* v = vf + j * dim + d0;
    for (int i = 0; i < W; ++i)
      acc[i] = _mm256_blendv_ps(acc[i], _mm256_fmadd_ps(p, _mm256_set1_ps(v[i]), acc[i]), visible[j]);
  }
  for (int i = 0; i < W; ++i) _mm256_storeu_ps(o + (d0 + i) * kLanes8, acc[i]);
}

AVX2_FMA_TARGET static void attend_avx2(const AttnArgs& a, int64_t row, int64_t kvh, const int64_t* lane_head,
                                        const int64_t* lane_t, int count) {
  const int64_t dim = a.dim;
  thread_local std::vector<float> qt, scores, o;
  thread_local KvCopy copy;
  if (static_cast<int64_t>(qt.size()) < dim * kLanes8) qt.resize(dim * kLanes8);
  std::fill(qt.begin(), qt.begin() + dim * kLanes8, 0.0f);  // [dim][lane]
  alignas(32) int32_t last_lane[kLanes8];
  int64_t last = 0;
  for (int i = 0; i < kLanes8; ++i) {
    if (i < count) {
      int64_t qo = row * a.q_row + lane_head[i] * a.q_head + lane_t[i] * a.q_pos;
      for (int64_t d = 0; d < dim; ++d) qt[d * kLanes8 + i] = elem(a.q, qo + d, a.bf16);
      int64_t p = query_position(a, row, lane_t[i]);
      last_lane[i] = static_cast<int32_t>(p);
      last = p > last ? p : last;
    } else {
      last_lane[i] = -1;
    }
  }
  const __m256i last_v = _mm256_load_si256(reinterpret_cast<const __m256i*>(last_lane));
  const int64_t keys = last + 1, padded = (keys + 3) / 4 * 4;
  copy_kv_row(a, row, kvh, keys, padded, copy);
  const float *kf = copy.k.data(), *vf = copy.v.data();
  if (static_cast<int64_t>(scores.size()) < padded * kLanes8) scores.resize(padded * kLanes8);
  const __m256 scale = _mm256_set1_ps(a.scale);  // scores: [key][lane]
  for (int64_t j = 0; j < padded; j += 4) {
    const float *k0 = kf + j * dim, *k1 = k0 + dim, *k2 = k1 + dim, *k3 = k2 + dim;
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      __m256 q = _mm256_loadu_ps(qt.data() + d * kLanes8);
      s0 = _mm256_fmadd_ps(q, _mm256_set1_ps(k0[d]), s0);
      s1 = _mm256_fmadd_ps(q, _mm256_set1_ps(k1[d]), s1);
      s2 = _mm256_fmadd_ps(q, _mm256_set1_ps(k2[d]), s2);
      s3 = _mm256_fmadd_ps(q, _mm256_set1_ps(k3[d]), s3);
    }
    _mm256_storeu_ps(scores.data() + (j + 0) * kLanes8, _mm256_mul_ps(s0, scale));
    _mm256_storeu_ps(scores.data() + (j + 1) * kLanes8, _mm256_mul_ps(s1, scale));
    _mm256_storeu_ps(scores.data() + (j + 2) * kLanes8, _mm256_mul_ps(s2, scale));
    _mm256_storeu_ps(scores.data() + (j + 3) * kLanes8, _mm256_mul_ps(s3, scale));
  }
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < keys; ++j) {
    __m256 s = _mm256_loadu_ps(scores.data() + j * kLanes8);
    m = _mm256_blendv_ps(m, _mm256_max_ps(m, s), visible_at(last_v, j));
  }
  if (static_cast<int64_t>(o.size()) < dim * kLanes8) o.resize(dim * kLanes8);
  std::fill(o.begin(), o.begin() + dim * kLanes8, 0.0f);  // [dim][lane]
  __m256 visible[kKeyBlock];
  __m256 l = _mm256_setzero_ps();
  for (int64_t j0 = 0; j0 < keys; j0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, keys - j0);
    float* weights = scores.data() + j0 * kLanes8;
    for (int64_t j = 0; j < n; ++j) {
      visible[j] = visible_at(last_v, j0 + j);
      __m256 p = v8_exp_fixed(_mm256_sub_ps(_mm256_loadu_ps(weights + j * kLanes8), m));
      _mm256_storeu_ps(weights + j * kLanes8, p);
      l = _mm256_blendv_ps(l, _mm256_add_ps(l, p), visible[j]);
    }
    const float* vb = vf + j0 * dim;
    int64_t d0 = 0;
    for (; d0 + 8 <= dim; d0 += 8) weigh_values_avx2<8>(weights, vb, visible, n, dim, d0, o.data());
    for (; d0 < dim; ++d0) weigh_values_avx2<1>(weights, vb, visible, n, dim, d0, o.data());
  }
  alignas(32) float lsum[kLanes8];
  _mm256_store_ps(lsum, l);
  for (int i = 0; i < count; ++i) {
    int64_t oo = ((row * a.queries + lane_t[i]) * a.heads + lane_head[i]) * dim;
    for (int64_t d = 0; d < dim; ++d) store_from_float(a.out, oo + d, o[d * kLanes8 + i] / lsum[i], a.bf16);
  }
}

// 8 rows of 8 floats, transposed in place.
AVX2_FMA_TARGET static inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// Eight elements as float32 (a bf16 is the top half of its float32: exact).
AVX2_FMA_TARGET static inline __m256 v8_load_as_float(const char* base, int64_t i, bool bf16) {
  if (bf16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(base) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_loadu_ps(reinterpret_cast<const float*>(base) + i);
}

// The weighted values of C queries (C <= 3) over dimensions d0..d0 + 8S (S <= 4: a 64-byte line
// of bf16 values), in one pass over the keys. Query c's sum runs over its keys 0..last[c] in
// order; keys up to the least `last` count for all of them, without a test per query.
template <int C, int S>
AVX2_FMA_TARGET static inline void weigh_values_few_avx2(const AttnArgs& a, int64_t row, int64_t kvh, const float* p,
                                                         int64_t width, const int64_t* last, int64_t d0, __m256* o) {
  int64_t last_min = last[0], last_max = last[0];
  for (int c = 1; c < C; ++c) {
    last_min = std::min(last_min, last[c]);
    last_max = std::max(last_max, last[c]);
  }
  __m256 acc[C][S];
  for (int c = 0; c < C; ++c)
    for (int i = 0; i < S; ++i) acc[c][i] = _mm256_setzero_ps();
  const int64_t base = row * a.v_row + kvh * a.v_head + d0;
  int64_t j = 0;
  for (; j <= last_min; ++j) {
    __m256 pv[C];
    for (int c = 0; c < C; ++c) pv[c] = _mm256_set1_ps(p[c * width + j]);
    for (int i = 0; i < S; ++i) {
      const __m256 v = v8_load_as_float(a.v, base + j * a.v_pos + i * kLanes8, a.bf16);
      for (int c = 0; c < C; ++c) acc[c][i] = _mm256_fmadd_ps(pv[c], v, acc[c][i]);
    }
  }
  for (; j <= last_max; ++j) {
    for (int c = 0; c < C; ++c) {
      if (j > last[c]) continue;
      const __m256 pv = _mm256_set1_ps(p[c * width + j]);
      for (int i = 0; i < S; ++i)
        acc[c][i] = _mm256_fmadd_ps(pv, v8_load_as_float(a.v, base + j * a.v_pos + i * kLanes8, a.bf16), acc[c][i]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int i = 0; i < S; ++i) o[c * S + i] = acc[c][i];
}

// A few queries of one kv head (a decode step's, up to eight), keys eight at a time in the lanes:
// attend_few_avx512's passes on AVX2. Four blocks of eight keys are scored at once; up to three
// queries' weighted values are summed in one pass over the values. Each (query, key) and each
// query's sums run attend_scalar's operations in its order.
AVX2_FMA_TARGET static void attend_few_avx2(const AttnArgs& a, int64_t row, int64_t kvh, const int64_t* lane_head,
                                            const int64_t* lane_t, int count) {
  const int64_t dim = a.dim;
  auto& [q, scores, p, kt, last, last_max, width] = few_queries(a, row, lane_head, lane_t, count, kLanes8);
  constexpr int64_t kSpan = kFewBlocks * kLanes8;  // keys scored per pass
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int64_t j0 = 0; j0 <= last_max; j0 += kSpan) {
    for (int b = 0; b < kFewBlocks; ++b) {  // kt[b][d][lane]: block b's keys, transposed
      const int64_t jb = j0 + b * kLanes8;
      const int64_t n = std::max<int64_t>(0, std::min<int64_t>(kLanes8, last_max + 1 - jb));
      for (int64_t dc = 0; dc < dim; dc += kLanes8) {
        __m256 block[kLanes8];
        for (int i = 0; i < kLanes8; ++i)
          block[i] = i < n ? v8_load_as_float(a.k, row * a.k_row + kvh * a.k_head + (jb + i) * a.k_pos + dc, a.bf16)
                           : _mm256_setzero_ps();
        transpose8(block);
        for (int i = 0; i < kLanes8; ++i) _mm256_storeu_ps(kt.data() + (b * dim + dc + i) * kLanes8, block[i]);
      }
    }
    for (int c = 0; c < count; ++c) {
      __m256 acc[kFewBlocks];
      for (int b = 0; b < kFewBlocks; ++b) acc[b] = _mm256_setzero_ps();
      for (int64_t d = 0; d < dim; ++d) {
        const __m256 qd = _mm256_set1_ps(q[c * dim + d]);
        for (int b = 0; b < kFewBlocks; ++b)
          acc[b] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kt.data() + (b * dim + d) * kLanes8), acc[b]);
      }
      for (int b = 0; b < kFewBlocks; ++b)
        _mm256_storeu_ps(scores.data() + c * width + j0 + b * kLanes8, _mm256_mul_ps(acc[b], scale));
    }
  }
  // Each query's maximum over its keys (any order gives the same maximum; a NaN score is passed
  // over, as std::fmax does), its weights, and their sum in key order.
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  float l[kLanes8];
  for (int c = 0; c < count; ++c) {
    const float* s = scores.data() + c * width;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + kLanes8 <= last[c] + 1; j += kLanes8) mv = _mm256_max_ps(_mm256_loadu_ps(s + j), mv);
    if (j <= last[c]) {
      const __m256 tail = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(last[c] + 1 - j)), iota));
      mv = _mm256_max_ps(_mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s + j), tail), mv);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(h));
    float* pc = p.data() + c * width;
    for (int64_t k = 0; k <= last[c]; k += kLanes8)
      _mm256_storeu_ps(pc + k, v8_exp_fixed(_mm256_sub_ps(_mm256_loadu_ps(s + k), m)));
    float sum = 0.0f;
    for (int64_t k = 0; k <= last[c]; ++k) sum = sum + pc[k];
    l[c] = sum;
  }
  __m256 o[3 * 4];
  alignas(32) float lane[kLanes8];
  for (int g = 0; g < count; g += 3) {
    const int group = std::min(3, count - g);
    for (int64_t d0 = 0; d0 < dim; d0 += 4 * kLanes8) {
      const int slice = static_cast<int>(std::min<int64_t>(4, (dim - d0) / kLanes8));
      const float* pg = p.data() + g * width;
#define RELAYLM_FEW8(C, S) \
      if (group == C && slice == S) weigh_values_few_avx2<C, S>(a, row, kvh, pg, width, last + g, d0, o);
      RELAYLM_FEW8(1, 1) RELAYLM_FEW8(1, 2) RELAYLM_FEW8(1, 3) RELAYLM_FEW8(1, 4)
      RELAYLM_FEW8(2, 1) RELAYLM_FEW8(2, 2) RELAYLM_FEW8(2, 3) RELAYLM_FEW8(2, 4)
      RELAYLM_FEW8(3, 1) RELAYLM_FEW8(3, 2) RELAYLM_FEW8(3, 3) RELAYLM_FEW8(3, 4)
#undef RELAYLM_FEW8
      for (int c = 0; c < group; ++c) {
        const int64_t oo = ((row * a.queries + lane_t[g + c]) * a.heads + lane_head[g + c]) * dim;
        for (int i = 0; i < slice; ++i) {
          _mm256_store_ps(lane, _mm256_div_ps(o[c * slice + i], _mm256_set1_ps(l[g + c])));
          for (int e = 0; e < kLanes8; ++e) store_from_float(a.out, oo + d0 + i * kLanes8 + e, lane[e], a.bf16);
        }
      }
    }
  }
}

static bool use_avx2_fma() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#endif

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                     double scale, bool scalar, bool portable) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention: 4-d q, k, v");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "attention: one dtype");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, "attention: bf16 or fp32");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "attention: dim must be contiguous");
  int64_t rows = q.size(0), heads = q.size(1), queries = q.size(2), dim = q.size(3);
  int64_t kv_heads = k.size(1), keys = k.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "attention: heads a multiple of kv heads");
  at::Tensor pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.size(0) == rows && pos.size(1) == queries, "attention: positions [rows, queries]");
  at::Tensor out = at::empty({rows, queries, heads, dim}, q.options());
  if (q.numel() == 0) return out;
  AttnArgs a{static_cast<const char*>(q.data_ptr()), static_cast<const char*>(k.data_ptr()),
             static_cast<const char*>(v.data_ptr()), q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
             k.stride(2), v.stride(0), v.stride(1), v.stride(2), q.scalar_type() == at::kBFloat16,
             pos.data_ptr<int64_t>(), queries, heads, kv_heads, dim, keys, static_cast<float>(scale),
             static_cast<char*>(out.data_ptr()), attention_calls.fetch_add(1) + 1};
  const int64_t group = heads / kv_heads;
  const int64_t per_kv = group * queries;  // query lanes of one kv head: (t, head in group)
  const int64_t chunks = (per_kv + kLanes - 1) / kLanes;
  const bool vec = use_avx512(scalar || portable);
#ifdef RELAYLM_X86
  const bool vec8 = !vec && !portable && use_avx2_fma();
#endif
  const int64_t work = keys * dim * std::min<int64_t>(per_kv, kLanes) * 2;
  at::parallel_for(0, rows * kv_heads * chunks, grain_for(work), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      int64_t chunk = item % chunks, kvh = (item / chunks) % kv_heads, row = item / chunks / kv_heads;
      int64_t lane_head[kLanes], lane_t[kLanes];
      int count = 0;
      for (int64_t i = chunk * kLanes; i < per_kv && count < kLanes; ++i, ++count) {
        lane_t[count] = i / group;
        lane_head[count] = kvh * group + i % group;
      }
#ifdef RELAYLM_X86
      if (vec && count <= 8 && dim % kLanes == 0 && dim <= 256) {
        attend_few_avx512(a, row, kvh, lane_head, lane_t, count);
        continue;
      }
      if (vec) {
        attend_avx512(a, row, kvh, lane_head, lane_t, count);
        continue;
      }
      if (vec8 && count <= kLanes8 && dim % kLanes8 == 0 && dim <= 256) {
        attend_few_avx2(a, row, kvh, lane_head, lane_t, count);
        continue;
      }
      if (vec8) {
        for (int first = 0; first < count; first += kLanes8)
          attend_avx2(a, row, kvh, lane_head + first, lane_t + first, std::min(kLanes8, count - first));
        continue;
      }
#endif
      for (int i = 0; i < count; ++i) attend_scalar(a, row, lane_head[i], lane_t[i]);
    }
  });
  return out;
}

// ---------------------------------------------------------------- norms and sampler reductions

#ifdef RELAYLM_X86
AVX512_TARGET static void store_row_avx512(const float* act, int64_t k, void* out, bool bf16) {
  for (int64_t i = 0; i < k; i += kLanes) {
    __mmask16 m = tail_mask(k - i);
    v_store_from_float(out, i, _mm512_maskz_loadu_ps(m, act + i), bf16, m);
  }
}

AVX512_TARGET static void exp_shifted_row_avx512(const float* x, int64_t width, float m, float* out) {
  for (int64_t i = 0; i < width; i += kLanes) {
    __mmask16 mask = tail_mask(width - i);
    __m512 v = _mm512_maskz_loadu_ps(mask, x + i);
    _mm512_mask_storeu_ps(out + i, mask, v_exp_fixed(_mm512_sub_ps(v, _mm512_set1_ps(m))));
  }
}

AVX512_TARGET static float block_sum_avx512(const float* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    __mmask16 mask = tail_mask(n - i);
    acc = _mm512_mask_add_ps(acc, mask, acc, _mm512_maskz_loadu_ps(mask, x + i));
  }
  return v_tree16(acc);
}
#endif

// exp_fixed(x - max of the row) of one row: the vector code where `vec`, else the portable code.
static void exp_shifted_row(const float* x, int64_t width, bool vec, float* out) {
  float m = -INFINITY;
  for (int64_t i = 0; i < width; ++i) m = std::fmax(m, x[i]);  // exact in any order
#ifdef RELAYLM_X86
  if (vec) {
    exp_shifted_row_avx512(x, width, m, out);
    return;
  }
#else
  (void)vec;
#endif
  for (int64_t i = 0; i < width; ++i) out[i] = exp_fixed(x[i] - m);
}

// The sum of n values: element i in lane i % 16, then tree16.
static float block_sum(const float* x, int64_t n, bool vec) {
#ifdef RELAYLM_X86
  if (vec) return block_sum_avx512(x, n);
#else
  (void)vec;
#endif
  float lanes[kLanes] = {0};
  for (int64_t i = 0; i < n; ++i) lanes[i % kLanes] = lanes[i % kLanes] + x[i];
  return tree16(lanes);
}

// RMSNorm of each row of x [..., k]: sum of squares in 16 lanes (tree16), (x / rms) * w.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps, bool scalar) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat, "rms_norm: bf16 or fp32");
  int64_t k = x_in.size(-1);
  at::Tensor x = x_in.reshape({-1, k}).contiguous();
  at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty_like(x);
  bool bf16 = x.scalar_type() == at::kBFloat16, w_bf16 = w.scalar_type() == at::kBFloat16;
  const bool vec = use_avx512(scalar);
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const int64_t row_bytes = k * x.element_size();
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> act(k);
    for (int64_t r = begin; r < end; ++r) {
#ifdef RELAYLM_X86
      if (vec) {
        prologue_avx512(xp + r * row_bytes, bf16, k, kRmsNorm, w.data_ptr(), w_bf16, static_cast<float>(eps), act.data());
        store_row_avx512(act.data(), k, op + r * row_bytes, bf16);
        continue;
      }
#endif
      prologue_scalar(xp + r * row_bytes, bf16, k, kRmsNorm, w.data_ptr(), w_bf16, static_cast<float>(eps), act.data());
      for (int64_t i = 0; i < k; ++i) store_from_float(op + r * row_bytes, i, act[i], bf16);
    }
  });
  return out.view(x_in.sizes());
}

// exp_fixed(x - max of its row), fp32 [rows, width]: unnormalised probabilities.
at::Tensor exp_shifted(const at::Tensor& x_in, bool scalar) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "exp_shifted: fp32 [rows, width]");
  at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  int64_t width = x.size(1);
  const bool vec = use_avx512(scalar);
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      exp_shifted_row(x.data_ptr<float>() + r * width, width, vec, out.data_ptr<float>() + r * width);
  });
  return out;
}

// Sums of each `block`-wide run of each row (the last may be shorter), fp32: element i of a
// block in lane i % 16, tree16.
at::Tensor block_sums(const at::Tensor& x_in, int64_t block, bool scalar) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "block_sums: fp32 [rows, width]");
  at::Tensor x = x_in.contiguous();
  int64_t rows = x.size(0), width = x.size(1), blocks = (width + block - 1) / block;
  at::Tensor out = at::empty({rows, blocks}, x.options());
  const bool vec = use_avx512(scalar);
  at::parallel_for(0, rows * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      int64_t r = item / blocks, b = item % blocks;
      const float* xs = x.data_ptr<float>() + r * width + b * block;
      out.data_ptr<float>()[item] = block_sum(xs, std::min(block, width - b * block), vec);
    }
  });
  return out;
}

// ---------------------------------------------------------------- mixture-of-experts layer
//
// A Qwen3-MoE sparse layer in one call, computing exactly what these kernels' one-projection
// calls compute when composed (the bits of `qlinear`, `exp_shifted` and `block_sums`):
// - each token's row RMS-normalised and quantized once: the router and every expert's gate/up
//   projection quantize the same row with the same norm, so they read the same integers;
// - the router's fp32 logits; p = exp_shifted / block_sums (one block), divided element-wise;
// - the top_k experts by a stable descending sort: equal probabilities in expert order, NaN
//   before any number (as torch.sort); their probabilities renormalised where norm_topk_prob (a
//   sum in rank order, then one division each);
// - each (token, expert) route's gate/up output rounded to x's dtype, its SwiGLU product
//   quantized, its down projection in fp32;
// - per token and element, in fp32: total = y_0 * w_0, then total = total + y_r * w_r in rank
//   order, and x + total rounded once to x's dtype.
// A token's values depend on its row alone: never on the tokens beside it, which experts they
// chose, or the threads. Each phase is one parallel region over rows or over (expert, output
// block) pairs, so a step's small expert matmuls share a region instead of making one each.

struct Experts {
  std::vector<at::Tensor> keep;
  PackedWeight router;
  std::vector<PackedWeight> gate_up, down;
  const void* norm = nullptr;
  bool norm_bf16 = false;
  float eps;
  int64_t hidden, inter, num_experts, top_k;
  bool norm_topk_prob;

  // weights: the router's, then each expert's gate/up, then each expert's down, each as
  // [data, scales, mins, super_scales, super_mins]; numbers: each one's [zero, bits, n_out, k_in].
  Experts(const std::vector<std::vector<c10::optional<at::Tensor>>>& weights,
          const std::vector<std::vector<int64_t>>& numbers, const at::Tensor& norm_weight, double eps_,
          int64_t top_k_, bool norm_topk_prob_)
      : eps(static_cast<float>(eps_)), top_k(top_k_), norm_topk_prob(norm_topk_prob_) {
    TORCH_CHECK(!weights.empty() && weights.size() % 2 == 1 && numbers.size() == weights.size(),
                "experts: the router's weight, then two per expert");
    std::vector<PackedWeight> all;
    for (size_t i = 0; i < weights.size(); ++i) {
      const auto& t = weights[i];
      const auto& n = numbers[i];
      TORCH_CHECK(t.size() == 5 && n.size() == 4 && t[0].has_value() && t[1].has_value(),
                  "experts: [data, scales, mins, super_scales, super_mins] and [zero, bits, n_out, k_in]");
      all.push_back(packed_weight(*t[0], *t[1], t[2], t[3], t[4], n[0], n[1], n[2], n[3], keep));
    }
    num_experts = static_cast<int64_t>(weights.size() / 2);
    hidden = numbers[0][3];
    inter = numbers[1 + num_experts][3];
    TORCH_CHECK(numbers[0][2] == num_experts, "experts: one router logit per expert");
    TORCH_CHECK(top_k >= 1 && top_k <= num_experts, "experts: 1 <= top_k <= experts");
    for (int64_t e = 0; e < num_experts; ++e) {
      const auto& gu = numbers[1 + e];
      const auto& dn = numbers[1 + num_experts + e];
      TORCH_CHECK(gu[2] == 2 * inter && gu[3] == hidden && dn[2] == hidden && dn[3] == inter,
                  "experts: gate/up [2 * inter, hidden] and down [hidden, inter] for every expert");
    }
    router = all[0];
    gate_up.assign(all.begin() + 1, all.begin() + 1 + num_experts);
    down.assign(all.begin() + 1 + num_experts, all.end());
    TORCH_CHECK(norm_weight.numel() == hidden &&
                    (norm_weight.scalar_type() == at::kBFloat16 || norm_weight.scalar_type() == at::kFloat),
                "experts: a bf16 or fp32 norm weight of the hidden width");
    at::Tensor norm_c = norm_weight.contiguous();
    keep.push_back(norm_c);
    norm = norm_c.data_ptr();
    norm_bf16 = norm_c.scalar_type() == at::kBFloat16;
  }
};

// Torch's descending order: NaN first, then larger numbers; a stable sort keeps ties in order.
static inline bool ranks_before(float a, float b) {
  if (std::isnan(a)) return !std::isnan(b);
  return !std::isnan(b) && a > b;
}

// x [..., hidden] bf16 or fp32 (not yet normalised) -> (x + the experts' weighted sum, each
// token's chosen experts [tokens, top_k] int64 in rank order).
std::tuple<at::Tensor, at::Tensor> experts(const Experts& m, const at::Tensor& x_in, bool scalar, bool portable) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat, "experts: bf16 or fp32 input");
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == m.hidden, "experts: input width ", x_in.size(-1), ", expected ",
              m.hidden);
  const int64_t H = m.hidden, I = m.inter, E = m.num_experts, K = m.top_k;
  at::Tensor x = x_in.reshape({-1, H}).contiguous();
  const int64_t tokens = x.size(0), routes = tokens * K;
  at::Tensor out = at::empty_like(x);
  at::Tensor index = at::empty({tokens, K}, x.options().dtype(at::kLong));
  if (tokens == 0) return {out.view(x_in.sizes()), index};
  const bool vec = use_avx512(scalar || portable), avx2 = !vec && !portable && any_avx2();
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t es = x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());

  // Each token's row normalised and quantized once.
  const int64_t groups_h = (H + kGroup - 1) / kGroup, groups_i = (I + kGroup - 1) / kGroup;
  QuantizedRows xq(tokens, groups_h);
  at::parallel_for(0, tokens, grain_for(H * 16), [&](int64_t begin, int64_t end) {
    std::vector<float> act(groups_h * kGroup);
    for (int64_t t = begin; t < end; ++t)
      quantize_row(xp + t * H * es, is_bf16, H, kRmsNorm, m.norm, m.norm_bf16, m.eps, vec, act.data(), groups_h,
                   xq.rows[t]);
  });

  // The router's logits, then each token's experts and weights.
  std::vector<float> logits(tokens * E), weight(routes);
  const int64_t router_blocks = (E + kLanes - 1) / kLanes;
  at::parallel_for(0, router_blocks, grain_for(kLanes * H * tokens), [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block)
      matmul_block_any(m.router, block, xq.rows.data(), tokens, E, Epilogue{nullptr, nullptr}, logits.data(), E, false,
                       vec, avx2);
  });
  int64_t* chosen = index.data_ptr<int64_t>();
  at::parallel_for(0, tokens, grain_for(E * 64), [&](int64_t begin, int64_t end) {
    std::vector<float> p(E);
    std::vector<int64_t> order(E);
    for (int64_t t = begin; t < end; ++t) {
      exp_shifted_row(logits.data() + t * E, E, vec, p.data());
      const float total = block_sum(p.data(), E, vec);
      for (int64_t i = 0; i < E; ++i) p[i] = p[i] / total;
      for (int64_t i = 0; i < E; ++i) order[i] = i;
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ranks_before(p[a], p[b]); });
      float* w = weight.data() + t * K;
      for (int64_t r = 0; r < K; ++r) {
        chosen[t * K + r] = order[r];
        w[r] = p[order[r]];
      }
      if (m.norm_topk_prob) {
        float sum = w[0];
        for (int64_t r = 1; r < K; ++r) sum = sum + w[r];
        for (int64_t r = 0; r < K; ++r) w[r] = w[r] / sum;
      }
    }
  });

  // The routes by expert (token order within one): route j = t * K + r sits at position[j].
  std::vector<int64_t> start(E + 1, 0), position(routes);
  for (int64_t j = 0; j < routes; ++j) ++start[chosen[j] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> cursor(start.begin(), start.end() - 1);
  std::vector<RowQuant> expert_rows(routes);
  for (int64_t j = 0; j < routes; ++j) {
    position[j] = cursor[chosen[j]]++;
    expert_rows[position[j]] = xq.rows[j / K];
  }
  std::vector<int64_t> used;
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) used.push_back(e);
  const int64_t num_used = static_cast<int64_t>(used.size()), rows_per_expert = (routes + num_used - 1) / num_used;

  // Gate/up, in x's dtype: items are (expert, output block) pairs.
  const int64_t gu_blocks = (2 * I + kLanes - 1) / kLanes;
  std::vector<char> gu(routes * 2 * I * es);
  at::parallel_for(0, num_used * gu_blocks, grain_for(kLanes * H * rows_per_expert), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = used[item / gu_blocks], block = item % gu_blocks, first = start[e];
      matmul_block_any(m.gate_up[e], block, expert_rows.data() + first, start[e + 1] - first, 2 * I,
                       Epilogue{nullptr, nullptr}, gu.data() + first * 2 * I * es, 2 * I, is_bf16, vec, avx2);
    }
  });
  QuantizedRows hq(routes, groups_i);
  at::parallel_for(0, routes, grain_for(I * 16), [&](int64_t begin, int64_t end) {
    std::vector<float> act(groups_i * kGroup);
    for (int64_t p = begin; p < end; ++p)
      quantize_row(gu.data() + p * 2 * I * es, is_bf16, I, kSiluMul, nullptr, false, 0.0f, vec, act.data(), groups_i,
                   hq.rows[p]);
  });
  // Down, in fp32.
  const int64_t down_blocks = (H + kLanes - 1) / kLanes;
  std::vector<float> y(routes * H);
  at::parallel_for(0, num_used * down_blocks, grain_for(kLanes * I * rows_per_expert), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = used[item / down_blocks], block = item % down_blocks, first = start[e];
      matmul_block_any(m.down[e], block, hq.rows.data() + first, start[e + 1] - first, H, Epilogue{nullptr, nullptr},
                       y.data() + first * H, H, false, vec, avx2);
    }
  });

  // Each token's weighted sum in rank order, plus its row, rounded once.
  void* op = out.data_ptr();
  at::parallel_for(0, tokens, grain_for(H * K), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* w = weight.data() + t * K;
      const float* first = y.data() + position[t * K] * H;
      for (int64_t k = 0; k < H; ++k) {
        float total = first[k] * w[0];
        for (int64_t r = 1; r < K; ++r) total = total + y[position[t * K + r] * H + k] * w[r];
        store_from_float(op, t * H + k, load_as_float(xp, t * H + k, is_bf16) + total, is_bf16);
      }
    }
  });
  return {out.view(x_in.sizes()), index};
}

bool has_avx512() { return use_avx512(false); }

// The instruction set this CPU runs the matmul and attention on (the same bits on each).
std::string code_path() {
  if (use_avx512(false)) return "AVX512-VNNI";
#ifdef RELAYLM_X86
  if (use_avx2() && use_avx2_fma()) return "AVX2";
#endif
  return "portable code";
}

}  // namespace relaylm_exact

// A Python module rather than torch operators: a call costs about half as much without the
// dispatcher's schema, and a one-row step makes a few hundred of them.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is let go while a kernel runs, as torch's own operators do: the worker's event loop
  // runs beside the engine's step.
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("qlinear", &relaylm_exact::qlinear, release());
  pybind11::class_<relaylm_exact::LoraFactors>(m, "LoraFactors")
      .def(pybind11::init<const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, const std::vector<int64_t>&,
                          const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                          const std::vector<std::vector<int64_t>>&, int64_t, int64_t>());
  m.def("qlinear_lora", &relaylm_exact::qlinear_lora, release());
  pybind11::class_<relaylm_exact::Experts>(m, "Experts")
      .def(pybind11::init<const std::vector<std::vector<c10::optional<at::Tensor>>>&,
                          const std::vector<std::vector<int64_t>>&, const at::Tensor&, double, int64_t, bool>());
  m.def("experts", &relaylm_exact::experts, release());
  m.def("attention", &relaylm_exact::attention, release());
  m.def("rms_norm", &relaylm_exact::rms_norm, release());
  m.def("exp_shifted", &relaylm_exact::exp_shifted, release());
  m.def("block_sums", &relaylm_exact::block_sums, release());
  m.def("has_avx512", &relaylm_exact::has_avx512);
  m.def("code_path", &relaylm_exact::code_path);
}
