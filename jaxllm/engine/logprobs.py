"""Per-request logprobs bookkeeping: the runner's `LogprobsLists` -> user-facing `Logprob` dicts.

Owns the cumulative logprob, sample logprobs and prompt logprobs of one request, built from
the runner's `LogprobsLists` (jaxllm/messages.py). Pure Python like the rest of jaxllm/engine:
never imports jax.
"""

from __future__ import annotations

from jaxllm.messages import LogprobsLists
from jaxllm.outputs import Logprob, PromptLogprobs, SampleLogprobs
from jaxllm.sampling_params import SamplingParams


def decode_tokens(tokenizer, token_ids: list[int]) -> list[str]:
    """Each id decoded on its own, special tokens kept (vLLM's `decoded_token`)."""
    return tokenizer.batch_decode([[t] for t in token_ids], skip_special_tokens=False,
                                  clean_up_tokenization_spaces=False)


def make_logprob_dicts(lists: LogprobsLists, tokenizer=None) -> list[dict[int, Logprob]]:
    """One dict per row: the selected token with its true rank, then the top-n (ranks 1..n).

    A selected token that is also in the top-n keeps one entry. tokenizer=None (detokenize off)
    leaves `decoded_token` None.
    """
    dicts = []
    for token_ids, logprobs, rank in zip(lists.logprob_token_ids, lists.logprobs,
                                         lists.sampled_token_ranks):
        decoded = decode_tokens(tokenizer, token_ids) if tokenizer is not None else None
        ranks = [rank, *range(1, len(token_ids))]
        dicts.append({
            token_id: Logprob(logprob=logprob, rank=r,
                              decoded_token=None if decoded is None else decoded[j])
            for j, (token_id, logprob, r) in enumerate(zip(token_ids, logprobs, ranks))
        })
    return dicts


class LogprobsProcessor:
    """Accumulates one request's logprobs across steps.

    logprobs: None unless the request asked for them; else one dict per generated token.
    prompt_logprobs: None unless asked; else None for the first prompt token (nothing predicts
    it), then one dict per prompt token, filled as prefill chunks arrive.
    cumulative_logprob: sum of the sampled tokens' raw logprobs; None unless logprobs were asked.
    """

    def __init__(self, params: SamplingParams, tokenizer=None):
        self.tokenizer = tokenizer if params.detokenize else None
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] if params.prompt_logprobs is not None else None)

    def add_sample_logprobs(self, lists: LogprobsLists) -> None:
        if self.logprobs is None:
            raise ValueError("this request did not ask for logprobs.")
        self.logprobs.extend(make_logprob_dicts(lists, self.tokenizer))
        self.cumulative_logprob += sum(row[0] for row in lists.logprobs)

    def add_prompt_logprobs(self, lists: LogprobsLists) -> None:
        """Rows for the next prompt positions (a prefill chunk), in order."""
        if self.prompt_logprobs is None:
            raise ValueError("this request did not ask for prompt_logprobs.")
        self.prompt_logprobs.extend(make_logprob_dicts(lists, self.tokenizer))
