"""Input processing: what users pass -> validated, tokenized `EngineCoreRequest`s.

Owns the prompt forms (a string, a {"prompt"} or {"prompt_token_ids"} dict, the older
`prompt_token_ids=` keyword), chat templates (the messages they read are
chat_messages.py's), every
admission check (types and ranges, vocabulary, lengths, the engine's caps), and the `n`
fan-out into child requests with their seeds. Shared by `LLM`, `LLMEngine` and the async
front ends. Never schedules, never touches a device: everything it rejects is rejected
before anything is queued.

Text is measured before it is tokenized: no token of the vocabulary spells more than
`longest_token_chars` characters (a byte-level vocabulary spells each byte as one character,
and a character is at least one byte), so a text longer than max_model_len times that cannot
fit the model and is refused at the cost of one len(), instead of seconds of tokenizing.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import time
from collections.abc import Sequence
from typing import Any

from jaxllm.engine.chat_messages import chat_messages
from jaxllm.engine.request_ids import child_request_ids
from jaxllm.engine.structured_output import check_grammar
from jaxllm.messages import EngineCoreRequest
from jaxllm.research.requests import ResearchLimits
from jaxllm.sampling_limits import (MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, banned_until_min_tokens,
                                    request_seed)
from jaxllm.sampling_params import RequestOutputKind, SamplingParams
from jaxllm.unicode_text import check_json_text, check_text
from jaxllm.value_ranges import ParameterError

@dataclasses.dataclass(frozen=True)
class PromptInput:
    """One prompt as the user gave it: text, token ids, or both."""

    text: str | None
    token_ids: list[int] | None


@dataclasses.dataclass(frozen=True)
class ProcessedRequest:
    """A validated request before its ids and seeds are drawn (so a rejected batch draws
    none)."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # the checked copy; the user's object is never touched
    priority: int = 0  # shared by all `n` children


