// Dense GEMM y = x @ W on CPU as an XLA FFI handler, against weights packed once at load
// (see jaxllm/kernels/cpu_gemm.py for the packed layout and the Python side).
//
// Owns: the XLA FFI handlers `JaxllmCpuGemm` and `JaxllmCpuGroupedGemm` (rows sorted by
// group, each group against its own W [K, N] stored in place: the experts of a mixture of
// experts, jaxllm/kernels/cpu_grouped_gemm.py): checking shapes, cutting the product into work
// items (a range of 32-column panels x a chunk of rows), running them on a thread pool, and
// the register-blocked micro-kernels: bf16 x bf16 pairs by AVX512-BF16 (vdpbf16ps), f32 by
// FMAs, both accumulating in f32, the result stored as f32 or rounded once to bf16.
// Must never: read past the x rows or the packed panels it was handed (odd K and partial
// panels are handled by the tail code and the packing's zero padding, never by over-reading
// x), or write outside y.
//
// The micro-kernel keeps a tile of up to kMaxRows rows x 32 columns in 2 x kMaxRows zmm
// accumulators; per step of K it loads the panel's 32 columns once (two zmm) and broadcasts
// one value (f32) or one pair (bf16) of each row:
//
//   packed bf16 panel p, step k2:  [ W[2k2][32p+0] W[2k2+1][32p+0] | W[2k2][32p+1] ... ]
//                                   = 64 bf16, lane j of the two zmm = column 32p+j's pair
//   x row m, step k2:               ( x[m][2k2] x[m][2k2+1] ) broadcast to all 16 lanes
//   acc[m][j] += x[m][2k2] * W[2k2][32p+j] + x[m][2k2+1] * W[2k2+1][32p+j]   (vdpbf16ps)
//
// A panel is contiguous (K x 32 values), so a work item streams its panels linearly; the
// rows of a chunk (up to 72) reuse each panel from L1/L2 while it is hot.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "thread_pool.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace jaxllm {
namespace {

constexpr int kPanelCols = 32;     // columns per packed panel: two zmm of f32 accumulators
constexpr int kMaxRows = 12;       // rows per micro-kernel call: 24 accumulators + 2 + 1
constexpr int kChunkBlocks = 6;    // micro-blocks (of up to kMaxRows rows) per work item
// Measured (64 x 1536 x 576 bf16, down_proj at decode, interleaved, two runs): 8 rows 334
// and 415 us against 12 rows 379 and 451 us; at 256 rows 2101 against 2178 us. f32 got
// slower with fewer rows (865 -> 1138 us at 4 rows), so it keeps kMaxRows.
constexpr int kLongKRows = 8;
constexpr long kLongKBytes = 24 << 10;
constexpr int kItemsPerThread = 4; // grouped GEMM: work items per pool thread (if enough panels)
// Dense GEMM: up to this many work items per pool thread, none under kMinItemKiloMacs
// multiply-adds (x 1e3; ~2 us at the bf16 peak of one core). The pool hands them out in order,
// so a thread that starts late takes fewer and the threads finish within one item.
constexpr int kSplitItemsPerThread = 64;
constexpr long kMinItemKiloMacs = 256;
// At most this many bytes of packed weight per work item: the slice stays in L2 while the
// items of the other row chunks (handed out next, to any thread) read it again.
constexpr long kItemWeightBytes = 256 << 10;
// Below this many multiply-adds (x 1e3) a call runs on the calling thread alone: waking the
// pool costs more than it saves.
constexpr long kInlineKiloMacs = 64;

// How long the pool's threads poll for the next GEMM before they sleep, and the caller for
// their last items (thread_pool.h): a model step calls the GEMMs tens of microseconds
// apart, and waking a sleeping thread costs about as much. JAXLLM_CPU_GEMM_SPIN_US
// overrides it (0: never poll, for a machine whose cores are all taken by other work).
constexpr int kSpinUs = 200;

ThreadPool& Pool() {
  // Leaked on purpose, as ThreadPool::Get() is (see thread_pool.h).
  static ThreadPool* pool = [] {
    const char* env = std::getenv("JAXLLM_CPU_GEMM_SPIN_US");
    return new ThreadPool(ThreadPool::DefaultSize("JAXLLM_CPU_GEMM_THREADS"),
                          env ? std::atoi(env) : kSpinUs);
  }();
  return *pool;
}

enum class Elem { kF32, kBF16 };

struct Problem {
  int M, K, N;
  Elem in;          // x and W
  bool out_bf16;    // y is bf16 (rounded to nearest even) rather than f32
  const void* x;    // [M, K]
  const void* w;    // packed panels
  void* y;          // [M, N]
};

#if defined(__AVX512F__)

// Store one row's 32 accumulators (two zmm) as `cols` <= 32 values of y.
inline void StoreRow(__m512 lo, __m512 hi, void* y, long offset, int cols, bool out_bf16) {
  const __mmask16 m0 = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const int rest = cols - 16;
  const __mmask16 m1 = rest >= 16 ? 0xffff
                       : rest > 0 ? static_cast<__mmask16>((1u << rest) - 1) : 0;
  if (out_bf16) {
#if defined(__AVX512BF16__)
    uint16_t* dst = static_cast<uint16_t*>(y) + offset;
    _mm256_mask_storeu_epi16(dst, m0, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
    if (m1) _mm256_mask_storeu_epi16(dst + 16, m1,
                                     reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(hi)));
#endif
  } else {
    float* dst = static_cast<float*>(y) + offset;
    _mm512_mask_storeu_ps(dst, m0, lo);
    if (m1) _mm512_mask_storeu_ps(dst + 16, m1, hi);
  }
}

// Where a micro-kernel reads 32 columns of W (one panel), step by step along K. Two ways:
//   Packed*: the panel as cpu_gemm.py `pack`ed it, contiguous (the dense GEMM's weights);
//   Rows*:   W [K, N] as stored, row-major with row stride ldw, columns [col0, col0 + cols)
//            (the grouped GEMM's expert weights, used in place). A bf16 step needs the
//            column pairs (W[2k2][c], W[2k2+1][c]) side by side: vpunpck{l,h}wd interleave
//            two rows within each 128-bit lane, so the accumulators hold the columns in the
//            order  lo: 0-3 8-11 16-19 24-27  hi: 4-7 12-15 20-23 28-31,  put back in order
//            once per tile (Fix) before the store.
// Load(k, b0, b1): the two zmm of step k (a pair step for bf16); Last(K2, ...): bf16's odd
// K, the last row paired with zeros. Tails past N are masked loads, never over-reads.
#if defined(__AVX512BF16__)
struct PackedBf16 {
  const uint16_t* panel;
  PackedBf16(const void* w, long, int) : panel(static_cast<const uint16_t*>(w)) {}
  void Load(int k2, __m512bh& b0, __m512bh& b1) const {
    b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + k2 * 64));
    b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + k2 * 64 + 32));
  }
  void Last(int k2, __m512bh& b0, __m512bh& b1) const { Load(k2, b0, b1); }  // zero-padded
  void Fix(__m512&, __m512&) const {}
};

