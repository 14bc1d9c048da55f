"""How tokens are chosen: one small traceable function over the padded batch of logits.

Owns the sampling math (vLLM v1 order, below) and the shape of its results. The host-side
bookkeeping that feeds it lives in `sampling_metadata.py`; this file never looks at a request.

Per step, on logits [S, V] (float32 from here on):
  1. raw = the logits as they came                (the "raw_*" logprobs modes read these)
  2. allowed_token_ids: other ids -> -inf          (only if some row restricts)
  3. bad_words: a word's last token -> -inf when the output ends with the rest of it,
     matched on the device token history           (only if some row has bad words)
  4. min_tokens: EOS / stop ids -> -inf           (rows below their min_tokens)
  5. penalties: repetition, frequency, presence   (only if some row has one)
  6. greedy = argmax                              (penalised, temperature-free)
  7. / temperature, min_p, top_k + top_p          (only if some row is random; greedy
     rows pass through unchanged)
  8. inverse-CDF draw, one uniform per row from key fold_in(key(seed), step)
  9. sampled = greedy where temperature < eps, else the draw
 10. logprobs of the sampled token and the top K (only if some row wants logprobs), per the
     engine's static logprobs_mode (vLLM's four): raw_logprobs (default, log_softmax of 1),
     raw_logits (1), processed_logprobs (log_softmax of 7's output), processed_logits (7's
     output). Rows that did not ask, and whole batches where none did, get zeros.

The "only if" steps are `lax.cond`s on the batch, so one compiled program per S bucket serves
every mix of parameters at the cost of the work some row actually needs.

Shapes: S sequences (bucket), V vocab, K = min(max_logprobs, V) (V when -1; static), L token
history window, W stop ids, B x G bad-word sequences x tokens, N = ceil(V / 32) bit words.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels.cpu_argmax import argmax_first_here as argmax_first
from jaxllm.messages import LogprobsLists
from jaxllm.runner.sampling_metadata import NO_TOKEN, PenaltyMetadata, SamplingMetadata
from jaxllm.sampling_params import MAX_LOGPROBS, SAMPLING_EPS


@flax.struct.dataclass
class LogprobsTensors:
    """Raw logprobs of R rows (sampled rows, or prompt positions)."""

    selected_token_ids: jax.Array  # [R] int32, the sampled token (or the prompt's next token)
    selected_logprobs: jax.Array  # [R] float32, its raw logprob
    selected_ranks: jax.Array  # [R] int32, 1 + number of tokens strictly more likely
    topk_token_ids: jax.Array  # [R, K] int32, most likely first
    topk_logprobs: jax.Array  # [R, K] float32


@flax.struct.dataclass
class SamplerOutput:
    sampled_token_ids: jax.Array  # [S] int32; padding rows hold garbage, ignore them
    logprobs: LogprobsTensors  # zeros unless some row asked (md.num_logprobs >= 0)


def sample(logits_SV: jax.Array, md: SamplingMetadata,
           token_history_fn: Callable[[], jax.Array] | None = None, *,
           logprobs_mode: str = "raw_logprobs", max_num_logprobs: int = MAX_LOGPROBS
           ) -> SamplerOutput:
    """Pure, traceable: call it inside a larger jit, or use `sample_jit`. The token history
    (penalties, bad words) is `md.penalties.token_ids`, or, when that is None,
    `token_history_fn()` [S, L], called only in the branches that read it (so other batches
    never do). logprobs_mode and max_num_logprobs (K = min of it and V; -1 = V) are static."""
    logits_SV = logits_SV.astype(jnp.float32)
    raw_SV = logits_SV

    def history() -> jax.Array:
        pen = md.penalties
        return pen.token_ids if pen.token_ids is not None else token_history_fn()

    x_SV = logits_SV
    if md.allowed_token_bits.shape[-1]:  # 0 words: built without a vocabulary, none restrict
        x_SV = jax.lax.cond(jnp.any(md.allowed_token_bits != jnp.uint32(0xFFFFFFFF)),
                            lambda x: _apply_allowed_token_ids(x, md.allowed_token_bits),
                            lambda x: x, x_SV)
    x_SV = jax.lax.cond(jnp.any(md.bad_words[:, :, -1] != NO_TOKEN),
                        lambda x: apply_bad_words(x, md.bad_words, history(),
                                                  md.penalties.prompt_lens,
                                                  md.penalties.seq_lens),
                        lambda x: x, x_SV)
    x_SV = _apply_min_tokens(x_SV, md.min_tokens_stop_ids)
    x_SV = jax.lax.cond(_any_penalties(md.penalties),
                        lambda x: apply_penalties(x, md.penalties.replace(token_ids=history())),
                        lambda x: x, x_SV)
    greedy_S = argmax_first(x_SV)
    is_greedy_S = md.temperature < SAMPLING_EPS

    def draw(x_SV):
        # Greedy rows pass through unchanged (temperature 1, every knob off), as in vLLM.
        x_SV = x_SV / jnp.where(is_greedy_S, 1.0, md.temperature)[:, None]
        x_SV = _apply_min_p(x_SV, md.min_p)
        x_SV = apply_top_k_top_p(x_SV, md.top_k, md.top_p)
        sampled_S = jnp.where(is_greedy_S, greedy_S, _sample_from(x_SV, md.seeds, md.steps))
        return sampled_S, x_SV if processed else None

    # The processed logits leave the cond only in the modes that read them.
    processed = logprobs_mode.startswith("processed")
    sampled_S, processed_SV = jax.lax.cond(
        jnp.all(is_greedy_S), lambda x: (greedy_S, x if processed else None), draw, x_SV)
    scores_SV = {"raw_logprobs": lambda: jax.nn.log_softmax(raw_SV, axis=-1),
                 "raw_logits": lambda: raw_SV,
                 "processed_logprobs": lambda: jax.nn.log_softmax(processed_SV, axis=-1),
                 "processed_logits": lambda: processed_SV}[logprobs_mode]
    k = num_topk(max_num_logprobs, logits_SV.shape[-1])
    logprobs = jax.lax.cond(
        jnp.any(md.num_logprobs >= 0),
        lambda: gather_logprobs(scores_SV(), sampled_S, k),
        lambda: zero_logprobs(sampled_S, k))
    return SamplerOutput(sampled_token_ids=sampled_S, logprobs=logprobs)


sample_jit = jax.jit(sample, static_argnames=("logprobs_mode", "max_num_logprobs"))


def num_topk(max_num_logprobs: int, vocab: int) -> int:
    """K, the static top-k width of logprobs: the engine's max_logprobs (-1: all) within V."""
    return vocab if max_num_logprobs == -1 else min(max_num_logprobs, vocab)


