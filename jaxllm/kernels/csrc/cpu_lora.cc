// Batched multi-LoRA on CPU as an XLA FFI handler (jaxllm/kernels/cpu_lora.py is the Python
// side): y[t] += (x[t] @ A[m_t, l]) @ B[m_t, l] for each token t whose adapter slot m_t is
// in [0, num_adapters), every other row of y untouched. An SGMV-style kernel: the tokens are
// grouped by slot here (a counting sort of m), and each group reads its own slot's A [K, R]
// and B [R, N] in place, from the whole tables [S, L, K, R] and [S, L, R, N].
//
// Owns: the handler `JaxllmCpuLora`: the shrink xa = x @ A (f32 sums, rounded to the
// tables' dtype, as peft's bf16 module does) and the expand y + xa @ B (f32 sums, added to
// y in f32, rounded once to y's dtype), in blocks of up to 8 tokens of one slot, blocks
// spread over a thread pool when the work is large enough.
// Must never: read a table row other than the token's own slot's layer `layer`, write a row
// of y whose token has no adapter, or read x, y, m outside their shapes (a slot out of range
// means "no adapter").
//
// Why: XLA:CPU ran the rank-16 dots at ~45 GFLOP/s, and each of the 210 projections of a
// SmolLM2 step paid a switch, a slot gather and a one-hot mask around them; here one call
// per projection reads each slot's A and B once per block of tokens.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"
#include "thread_pool.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;
using Int32Vector = ffi::Buffer<ffi::S32, 1>;

namespace jaxllm {
namespace {

constexpr int kBlock = 8;             // tokens of one slot per work item
// Multiply-adds below which one thread does it all: a decode step's 64 rows stay inline (on
// a busy 2-core machine waking the pool cost more than it saved there: 104 vs 77 us at
// T = 64, K = 576, N = 1536), a prefill chunk's 512 use the pool.
constexpr long kInlineWork = 1L << 23;

ThreadPool& Pool() {
  // Leaked on purpose, as ThreadPool::Get() is (see thread_pool.h).
  static ThreadPool* pool = new ThreadPool(ThreadPool::DefaultSize("JAXLLM_CPU_LORA_THREADS"));
  return *pool;
}

inline float ToFloat(float x) { return x; }
inline float ToFloat(Bf16 x) { return Bf16ToF32(x.bits); }
inline void Store(float v, float* p) { *p = v; }
inline void Store(float v, Bf16* p) { p->bits = F32ToBf16(v); }
inline float Round(float v, const float*) { return v; }
inline float Round(float v, const Bf16*) { return Bf16ToF32(F32ToBf16(v)); }

#if defined(__AVX512F__)
inline __mmask16 Live(long left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}
inline __m512 Load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 Load(const Bf16* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void StoreRow(__m512 v, float* p, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void StoreRow(__m512 v, Bf16* p, __mmask16 m) {
  // Round to nearest even in integer lanes, as F32ToBf16 (simd.h) does one at a time: NaN
  // stays a quiet NaN, denormals are rounded (never flushed, unlike VCVTNEPS2BF16).
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(
      r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}
#endif

// One block of NT tokens of one slot: rows[j] is token j's row index into x and y.
//   xa[j, r] = round(sum_k x[j, k] A[k, r])            A [K, R]
//   y[j, n]  = round(y[j, n] + sum_r xa[j, r] B[r, n])  B [R, N]
template <int NT, typename W, typename Y>
void BlockFma(const W* x, Y* y, const W* A, const W* B, const int32_t* rows, long K, long R,
           long N) {
  thread_local std::vector<float> buffer;
  if (static_cast<long>(buffer.size()) < NT * (R + K)) buffer.resize(NT * (R + K));
  float* xa = buffer.data();  // [NT, R]
#if defined(__AVX512F__)
  float* xf = xa + NT * R;  // the block's x rows in f32 [NT, K]: broadcast from memory
  for (int j = 0; j < NT; ++j) {
    for (long k = 0; k < K; k += 16) {
      const __mmask16 m = Live(K - k);
      _mm512_mask_storeu_ps(xf + j * K + k, m, Load(x + rows[j] * K + k, m));
    }
  }
  for (long c = 0; c < R; c += 16) {
    const __mmask16 m = Live(R - c);
    __m512 acc[NT];
    for (int j = 0; j < NT; ++j) acc[j] = _mm512_setzero_ps();
    for (long k = 0; k < K; ++k) {
      const __m512 a = Load(A + k * R + c, m);
      for (int j = 0; j < NT; ++j) {
        acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(xf[j * K + k]), a, acc[j]);
      }
    }
    for (int j = 0; j < NT; ++j) _mm512_mask_storeu_ps(xa + j * R + c, m, acc[j]);
  }
#else
  for (int j = 0; j < NT; ++j) {
    for (long c = 0; c < R; ++c) xa[j * R + c] = 0.f;
    for (long k = 0; k < K; ++k) {
      const float xk = ToFloat(x[rows[j] * K + k]);
      for (long c = 0; c < R; ++c) xa[j * R + c] += xk * ToFloat(A[k * R + c]);
    }
  }
#endif
  for (long i = 0; i < NT * R; ++i) xa[i] = Round(xa[i], A);
#if defined(__AVX512F__)
  for (long n = 0; n < N; n += 16) {
    const __mmask16 m = Live(N - n);
    __m512 acc[NT];
    for (int j = 0; j < NT; ++j) acc[j] = _mm512_setzero_ps();
    for (long r = 0; r < R; ++r) {
      const __m512 b = Load(B + r * N + n, m);
      for (int j = 0; j < NT; ++j) {
        acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(xa[j * R + r]), b, acc[j]);
      }
    }
    for (int j = 0; j < NT; ++j) {
      Y* out = y + rows[j] * N + n;
      StoreRow(_mm512_add_ps(Load(out, m), acc[j]), out, m);
    }
  }
#else
  for (int j = 0; j < NT; ++j) {
    for (long n = 0; n < N; ++n) {
      float d = 0.f;
      for (long r = 0; r < R; ++r) d += xa[j * R + r] * ToFloat(B[r * N + n]);
      Y* out = y + rows[j] * N + n;
      Store(ToFloat(*out) + d, out);
    }
  }
#endif
}

#if defined(__AVX512BF16__)
// Rows r0 and r1 (16 bf16 each, masked; r1 null: zeros) interleaved into the pairs
// vdpbf16ps multiplies: word 2i = r0[i], word 2i + 1 = r1[i].
inline __m512i Pairs(const Bf16* r0, const Bf16* r1, __mmask16 m) {
  const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                       40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33,
                                       1, 32, 0);
  const __m512i a = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(m, r0));
  const __m512i b = r1 ? _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(m, r1))
                       : _mm512_setzero_si512();
  return _mm512_permutex2var_epi16(a, idx, b);
}