struct RowsBf16 {
  const uint16_t* w;
  long ldw;
  __mmask32 mask;
  RowsBf16(const void* w_, long ldw_, int cols)
      : w(static_cast<const uint16_t*>(w_)), ldw(ldw_),
        mask(cols >= 32 ? 0xffffffffu : static_cast<__mmask32>((1u << cols) - 1)) {}
  void Pair(__m512i r0, __m512i r1, __m512bh& b0, __m512bh& b1) const {
    b0 = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(r0, r1));
    b1 = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(r0, r1));
  }
  void Load(int k2, __m512bh& b0, __m512bh& b1) const {
    const uint16_t* row = w + 2L * k2 * ldw;
    Pair(_mm512_maskz_loadu_epi16(mask, row), _mm512_maskz_loadu_epi16(mask, row + ldw), b0, b1);
  }
  void Last(int k2, __m512bh& b0, __m512bh& b1) const {
    Pair(_mm512_maskz_loadu_epi16(mask, w + 2L * k2 * ldw), _mm512_setzero_si512(), b0, b1);
  }
  void Fix(__m512& lo, __m512& hi) const {
    // Column c of the tile sits in lane 4 * (c / 8) + c % 4 of lo (c % 8 < 4) or hi.
    const __m512i want_lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19,
                                              4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i want_hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27,
                                              12, 13, 14, 15, 28, 29, 30, 31);
    const __m512 l = _mm512_permutex2var_ps(lo, want_lo, hi);
    hi = _mm512_permutex2var_ps(lo, want_hi, hi);
    lo = l;
  }
};