def _any_penalties(pen: PenaltyMetadata) -> jax.Array:
    return jnp.any((pen.presence_penalty != 0) | (pen.frequency_penalty != 0)
                   | (pen.repetition_penalty != 1))


def zero_logprobs(token_ids_R: jax.Array, k: int) -> LogprobsTensors:
    rows = token_ids_R.shape[0]
    return LogprobsTensors(selected_token_ids=token_ids_R,
                           selected_logprobs=jnp.zeros(rows, jnp.float32),
                           selected_ranks=jnp.zeros(rows, jnp.int32),
                           topk_token_ids=jnp.zeros((rows, k), jnp.int32),
                           topk_logprobs=jnp.zeros((rows, k), jnp.float32))


def compute_prompt_logprobs(logits_TV: jax.Array, target_ids_T: jax.Array,
                            k: int = MAX_LOGPROBS) -> LogprobsTensors:
    """Raw logprobs at prompt positions (whatever the logprobs_mode, as in vLLM): row t
    scores target_ids_T[t] (the prompt's next token) and lists the top-k. Pure;
    `prompt_logprobs_jit` is the jitted form."""
    return gather_logprobs(jax.nn.log_softmax(logits_TV.astype(jnp.float32), axis=-1),
                           target_ids_T.astype(jnp.int32), min(k, logits_TV.shape[-1]))