// Elements 2p and 2p + 1 of a bf16 row of length n as one 32-bit word (the second 0 past n).
inline int32_t PairBits(const Bf16* row, long p, long n) {
  uint32_t lo = row[2 * p].bits, hi = 2 * p + 1 < n ? row[2 * p + 1].bits : 0;
  return static_cast<int32_t>(lo | hi << 16);
}

// BlockFma's contract for bf16 tables, two products per instruction (AVX512-BF16's
// vdpbf16ps, f32 sums, as the dense GEMM's bf16 kernel): pairs of k in the shrink, pairs
// of ranks in the expand (xa is a bf16 value by then, so its pairs are exact).
template <int NT, typename Y>
void BlockBf16(const Bf16* x, Y* y, const Bf16* A, const Bf16* B, const int32_t* rows, long K,
               long R, long N) {
  thread_local std::vector<float> buffer;
  if (static_cast<long>(buffer.size()) < NT * R) buffer.resize(NT * R);
  float* xa = buffer.data();  // [NT, R]
  const long RP = (R + 1) / 2;
  for (long c = 0; c < R; c += 16) {
    const __mmask16 m = Live(R - c);
    __m512 acc[NT];
    for (int j = 0; j < NT; ++j) acc[j] = _mm512_setzero_ps();
    for (long p = 0; p < K / 2; ++p) {  // whole pairs: x's two bf16 read as one word
      const __m512bh a = (__m512bh)Pairs(A + 2 * p * R + c, A + (2 * p + 1) * R + c, m);
      for (int j = 0; j < NT; ++j) {
        int32_t bits;
        std::memcpy(&bits, x + rows[j] * K + 2 * p, 4);
        acc[j] = _mm512_dpbf16_ps(acc[j], a, (__m512bh)_mm512_set1_epi32(bits));
      }
    }
    if (K % 2) {  // the last k alone, paired with zeros
      const __m512bh a = (__m512bh)Pairs(A + (K - 1) * R + c, nullptr, m);
      for (int j = 0; j < NT; ++j) {
        const __m512bh xp = (__m512bh)_mm512_set1_epi32(PairBits(x + rows[j] * K, K / 2, K));
        acc[j] = _mm512_dpbf16_ps(acc[j], a, xp);
      }
    }
    for (int j = 0; j < NT; ++j) _mm512_mask_storeu_ps(xa + j * R + c, m, acc[j]);
  }
  std::vector<int32_t> xab(NT * RP);  // xa rounded to bf16, in pairs of ranks
  for (int j = 0; j < NT; ++j) {
    for (long p = 0; p < RP; ++p) {
      uint32_t lo = F32ToBf16(xa[j * R + 2 * p]);
      uint32_t hi = 2 * p + 1 < R ? F32ToBf16(xa[j * R + 2 * p + 1]) : 0;
      xab[j * RP + p] = static_cast<int32_t>(lo | hi << 16);
    }
  }
  for (long n = 0; n < N; n += 16) {
    const __mmask16 m = Live(N - n);
    __m512 acc[NT];
    for (int j = 0; j < NT; ++j) acc[j] = _mm512_setzero_ps();
    for (long p = 0; p < RP; ++p) {
      const __m512bh b = (__m512bh)Pairs(B + 2 * p * N + n,
                                          2 * p + 1 < R ? B + (2 * p + 1) * N + n : nullptr, m);
      for (int j = 0; j < NT; ++j) {
        acc[j] = _mm512_dpbf16_ps(acc[j], b, (__m512bh)_mm512_set1_epi32(xab[j * RP + p]));
      }
    }
    for (int j = 0; j < NT; ++j) {
      Y* out = y + rows[j] * N + n;
      StoreRow(_mm512_add_ps(Load(out, m), acc[j]), out, m);
    }
  }
}
#endif