// Rows [0, MR) of x (bf16, row stride ldx) against 32 columns of W read through `b`.
template <int MR, class B>
void KernelBf16(const uint16_t* x, long ldx, int K, const B& b, void* y, long ldy, int cols,
                bool out_bf16) {
  __m512 acc[MR][2];
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int K2 = K / 2;
  for (int k2 = 0; k2 < K2; ++k2) {
    __m512bh b0, b1;
    b.Load(k2, b0, b1);
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * k2, 4);
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
    }
  }
  if (K & 1) {  // the last k pairs with a zero row of W; x[m][K] is never read
    __m512bh b0, b1;
    b.Last(K2, b0, b1);
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      const __m512bh a = reinterpret_cast<__m512bh>(
          _mm512_set1_epi32(static_cast<int32_t>(x[m * ldx + K - 1])));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
    }
  }
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) {
    b.Fix(acc[m][0], acc[m][1]);
    StoreRow(acc[m][0], acc[m][1], y, m * ldy, cols, out_bf16);
  }
}
#endif  // __AVX512BF16__

struct PackedF32 {
  const float* panel;
  PackedF32(const void* w, long, int) : panel(static_cast<const float*>(w)) {}
  void Load(int k, __m512& b0, __m512& b1) const {
    b0 = _mm512_loadu_ps(panel + k * 32);
    b1 = _mm512_loadu_ps(panel + k * 32 + 16);
  }
};

struct RowsF32 {
  const float* w;
  long ldw;
  __mmask16 m0, m1;
  RowsF32(const void* w_, long ldw_, int cols)
      : w(static_cast<const float*>(w_)), ldw(ldw_),
        m0(cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1)),
        m1(cols >= 32 ? 0xffff : cols > 16 ? static_cast<__mmask16>((1u << (cols - 16)) - 1)
                                           : 0) {}
  void Load(int k, __m512& b0, __m512& b1) const {
    b0 = _mm512_maskz_loadu_ps(m0, w + k * ldw);
    b1 = _mm512_maskz_loadu_ps(m1, w + k * ldw + 16);
  }
};

// Rows [0, MR) of x (f32) against 32 columns of W read through `b`.
template <int MR, class B>
void KernelF32(const float* x, long ldx, int K, const B& b, void* y, long ldy, int cols,
               bool out_bf16) {
  __m512 acc[MR][2];
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int k = 0; k < K; ++k) {
    __m512 b0, b1;
    b.Load(k, b0, b1);
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(a, b0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(a, b1, acc[m][1]);
    }
  }
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m) StoreRow(acc[m][0], acc[m][1], y, m * ldy, cols, out_bf16);
}

// w: the panel (Packed) or W's first row at the tile's first column (Rows, stride ldw).
using KernelFn = void (*)(const void* x, long ldx, int K, const void* w, long ldw, void* y,
                          long ldy, int cols, bool out_bf16);

enum class Layout { kPacked, kRows };

template <Elem E, Layout L, int MR>
void KernelThunk(const void* x, long ldx, int K, const void* w, long ldw, void* y, long ldy,
                 int cols, bool out_bf16) {
  if constexpr (E == Elem::kF32) {
    using B = std::conditional_t<L == Layout::kPacked, PackedF32, RowsF32>;
    KernelF32<MR>(static_cast<const float*>(x), ldx, K, B(w, ldw, cols), y, ldy, cols,
                  out_bf16);
  } else {
#if defined(__AVX512BF16__)
    using B = std::conditional_t<L == Layout::kPacked, PackedBf16, RowsBf16>;
    KernelBf16<MR>(static_cast<const uint16_t*>(x), ldx, K, B(w, ldw, cols), y, ldy, cols,
                   out_bf16);
#endif
  }
}

