// Ragged paged attention on CPU as an XLA FFI handler (backend "cpu", see
// jaxllm/kernels/cpu_attention.py for the work split picture and the Python side).
//
// Owns: the XLA FFI handler `JaxllmRaggedPagedAttention`: checking the batch metadata, cutting
// the batch into work items (sequence x query tile x key range), running them on the thread
// pool (each thread prefetching into the item it runs next), merging split key ranges, and
// zeroing padding rows.
// Must never: read a cache slot that no query of its item may see, past its rows or before
// their sliding window (invisible slots may hold NaN, and may not even be backed by a valid
// page), or anything of sequences past num_seqs; visit key blocks wholly before a window;
// trust the metadata with memory (every index is checked before the first read).
//
// Options (kernels/reference.py): sliding_window W > 0 (0: none): row at position p sees keys
// (p - W, p]; an item's key blocks start at the block of its first row's window, and within a
// block a row's visible lanes are [lo, nv). logits_soft_cap c > 0 (0: none): scores become
// c tanh(s / c) before the softmax.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "simd.h"
#include "thread_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
// Aliases without commas: the handler macro below splits its arguments at commas.
using Int32Matrix = ffi::Buffer<ffi::S32, 2>;
using Int32Vector = ffi::Buffer<ffi::S32, 1>;
using Int32Scalar = ffi::BufferR0<ffi::S32>;

