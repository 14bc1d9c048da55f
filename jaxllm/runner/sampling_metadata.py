"""Host side of sampling: per-request parameters -> one padded `SamplingMetadata` per step.

Owns: which jitted sampler variant a batch needs, and the numpy arrays (padded to the sequence
bucket S) it reads. Never touches a device and never does sampling math: that is `sampler.py`.

Every shape is a bucket constant: S (sequence bucket), W = MAX_MIN_TOKENS_STOP_IDS,
L = max_model_len (penalty window). So a variant compiled once per S at start-up never
recompiles.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Sequence

import flax.struct
import numpy as np

from jaxllm.sampling_params import SAMPLING_EPS, SamplingParams

# Width of the per-row list of token ids banned while a request is below `min_tokens`
# (its EOS ids + stop_token_ids). A fixed width keeps one compiled shape per bucket.
MAX_MIN_TOKENS_STOP_IDS = 32
# Out of range for any vocabulary: scatters drop it. (-1 would wrap to the last token.)
NO_TOKEN = np.iinfo(np.int32).max


class SampleMode(enum.IntEnum):
    GREEDY = 0  # every row greedy: argmax only, no randomness
    RANDOM = 1  # some row random; no row uses top_k/top_p (no sort)
    RANDOM_TOP_K_TOP_P = 2  # some row uses top_k or top_p: one sort over V per row


@dataclasses.dataclass(frozen=True)
class SamplerVariant:
    """The static choices of the jitted sampler; one compiled program per (bucket, variant)."""

    mode: SampleMode = SampleMode.GREEDY
    do_penalties: bool = False  # some row has presence/frequency/repetition penalties
    do_logprobs: bool = False  # some row asked for logprobs (top-MAX_LOGPROBS raw logprobs)


def sampler_variants() -> list[SamplerVariant]:
    """Every variant, for start-up precompilation (3 modes x 2 x 2 = 12)."""
    return [SamplerVariant(mode, penalties, logprobs) for mode, penalties, logprobs
            in itertools.product(SampleMode, (False, True), (False, True))]


@flax.struct.dataclass
class PenaltyMetadata:
    presence_penalty: np.ndarray  # [S] float32, 0 = off (also padding)
    frequency_penalty: np.ndarray  # [S] float32, 0 = off
    repetition_penalty: np.ndarray  # [S] float32, 1 = off
    token_ids: np.ndarray  # [S, L] int32, prompt ids then output ids so far, 0 past seq_lens
    prompt_lens: np.ndarray  # [S] int32, token_ids[s, :prompt_lens[s]] is the prompt
    seq_lens: np.ndarray  # [S] int32, prompt + output so far; 0 for rows without penalties


@flax.struct.dataclass
class SamplingMetadata:
    temperature: np.ndarray  # [S] float32, 0 = greedy (also padding rows)
    top_k: np.ndarray  # [S] int32, 0 = off
    top_p: np.ndarray  # [S] float32, 1 = off
    min_p: np.ndarray  # [S] float32, 0 = off
    seeds: np.ndarray  # [S, 2] uint32, threefry key words (hi, lo) of each row's 64-bit seed
    steps: np.ndarray  # [S] int32, output tokens the row already has (folded into its key)
    min_tokens_stop_ids: np.ndarray  # [S, W] int32, ids masked to -inf this step; NO_TOKEN pads
    penalties: PenaltyMetadata | None  # present iff variant.do_penalties
    variant: SamplerVariant = flax.struct.field(pytree_node=False, default=SamplerVariant())


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    """What the builder needs about one request being sampled this step."""

    params: SamplingParams
    seed: int  # params.seed if set, else request_seed(engine_seed, request_index)
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


def request_seed(engine_seed: int, request_index: int) -> int:
    """A 64-bit seed for a request without its own, reproducible from the engine seed and the
    request's arrival index (so the whole run is reproducible, whatever the batching)."""
    entropy = (engine_seed % 2**64, request_index % 2**64)
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0])


def select_variant(params: Sequence[SamplingParams]) -> SamplerVariant:
    if all(p.temperature < SAMPLING_EPS for p in params):
        mode = SampleMode.GREEDY
    elif any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        mode = SampleMode.RANDOM_TOP_K_TOP_P
    else:
        mode = SampleMode.RANDOM
    return SamplerVariant(mode=mode, do_penalties=any(p.uses_penalties for p in params),
                          do_logprobs=any(p.logprobs is not None for p in params))