template <Elem E, Layout L, int... MRs>
constexpr std::array<KernelFn, sizeof...(MRs)> KernelTable(std::integer_sequence<int, MRs...>) {
  return {&KernelThunk<E, L, MRs + 1>...};
}

// The micro-kernels for 1 .. kMaxRows rows, indexed by rows - 1.
template <Elem E, Layout L = Layout::kPacked>
const KernelFn* KernelsFor() {
  static constexpr auto table = KernelTable<E, L>(std::make_integer_sequence<int, kMaxRows>{});
  return table.data();
}

template <Elem E, Layout L = Layout::kPacked>
KernelFn KernelFor(int rows) {
  return KernelsFor<E, L>()[rows - 1];
}

#endif  // __AVX512F__

// M rows cut into `count` micro-blocks of at most kMaxRows (or kLongKRows) rows, as even
// as possible.
struct RowBlocks {
  int count;
  int Begin(int i, int M) const { return static_cast<int>(static_cast<long>(M) * i / count); }
};

// Where part i of `total` things cut into `parts` starts: the first total % parts parts get
// one more than the others, so the work items handed out first are the larger ones.
inline int EvenBegin(int total, int parts, int i) {
  return i * (total / parts) + std::min(i, total % parts);
}

// How the dense GEMM cuts a product into work items: row chunks (runs of consecutive
// micro-blocks) x column slices (runs of consecutive panels), both spread evenly. Item i is
// slice i / m_chunks, row chunk i % m_chunks: a slice's row chunks are handed out one after
// another while its panels are in L2.
//
// A row's result does not depend on the cut: every output element is one micro-kernel's
// accumulator over the whole of K, in k order, whichever tile, item or thread computes it.
struct Split {
  RowBlocks blocks;
  int m_chunks;  // row chunks
  int n_chunks;  // column slices
  int items() const { return m_chunks * n_chunks; }
};

// `threads` pool threads; `panel_bytes`: one packed panel's size.
Split SplitFor(int M, int K, int N, int max_rows, long panel_bytes, int threads) {
  const int P = (N + kPanelCols - 1) / kPanelCols;
  Split s;
  s.blocks.count = (M + max_rows - 1) / max_rows;
  s.m_chunks = (s.blocks.count + kChunkBlocks - 1) / kChunkBlocks;
  // Enough items that the threads finish together (one that starts late takes fewer), none
  // smaller than kMinItemKiloMacs.
  const long kilo_macs = static_cast<long>(M) * K * N / 1000;
  const long want = std::clamp<long>(kilo_macs / kMinItemKiloMacs, 1,
                                     static_cast<long>(kSplitItemsPerThread) * threads);
  long n_chunks = (want + s.m_chunks - 1) / s.m_chunks;
  // Where several row chunks reread a slice, it must stay in L2 beside their x.
  if (s.m_chunks > 1) {
    n_chunks = std::max(n_chunks, (P * panel_bytes + kItemWeightBytes - 1) / kItemWeightBytes);
  }
  s.n_chunks = static_cast<int>(std::clamp<long>(n_chunks, 1, P));
  return s;
}