prompt_logprobs_jit = jax.jit(compute_prompt_logprobs, static_argnames="k")

# Prompt logits computed at once: at most this many bytes of [rows, V] float32 (unless that
# is fewer than CHUNK_ROW_MULTIPLE rows).
PROMPT_LOGPROBS_CHUNK_BYTES = 1 << 26
# Chunks are a multiple of this many rows. Then every chunked result equalled the unchunked
# one bit for bit on XLA:CPU (every vocabulary, dtype and T measured); chunks of 1 to 7 rows
# or of 3 x 2^n did not (last-bit differences in log_softmax: XLA:CPU vectorizes its row
# reductions over groups of rows).
CHUNK_ROW_MULTIPLE = 8


def prompt_logprobs_chunk_rows(vocab_size: int,
                               chunk_bytes: int = PROMPT_LOGPROBS_CHUNK_BYTES) -> int:
    """The largest power of two of rows whose float32 logits fit chunk_bytes, at least
    CHUNK_ROW_MULTIPLE: 128 rows for a 128k vocabulary, 256 for SmolLM2's 49k."""
    if vocab_size < 1 or chunk_bytes < 1:
        raise ValueError(f"vocab_size and chunk_bytes must be >= 1, got {vocab_size}, "
                         f"{chunk_bytes}")
    rows = max(CHUNK_ROW_MULTIPLE, chunk_bytes // (4 * vocab_size))
    return 1 << (rows.bit_length() - 1)


def chunked_prompt_logprobs(logits_fn: Callable[[jax.Array], jax.Array], hidden_TD: jax.Array,
                            target_ids_T: jax.Array, k: int, chunk_rows: int
                            ) -> LogprobsTensors:
    """`compute_prompt_logprobs(logits_fn(hidden_TD), target_ids_T, k)`, C = chunk_rows rows
    at a time, so that one [C, V] block of logits is alive instead of [T, V] (4.2 GB of f32
    at T = 8192 and a 128k vocabulary). Rows are independent (one row of the LM-head
    matmul, a row-wise log_softmax, rank and top-k), so the result is the unchunked one
    (bit for bit on XLA:CPU, see CHUNK_ROW_MULTIPLE). T is padded up to a multiple of C
    with zero rows whose results are dropped:

        hidden [T, D] -> [N, C, D] --lax.map: logits [C, V] -> C rows of logprobs-->
                         [N, C, ...] -> [T, ...]
    """
    if chunk_rows < 1 or chunk_rows % CHUNK_ROW_MULTIPLE:
        raise ValueError(f"chunk_rows must be a positive multiple of {CHUNK_ROW_MULTIPLE}, "
                         f"got {chunk_rows}")
    T = hidden_TD.shape[0]
    C = min(chunk_rows, T)
    N = -(-T // C)
    if N == 1:
        return compute_prompt_logprobs(logits_fn(hidden_TD), target_ids_T, k)
    pad = N * C - T
    hidden_NCD = jnp.pad(hidden_TD, ((0, pad), (0, 0))).reshape(N, C, -1)
    targets_NC = jnp.pad(target_ids_T, (0, pad)).reshape(N, C)
    out = jax.lax.map(lambda x: compute_prompt_logprobs(logits_fn(x[0]), x[1], k),
                      (hidden_NCD, targets_NC))
    return jax.tree.map(lambda a: a.reshape(N * C, *a.shape[2:])[:T], out)


def gather_logprobs(logprobs_RV: jax.Array, token_ids_R: jax.Array,
                    k: int = MAX_LOGPROBS) -> LogprobsTensors:
    """The selected token's score and rank, and the top-k scores (k <= V)."""
    topk_logprobs_RK, topk_ids_RK = jax.lax.top_k(logprobs_RV, min(k, logprobs_RV.shape[-1]))
    selected_R = jnp.take_along_axis(logprobs_RV, token_ids_R[:, None], axis=-1)[:, 0]
    ranks_R = 1 + jnp.sum(logprobs_RV > selected_R[:, None], axis=-1, dtype=jnp.int32)
    return LogprobsTensors(selected_token_ids=token_ids_R, selected_logprobs=selected_R,
                           selected_ranks=ranks_R, topk_token_ids=topk_ids_RK.astype(jnp.int32),
                           topk_logprobs=topk_logprobs_RK)


def _apply_allowed_token_ids(x_SV: jax.Array, bits_SN: jax.Array) -> jax.Array:
    """Tokens whose bit is clear -> -inf (rows with all bits set are unchanged)."""
    S, V = x_SV.shape
    shifts_32 = jnp.arange(32, dtype=jnp.uint32)
    allowed_SV = ((bits_SN[:, :, None] >> shifts_32) & 1).reshape(S, -1)[:, :V] == 1
    return jnp.where(allowed_SV, x_SV, -jnp.inf)


def apply_bad_words(x_SV: jax.Array, words_SBG: jax.Array, token_ids_SL: jax.Array,
                    prompt_lens_S: jax.Array, seq_lens_S: jax.Array) -> jax.Array:
    """vLLM v1's bad words: a sequence's last token -> -inf when the row's last G-1 OUTPUT
    tokens end with the rest of it. Sequences are right-aligned, so column j of the prefix
    lines up with history position seq_len - (G-1) + j; NO_TOKEN columns match anything,
    prompt positions nothing.

        history  ... p p | o o o o         (seq_len = 7, G = 4)
        window           |   o o o          positions 4..6
        word      N  N  12 | 34             -> ban 34 when o6 == 12
    """
    G = words_SBG.shape[-1]
    pos_SJ = seq_lens_S[:, None] - (G - 1) + jnp.arange(G - 1)[None, :]
    past_SJ = jnp.take_along_axis(token_ids_SL, jnp.clip(pos_SJ, 0, token_ids_SL.shape[1] - 1),
                                  axis=-1)
    is_output_SJ = pos_SJ >= prompt_lens_S[:, None]
    prefix_SBJ = words_SBG[:, :, :-1]
    match_SBJ = (prefix_SBJ == NO_TOKEN) | ((past_SJ[:, None, :] == prefix_SBJ)
                                           & is_output_SJ[:, None, :])
    last_SB = jnp.where(jnp.all(match_SBJ, axis=-1), words_SBG[:, :, -1], NO_TOKEN)
    rows_S1 = jnp.arange(x_SV.shape[0])[:, None]
    return x_SV.at[rows_S1, last_SB].set(-jnp.inf, mode="drop")


def _apply_min_tokens(x_SV: jax.Array, stop_ids_SW: jax.Array) -> jax.Array:
    rows_S1 = jnp.arange(x_SV.shape[0])[:, None]
    # NO_TOKEN padding is out of range and dropped; stop ids outside V are dropped too.
    return x_SV.at[rows_S1, stop_ids_SW].set(-jnp.inf, mode="drop")


def apply_penalties(x_SV: jax.Array, pen: PenaltyMetadata) -> jax.Array:
    """vLLM semantics: repetition over prompt + output tokens (divide positive logits, multiply
    negative ones), then frequency (x count) and presence (x seen) over output tokens only."""
    num_seqs, vocab = x_SV.shape
    pos_1L = jnp.arange(pen.token_ids.shape[1])[None, :]
    in_seq_SL = pos_1L < pen.seq_lens[:, None]
    is_output_SL = in_seq_SL & (pos_1L >= pen.prompt_lens[:, None])
    rows_S1 = jnp.arange(num_seqs)[:, None]
    zeros_SV = jnp.zeros((num_seqs, vocab), jnp.int32)
    output_counts_SV = zeros_SV.at[rows_S1, pen.token_ids].add(is_output_SL, mode="drop")
    seen_SV = zeros_SV.at[rows_S1, pen.token_ids].add(in_seq_SL, mode="drop") > 0

    rep_S1 = pen.repetition_penalty[:, None]
    x_SV = jnp.where(seen_SV, jnp.where(x_SV > 0, x_SV / rep_S1, x_SV * rep_S1), x_SV)
    x_SV = x_SV - pen.frequency_penalty[:, None] * output_counts_SV
    x_SV = x_SV - pen.presence_penalty[:, None] * (output_counts_SV > 0)
    # A tiny repetition_penalty (it may be as small as float32's smallest) divides a positive
    # logit past float32's range; +inf would make the softmax NaN, so those tokens tie at the
    # largest finite value instead.
    return jnp.minimum(x_SV, jnp.finfo(jnp.float32).max)


def _apply_min_p(x_SV: jax.Array, min_p_S: jax.Array) -> jax.Array:
    # p_i < min_p * p_max  <=>  x_i - x_max < log(min_p); min_p = 0 gives -inf: keeps all.
    threshold_S1 = jnp.max(x_SV, axis=-1, keepdims=True) + jnp.log(min_p_S)[:, None]
    return jnp.where(x_SV < threshold_S1, -jnp.inf, x_SV)


def apply_top_k_top_p(x_SV: jax.Array, top_k_S: jax.Array, top_p_S: jax.Array) -> jax.Array:
    """Keep the top_k largest, then the fewest largest whose probability (renormalised over the
    top_k) reaches top_p; the top token always stays, and ties with a threshold are kept.

    No sort: each threshold is found exactly by a 32-step search over the float bits (below),
    which is 3x faster than sorting [S, V] on CPU and as cheap on GPU.
    """
    vocab = x_SV.shape[-1]
    key_SV = _sortable_bits(x_SV)
    k_S = jnp.where((top_k_S <= 0) | (top_k_S > vocab), vocab, top_k_S)

    def top_k(x_SV):
        kth_S = _largest_threshold(key_SV, lambda kept_SV: jnp.sum(kept_SV, axis=-1) >= k_S)
        return jnp.where(key_SV >= kth_S[:, None], x_SV, -jnp.inf)

    def top_p(x_SV):
        probs_SV = jax.nn.softmax(x_SV, axis=-1)
        mass_S = lambda kept_SV: jnp.sum(jnp.where(kept_SV, probs_SV, 0.0), axis=-1)  # noqa
        pth_S = _largest_threshold(key_SV, lambda kept_SV: mass_S(kept_SV) >= top_p_S)
        # The top token always stays (vLLM's rule): a top_p that float32 rounds to 0 (say
        # 1e-300) is "enough" with no token kept, and the search would run past every key.
        pth_S = jnp.minimum(pth_S, jnp.max(key_SV, axis=-1))
        # top_p = 1 keeps everything: a float sum over a subset can round up to 1.0.
        pth_S = jnp.where(top_p_S >= 1.0, 0, pth_S)
        return jnp.where(key_SV >= pth_S[:, None], x_SV, -jnp.inf)

    # Each search is 32 passes over [S, V]; skip it at run time when no row needs it (a
    # batch with only top_p, as in vLLM's quickstart, pays for one search; plain
    # temperature sampling pays for none).
    x_SV = jax.lax.cond(jnp.any(k_S < vocab), top_k, lambda x: x, x_SV)
    return jax.lax.cond(jnp.any(top_p_S < 1.0), top_p, lambda x: x, x_SV)


def _sortable_bits(x_SV: jax.Array) -> jax.Array:
    """Map float32 to uint32 so that unsigned order = float order (-inf lowest)."""
    bits_SV = jax.lax.bitcast_convert_type(x_SV, jnp.uint32)
    negative_SV = (bits_SV >> 31) == 1
    return jnp.where(negative_SV, ~bits_SV, bits_SV | jnp.uint32(0x80000000))


def _largest_threshold(key_SV: jax.Array, enough) -> jax.Array:
    """Per row, the largest uint32 T with enough(key_SV >= T), for `enough` monotone (true at
    T = 0). Built greedily from the top bit down; the result is some token's key unless
    `enough` already holds with no token kept (then it is 0xFFFFFFFF: callers clamp).

      bit 31: try T = 1000...0 -> enough? keep it : drop it
      bit 30: try T | 0100...0 -> ...          (32 passes of a compare + row sum over [S, V])
    """

    def try_bit(i, t_S):
        candidate_S = t_S | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(enough(key_SV >= candidate_S[:, None]), candidate_S, t_S)

    return jax.lax.fori_loop(0, 32, try_bit, jnp.zeros(key_SV.shape[0], jnp.uint32))


def _sample_from(x_SV: jax.Array, seeds_S2: jax.Array, steps_S: jax.Array) -> jax.Array:
    """One exact draw per row from softmax(x) by inverse CDF: a single uniform per row (V
    Gumbels per row, as in Gumbel-max, cost 5x more on CPU). Each row's uniform depends only
    on its own (seed, step), so a seeded request samples the same tokens in any batch.

    The CDF is walked in two levels, because a cumsum over the whole vocabulary is XLA:CPU's
    slowest op here (~20 ms at [64, 49152], 10x a softmax):

        probs  [S, N, B]   (V padded to N blocks of B tokens)
        level 1: cumsum of the N block sums   -> the block where the CDF crosses u
        level 2: cumsum inside that one block -> the token
    """

    def uniform(seed_2, step):
        key = jax.random.fold_in(jax.random.wrap_key_data(seed_2, impl="threefry2x32"), step)
        return jax.random.uniform(key, (), jnp.float32)

    S, V = x_SV.shape
    B = _CDF_BLOCK
    N = -(-V // B)
    probs_SV = jax.nn.softmax(x_SV, axis=-1)
    probs_SNB = jnp.pad(probs_SV, ((0, 0), (0, N * B - V))).reshape(S, N, B)
    block_SN = jnp.sum(probs_SNB, axis=-1)
    cdf_SN = jnp.cumsum(block_SN, axis=-1)
    u_S = jax.vmap(uniform)(seeds_S2, steps_S) * cdf_SN[:, -1]
    blk_S = jnp.minimum(_first_true(cdf_SN > u_S[:, None]), N - 1)
    inner_SB = jnp.take_along_axis(probs_SNB, blk_S[:, None, None], axis=1)[:, 0]
    before_S = jnp.take_along_axis(cdf_SN - block_SN, blk_S[:, None], axis=1)
    idx_S = jnp.minimum(_first_true(before_S + jnp.cumsum(inner_SB, axis=-1) > u_S[:, None]),
                        B - 1)
    token_S = (blk_S * B + idx_S).astype(jnp.int32)
    # Float rounding can land on a zero-probability token (or none): fall back to the top one.
    chosen_ok_S = jnp.take_along_axis(
        probs_SV, jnp.minimum(token_S, V - 1)[:, None], axis=-1)[:, 0] > 0
    return jnp.where(chosen_ok_S & (token_S < V), token_S, argmax_first(x_SV))


_CDF_BLOCK = 256


def _first_true(mask_SN: jax.Array) -> jax.Array:
    """Index of the first True per row (N when none)."""
    n = mask_SN.shape[-1]
    return jnp.min(jnp.where(mask_SN, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def logprobs_lists(tensors: LogprobsTensors, rows: slice | Sequence[int],
                   num_logprobs: int) -> LogprobsLists:
    """Slice `rows` out of (host-fetched) tensors and keep each row's top `num_logprobs`.

    Sampled tokens: rows=[i] for request row i. Prompt logprobs: the request's positions.
    Fetch the whole output with one `jax.device_get` first; this only indexes numpy arrays.
    """
    n = min(num_logprobs, np.shape(tensors.topk_token_ids)[-1])
    ids = np.concatenate([np.asarray(tensors.selected_token_ids)[rows][:, None],
                          np.asarray(tensors.topk_token_ids)[rows, :n]], axis=-1)
    lps = np.concatenate([np.asarray(tensors.selected_logprobs)[rows][:, None],
                          np.asarray(tensors.topk_logprobs)[rows, :n]], axis=-1)
    return LogprobsLists(logprob_token_ids=ids.tolist(), logprobs=lps.tolist(),
                         sampled_token_ranks=np.asarray(tensors.selected_ranks)[rows].tolist())