def build_sampling_metadata(rows: Sequence[SamplingRow], *, num_seqs_padded: int,
                            eos_token_ids: Sequence[int], max_model_len: int,
                            variant: SamplerVariant | None = None) -> SamplingMetadata:
    """Pad `rows` to `num_seqs_padded` (the S bucket) and pick the cheapest variant.

    eos_token_ids: the model's EOS ids, banned (with stop_token_ids) while a row is below its
    min_tokens, even with ignore_eos, as vLLM does.
    max_model_len: the penalty window L (prompt + output never exceeds it).
    variant: force a variant (must cover the rows' needs); default is the cheapest that does.
    """
    num_rows = len(rows)
    if num_rows > num_seqs_padded:
        raise ValueError(f"{num_rows} rows do not fit the bucket num_seqs_padded="
                         f"{num_seqs_padded}.")
    if variant is None:
        variant = select_variant([row.params for row in rows])
    md = dummy_sampling_metadata(num_seqs_padded, variant, max_model_len=max_model_len)
    for i, row in enumerate(rows):
        p = row.params
        md.temperature[i] = p.temperature
        md.top_k[i] = p.top_k
        md.top_p[i] = p.top_p
        md.min_p[i] = p.min_p
        seed = row.seed % 2**64
        md.seeds[i] = (seed >> 32, seed & 0xFFFFFFFF)
        md.steps[i] = len(row.output_token_ids)
        if len(row.output_token_ids) < p.min_tokens:
            banned = list(dict.fromkeys([*eos_token_ids, *p.stop_token_ids]))
            if len(banned) > MAX_MIN_TOKENS_STOP_IDS:
                raise ValueError(f"min_tokens supports at most {MAX_MIN_TOKENS_STOP_IDS} EOS + "
                                 f"stop_token_ids, got {len(banned)}.")
            md.min_tokens_stop_ids[i, :len(banned)] = banned
        if p.uses_penalties:
            _fill_penalty_row(md.penalties, i, row, max_model_len)
    return md


def _fill_penalty_row(pen: PenaltyMetadata | None, i: int, row: SamplingRow,
                      max_model_len: int) -> None:
    if pen is None:
        raise ValueError("a row uses penalties but the forced variant has do_penalties=False.")
    p = row.params
    num_prompt, num_output = len(row.prompt_token_ids), len(row.output_token_ids)
    if num_prompt + num_output > max_model_len:
        raise ValueError(f"prompt + output ({num_prompt + num_output} tokens) exceeds "
                         f"max_model_len={max_model_len}.")
    pen.presence_penalty[i] = p.presence_penalty
    pen.frequency_penalty[i] = p.frequency_penalty
    pen.repetition_penalty[i] = p.repetition_penalty
    pen.token_ids[i, :num_prompt] = row.prompt_token_ids
    pen.token_ids[i, num_prompt:num_prompt + num_output] = row.output_token_ids
    pen.prompt_lens[i] = num_prompt
    pen.seq_lens[i] = num_prompt + num_output


def dummy_sampling_metadata(num_seqs_padded: int, variant: SamplerVariant, *,
                            max_model_len: int) -> SamplingMetadata:
    """All-padding metadata of bucket S for `variant`: the builder's starting point, and the
    input for precompiling (bucket, variant) at start-up. Padding rows are greedy, with every
    knob off, so they never produce NaN or errors."""
    s = num_seqs_padded
    penalties = None
    if variant.do_penalties:
        penalties = PenaltyMetadata(
            presence_penalty=np.zeros(s, np.float32),
            frequency_penalty=np.zeros(s, np.float32),
            repetition_penalty=np.ones(s, np.float32),
            token_ids=np.zeros((s, max_model_len), np.int32),
            prompt_lens=np.zeros(s, np.int32),
            seq_lens=np.zeros(s, np.int32),
        )
    return SamplingMetadata(
        temperature=np.zeros(s, np.float32),
        top_k=np.zeros(s, np.int32),
        top_p=np.ones(s, np.float32),
        min_p=np.zeros(s, np.float32),
        seeds=np.zeros((s, 2), np.uint32),
        steps=np.zeros(s, np.int32),
        min_tokens_stop_ids=np.full((s, MAX_MIN_TOKENS_STOP_IDS), NO_TOKEN, np.int32),
        penalties=penalties,
        variant=variant,
    )