std::string Run(const Problem& p) {
#if !defined(__AVX512F__)
  return "this library was built without AVX-512";
#else
  if (p.in == Elem::kBF16 || p.out_bf16) {
#if !defined(__AVX512BF16__)
    return "this library was built without AVX512-BF16";
#endif
  }
  const int P = (p.N + kPanelCols - 1) / kPanelCols;
  const long panel_elems = p.in == Elem::kBF16 ? static_cast<long>((p.K + 1) / 2) * 64
                                               : static_cast<long>(p.K) * kPanelCols;
  const int elem_bytes = p.in == Elem::kBF16 ? 2 : 4;
  const int out_bytes = p.out_bf16 ? 2 : 4;
  // bf16 with a long K: micro-blocks of at most kLongKRows rows, whose x (K x 2 bytes a row)
  // stays within kLongKBytes of L1 beside the panel lines streaming through.
  const int max_rows = p.in == Elem::kBF16 && 2L * p.K * kMaxRows > kLongKBytes ? kLongKRows
                                                                               : kMaxRows;
  ThreadPool& pool = Pool();
  const Split split = SplitFor(p.M, p.K, p.N, max_rows, panel_elems * elem_bytes, pool.size());
  const KernelFn* kernels = p.in == Elem::kBF16 ? KernelsFor<Elem::kBF16>()
                                                : KernelsFor<Elem::kF32>();

  auto item = [&](int i) {
    const int nc = i / split.m_chunks, mc = i % split.m_chunks;
    const int b_begin = EvenBegin(split.blocks.count, split.m_chunks, mc);
    const int b_end = EvenBegin(split.blocks.count, split.m_chunks, mc + 1);
    const int p_begin = EvenBegin(P, split.n_chunks, nc);
    const int p_end = EvenBegin(P, split.n_chunks, nc + 1);
    for (int q = p_begin; q < p_end; ++q) {
      const char* panel = static_cast<const char*>(p.w) + q * panel_elems * elem_bytes;
      const int col0 = q * kPanelCols, cols = std::min(kPanelCols, p.N - col0);
      for (int b = b_begin; b < b_end; ++b) {
        const int r0 = split.blocks.Begin(b, p.M), rows = split.blocks.Begin(b + 1, p.M) - r0;
        const char* x = static_cast<const char*>(p.x) + static_cast<long>(r0) * p.K * elem_bytes;
        char* y = static_cast<char*>(p.y) +
                  (static_cast<long>(r0) * p.N + col0) * out_bytes;
        kernels[rows - 1](x, p.K, p.K, panel, 0, y, p.N, cols, p.out_bf16);
      }
    }
  };
  const int items = split.items();
  if (items == 1) {
    item(0);
  } else {
    pool.Run(items, item);
  }
  return "";
#endif
}

// The grouped GEMM: y[r] = x[r] @ W[e] for the rows r of group e, W [E, K, N] as stored.
//
//   x rows (sorted by group):  | group 0 | group 1 (empty) | group 2 ...  | past the end |
//   group_end (int32 [E]):       end_0     end_1 = end_0     end_2   ...    end_{E-1}
//
// Row r belongs to the group e with end_{e-1} <= r < end_e (end_{-1} = 0); rows from
// end_{E-1} on belong to none and come out zero. group_end is clamped to be nondecreasing
// and within [0, M], so no value of it reads or writes outside the buffers. Each group's
// rows run the dense GEMM's micro-kernels against its W[e] read in place (Rows*), in work
// items of (group, column slice, chunk of row blocks); the weights of the experts no row
// chose are never read.
struct GroupedProblem {
  int M, K, N, E;
  Elem in;
  bool out_bf16;
  const void* x;            // [M, K]
  const void* w;            // [E, K, N]
  const int32_t* group_end; // [E]
  void* y;                  // [M, N]
};