template <int NT, typename W, typename Y>
void Block(const W* x, Y* y, const W* A, const W* B, const int32_t* rows, long K, long R,
           long N) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<W, Bf16>::value) {
    return BlockBf16<NT>(x, y, A, B, rows, K, R, N);
  }
#endif
  BlockFma<NT>(x, y, A, B, rows, K, R, N);
}

template <typename W, typename Y>
void BlockAny(int nt, const W* x, Y* y, const W* A, const W* B, const int32_t* rows, long K,
              long R, long N) {
  switch (nt) {
    case 1: return Block<1>(x, y, A, B, rows, K, R, N);
    case 2: return Block<2>(x, y, A, B, rows, K, R, N);
    case 3: return Block<3>(x, y, A, B, rows, K, R, N);
    case 4: return Block<4>(x, y, A, B, rows, K, R, N);
    case 5: return Block<5>(x, y, A, B, rows, K, R, N);
    case 6: return Block<6>(x, y, A, B, rows, K, R, N);
    case 7: return Block<7>(x, y, A, B, rows, K, R, N);
    default: return Block<8>(x, y, A, B, rows, K, R, N);
  }
}

struct Item {
  long slot;
  int begin, count;  // into the sorted token order
};

template <typename W, typename Y>
void Run(const W* x, Y* y, const W* A_table, const W* B_table, const int32_t* m, long T,
         long layers, long layer, long num_adapters, long K, long R, long N) {
  // Counting sort of the tokens with an adapter by slot.
  std::vector<int> start(num_adapters + 1, 0);
  for (long t = 0; t < T; ++t) {
    if (m[t] >= 0 && m[t] < num_adapters) ++start[m[t] + 1];
  }
  for (long s = 0; s < num_adapters; ++s) start[s + 1] += start[s];
  if (start[num_adapters] == 0) return;
  std::vector<int32_t> order(start[num_adapters]);
  std::vector<int> fill(start.begin(), start.end() - 1);
  for (long t = 0; t < T; ++t) {
    if (m[t] >= 0 && m[t] < num_adapters) order[fill[m[t]]++] = static_cast<int32_t>(t);
  }
  std::vector<Item> items;
  for (long s = 0; s < num_adapters; ++s) {
    for (int b = start[s]; b < start[s + 1]; b += kBlock) {
      items.push_back({s, b, std::min(kBlock, start[s + 1] - b)});
    }
  }
  auto item = [&](int i) {
    const Item& it = items[i];
    const W* A = A_table + (it.slot * layers + layer) * K * R;
    const W* B = B_table + (it.slot * layers + layer) * R * N;
    BlockAny(it.count, x, y, A, B, order.data() + it.begin, K, R, N);
  };
  const int n = static_cast<int>(items.size());
  if (static_cast<long>(order.size()) * (K + N) * R < kInlineWork) {
    for (int i = 0; i < n; ++i) item(i);
  } else {
    Pool().Run(n, item);
  }
}