@dataclasses.dataclass(frozen=True)
class FanOut:
    """A request as the user sees it, with its `n` children (ids `"{index}_{request_id}"`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[EngineCoreRequest]


def parse_prompts(prompts, prompt_token_ids=None) -> list[PromptInput]:
    if prompts is None and prompt_token_ids is None:
        raise ValueError("Either prompts or prompt_token_ids must be provided")
    if prompts is None:
        return [PromptInput(None, _token_list(ids, "prompt_token_ids"))
                for ids in _as_list(prompt_token_ids, "prompt_token_ids")]
    if prompt_token_ids is not None:
        raise ValueError("Pass either prompts or prompt_token_ids, not both")
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    return [parse_prompt(p) for p in _as_list(prompts, "prompts")]


def parse_prompt(prompt) -> PromptInput:
    if isinstance(prompt, str):
        return PromptInput(prompt, None)
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"prompt must be a str, got {type(text).__name__}")
        return PromptInput(text, _token_list(prompt["prompt_token_ids"], "prompt_token_ids"))
    if isinstance(prompt, dict) and "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"prompt must be a str, got {type(prompt['prompt']).__name__}")
        return PromptInput(prompt["prompt"], None)
    raise ValueError("each prompt must be a str, or a dict with 'prompt' or "
                     f"'prompt_token_ids'; got {type(prompt).__name__}")


def broadcast_params(sampling_params, num_prompts: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if isinstance(sampling_params, (str, bytes, dict)) or not isinstance(
            sampling_params, Sequence):
        raise ValueError("sampling_params must be a SamplingParams or a list of them, got "
                         f"{type(sampling_params).__name__}")
    params = list(sampling_params)
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got "
                             f"{type(p).__name__}")
    if len(params) != num_prompts:
        raise ValueError(f"The lengths of prompts ({num_prompts}) and sampling_params "
                         f"({len(params)}) must be the same.")
    return params


def _as_list(value, name: str) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list, got {type(value).__name__}")
    return list(value)


def _token_list(ids, name: str) -> list[int]:
    ids = _as_list(ids, name)
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            # numpy integers are ints too, as far as users are concerned
            if type(t).__module__ == "numpy" and hasattr(t, "dtype") and t.dtype.kind in "iu":
                continue
            raise ValueError(f"{name} must contain only ints; got {type(t).__name__} "
                             f"{t!r:.40} at index {i}")
    return [int(t) for t in ids]


def longest_token_chars(tokenizer) -> int:
    """Characters in the longest spelling of a token in the tokenizer's vocabulary (added and
    special tokens included): no token covers more characters of a text than this."""
    return max(map(len, tokenizer.get_vocab()), default=1)


class Processor:
    """Validation, tokenization and fan-out for one engine (its tokenizer and limits)."""

    def __init__(self, tokenizer, *, vocab_size: int, max_model_len: int, max_logprobs: int,
                 eos_token_id: int | None, extra_eos_ids: Sequence[int], engine_seed: int,
                 scheduling_policy: str = "fcfs", max_n_sequences: int = 16384,
                 research: ResearchLimits | None = None):
        """max_n_sequences: the largest `n` a request may ask for (vLLM's
        VLLM_MAX_N_SEQUENCES, the engine argument `max_n_sequences` here). research: what
        the engine can capture and steer (None: nothing)."""
        self.research = research or ResearchLimits()
        self.tokenizer = tokenizer
        self.scheduling_policy = scheduling_policy
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_n_sequences = max_n_sequences
        self.max_token_chars = longest_token_chars(tokenizer)
        # Longer text cannot tokenize to max_model_len tokens or fewer.
        self.max_prompt_chars = max_model_len * self.max_token_chars
        self.max_logprobs = max_logprobs
        self.eos_token_id = eos_token_id
        self.extra_eos_ids = list(extra_eos_ids)
        self.eos_token_ids = [t for t in [eos_token_id, *extra_eos_ids] if t is not None]
        self.engine_seed = engine_seed
        self._seed_counter = itertools.count()

    # ---- prompts -------------------------------------------------------------------------

    def render_chat(self, conversations, chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict] | None = None) -> list[PromptInput]:
        """One conversation (a list of messages) or a list of them -> prompts.
        chat_template_kwargs: extra variables for the template (e.g. enable_thinking);
        tools: OpenAI's tool definitions, the template's `tools`."""
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError("chat_template_kwargs must be a dict, got "
                             f"{type(chat_template_kwargs).__name__}")
        if chat_template is not None:
            if not isinstance(chat_template, str):
                raise ValueError("chat_template must be a str, got "
                                 f"{type(chat_template).__name__}")
            check_text(chat_template, "chat_template")
        check_json_text(chat_template_kwargs, "chat_template_kwargs")
        if (isinstance(conversations, (list, tuple)) and conversations
                and isinstance(conversations[0], dict)):
            conversations = [conversations]
        conversations = [chat_messages(conv, i)
                         for i, conv in enumerate(_as_list(conversations, "messages"))]
        prompts = []
        for i, conv in enumerate(conversations):
            try:
                text = self.tokenizer.apply_chat_template(
                    conv, chat_template=chat_template, tools=tools,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    **(chat_template_kwargs or {}))
            except Exception as e:  # jinja errors and template-raised exceptions
                raise ValueError(f"the chat template failed on conversation {i}: "
                                 f"{type(e).__name__}: {e}") from e
            if not isinstance(text, str):  # e.g. chat_template_kwargs={"return_dict": ...}
                raise ValueError(f"the chat template gave a {type(text).__name__} for "
                                 f"conversation {i}, not text")
            prompts.append(self.chat_prompt(text, i))
        return prompts

    def chat_prompt(self, text: str, index: int = 0) -> PromptInput:
        """A rendered chat (conversation `index`) -> its prompt. The template already holds
        any BOS: tokenizing must not add a second one."""
        self.check_text_length(text, "rendered chat prompt")
        # A template can make what no message held ({{ '%c' % 55296 }}).
        check_text(text, f"the chat template's output for conversation {index}")
        return PromptInput(text, self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def check_text_length(self, text: str, what: str = "prompt") -> None:
        """Refuse, before tokenizing, a text too long to fit max_model_len tokens."""
        if len(text) > self.max_prompt_chars:
            raise ValueError(
                f"The {what} has {len(text)} characters; the limit is {self.max_prompt_chars} "
                f"(the maximum model length of {self.max_model_len} tokens times "
                f"{self.max_token_chars}, the most characters one token of this tokenizer "
                "spans), so it cannot fit and was refused without tokenizing it.")

    def process(self, prompt: PromptInput, params: SamplingParams,
                output_kind: RequestOutputKind | None = None, priority: int = 0
                ) -> ProcessedRequest:
        """Tokenize and check one request; raises ValueError naming what is wrong.
        output_kind: overrides the params' (LLM.generate asks for FINAL_ONLY)."""
        priority = self.check_priority(priority)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        ids = self.tokenize_prompt(prompt)
        self.check_prompt(ids)
        params = self.check_params(params)
        if output_kind is not None:
            params.output_kind = output_kind
        return ProcessedRequest(prompt.text, list(ids), params, priority)

    def tokenize_prompt(self, prompt: PromptInput) -> list[int]:
        """The prompt's token ids: its own, or its text's. The text is first measured (one
        too long to fit is refused without tokenizing it) and checked to be valid Unicode
        (the tokenizer raises TypeError on a lone surrogate)."""
        if prompt.token_ids is not None:
            return prompt.token_ids
        self.check_text_length(prompt.text)
        check_text(prompt.text, "prompt")
        return self.tokenizer(prompt.text)["input_ids"]

    def check_priority(self, priority) -> int:
        """An int; anything but 0 needs the "priority" scheduling policy (vLLM's check)."""
        if not isinstance(priority, numbers.Integral) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {type(priority).__name__}")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled "
                             f"(scheduling_policy={self.scheduling_policy!r}; use "
                             "scheduling_policy='priority').")
        return int(priority)

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("The decoder prompt cannot be empty")
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(prompt_token_ids)}) is longer than the "
                f"maximum model length of {self.max_model_len}.")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary: prompt_token_ids must "
                             f"be in [0, {self.vocab_size})")

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """The checked copy this request will run with."""
        if params.logits_processors:
            raise ValueError("logits_processors are not supported: per-request Python logits "
                             "processors cannot run inside the compiled step (vLLM v1 refuses "
                             "them too)")
        if params.best_of is not None and params.best_of != params.n:
            raise ValueError(f"best_of is not supported (got best_of={params.best_of}, "
                             f"n={params.n}); use n")
        params = params.checked_clone()
        if params.n > self.max_n_sequences:
            raise ParameterError(f"n must be at most {self.max_n_sequences} (the engine's "
                                 f"max_n_sequences), got {params.n}", "n")
        # -1 means the whole vocabulary, for a request and for the engine's cap (vLLM).
        cap = self.vocab_size if self.max_logprobs == -1 else self.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            k = self.vocab_size if k == -1 else k
            if k is not None and k > cap:
                raise ValueError(f"Requested {name} of {k}, which is greater than max allowed: "
                                 f"{cap}")
        for name in ("stop_token_ids", "allowed_token_ids"):
            bad = [t for t in getattr(params, name) or [] if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} must be in [0, {self.vocab_size}), got {bad[0]}")
        bad = [t for t in params.logit_bias or {} if not 0 <= t < self.vocab_size]
        if bad:
            raise ParameterError(f"token_id(s) {bad[:8]} in logit_bias contain out-of-vocab "
                                 f"token ids. Vocabulary size: {self.vocab_size}",
                                 "logit_bias")
        banned_until_min_tokens(params, self.eos_token_ids)  # raises past the sampler's width
        self.research.check(params)
        if params.structured_outputs is not None:
            check_grammar(params.structured_outputs)  # a bad schema fails here, alone
        if params.bad_words:
            params._bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        return params

    def bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """vLLM's `update_from_tokenizer`: each word (left-stripped) without and with a
        leading space, so it is banned at the start of the text and after a space; the
        spaced form only when it starts with another token and has as many tokens (else it
        is the same word split differently)."""
        # Refused before tokenizing: each word is one or two sequences of at least one
        # token, and a token spans at most max_token_chars characters.
        longest = MAX_BAD_WORD_TOKENS * self.max_token_chars
        if len(bad_words) > MAX_BAD_WORDS or any(len(w.lstrip()) > longest for w in bad_words):
            raise ValueError(f"bad_words supports at most {MAX_BAD_WORDS} token sequences "
                             f"of at most {MAX_BAD_WORD_TOKENS} tokens (at most {longest} "
                             f"characters; each word is one or two sequences), got "
                             f"{len(bad_words)} words, the longest of "
                             f"{max(len(w.lstrip()) for w in bad_words)} characters")
        sequences: list[list[int]] = []
        for word in bad_words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        if len(sequences) > MAX_BAD_WORDS or any(len(s) > MAX_BAD_WORD_TOKENS
                                                 for s in sequences):
            raise ValueError(f"bad_words supports at most {MAX_BAD_WORDS} token sequences of "
                             f"at most {MAX_BAD_WORD_TOKENS} tokens (each word counts once "
                             f"or twice: with and without a leading space), got "
                             f"{[len(s) for s in sequences]}")
        bad = [t for s in sequences for t in s if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"bad_words tokenize to ids outside [0, {self.vocab_size}): {bad}")
        return sequences

    # ---- ids, seeds and the n fan-out ------------------------------------------------------

    def fan_out(self, request: ProcessedRequest, request_id: str,
                arrival_time: float | None = None) -> FanOut:
        """Give each child its id and seed: call only once every request of a batch has
        passed `process` and its id is reserved (engine/request_ids.py)."""
        params = request.params
        now = arrival_time if arrival_time is not None else time.time()
        ids = child_request_ids(request_id, params.n)
        children = [EngineCoreRequest(child_id, request.prompt_token_ids,
                                      self._child_params(params, i), self.eos_token_id, now,
                                      request.priority)
                    for i, child_id in enumerate(ids)]
        return FanOut(request_id, request.prompt, request.prompt_token_ids, params, children)

    def _child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        p = params.clone()
        # Every sequence gets a concrete seed: its own (shifted per child, so n > 1 samples
        # differ) or one derived from the engine seed, so a whole run is reproducible.
        if params.seed is not None:
            p.seed = params.seed + index
        else:
            p.seed = request_seed(self.engine_seed, next(self._seed_counter))
        if not p.ignore_eos and self.extra_eos_ids:
            p.stop_token_ids = list(dict.fromkeys([*p.stop_token_ids, *self.extra_eos_ids]))
        return p