std::string RunGrouped(const GroupedProblem& p) {
#if !defined(__AVX512F__)
  return "this library was built without AVX-512";
#else
  if (p.in == Elem::kBF16 || p.out_bf16) {
#if !defined(__AVX512BF16__)
    return "this library was built without AVX512-BF16";
#endif
  }
  const int elem_bytes = p.in == Elem::kBF16 ? 2 : 4;
  const int out_bytes = p.out_bf16 ? 2 : 4;
  const int P = (p.N + kPanelCols - 1) / kPanelCols;
  const int max_rows = p.in == Elem::kBF16 && 2L * p.K * kMaxRows > kLongKBytes ? kLongKRows
                                                                               : kMaxRows;
  struct Group { int e, r0, rows, m_chunks; };
  std::vector<Group> groups;
  int begin = 0, total_m_chunks = 0;
  for (int e = 0; e < p.E; ++e) {
    const int end = std::clamp(static_cast<int>(p.group_end[e]), begin, p.M);
    if (end > begin) {
      const int blocks = (end - begin + max_rows - 1) / max_rows;
      groups.push_back({e, begin, end - begin, (blocks + kChunkBlocks - 1) / kChunkBlocks});
      total_m_chunks += groups.back().m_chunks;
    }
    begin = end;
  }
  if (begin < p.M) {  // rows in no group
    std::memset(static_cast<char*>(p.y) + static_cast<long>(begin) * p.N * out_bytes, 0,
                static_cast<long>(p.M - begin) * p.N * out_bytes);
  }
  if (groups.empty()) return "";
  ThreadPool& pool = Pool();
  const long kilo_macs = static_cast<long>(begin) * p.K / 1000 * p.N;
  const int threads = kilo_macs < kInlineKiloMacs ? 1 : pool.size();
  // Column slices: enough items to share out, and at most kItemWeightBytes of W[e] per
  // slice where a group's rows span several chunks (they reread it from L2).
  const long slice_chunks = (static_cast<long>(p.K) * P * kPanelCols * elem_bytes +
                             kItemWeightBytes - 1) / kItemWeightBytes;
  const bool reread = total_m_chunks > static_cast<int>(groups.size());
  const int n_chunks = static_cast<int>(std::clamp<long>(
      std::max<long>((kItemsPerThread * threads + total_m_chunks - 1) / total_m_chunks,
                     reread ? slice_chunks : 1),
      1, P));
  struct Item { int g, nc, mc; };
  std::vector<Item> items;
  for (int g = 0; g < static_cast<int>(groups.size()); ++g) {
    for (int nc = 0; nc < n_chunks; ++nc) {
      for (int mc = 0; mc < groups[g].m_chunks; ++mc) items.push_back({g, nc, mc});
    }
  }
  const long w_expert = static_cast<long>(p.K) * p.N;  // elements of one W[e]
  auto item = [&](int i) {
    const Item& it = items[i];
    const Group& g = groups[it.g];
    const RowBlocks blocks{(g.rows + max_rows - 1) / max_rows};
    const int b_begin = it.mc * kChunkBlocks;
    const int b_end = std::min(blocks.count, b_begin + kChunkBlocks);
    const int p_begin = static_cast<int>(static_cast<long>(P) * it.nc / n_chunks);
    const int p_end = static_cast<int>(static_cast<long>(P) * (it.nc + 1) / n_chunks);
    const char* w = static_cast<const char*>(p.w) + g.e * w_expert * elem_bytes;
    for (int q = p_begin; q < p_end; ++q) {
      const int col0 = q * kPanelCols, cols = std::min(kPanelCols, p.N - col0);
      for (int b = b_begin; b < b_end; ++b) {
        const int r0 = g.r0 + blocks.Begin(b, g.rows);
        const int rows = g.r0 + blocks.Begin(b + 1, g.rows) - r0;
        const char* x = static_cast<const char*>(p.x) + static_cast<long>(r0) * p.K * elem_bytes;
        char* y = static_cast<char*>(p.y) + (static_cast<long>(r0) * p.N + col0) * out_bytes;
        const char* wq = w + static_cast<long>(col0) * elem_bytes;
        if (p.in == Elem::kBF16) {
          KernelFor<Elem::kBF16, Layout::kRows>(rows)(x, p.K, p.K, wq, p.N, y, p.N, cols,
                                                      p.out_bf16);
        } else {
          KernelFor<Elem::kF32, Layout::kRows>(rows)(x, p.K, p.K, wq, p.N, y, p.N, cols,
                                                     p.out_bf16);
        }
      }
    }
  };
  const int n = static_cast<int>(items.size());
  if (threads == 1) {
    for (int i = 0; i < n; ++i) item(i);
  } else {
    pool.Run(n, item);
  }
  return "";
#endif
}

