"""Host side of sampling: per-request parameters -> one padded `SamplingMetadata` per step.

Owns the slot-indexed arrays of sampling parameters (`SamplingSlots`: written once when a
request joins the batch, gathered per step) and the metadata pytree the sampler reads. Never
touches a device and never does sampling math: that is `sampler.py`. The two wide per-row
tables, bad words and allowed-token bits, are built here (`bad_words_rows`,
`allowed_token_bits`) but kept by the input batch as device rows (`device_rows.py`): the
runner's step gathers them on the device, so its host metadata leaves them None.

Every shape is a bucket constant: S (sequence bucket), W = MAX_MIN_TOKENS_STOP_IDS,
B x G = MAX_BAD_WORDS x MAX_BAD_WORD_TOKENS, N = ceil(V / 32) words of allowed-token bits (0
when built without a vocabulary: then no row can restrict), and in tests L (token history).
There is no static "variant": the sampler skips the work no row needs at run time, so one
program per S bucket serves every mix of parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import flax.struct
import numpy as np

from jaxllm.sampling_limits import (MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS,  # noqa: F401
                                    MAX_MIN_TOKENS_STOP_IDS, NO_TOKEN,
                                    banned_until_min_tokens, request_seed)
from jaxllm.sampling_params import SamplingParams
from jaxllm.value_ranges import INT32_MAX

# num_logprobs of a request asking for -1 (the whole vocabulary): every one the sampler lists.
ALL_LOGPROBS = np.iinfo(np.int32).max


@flax.struct.dataclass
class PenaltyMetadata:
    presence_penalty: np.ndarray  # [S] float32, 0 = off (also padding)
    frequency_penalty: np.ndarray  # [S] float32, 0 = off
    repetition_penalty: np.ndarray  # [S] float32, 1 = off
    prompt_lens: np.ndarray  # [S] int32, token_ids[s, :prompt_lens[s]] is the prompt
    seq_lens: np.ndarray  # [S] int32, prompt + output so far (tokens before the sampled one)
    # [S, L] int32, prompt ids then output ids, anything past seq_lens. None when the caller
    # fills it on the device (the runner's step reads its device token history).
    token_ids: np.ndarray | None = None


@flax.struct.dataclass
class SamplingMetadata:
    temperature: np.ndarray  # [S] float32, 0 = greedy (also padding rows)
    top_k: np.ndarray  # [S] int32, 0 = off
    top_p: np.ndarray  # [S] float32, 1 = off
    min_p: np.ndarray  # [S] float32, 0 = off
    seeds: np.ndarray  # [S, 2] uint32, threefry key words (hi, lo) of each row's 64-bit seed
    steps: np.ndarray  # [S] int32, output tokens the row already has (folded into its key)
    min_tokens_stop_ids: np.ndarray  # [S, W] int32, ids masked to -inf this step; NO_TOKEN pads
    num_logprobs: np.ndarray  # [S] int32, -1 = the row wants no logprobs
    penalties: PenaltyMetadata
    # [S, B, G] int32, each bad-word sequence right-aligned (its last token at column G-1),
    # NO_TOKEN to its left and in unused sequences
    bad_words: np.ndarray | None = None
    # [S, N] uint32, bit v % 32 of word v // 32; all ones = off
    allowed_token_bits: np.ndarray | None = None
    # Both None in the runner's host metadata: its step gathers them from the device rows.


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    """One request being sampled, for `build_sampling_metadata` (tests and tools)."""

    params: SamplingParams
    seed: int  # params.seed if set, else request_seed(engine_seed, request_index)
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


def bad_words_rows(sequences: Sequence[Sequence[int]] | None) -> np.ndarray:
    """[B, G] int32: each sequence right-aligned, NO_TOKEN elsewhere.

        "hello world" -> [12, 34]:   NO_TOKEN ... NO_TOKEN 12 34
    """
    rows = np.full((MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), NO_TOKEN, np.int32)
    sequences = sequences or []
    if len(sequences) > MAX_BAD_WORDS or any(len(s) > MAX_BAD_WORD_TOKENS for s in sequences):
        raise ValueError(f"bad_words supports at most {MAX_BAD_WORDS} token sequences of at "
                         f"most {MAX_BAD_WORD_TOKENS} tokens.")
    for b, seq in enumerate(sequences):
        if seq:
            rows[b, MAX_BAD_WORD_TOKENS - len(seq):] = seq
    return rows


def allowed_token_bits(allowed_token_ids: Sequence[int] | None, vocab_size: int) -> np.ndarray:
    """[ceil(V / 32)] uint32 bit set of the allowed ids; all ones when there is no list."""
    words = -(-vocab_size // 32)
    if allowed_token_ids is None:
        return np.full(words, 0xFFFFFFFF, np.uint32)
    ids = np.asarray(allowed_token_ids, np.int64)
    if words == 0 or ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"allowed_token_ids must be in [0, {vocab_size}).")
    bits = np.zeros(words, np.uint32)
    np.bitwise_or.at(bits, ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
    return bits


class SamplingSlots:
    """Sampling parameters of up to `num_slots` requests, one row per slot (the bad words
    and allowed-token bits excepted: see the module docstring)."""

    def __init__(self, num_slots: int):
        n = num_slots
        self.temperature = np.zeros(n, np.float32)
        self.top_k = np.zeros(n, np.int32)
        self.top_p = np.ones(n, np.float32)
        self.min_p = np.zeros(n, np.float32)
        self.seeds = np.zeros((n, 2), np.uint32)
        self.min_tokens = np.zeros(n, np.int32)
        self.banned = np.full((n, MAX_MIN_TOKENS_STOP_IDS), NO_TOKEN, np.int32)
        self.presence_penalty = np.zeros(n, np.float32)
        self.frequency_penalty = np.zeros(n, np.float32)
        self.repetition_penalty = np.ones(n, np.float32)
        self.num_logprobs = np.full(n, -1, np.int32)

    def add(self, slot: int, params: SamplingParams, seed: int,
            eos_token_ids: Sequence[int]) -> None:
        banned = banned_until_min_tokens(params, eos_token_ids)
        self.temperature[slot] = params.temperature
        # Any k >= the vocabulary is off in the sampler (vLLM clamps k to the vocabulary the
        # same way), so a k past int32 is stored as int32's largest, never overflowing.
        self.top_k[slot] = min(params.top_k, INT32_MAX)
        self.top_p[slot] = params.top_p
        self.min_p[slot] = params.min_p
        seed %= 2**64
        self.seeds[slot] = (seed >> 32, seed & 0xFFFFFFFF)
        self.min_tokens[slot] = params.min_tokens
        self.banned[slot] = NO_TOKEN
        self.banned[slot, :len(banned)] = banned
        self.presence_penalty[slot] = params.presence_penalty
        self.frequency_penalty[slot] = params.frequency_penalty
        self.repetition_penalty[slot] = params.repetition_penalty
        self.num_logprobs[slot] = (-1 if params.logprobs is None else ALL_LOGPROBS
                                   if params.logprobs == -1 else params.logprobs)

    def gather(self, slots: np.ndarray, num_output_tokens: np.ndarray, prompt_lens: np.ndarray,
               num_seqs_padded: int) -> SamplingMetadata:
        """Rows `slots` (one per real sequence, in batch order) padded to `num_seqs_padded`,
        bad_words and allowed_token_bits None. num_output_tokens: output tokens each row has
        before this sample (in-flight ones included); prompt_lens: its prompt length."""
        n = len(slots)
        if n > num_seqs_padded:
            raise ValueError(f"{n} rows do not fit the bucket num_seqs_padded="
                             f"{num_seqs_padded}.")
        md = dummy_sampling_metadata(num_seqs_padded, slot_rows=False)
        for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "num_logprobs"):
            getattr(md, name)[:n] = getattr(self, name)[slots]
        md.steps[:n] = num_output_tokens
        below = num_output_tokens < self.min_tokens[slots]
        md.min_tokens_stop_ids[:n] = np.where(below[:, None], self.banned[slots], NO_TOKEN)
        pen = md.penalties
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            getattr(pen, name)[:n] = getattr(self, name)[slots]
        pen.prompt_lens[:n] = prompt_lens
        pen.seq_lens[:n] = prompt_lens + num_output_tokens
        return md


def build_sampling_metadata(rows: Sequence[SamplingRow], *, num_seqs_padded: int,
                            eos_token_ids: Sequence[int], max_model_len: int,
                            vocab_size: int = 0) -> SamplingMetadata:
    """Metadata for `rows` with the token history filled from the rows themselves (the
    runner fills it on the device instead). max_model_len: the history window L. Rows with
    bad_words need params._bad_words_token_ids set (the processor does it at admission);
    rows with allowed_token_ids need vocab_size."""
    slots = SamplingSlots(max(len(rows), 1))
    token_ids = np.zeros((num_seqs_padded, max_model_len), np.int32)
    for i, row in enumerate(rows):
        slots.add(i, row.params, row.seed, eos_token_ids)
        tokens = [*row.prompt_token_ids, *row.output_token_ids]
        if row.params.uses_penalties or row.params.bad_words_token_ids:
            if len(tokens) > max_model_len:
                raise ValueError(f"prompt + output ({len(tokens)} tokens) exceeds "
                                 f"max_model_len={max_model_len}.")
            token_ids[i, :len(tokens)] = tokens
    md = slots.gather(np.arange(len(rows)),
                      np.array([len(r.output_token_ids) for r in rows], np.int32),
                      np.array([len(r.prompt_token_ids) for r in rows], np.int32),
                      num_seqs_padded)
    padding = dummy_sampling_metadata(num_seqs_padded, vocab_size=vocab_size)
    bad_words, allowed = padding.bad_words, padding.allowed_token_bits
    for i, row in enumerate(rows):
        bad_words[i] = bad_words_rows(row.params.bad_words_token_ids)
        allowed[i] = allowed_token_bits(row.params.allowed_token_ids, vocab_size)
    return md.replace(penalties=md.penalties.replace(token_ids=token_ids), bad_words=bad_words,
                      allowed_token_bits=allowed)


def dummy_sampling_metadata(num_seqs_padded: int, max_model_len: int | None = None, *,
                            vocab_size: int = 0, slot_rows: bool = True) -> SamplingMetadata:
    """All-padding metadata of bucket S: greedy rows with every knob off, so they never
    produce NaN or errors. With max_model_len, the penalty history is a zero [S, L] array.
    vocab_size: the width of the allowed-token bit sets (0: none). slot_rows=False leaves
    bad_words and allowed_token_bits None (the runner's step fills them on the device)."""
    s = num_seqs_padded
    penalties = PenaltyMetadata(
        presence_penalty=np.zeros(s, np.float32),
        frequency_penalty=np.zeros(s, np.float32),
        repetition_penalty=np.ones(s, np.float32),
        prompt_lens=np.zeros(s, np.int32),
        seq_lens=np.zeros(s, np.int32),
        token_ids=None if max_model_len is None else np.zeros((s, max_model_len), np.int32),
    )
    return SamplingMetadata(
        temperature=np.zeros(s, np.float32),
        top_k=np.zeros(s, np.int32),
        top_p=np.ones(s, np.float32),
        min_p=np.zeros(s, np.float32),
        seeds=np.zeros((s, 2), np.uint32),
        steps=np.zeros(s, np.int32),
        min_tokens_stop_ids=np.full((s, MAX_MIN_TOKENS_STOP_IDS), NO_TOKEN, np.int32),
        num_logprobs=np.full(s, -1, np.int32),
        penalties=penalties,
        bad_words=(np.full((s, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), NO_TOKEN, np.int32)
                   if slot_rows else None),
        allowed_token_bits=(np.full((s, -(-vocab_size // 32)), 0xFFFFFFFF, np.uint32)
                            if slot_rows else None),
    )