ffi::Error Lora(ffi::AnyBuffer x, ffi::AnyBuffer y, ffi::AnyBuffer A, ffi::AnyBuffer B,
                Int32Vector m, int64_t layer, int64_t num_adapters,
                ffi::Result<ffi::AnyBuffer> out) {
  const auto xd = x.dimensions(), yd = y.dimensions(), ad = A.dimensions(), bd = B.dimensions();
  if (xd.size() != 2 || yd.size() != 2 || ad.size() != 4 || bd.size() != 4) {
    return ffi::Error::InvalidArgument("x, y must be 2-D and the tables 4-D");
  }
  const long T = xd[0], K = xd[1], N = yd[1], S = ad[0], L = ad[1], R = ad[3];
  if (yd[0] != T || m.dimensions()[0] != T || ad[2] != K || bd[0] != S || bd[1] != L ||
      bd[2] != R || bd[3] != N) {
    return ffi::Error::InvalidArgument("x [T, K], y [T, N], A [S, L, K, R], B [S, L, R, N] "
                                       "and m [T] disagree");
  }
  if (layer < 0 || layer >= L) return ffi::Error::InvalidArgument("layer out of range");
  if (num_adapters < 0 || num_adapters > S) {
    return ffi::Error::InvalidArgument("num_adapters out of [0, S]");
  }
  const ffi::DataType wt = x.element_type(), yt = y.element_type();
  if (A.element_type() != wt || B.element_type() != wt ||
      (wt != ffi::DataType::F32 && wt != ffi::DataType::BF16)) {
    return ffi::Error::InvalidArgument("x, A and B must be all float32 or all bfloat16");
  }
  if ((yt != ffi::DataType::F32 && yt != ffi::DataType::BF16) || out->element_type() != yt) {
    return ffi::Error::InvalidArgument("y and the result must be float32 or bfloat16 alike");
  }
  const size_t y_bytes = static_cast<size_t>(T) * N * (yt == ffi::DataType::F32 ? 4 : 2);
  if (out->untyped_data() != y.untyped_data()) {  // XLA could not alias y with the result
    std::memcpy(out->untyped_data(), y.untyped_data(), y_bytes);
  }
  const int32_t* mt = m.typed_data();
  void* yo = out->untyped_data();
  const bool w_bf16 = wt == ffi::DataType::BF16, y_bf16 = yt == ffi::DataType::BF16;
#define JAXLLM_LORA_RUN(WT, YT)                                                              \
  Run(static_cast<const WT*>(x.untyped_data()), static_cast<YT*>(yo),                       \
      static_cast<const WT*>(A.untyped_data()), static_cast<const WT*>(B.untyped_data()), mt, \
      T, L, layer, num_adapters, K, R, N)
  if (w_bf16 && y_bf16) JAXLLM_LORA_RUN(Bf16, Bf16);
  else if (w_bf16) JAXLLM_LORA_RUN(Bf16, float);
  else if (y_bf16) JAXLLM_LORA_RUN(float, Bf16);
  else JAXLLM_LORA_RUN(float, float);
#undef JAXLLM_LORA_RUN
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxllm

extern "C" {

__attribute__((visibility("default"))) XLA_FFI_Error* JaxllmCpuLora(XLA_FFI_CallFrame* frame);

// Which instructions the library was compiled with: bit 1 AVX512F, bit 2 AVX512-BF16 (0:
// the portable loops).
__attribute__((visibility("default"))) int JaxllmCpuLoraIsa() {
  int isa = 0;
#if defined(__AVX512F__)
  isa |= 1;
#endif
#if defined(__AVX512BF16__)
  isa |= 2;
#endif
  return isa;
}

}  // extern "C"

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmCpuLora, jaxllm::Lora,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x [T, K]
                                  .Arg<ffi::AnyBuffer>()  // y [T, N]
                                  .Arg<ffi::AnyBuffer>()  // A [S, L, K, R]
                                  .Arg<ffi::AnyBuffer>()  // B [S, L, R, N]
                                  .Arg<Int32Vector>()     // m [T]: each token's slot
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("num_adapters")
                                  .Ret<ffi::AnyBuffer>());  // y + the adapters' deltas
