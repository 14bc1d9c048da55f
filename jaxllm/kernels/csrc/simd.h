// Vector building blocks of the CPU attention kernel, over one block of 16 keys.
//
// Owns: 16-bit float <-> f32 conversions, and the three inner steps of attention for the G
// query heads that share one kv head, against a block of kBlockKeys keys: the dot products
// (DotGroup), the online-softmax update (SoftmaxBlock, per head) and the P @ V accumulation
// (PVGroup). Rows are read as f32 or as bf16 bits (widened in registers, or multiplied in
// pairs by AVX512-BF16). AVX-512 versions when compiled for it, and portable scalar versions
// with the same contract.
// Must never: read a key or value row the caller did not hand over (the caller passes only
// rows that hold real data, zero rows in place of the rest), or let a masked lane reach a
// probability (masked lanes are selected to 0, never multiplied by 0).
//
// Zen 5 (the machine these were tuned on) issues two 512-bit FMAs and two 512-bit loads per
// cycle, so the loops are shaped to need few loads per FMA: PVGroup loads each V chunk once
// for all G heads and broadcasts each probability once for 4 chunks (12 FMAs per 7 loads at
// G = 3, H = 64, against 1 per 2 one head at a time: 180 -> 115 ns per block of 3 kv heads).

#ifndef JAXLLM_KERNELS_CSRC_SIMD_H_
#define JAXLLM_KERNELS_CSRC_SIMD_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jaxllm {

constexpr int kBlockKeys = 16;  // keys per block: one AVX-512 vector of scores
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// What the cache arrays hold. q and the output have the same float type.
enum class Storage { kF32, kBF16, kF16 };

inline float Bf16ToF32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t F32ToBf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float F16ToF32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    std::memcpy(&u, &f, 4);
    u |= sign;
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t F32ToF16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;            // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;           // rounds to >= 65520: inf
  if (a < 0x38800000u) {                                 // below 2^-14: subnormal or zero
    float mag;
    std::memcpy(&mag, &a, 4);
    // mag * 2^24 rounded to an integer (nearest even, the default FP mode) is the f16 mantissa.
    return sign | static_cast<uint16_t>(std::nearbyint(mag * 16777216.0f));
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);            // round the 13 dropped bits
  return sign | static_cast<uint16_t>((r - (112u << 23)) >> 13);
}

template <Storage S>
inline float ToF32(const void* p, int i) {
  if constexpr (S == Storage::kF32) return static_cast<const float*>(p)[i];
  if constexpr (S == Storage::kBF16) return Bf16ToF32(static_cast<const uint16_t*>(p)[i]);
  if constexpr (S == Storage::kF16) return F16ToF32(static_cast<const uint16_t*>(p)[i]);
}

template <Storage S>
inline void FromF32(float x, void* p, long i) {
  if constexpr (S == Storage::kF32) static_cast<float*>(p)[i] = x;
  if constexpr (S == Storage::kBF16) static_cast<uint16_t*>(p)[i] = F32ToBf16(x);
  if constexpr (S == Storage::kF16) static_cast<uint16_t*>(p)[i] = F32ToF16(x);
}

// dst[0:n] = src[0:n] as f32.
template <Storage S>
inline void RowToF32(const void* src, float* dst, int n) {
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    __m512 x;
    if constexpr (S == Storage::kF32) {
      x = _mm512_loadu_ps(static_cast<const float*>(src) + i);
    } else {
      __m256i h = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(src) + i));
      if constexpr (S == Storage::kBF16) {
        x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      } else {
        x = _mm512_cvtph_ps(h);
      }
    }
    _mm512_storeu_ps(dst + i, x);
  }
#endif
  for (; i < n; ++i) dst[i] = ToF32<S>(src, i);
}

#if defined(__AVX512F__)

