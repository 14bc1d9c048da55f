"""What `LLM.generate` hands back to the user (vLLM's names and field order).

Plain containers only: no tokenizer, no device arrays. The engine fills them; users read them.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Logprob:
    """One token's log-probability.

    logprob: by default the raw log-softmax of the model's logits (before penalties and
        temperature); the engine's `logprobs_mode` may make it processed, or a logit.
    rank: 1 for the most likely token of the vocabulary, 2 for the next, ...
    decoded_token: the token's text, or None when detokenization is off.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the top-k, plus the sampled token).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing predicts the first token).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclasses.dataclass
class CompletionOutput:
    """One of the `n` completions of a request.

    finish_reason: "stop" (EOS, a stop token or a stop string), "length" (max_tokens or the
    context length) or "abort"; None while running.
    stop_reason: the stop string or stop token id that ended the completion; None for EOS and
    every other reason.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # jaxllm.research.Activations when the request captured (extra_args["capture"]): every
    # position computed so far, cumulative whatever the output kind; None otherwise
    activations: Any | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, "
                f"token_ids={self.token_ids}, cumulative_logprob={self.cumulative_logprob}, "
                f"logprobs={self.logprobs}, finish_reason={self.finish_reason}, "
                f"stop_reason={self.stop_reason})")


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock timestamps (seconds, `time.time()`) of a request's life; None until reached."""

    arrival_time: float
    first_scheduled_time: float | None = None  # when the scheduler first gave it tokens
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclasses.dataclass
class RequestOutput:
    """Everything about one request: its prompt and its `n` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, "
                f"prompt_logprobs={self.prompt_logprobs}, outputs={self.outputs}, "
                f"finished={self.finished}, metrics={self.metrics}, "
                f"num_cached_tokens={self.num_cached_tokens})")