#if defined(__AVX512F__)
// 12 independent accumulators hide the instruction's latency (4-6 cycles) at 2 per cycle.
template <bool kBf16>
double PeakLoop(long iters) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
         a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
  const __m512 u = _mm512_set1_ps(1e-8f), v = _mm512_set1_ps(1e-8f);
  for (long i = 0; i < iters; ++i) {
#define JAXLLM_STEP(acc)                                                               \
    if constexpr (kBf16) {                                                             \
      acc = _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(u),                      \
                             reinterpret_cast<__m512bh>(v));                          \
    } else {                                                                           \
      acc = _mm512_fmadd_ps(u, v, acc);                                                \
    }                                                                                  \
    __asm__ volatile("" : "+v"(acc));
    JAXLLM_STEP(a0) JAXLLM_STEP(a1) JAXLLM_STEP(a2) JAXLLM_STEP(a3) JAXLLM_STEP(a4)
    JAXLLM_STEP(a5) JAXLLM_STEP(a6) JAXLLM_STEP(a7) JAXLLM_STEP(a8) JAXLLM_STEP(a9)
    JAXLLM_STEP(a10) JAXLLM_STEP(a11)
#undef JAXLLM_STEP
  }
  __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                             _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
  sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
  float lanes[16];  // (not _mm512_reduce_add_ps: GCC 12 warns inside it)
  _mm512_storeu_ps(lanes, sum);
  double total = 0.0;
  for (float lane : lanes) total += lane;
  return total;
}
#endif

double PeakGflops(bool bf16, int threads, double seconds) {
#if !defined(__AVX512F__)
  return 0.0;
#else
#if !defined(__AVX512BF16__)
  if (bf16) return 0.0;
#endif
  auto loop = [bf16](long iters) {
#if defined(__AVX512BF16__)
    if (bf16) return PeakLoop<true>(iters);
#endif
    return PeakLoop<false>(iters);
  };
  // Calibrate on this thread, then run `threads` copies at once.
  long iters = 1 << 16;
  for (;;) {
    auto t0 = std::chrono::steady_clock::now();
    volatile double sink = loop(iters);
    (void)sink;
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dt > seconds / 10 || iters > (1L << 40)) {
      iters = static_cast<long>(iters * seconds / std::max(dt, 1e-9));
      break;
    }
    iters *= 4;
  }
  std::vector<std::thread> pool;
  auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&loop, iters] {
      volatile double sink = loop(iters);
      (void)sink;
    });
  }
  for (auto& t : pool) t.join();
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double flops_per_step = bf16 ? 64.0 : 32.0;
  return 12.0 * flops_per_step * iters * threads / dt / 1e9;
#endif
}

// The dtypes of x and the weight (the same: bf16 or f32) -> *in, and of y (bf16 or f32) ->
// *out_bf16; both FFI handlers take their operands' types this way.
ffi::Error ReadDtypes(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                      const ffi::AnyBuffer& y, Elem* in, bool* out_bf16) {
  const ffi::DataType xt = x.element_type(), wt = w.element_type(), yt = y.element_type();
  if (xt != wt) return ffi::Error::InvalidArgument("x and the weight differ in dtype");
  if (xt == ffi::DataType::BF16) {
    *in = Elem::kBF16;
  } else if (xt != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("x must be bf16 or f32");
  }
  if (yt == ffi::DataType::BF16) {
    *out_bf16 = true;
  } else if (yt != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("y must be bf16 or f32");
  }
  return ffi::Error::Success();
}

ffi::Error Gemm(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || wd.size() != 3) {
    return ffi::Error::InvalidArgument("x must be [M, K], y [M, N] and the packed weight 3-D");
  }
  Problem p{static_cast<int>(xd[0]), static_cast<int>(xd[1]), static_cast<int>(yd[1]),
            Elem::kF32, false, x.untyped_data(), w.untyped_data(), y->untyped_data()};
  if (yd[0] != p.M) return ffi::Error::InvalidArgument("x and y have different row counts");
  if (ffi::Error e = ReadDtypes(x, w, *y, &p.in, &p.out_bf16); e.failure()) return e;
  const long P = (p.N + kPanelCols - 1) / kPanelCols;
  const bool packed_ok = p.in == Elem::kBF16
      ? wd[0] == P && wd[1] == (p.K + 1) / 2 && wd[2] == 2 * kPanelCols
      : wd[0] == P && wd[1] == p.K && wd[2] == kPanelCols;
  if (!packed_ok) {
    return ffi::Error::InvalidArgument(
        "the packed weight's shape does not match K = " + std::to_string(p.K) +
        " and N = " + std::to_string(p.N));
  }
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  std::string problem = Run(p);
  if (!problem.empty()) return ffi::Error::InvalidArgument(problem);
  return ffi::Error::Success();
}