namespace jaxllm {
namespace {

// Rows of one sequence that share each key read. 16 rows x N query heads of f32 scratch
// (queries and accumulators) stay in L2 for any head count this engine serves.
constexpr int kTileRows = 16;
// Key blocks between the one being computed and the one being prefetched.
constexpr int kPrefetchDistance = 2;
// Row invariance: a row's output must not depend on the other rows of the step (the same
// row in a 1-row decode step and in a 5-row verify step gives the same bits, or greedy
// speculative decoding diverges from plain decoding). So a row's keys are always reduced in
// the same order: the online softmax runs over fixed chunks of kChunkBlocks key blocks (an
// absolute grid: chunk c is blocks [c * kChunkBlocks, (c + 1) * kChunkBlocks)), each from a
// fresh state, and the chunks' partial softmaxes are folded in chunk order by FoldChunk,
// whether the item runs whole (folded as it goes) or split over threads (each chunk's
// partial saved to a slot, folded by MergeSplit).
constexpr int kChunkBlocks = 16;
// 256 keys: the fold costs a decode row about 1/256 of its key work, and a row shorter than
// a chunk never folds; contexts shorter than 2 chunks are never split (their attention is
// cheap next to the step's GEMMs).
// A long item is split over its chunks when the items are too few to keep every thread
// busy: parts (whole chunks) are cut so that there are about kPartsPerThread parts' worth of
// work per thread.
constexpr int kPartsPerThread = 4;

struct Shapes {
  int T, N, H;           // q [T, N, H]
  long num_blocks;       // caches [num_blocks, P, K, H]
  int P, K, G;           // G = N / K query heads per kv head
  int S, W;              // block_tables [S, W]
};

struct Batch {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* out;
  const int32_t* block_tables;
  float sm_scale;
  int window;      // sliding window in keys, 0: none
  float soft_cap;  // logit soft cap, 0: none
  Shapes sh;
  long part_stride;  // floats per partial slot: max rows x N x (m, l, H values)
};

// One unit of work: rows [row0, row0 + num_rows) of sequence `seq` (all N heads), against key
// blocks [kb_begin, kb_end) (blocks of kBlockKeys positions). `part` >= 0: one of several key
// ranges of the same rows, whose chunks' partial softmaxes go to the partial slots from
// `part` on (one per chunk, the first for chunk kb_begin / kChunkBlocks).
struct Item {
  int seq, row0, num_rows;
  int first_pos;  // position of row0
  int kb_begin, kb_end;
  int part;
  double cost;
};

// Rows of a split item and the partial slots [first_part, first_part + num_parts) to merge,
// one per chunk of its key range, in chunk order.
struct Split {
  int row0, num_rows, first_part, num_parts;
};

struct Plan {
  std::vector<Item> items;
  std::vector<Split> splits;
  int row_begin = 0, row_end = 0;  // rows of real sequences
  int max_rows = 0;
};

// Per-thread scratch, kept between calls.
struct Scratch {
  std::vector<float> q;           // f16 only: the item's queries as f32 [rows, N, H]
  std::vector<float> o, m, l;     // the chunk's accumulators [rows, N, H], max and sum [rows, N]
  std::vector<float> fo, fm, fl;  // the chunks before it, folded (a whole item only)
  std::vector<float> scores, p;   // one kv head's G query heads x 16 keys
  std::vector<float> alpha;       // their rescale factors for one block
  std::vector<float> kf, vf;      // one block of one kv head, [16, H] compute elements
  long kf_layout = 0;             // H x bytes per compute element that kf / vf were zeroed for
  int kf_zero_from = 0, vf_zero_from = 0;   // kf / vf rows >= these are zero
};

Scratch& ThreadScratch() {
  thread_local Scratch s;
  return s;
}

// Checks every index the items will follow, and builds the items. Returns an error message,
// empty when the metadata is sound.
std::string MakePlan(const Shapes& sh, const int32_t* block_tables, const int32_t* seq_lens,
                     const int32_t* qsl, int num_seqs, int window, int threads,
                     Plan* plan) {
  num_seqs = std::clamp(num_seqs, 0, sh.S);
  plan->row_begin = num_seqs > 0 ? qsl[0] : 0;
  plan->row_end = num_seqs > 0 ? qsl[num_seqs] : 0;
  if (plan->row_begin < 0 || plan->row_end > sh.T) {
    return "query_start_loc of the real sequences runs outside the T query rows";
  }
  double total = 0.0;
  const double per_key_read = 2.0 * sh.K;  // reading a key's K and V rows, in row-head units
  for (int s = 0; s < num_seqs; ++s) {
    const long q_len = static_cast<long>(qsl[s + 1]) - qsl[s], seq_len = seq_lens[s];
    if (q_len < 0) return "query_start_loc decreases at sequence " + std::to_string(s);
    if (q_len == 0) continue;
    if (q_len > seq_len || seq_len > static_cast<long>(sh.W) * sh.P) {
      return "sequence " + std::to_string(s) + ": seq_len " + std::to_string(seq_len) +
             " is below its query length " + std::to_string(q_len) +
             " or beyond the block table";
    }
    const int32_t* bt = block_tables + static_cast<long>(s) * sh.W;
    const int ctx = static_cast<int>(seq_len - q_len);
    // The first key any row of s sees: pages before it are never read (nor checked).
    const int first_seen = window > 0 ? std::max(0, ctx - window + 1) : 0;
    for (int b = first_seen / sh.P; b < (seq_len + sh.P - 1) / sh.P; ++b) {
      if (bt[b] < 0 || bt[b] >= sh.num_blocks) {
        return "sequence " + std::to_string(s) + " has block id " + std::to_string(bt[b]) +
               " outside the cache";
      }
    }
    for (int r = 0; r < q_len; r += kTileRows) {
      const int rows = static_cast<int>(std::min<long>(kTileRows, q_len - r));
      const int last = ctx + r + rows - 1;  // position of the tile's last row
      const int kb_begin = (window > 0 ? std::max(0, ctx + r - window + 1) : 0) / kBlockKeys;
      const int blocks = last / kBlockKeys + 1 - kb_begin;
      double cost = static_cast<double>(blocks) * kBlockKeys * (rows * sh.N + per_key_read);
      plan->items.push_back({s, qsl[s] + r, rows, ctx + r, kb_begin, kb_begin + blocks, -1,
                             cost});
      plan->max_rows = std::max(plan->max_rows, rows);
      total += cost;
    }
  }
  if (threads > 1 && !plan->items.empty()) {
    double target = total / (threads * kPartsPerThread);
    std::vector<Item> whole;
    int slots_used = 0;
    for (const Item& it : plan->items) {
      const int blocks = it.kb_end - it.kb_begin;
      const int c0 = it.kb_begin / kChunkBlocks;
      const int chunks = (it.kb_end - 1) / kChunkBlocks + 1 - c0;
      int parts = std::min(static_cast<int>(it.cost / target), chunks);
      if (parts < 2) {
        whole.push_back(it);
        continue;
      }
      plan->splits.push_back({it.row0, it.num_rows, slots_used, chunks});
      for (int p = 0; p < parts; ++p) {  // part p: chunks [c0 + chunks p / parts, ...)
        const int cb = c0 + static_cast<int>(static_cast<long>(chunks) * p / parts);
        const int ce = c0 + static_cast<int>(static_cast<long>(chunks) * (p + 1) / parts);
        Item part = it;
        part.kb_begin = std::max(it.kb_begin, cb * kChunkBlocks);
        part.kb_end = std::min(it.kb_end, ce * kChunkBlocks);
        part.part = slots_used + cb - c0;
        part.cost = it.cost * (part.kb_end - part.kb_begin) / blocks;
        whole.push_back(part);
      }
      slots_used += chunks;
    }
    plan->items.swap(whole);
  }
  // Largest first: the last items handed out are the small ones.
  std::stable_sort(plan->items.begin(), plan->items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return "";
}

template <Storage S>
constexpr int kElemBytes = S == Storage::kF32 ? 4 : 2;

// The K and V row addresses (all kv heads) of the key positions [first, n) of one block that
// some row of the item sees (first > 0: the item's window starts inside the block; n <= 16),
// computed once per block (one division; the block is consecutive slots of one or two pages).
struct BlockRows {
  const char* k[kBlockKeys];
  const char* v[kBlockKeys];
  int first = 0, n = 0;
  long row_bytes = 0;
  bool contiguous = false;  // 16 consecutive slots (always so when block_size % 16 == 0)

  template <Storage S>
  void Fill(const Batch& b, const int32_t* bt, int kb0, int j0, int num) {
    const Shapes& sh = b.sh;
    row_bytes = static_cast<long>(sh.K) * sh.H * kElemBytes<S>;
    first = j0;
    n = num;
    int page = (kb0 + j0) / sh.P, offset = (kb0 + j0) % sh.P;
    for (int j = j0; j < n; ++j) {
      const long slot = static_cast<long>(bt[page]) * sh.P + offset;
      k[j] = static_cast<const char*>(b.k_cache) + slot * row_bytes;
      v[j] = static_cast<const char*>(b.v_cache) + slot * row_bytes;
      if (++offset == sh.P) {
        offset = 0;
        ++page;
      }
    }
    contiguous = first == 0 && n == kBlockKeys && k[n - 1] == k[0] + (n - 1) * row_bytes;
  }
};

// The key blocks an item reads: [kb_begin, kb_end), keys [first_key, last] of its sequence.
struct KeySpan {
  const int32_t* bt;
  int first_key, last, kb_begin, kb_end;

  KeySpan(const Batch& b, const Item& it)
      : bt(b.block_tables + static_cast<long>(it.seq) * b.sh.W),
        // Keys before the first row's window, or past the last row, are invisible to all.
        first_key(b.window > 0 ? std::max(0, it.first_pos - b.window + 1) : 0),
        last(it.first_pos + it.num_rows - 1),
        kb_begin(it.kb_begin),
        kb_end(std::min(it.kb_end, last / kBlockKeys + 1)) {}

  int blocks() const { return std::max(0, kb_end - kb_begin); }

  // The row addresses of key block `blk` into `rows`.
  template <Storage S>
  BlockRows& Fill(const Batch& b, int blk, BlockRows& rows) const {
    const int kb0 = blk * kBlockKeys;
    rows.Fill<S>(b, bt, kb0, std::max(0, first_key - kb0), std::min(kBlockKeys, last + 1 - kb0));
    return rows;
  }
};

// Prefetches the rows of one future key block a few cache lines at a time, spread over the
// current block's compute. Bursts stall the core (each prefetch waits for a miss buffer) and
// overlap little: all of a block's lines at once took 6.0 ms for 100 MB of pages with 2 ms of
// compute, a trickle 3.6 ms; and a tight loop of 32 line pairs per step made the f32 decode
// 1.6x slower than this loop, whose bookkeeping spaces the prefetches out.
class PrefetchCursor {
 public:
  // `steps`: how many Step() calls will follow.
  void Start(const BlockRows* rows, int steps) {
    rows_ = rows;
    const long lines = (rows->n - rows->first) * ((rows->row_bytes + 63) / 64);
    per_step_ = static_cast<int>((lines + steps - 1) / std::max(steps, 1));
    row_ = rows->first;
    offset_ = 0;
  }
  void Stop() { rows_ = nullptr; }
  // Prefetches the next few lines of K and of V.
  void Step() {
    if (rows_ == nullptr) return;
    for (int i = 0; i < per_step_ && row_ < rows_->n; ++i) {
      __builtin_prefetch(rows_->k[row_] + offset_);
      __builtin_prefetch(rows_->v[row_] + offset_);
      offset_ += 64;
      if (offset_ >= rows_->row_bytes) {
        offset_ = 0;
        ++row_;
      }
    }
  }

 private:
  const BlockRows* rows_ = nullptr;
  long offset_ = 0;
  int row_ = 0, per_step_ = 0;
};

// What the dot products and P @ V read rows as: bf16 caches stay bf16 (the kernels widen them
// in registers), f16 ones are converted to f32 per block.
template <Storage S>
using ComputeType = std::conditional_t<S == Storage::kBF16, Bf16, float>;

// The rows of kv head `kh` of the current block (row addresses `rows`, [first, n) of them):
// straight in the cache when they are a full block of consecutive slots in the compute type,
// else copied or converted into `scratch` with zero rows before first and past n (never read
// from the cache).
template <Storage S>
const ComputeType<S>* HeadRows(const BlockRows& block, const char* const* rows, int kh,
                               const Shapes& sh, float* scratch, int* zero_from, long* ld) {
  using E = ComputeType<S>;
  const int n = block.n;
  const long head_off = static_cast<long>(kh) * sh.H;
  if constexpr (S != Storage::kF16) {
    if (block.contiguous) {
      *ld = static_cast<long>(sh.K) * sh.H;
      return reinterpret_cast<const E*>(rows[0]) + head_off;
    }
  }
  E* out = reinterpret_cast<E*>(scratch);
  if (block.first > 0) std::memset(out, 0, block.first * sh.H * sizeof(E));
  for (int j = block.first; j < n; ++j) {
    const char* src = rows[j] + head_off * kElemBytes<S>;
    if constexpr (S == Storage::kF16) {
      RowToF32<S>(src, scratch + static_cast<long>(j) * sh.H, sh.H);
    } else {
      std::memcpy(out + static_cast<long>(j) * sh.H, src, sh.H * sizeof(E));
    }
  }
  if (*zero_from > n) {  // rows an earlier block filled, now past the end: zero them
    std::memset(out + static_cast<long>(n) * sh.H, 0, (*zero_from - n) * sh.H * sizeof(E));
  }
  *zero_from = n;
  *ld = sh.H;
  return out;
}

// Folds one chunk's partial softmax (max m, sum l, unnormalised o [H]) into the running one
// (*fm, *fl, fo [H]; *fm == -inf: empty). RunItem and MergeSplit both fold with it, and must
// get the same bits: every multiply-add is an explicit fma (of a separately rounded product),
// so no compiler contraction choice can differ between the two inlined copies.
inline void FoldChunk(float m, float l, const float* o, int H, float* fm, float* fl,
                      float* fo) {
  if (m == kNegInf) return;  // no key of this chunk is visible to the row
  if (*fm == kNegInf) {
    *fm = m;
    *fl = l;
    std::memcpy(fo, o, H * sizeof(float));
    return;
  }
  const float mn = std::fmax(*fm, m);
  const float a = std::exp(*fm - mn), b = std::exp(m - mn);
  *fl = std::fma(*fl, a, l * b);
  for (int c = 0; c < H; ++c) fo[c] = std::fma(fo[c], a, o[c] * b);
  *fm = mn;
}

// Writes one (row, head)'s folded output o / l to `out` at element `at`. Inlined (out of
// line it cost a batch-64 decode call ~10%): one rounded multiply per element, the same bits
// wherever it is compiled.
template <Storage S>
inline void WriteNormalized(const float* fo, float fl, int H, void* out, long at) {
  const float inv = fl > 0.0f ? 1.0f / fl : 0.0f;
  for (int c = 0; c < H; ++c) FromF32<S>(fo[c] * inv, out, at + c);
}

// Runs item `it`, whose first `ready` key blocks a previous item already prefetched. `next`
// (nullptr: none) is the item this thread runs after it: once `it` has no blocks left to
// prefetch, the prefetches run on into `next`'s first blocks, so that a thread going from one
// short decode row to the next keeps its loads in flight. Returns how many of `next`'s
// leading blocks it prefetched.
template <Storage S, int kH>
int RunItem(const Batch& b, const Item& it, int ready, const Item* next, Scratch& sc,
            float* partials) {
  using E = ComputeType<S>;
  const Shapes& sh = b.sh;
  const int N = sh.N, H = HeadDim<kH>(sh.H), G = sh.G, rows = it.num_rows;
  const long NH = static_cast<long>(N) * H, RN = static_cast<long>(rows) * N;
  sc.o.assign(rows * NH, 0.0f);
  sc.m.assign(RN, kNegInf);
  sc.l.assign(RN, 0.0f);
  // The chunk just computed leaves: to its partial slot (a part of a split item), or folded
  // into fm / fl / fo (a whole item: the first chunk is swapped in, which is what folding it
  // into the empty state does); the chunk state starts afresh unless it was the last.
  bool folded_any = false;
  auto end_chunk = [&](int chunk, bool last) {
    if (it.part >= 0) {
      float* dst = partials + (it.part + chunk - it.kb_begin / kChunkBlocks) * b.part_stride;
      for (long h = 0; h < RN; ++h) {
        dst[h * (H + 2)] = sc.m[h];
        dst[h * (H + 2) + 1] = sc.l[h];
        std::memcpy(dst + h * (H + 2) + 2, sc.o.data() + h * H, H * sizeof(float));
      }
    } else if (!folded_any) {
      sc.o.swap(sc.fo);
      sc.m.swap(sc.fm);
      sc.l.swap(sc.fl);
      folded_any = true;
    } else {
      for (long h = 0; h < RN; ++h) {
        FoldChunk(sc.m[h], sc.l[h], sc.o.data() + h * H, H, &sc.fm[h], &sc.fl[h],
                  sc.fo.data() + h * H);
      }
    }
    if (last) return;
    sc.o.assign(rows * NH, 0.0f);
    sc.m.assign(RN, kNegInf);
    sc.l.assign(RN, 0.0f);
  };
  sc.scores.resize(16 * G);
  sc.p.resize(16 * G);
  sc.alpha.resize(G);
  if (sc.kf_layout != H * static_cast<long>(sizeof(E))) {  // first use, new H or dtype
    sc.kf.assign(static_cast<long>(kBlockKeys) * H, 0.0f);
    sc.vf.assign(static_cast<long>(kBlockKeys) * H, 0.0f);
    sc.kf_zero_from = sc.vf_zero_from = 0;
    sc.kf_layout = H * static_cast<long>(sizeof(E));
  }
  // The item's queries [rows, N, H] in the compute type (sm_scale applies to the scores).
  const E* q = reinterpret_cast<const E*>(static_cast<const char*>(b.q) +
                                          it.row0 * NH * kElemBytes<S>);
  if constexpr (S == Storage::kF16) {
    sc.q.resize(rows * NH);
    RowToF32<S>(static_cast<const char*>(b.q) + it.row0 * NH * 2, sc.q.data(),
                static_cast<int>(rows * NH));
    q = sc.q.data();
  }

  const KeySpan span(b, it);
  const int kb_end = span.kb_end;
  const int window = b.window;
  float* alpha = sc.alpha.data();
  // Rows of the current block and of the kPrefetchDistance blocks after it (a ring), and of
  // the next item's block being prefetched.
  BlockRows blocks[kPrefetchDistance + 1], ahead;
  auto fill = [&](int blk) -> BlockRows& {
    return span.Fill<S>(b, blk, blocks[blk % (kPrefetchDistance + 1)]);
  };
  // Only an item with at least kPrefetchDistance blocks prefetches into the next one, from
  // its first block on.
  const bool run_on = next != nullptr && span.blocks() >= kPrefetchDistance;
  int next_ready = 0;
  PrefetchCursor prefetch;
  // The first blocks have nothing to hide behind: all of their lines at once (unless the
  // previous item did it).
  for (int blk = it.kb_begin; blk < std::min(kb_end, it.kb_begin + kPrefetchDistance); ++blk) {
    prefetch.Start(&fill(blk), 1);
    if (blk - it.kb_begin >= ready) prefetch.Step();
  }
  for (int blk = it.kb_begin; blk < kb_end; ++blk) {
    if (blk > it.kb_begin && blk % kChunkBlocks == 0) end_chunk(blk / kChunkBlocks - 1, false);
    const BlockRows& cur = blocks[blk % (kPrefetchDistance + 1)];
    const int kb0 = blk * kBlockKeys, n = cur.n;  // n: keys visible to the last row
    const int first_row = std::max(0, kb0 - it.first_pos);  // rows before see nothing here
    // Rows from end_row on: their window starts past this block.
    const int end_row = window > 0 ? std::clamp(kb0 + kBlockKeys - 1 + window - it.first_pos,
                                                first_row, rows)
                                   : rows;
    // Spread over the Step() calls below.
    const int steps = 2 * sh.K * (end_row - first_row);
    if (blk + kPrefetchDistance < kb_end) {
      prefetch.Start(&fill(blk + kPrefetchDistance), steps);
    } else if (run_on) {
      const KeySpan next_span(b, *next);
      const int j = blk + kPrefetchDistance - kb_end;  // 0, 1, ...: blocks of next in order
      if (j < next_span.blocks()) {
        prefetch.Start(&next_span.Fill<S>(b, next_span.kb_begin + j, ahead), steps);
        next_ready = j + 1;
      } else {
        prefetch.Stop();
      }
    } else {
      prefetch.Stop();
    }
    for (int kh = 0; kh < sh.K; ++kh) {
      long ldk, ldv;
      const E* k = HeadRows<S>(cur, cur.k, kh, sh, sc.kf.data(), &sc.kf_zero_from, &ldk);
      const E* v = HeadRows<S>(cur, cur.v, kh, sh, sc.vf.data(), &sc.vf_zero_from, &ldv);
      for (int i = first_row; i < end_row; ++i) {
        const int pos = it.first_pos + i;
        const int nv = std::min(n, pos - kb0 + 1);
        const int lo = window > 0 ? std::max(0, pos - window + 1 - kb0) : 0;
        const long h0 = static_cast<long>(i) * N + kh * G;  // (row, first query head)
        prefetch.Step();
        DotGroup<kH>(q + h0 * H, G, k, ldk, H, b.sm_scale, sc.scores.data());
        if (b.soft_cap > 0.0f) SoftCap(sc.scores.data(), 16 * G, b.soft_cap);
        for (int g = 0; g < G; ++g) {
          alpha[g] = SoftmaxBlock(sc.scores.data() + 16 * g, lo, nv, &sc.m[h0 + g],
                                  &sc.l[h0 + g], sc.p.data() + 16 * g);
        }
        prefetch.Step();
        PVGroup<kH>(sc.o.data() + h0 * H, G, H, alpha, sc.p.data(), v, ldv);
      }
    }
  }

  end_chunk(std::max(kb_end - 1, it.kb_begin) / kChunkBlocks, true);
  if (it.part >= 0) return next_ready;
  for (long h = 0; h < RN; ++h) {
    WriteNormalized<S>(sc.fo.data() + h * H, sc.fl[h], H, b.out, it.row0 * NH + h * H);
  }
  return next_ready;
}

template <Storage S>
void MergeSplit(const Batch& b, const Split& sp, const float* partials) {
  const int N = b.sh.N, H = b.sh.H;
  const long NH = static_cast<long>(N) * H, stride = b.part_stride;
  std::vector<float> acc(H);
  for (long h = 0; h < static_cast<long>(sp.num_rows) * N; ++h) {
    float m = kNegInf, l = 0.0f;
    for (int p = 0; p < sp.num_parts; ++p) {  // the chunks in order, as RunItem folds them
      const float* part = partials + (sp.first_part + p) * stride + h * (H + 2);
      FoldChunk(part[0], part[1], part + 2, H, &m, &l, acc.data());
    }
    WriteNormalized<S>(acc.data(), l, H, b.out, sp.row0 * NH + h * H);
  }
}

template <Storage S>
void Run(const Batch& b, const Plan& plan) {
  const Shapes& sh = b.sh;
  const long NH = static_cast<long>(sh.N) * sh.H;
  // Padding rows are zeros.
  char* out = static_cast<char*>(b.out);
  std::memset(out, 0, plan.row_begin * NH * kElemBytes<S>);
  std::memset(out + plan.row_end * NH * kElemBytes<S>, 0,
              (sh.T - plan.row_end) * NH * kElemBytes<S>);

  std::vector<float> partials;
  if (!plan.splits.empty()) {
    const Split& last = plan.splits.back();
    partials.resize(static_cast<size_t>(last.first_part + last.num_parts) * b.part_stride);
  }
  auto run_item = [&](const Item& it, int ready, const Item* next) {
    switch (sh.H) {
      case 64: return RunItem<S, 64>(b, it, ready, next, ThreadScratch(), partials.data());
      case 128: return RunItem<S, 128>(b, it, ready, next, ThreadScratch(), partials.data());
      default: return RunItem<S, 0>(b, it, ready, next, ThreadScratch(), partials.data());
    }
  };
  // Items are claimed largest first from one counter. While many are left, a thread claims
  // its next item before running the current one, so that it can prefetch the next item's
  // first blocks during the current one's last; the last 2 x threads items are claimed one at
  // a time, so that none waits behind a busy thread while another is idle. A thread that
  // finds the pool busy runs every call itself: the first drains the items.
  const int num_items = static_cast<int>(plan.items.size());
  std::atomic<int> counter{0};
  ThreadPool& pool = ThreadPool::Get();
  const int threads = std::min(pool.size(), num_items);
  pool.Run(threads, [&](int) {
    int cur = counter.fetch_add(1), ready = 0;
    while (cur < num_items) {
      const bool hold = counter.load(std::memory_order_relaxed) + 2 * threads <= num_items;
      const int next = hold ? counter.fetch_add(1) : num_items;
      ready = run_item(plan.items[cur], ready, next < num_items ? &plan.items[next] : nullptr);
      if (hold) {
        cur = next;
      } else {
        cur = counter.fetch_add(1);
        ready = 0;
      }
    }
  });
  ThreadPool::Get().Run(static_cast<int>(plan.splits.size()), [&](int i) {
    MergeSplit<S>(b, plan.splits[i], partials.data());
  });
}

ffi::Error Attention(ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                     Int32Matrix block_tables, Int32Vector seq_lens,
                     Int32Vector query_start_loc, Int32Scalar num_seqs, float sm_scale,
                     int32_t sliding_window, float logits_soft_cap,
                     ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), bd = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || v_cache.dimensions().size() != 4) {
    return ffi::Error::InvalidArgument("q must be [T, N, H] and the caches [B, P, K, H]");
  }
  Shapes sh{static_cast<int>(qd[0]), static_cast<int>(qd[1]), static_cast<int>(qd[2]),
            kd[0], static_cast<int>(kd[1]), static_cast<int>(kd[2]), 0,
            static_cast<int>(bd[0]), static_cast<int>(bd[1])};
  for (int i = 0; i < 4; ++i) {
    if (v_cache.dimensions()[i] != kd[i]) {
      return ffi::Error::InvalidArgument("k_cache and v_cache shapes differ");
    }
  }
  if (kd[3] != sh.H || sh.K <= 0 || sh.N % sh.K != 0 || sh.P <= 0) {
    return ffi::Error::InvalidArgument("head dims differ, or N is not a multiple of K");
  }
  if (seq_lens.dimensions()[0] != sh.S || query_start_loc.dimensions()[0] != sh.S + 1) {
    return ffi::Error::InvalidArgument("seq_lens must be [S] and query_start_loc [S + 1]");
  }
  sh.G = sh.N / sh.K;
  const ffi::DataType qt = q.element_type(), ct = k_cache.element_type();
  if (out->element_type() != qt || v_cache.element_type() != ct) {
    return ffi::Error::InvalidArgument("the output must have q's dtype, V the dtype of K");
  }
  Storage st;
  if (qt == ffi::DataType::F32 && ct == ffi::DataType::F32) {
    st = Storage::kF32;
  } else if (qt == ffi::DataType::BF16 && (ct == ffi::DataType::BF16 || ct == ffi::DataType::U16)) {
    st = Storage::kBF16;
  } else if (qt == ffi::DataType::F16 && (ct == ffi::DataType::F16 || ct == ffi::DataType::U16)) {
    st = Storage::kF16;
  } else {
    return ffi::Error::InvalidArgument(
        "supported: f32 q with an f32 cache, bf16 / f16 q with a cache of the same type or "
        "uint16 holding its bits");
  }