// e^x for x <= 0 (larger x is clamped to 88): Cody-Waite reduction to r in [-ln2/2, ln2/2],
// a degree-6 Taylor polynomial (relative error ~1e-7), then scaling by 2^n.
inline __m512 Exp(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.0f)), _mm512_set1_ps(88.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Lane j of the result: the sum of the 16 lanes of v[j]. A transpose-and-add tree: pairs
// within 128-bit lanes, then across them.
inline __m512 HorizontalSums(const __m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

#endif  // __AVX512F__

// The element types the compute reads rows in: float, or Bf16 (bfloat16 bits).
struct Bf16 {
  uint16_t bits;
};

#if defined(__AVX512F__)
inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 Load16(const Bf16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif
inline float Scalar(float x) { return x; }
inline float Scalar(Bf16 x) { return Bf16ToF32(x.bits); }

// The head dim: kH when it is a compile-time constant (the common 64 and 128, for which the
// loops unroll: ~1.5x faster), else the runtime value.
template <int kH>
constexpr int HeadDim(int h) { return kH > 0 ? kH : h; }

// scores[g * 16 + j] = scale * (q_g . k_j) for the G query vectors q_g = q + g * H and the 16
// key rows k_j = k + j * ldk (all readable). Bf16 rows multiply in pairs with f32 sums
// (AVX512-BF16 vdpbf16ps) when the CPU has it.
template <int kH, typename E>
inline void DotGroup(const E* q, int G, const E* k, long ldk, int head_dim, float scale,
                     float* scores) {
  const int H = HeadDim<kH>(head_dim);
#if defined(__AVX512F__)
  if (H % 16 == 0) {
#if defined(__AVX512BF16__)
    const bool pairs = std::is_same_v<E, Bf16> && H % 32 == 0;
#else
    const bool pairs = false;
#endif
    for (int g = 0; g < G; ++g) {
      const E* qg = q + static_cast<long>(g) * H;
      __m512 acc[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      if (pairs) {
#if defined(__AVX512BF16__)
        for (int c = 0; c < H; c += 32) {
          __m512bh qv = (__m512bh)_mm512_loadu_si512(qg + c);
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) {
            acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_loadu_si512(k + j * ldk + c));
          }
        }
#endif
      } else {
        for (int c = 0; c < H; c += 16) {
          __m512 qv = Load16(qg + c);
#pragma GCC unroll 16
          for (int j = 0; j < 16; ++j) {
            acc[j] = _mm512_fmadd_ps(qv, Load16(k + j * ldk + c), acc[j]);
          }
        }
      }
      _mm512_storeu_ps(scores + 16 * g,
                       _mm512_mul_ps(HorizontalSums(acc), _mm512_set1_ps(scale)));
    }
    return;
  }
#endif
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < 16; ++j) {
      float s = 0.0f;
      for (int c = 0; c < H; ++c) s += Scalar(q[g * H + c]) * Scalar(k[j * ldk + c]);
      scores[16 * g + j] = s * scale;
    }
  }
}

// scores[i] = cap * tanh(scores[i] / cap) for i < n, n a multiple of 16 (Gemma 2's logit soft
// cap). tanh(x) = sign(x) (1 - e) / (1 + e) with e = e^(-2|x|) <= 1: Exp's range, no overflow,
// and an absolute error ~1e-7.
inline void SoftCap(float* scores, int n, float cap) {
  const float inv = 1.0f / cap;
#if defined(__AVX512F__)
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
  for (int i = 0; i < n; i += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(scores + i), _mm512_set1_ps(inv));
    const __m512 e = Exp(_mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_abs_ps(x)));
    __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));  // tanh |x|
    t = _mm512_mask_sub_ps(t, _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), zero, t);
    _mm512_storeu_ps(scores + i, _mm512_mul_ps(t, _mm512_set1_ps(cap)));
  }
#else
  for (int i = 0; i < n; ++i) scores[i] = cap * std::tanh(scores[i] * inv);
#endif
}