ffi::Error GroupedGemm(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer group_end,
                       ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), gd = group_end.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || wd.size() != 3 || gd.size() != 1) {
    return ffi::Error::InvalidArgument("x must be [M, K], w [E, K, N], group_end [E], y [M, N]");
  }
  GroupedProblem p{static_cast<int>(xd[0]), static_cast<int>(xd[1]), static_cast<int>(wd[2]),
                   static_cast<int>(wd[0]), Elem::kF32, false, x.untyped_data(),
                   w.untyped_data(), nullptr, y->untyped_data()};
  if (wd[1] != p.K || gd[0] != p.E || yd[0] != p.M || yd[1] != p.N) {
    return ffi::Error::InvalidArgument("x [M, K], w [E, K, N], group_end [E] and y [M, N] "
                                       "disagree");
  }
  if (group_end.element_type() != ffi::DataType::S32) {
    return ffi::Error::InvalidArgument("group_end must be int32");
  }
  p.group_end = static_cast<const int32_t*>(group_end.untyped_data());
  if (ffi::Error e = ReadDtypes(x, w, *y, &p.in, &p.out_bf16); e.failure()) return e;
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  if (p.K == 0 || p.E == 0) {  // an empty sum: zeros
    std::memset(p.y, 0, static_cast<long>(p.M) * p.N * (p.out_bf16 ? 2 : 4));
    return ffi::Error::Success();
  }
  std::string problem = RunGrouped(p);
  if (!problem.empty()) return ffi::Error::InvalidArgument(problem);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxllm

extern "C" {

__attribute__((visibility("default"))) XLA_FFI_Error* JaxllmCpuGemm(XLA_FFI_CallFrame* call_frame);
__attribute__((visibility("default"))) XLA_FFI_Error* JaxllmCpuGroupedGemm(
    XLA_FFI_CallFrame* call_frame);

// Threads the GEMM pool runs on (the caller's included), for tests and benchmarks.
__attribute__((visibility("default"))) int JaxllmCpuGemmNumThreads() {
  return jaxllm::Pool().size();
}

// What the library was compiled with: bit 0 AVX-512F (the f32 kernel), bit 1 AVX512-BF16
// (the bf16 kernel and bf16 outputs).
__attribute__((visibility("default"))) int JaxllmCpuGemmIsa() {
  int isa = 0;
#if defined(__AVX512F__)
  isa |= 1;
#endif
#if defined(__AVX512BF16__)
  isa |= 2;
#endif
  return isa;
}

// This machine's multiply-add peak in GFLOP/s: `threads` threads each running a chain-free
// loop of vdpbf16ps (bf16 != 0; 64 flops each) or vfmadd231ps (32 flops) on zmm registers for
// about `seconds`; 0 when the library lacks the instruction. For benchmarks/cpu_gemm.py.
__attribute__((visibility("default"))) double JaxllmCpuGemmPeakGflops(int bf16, int threads,
                                                                      double seconds) {
  return jaxllm::PeakGflops(bf16 != 0, threads, seconds);
}

}  // extern "C"

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmCpuGemm, jaxllm::Gemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()   // x [M, K]
                                  .Arg<ffi::AnyBuffer>()   // packed W
                                  .Ret<ffi::AnyBuffer>()); // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmCpuGroupedGemm, jaxllm::GroupedGemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()   // x [M, K], rows sorted by group
                                  .Arg<ffi::AnyBuffer>()   // w [E, K, N]
                                  .Arg<ffi::AnyBuffer>()   // group_end int32 [E]
                                  .Ret<ffi::AnyBuffer>()); // y [M, N]