  if (sliding_window < 0 || !(logits_soft_cap >= 0.0f)) {
    return ffi::Error::InvalidArgument("sliding_window and logits_soft_cap must be >= 0");
  }
  Plan plan;
  ThreadPool& pool = ThreadPool::Get();
  std::string problem = MakePlan(sh, block_tables.typed_data(), seq_lens.typed_data(),
                                 query_start_loc.typed_data(), num_seqs.typed_data()[0],
                                 sliding_window, pool.size(), &plan);
  if (!problem.empty()) return ffi::Error::InvalidArgument(problem);
  Batch b{q.untyped_data(), k_cache.untyped_data(), v_cache.untyped_data(),
          out->untyped_data(), block_tables.typed_data(), sm_scale, sliding_window,
          logits_soft_cap, sh,
          static_cast<long>(plan.max_rows) * sh.N * (sh.H + 2)};
  switch (st) {
    case Storage::kF32: Run<Storage::kF32>(b, plan); break;
    case Storage::kBF16: Run<Storage::kBF16>(b, plan); break;
    case Storage::kF16: Run<Storage::kF16>(b, plan); break;
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxllm

extern "C" {

// The handler is the library's only FFI symbol; the rest stays hidden (-fvisibility=hidden).
__attribute__((visibility("default"))) XLA_FFI_Error* JaxllmRaggedPagedAttention(
    XLA_FFI_CallFrame* call_frame);

// Threads the pool runs attention on (the caller's included), for tests and benchmarks.
__attribute__((visibility("default"))) int JaxllmCpuAttentionNumThreads() {
  return jaxllm::ThreadPool::Get().size();
}

}  // extern "C"

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmRaggedPagedAttention, jaxllm::Attention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()           // q
                                  .Arg<ffi::AnyBuffer>()           // k_cache
                                  .Arg<ffi::AnyBuffer>()           // v_cache
                                  .Arg<Int32Matrix>()              // block_tables
                                  .Arg<Int32Vector>()              // seq_lens
                                  .Arg<Int32Vector>()              // query_start_loc
                                  .Arg<Int32Scalar>()              // num_seqs
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")   // 0: none
                                  .Attr<float>("logits_soft_cap")    // 0: none
                                  .Ret<ffi::AnyBuffer>());
