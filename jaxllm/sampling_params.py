"""User-facing sampling parameters, with vLLM's names, defaults and validation.

This module owns what a user may ask for and the checks on it. It must never touch devices or
tokenizers: turning parameters into arrays is `jaxllm/runner/sampling_metadata.py`'s job.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Any

from jaxllm.structured_outputs import StructuredOutputsParams
from jaxllm.unicode_text import check_text
from jaxllm.value_ranges import (FLOAT32_MAX, FLOAT32_MIN_POSITIVE, INT32_MAX, INT64_MAX,
                                 INT64_MIN, ParameterError, Range)

# Temperatures below this mean greedy decoding (vLLM's `_SAMPLING_EPS`). Unlike vLLM we do not
# raise temperatures in [1e-5, 1e-2) to 1e-2: our sampler works on logits / T with max-shifted
# softmaxes and comparisons only, which stay finite for any T >= 1e-5.
SAMPLING_EPS = 1e-5
# vLLM's default `max_logprobs`: the most logprobs (sample or prompt) one request may ask for.
# The engine's `max_logprobs` sets the sampler's static top-k width (-1: the whole vocabulary).
MAX_LOGPROBS = 20
# What returned logprobs hold (vLLM's `logprobs_mode`, an engine setting; see runner/sampler.py).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


# The most tokens one request's logit_bias may hold (vLLM's MAX_NUM_LOGIT_BIAS_TOKENS): the
# width of its per-slot device table (runner/features/logit_bias.py).
MAX_LOGIT_BIAS_TOKENS = 1024


def _logit_bias(bias: dict) -> dict[int, float]:
    """Keys as token ids (ints or numeric strings), biases clamped to [-100, 100]."""
    out, bad = {}, []
    for token, value in bias.items():
        try:
            token_id = int(token) if not isinstance(token, (bool, float)) else None
        except (TypeError, ValueError):
            token_id = None
        if token_id is None:
            bad.append(token)
            continue
        if not _is_real(value) or value != value:  # NaN
            raise ParameterError(f"logit_bias values must be numbers, got {value!r:.40} for "
                                 f"token {token!r:.40}.", "logit_bias")
        out[token_id] = float(min(100.0, max(-100.0, value)))  # an int of any size
    if bad:
        raise ParameterError("logit_bias contains key(s) that cannot be converted to integer "
                             f"token IDs: {bad!r:.200}", "logit_bias")
    return out


class RequestOutputKind(enum.Enum):
    """What each output of a request carries (vLLM's names).

    CUMULATIVE: everything so far, on every step; DELTA: only what is new since the previous
    output (their concatenation is the final output); FINAL_ONLY: one output, at the end
    (what `LLM.generate` uses)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# Each number's allowed values, as stored in the step (jaxllm/value_ranges.py): the float
# knobs are float32, so temperature and repetition_penalty stop at float32's largest value,
# and a repetition_penalty that float32 rounds to 0 would divide by zero. top_p keeps vLLM's
# (0, 1]; one that float32 rounds to 0 still keeps the top token (runner/sampler.py). Token
# counts are int32. top_k may be any size: the sampler treats k >= vocabulary as off.
_RANGES = {
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(FLOAT32_MIN_POSITIVE, FLOAT32_MAX),
    "temperature": Range(0.0, FLOAT32_MAX),
    "top_p": Range(0.0, 1.0, low_open=True),
    "min_p": Range(0.0, 1.0),
    "max_tokens": Range(1, INT32_MAX),
    "min_tokens": Range(0, INT32_MAX),
}
# Seeds are kept in 64 bits; vLLM's server takes int64 seeds.
_SEED_RANGE = Range(INT64_MIN, INT64_MAX)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request's continuation.

    top_k convention: 0 disables it (vLLM's current convention); -1 is also accepted as "disabled"
    for compatibility with older vLLM and is normalised to 0; any k >= 1 keeps the k most likely
    tokens.
    """

    n: int = 1
    presence_penalty: float = 0.0  # over generated tokens; in [-2, 2]
    frequency_penalty: float = 0.0  # over generated tokens; in [-2, 2]
    repetition_penalty: float = 1.0  # over prompt + generated tokens; > 0, 1 = off
    temperature: float = 1.0  # >= 0; below SAMPLING_EPS means greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 (or -1) = off, else >= 1
    min_p: float = 0.0  # in [0, 1], relative to the most likely token's probability
    seed: int | None = None
    stop: str | list[str] | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None  # normalised to a list without duplicates
    ignore_eos: bool = False
    # vLLM's default: code written for vLLM generates here what it did there (short: pass
    # max_tokens for longer outputs). The server uses 16 for completions too, and the rest of
    # the context for chat, as vLLM's does.
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    # top-k logprobs per generated token (+ the sampled one); -1 = the whole vocabulary. What
    # they are (raw or processed logprobs or logits) is the engine's `logprobs_mode`.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top-k raw logprobs per prompt token (+ the actual one)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Words never generated: each is tokenized at admission without and with a leading space,
    # and a sequence's last token is banned whenever the output ends with the rest of it.
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None  # only these ids may be sampled (non-empty)
    # token id -> a bias added to its logit before sampling (vLLM's; keys may be numeric
    # strings, as on the wire; each bias is clamped to [-100, 100], as vLLM clamps it)
    logit_bias: dict[int, float] | None = None
    # Accepted for vLLM compatibility and refused at admission, as vLLM v1 refuses them:
    # per-request logits processors (arbitrary Python on the logits) and best_of.
    logits_processors: list | None = None
    best_of: int | None = None
    # vLLM's field for arguments its own sampler does not read; jaxllm reads "capture" and
    # "steer" (jaxllm.research: activation capture and steering) and ignores other keys.
    extra_args: dict[str, Any] | None = None
    # Constrain the output to a JSON schema, regex, choice or grammar (vLLM's field; a dict
    # of StructuredOutputsParams' fields is accepted too).
    structured_outputs: StructuredOutputsParams | None = None
    # bad_words as token sequences, filled by the processor at admission (it owns the
    # tokenizer); None until then.
    _bad_words_token_ids: list[list[int]] | None = dataclasses.field(
        default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._normalize()
        self._verify_args()
        if self.temperature < SAMPLING_EPS:
            # Greedy: the truncation knobs cannot change an argmax, so turn them off to keep the
            # batch on the cheapest sampler path.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")

    def _normalize(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        elif self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.seed == -1:  # vLLM treats seed=-1 as "no seed"
            self.seed = None
        if self.top_k == -1:
            self.top_k = 0
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words)
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = _logit_bias(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)

    def _verify_args(self) -> None:
        """Types first (a float where an int is meant, a bool or a string where a number is
        meant), then ranges; every message names the parameter."""
        for name in ("n", "top_k", "max_tokens", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an int, got "
                                 f"{type(getattr(self, name)).__name__}.")
        for name in ("seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ValueError(f"{name} must be an int or None, got {type(value).__name__}.")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                     "temperature", "top_p", "min_p"):
            if not _is_real(getattr(self, name)):
                raise ValueError(f"{name} must be a number, got "
                                 f"{type(getattr(self, name)).__name__}.")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got "
                                 f"{type(getattr(self, name)).__name__}.")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        for name, allowed in _RANGES.items():
            allowed.check(name, getattr(self, name))
        if self.seed is not None:
            _SEED_RANGE.check("seed", self.seed)
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled), or at least 1, got {self.top_k}.")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < -1:
                raise ValueError(f"{name} must be None, -1 (the whole vocabulary) or >= 0, "
                                 f"got {value}.")
        if not isinstance(self.stop_token_ids, list) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must contain only non-negative ints, "
                             f"got {self.stop_token_ids}.")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s
                                                  for s in self.stop):
            raise ValueError(f"stop must contain only non-empty strings, got {self.stop}.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True.")
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise ValueError("bad_words must be a list of non-blank strings, got "
                             f"{self.bad_words!r:.80}.")
        for name in ("stop", "bad_words"):  # bad words are tokenized at admission
            for text in getattr(self, name) or []:
                check_text(text, name)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not all(
                    _is_int(t) and t >= 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be a list of non-negative ints, got "
                                 f"{self.allowed_token_ids!r:.80}.")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is not None and empty!")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must be a dict of token id -> bias, got "
                             f"{type(self.logit_bias).__name__}.")
        if self.logit_bias is not None and len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} tokens, "
                             f"got {len(self.logit_bias)}.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, a dict of "
                             f"its fields or None, got {type(self.structured_outputs).__name__}.")
        if self.structured_outputs is not None:
            self.structured_outputs.__post_init__()  # again: its fields may have changed
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError("output_kind must be a RequestOutputKind, got "
                             f"{self.output_kind!r}.")

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        return self._bad_words_token_ids

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def output_text_buffer_length(self) -> int:
        """Characters a streaming caller must hold back so that a stop string is never shown."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0

    def clone(self) -> SamplingParams:
        """A deep copy, so that engine-side edits never leak into the user's object."""
        return copy.deepcopy(self)

    def checked_clone(self) -> SamplingParams:
        """A deep copy, normalised and validated again: users mutate params after
        construction (`sp.n = 0`), and a request must be admitted on what it holds now."""
        params = self.clone()
        params.__post_init__()
        return params