// Online softmax over one block: lanes [lo, nv) of `scores` are visible (lo < nv; lo > 0 only
// for a row whose sliding window starts inside the block). Updates the running max `m` and
// sum `l`; writes probabilities p (0 in the other lanes) relative to the new max, and returns
// the factor that rescales what was accumulated before.
inline float SoftmaxBlock(const float* scores, int lo, int nv, float* m, float* l, float* p) {
#if defined(__AVX512F__)
  const __mmask16 visible = static_cast<__mmask16>(
      (nv >= 16 ? 0xffffu : (1u << nv) - 1u) & (0xffffu << lo));
  const __m512 s = _mm512_loadu_ps(scores);
  const float block_max = _mm512_mask_reduce_max_ps(visible, s);
  const float m_new = block_max > *m ? block_max : *m;  // (std::fmax is a libm call)
  const __m512 pv = _mm512_maskz_mov_ps(visible, Exp(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
  _mm512_storeu_ps(p, pv);
  const float sum = _mm512_reduce_add_ps(pv);
  // 0 on the first block (m = -inf); 1 once the max has settled. Not std::exp: a libm call
  // makes the compiler spill every live vector register around it.
  const float alpha = m_new == *m ? 1.0f
                                  : _mm512_cvtss_f32(Exp(_mm512_set1_ps(*m - m_new)));
#else
  float m_new = *m;
  for (int j = lo; j < nv; ++j) m_new = scores[j] > m_new ? scores[j] : m_new;
  float sum = 0.0f;
  for (int j = 0; j < 16; ++j) {
    p[j] = j >= lo && j < nv ? std::exp(scores[j] - m_new) : 0.0f;
    sum += p[j];
  }
  const float alpha = m_new == *m ? 1.0f : std::exp(*m - m_new);  // 0 on the first block
#endif
  *m = m_new;
  *l = *l * alpha + sum;
  return alpha;
}

#if defined(__AVX512F__)
// GB query heads x CB 16-wide chunks from column c0: the V chunks of a key are loaded once
// for all GB heads, and each probability is broadcast once for all CB chunks.
template <int GB, int CB, typename E>
inline void PVTile(float* o, int H, const float* alpha, const float* p, const E* v, long ldv,
                   int c0) {
  __m512 acc[GB][CB];
  for (int g = 0; g < GB; ++g) {
    const __m512 a = _mm512_set1_ps(alpha[g]);
    for (int cb = 0; cb < CB; ++cb) {
      acc[g][cb] = _mm512_mul_ps(_mm512_loadu_ps(o + g * H + c0 + 16 * cb), a);
    }
  }
  for (int j = 0; j < 16; ++j) {
    __m512 vj[CB];
    for (int cb = 0; cb < CB; ++cb) vj[cb] = Load16(v + j * ldv + c0 + 16 * cb);
    for (int g = 0; g < GB; ++g) {
      const __m512 pj = _mm512_set1_ps(p[16 * g + j]);
      for (int cb = 0; cb < CB; ++cb) acc[g][cb] = _mm512_fmadd_ps(pj, vj[cb], acc[g][cb]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    for (int cb = 0; cb < CB; ++cb) _mm512_storeu_ps(o + g * H + c0 + 16 * cb, acc[g][cb]);
  }
}

template <int CB, typename E>
inline void PVColumns(float* o, int G, int H, const float* alpha, const float* p, const E* v,
                      long ldv, int c0) {
  int g = 0;
  for (; g + 4 <= G; g += 4) PVTile<4, CB>(o + g * H, H, alpha + g, p + 16 * g, v, ldv, c0);
  switch (G - g) {
    case 3: PVTile<3, CB>(o + g * H, H, alpha + g, p + 16 * g, v, ldv, c0); break;
    case 2: PVTile<2, CB>(o + g * H, H, alpha + g, p + 16 * g, v, ldv, c0); break;
    case 1: PVTile<1, CB>(o + g * H, H, alpha + g, p + 16 * g, v, ldv, c0); break;
    default: break;
  }
}
#endif

// o_g = alpha[g] * o_g + sum_j p[16 g + j] * v_j for the G accumulators o_g = o + g * H and
// the 16 value rows v_j = v + j * ldv.
template <int kH, typename E>
inline void PVGroup(float* o, int G, int head_dim, const float* alpha, const float* p,
                    const E* v, long ldv) {
  const int H = HeadDim<kH>(head_dim);
#if defined(__AVX512F__)
  if (H % 16 == 0) {
    int c = 0;
    for (; c + 64 <= H; c += 64) PVColumns<4>(o, G, H, alpha, p, v, ldv, c);
    for (; c < H; c += 16) PVColumns<1>(o, G, H, alpha, p, v, ldv, c);
    return;
  }
#endif
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < H; ++c) {
      float acc = o[g * H + c] * alpha[g];
      for (int j = 0; j < 16; ++j) acc += p[16 * g + j] * Scalar(v[j * ldv + c]);
      o[g * H + c] = acc;
    }
  }
}

}  // namespace jaxllm

#endif  // JAXLLM_KERNELS_CSRC_SIMD_H_
