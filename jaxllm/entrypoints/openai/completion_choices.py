"""The choices of a /v1/completions response, whole or streamed, from the engine's outputs.

Owns what a choice carries beyond its text (vLLM's rules): `echo` (the prompt's text, token
ids and prompt logprobs before the output's; with max_tokens 0, the prompt alone),
`return_token_ids` (`prompt_token_ids` and `token_ids`, null in a whole choice that did not
ask, as vLLM's; in a stream, the prompt's ids on a choice's first chunk only),
`prompt_logprobs`, `return_tokens_as_token_ids`, and the streamed `text_offset`s. Never
touches the engine or HTTP (serving.py does).

    echo, whole:    text = prompt text + output text          (return_token_ids: "" + ...)
                    logprobs over prompt ids + output ids; the prompt's first token has
                    token_logprob None and top_logprobs None (nothing predicts it)
    echo, stream:   the choice's first chunk carries the prompt before its first delta
"""

from __future__ import annotations

import dataclasses

from jaxllm.entrypoints.openai.logprobs_format import (completion_logprobs,
                                                       next_text_offset, prompt_logprobs_json)
from jaxllm.entrypoints.openai.protocol import CompletionRequest
from jaxllm.outputs import CompletionOutput, RequestOutput


@dataclasses.dataclass(frozen=True)
class CompletionShape:
    """What a request asks its choices to hold. k: top logprobs (None: no logprobs);
    echo_only: echo with max_tokens 0 (the engine still generates one token, dropped)."""

    k: int | None
    echo: bool
    echo_only: bool
    token_ids: bool
    as_ids: bool

    @classmethod
    def of(cls, req: CompletionRequest, server_as_ids: bool) -> "CompletionShape":
        as_ids = (req.return_tokens_as_token_ids if req.return_tokens_as_token_ids
                  is not None else server_as_ids)
        return cls(req.logprobs, bool(req.echo), bool(req.echo) and req.max_tokens == 0,
                   bool(req.return_token_ids), as_ids)

    def prompt_logprobs(self, req: CompletionRequest) -> int | None:
        """The engine's prompt_logprobs: the body's, else echo's (its logprobs)."""
        if req.prompt_logprobs is not None:
            return req.prompt_logprobs
        return self.k if self.echo else None


def _echoed(shape: CompletionShape, out: RequestOutput, c: CompletionOutput,
            prompt_text: str) -> tuple[str, list[int], list | None]:
    """(text, token ids, logprob entries) of a choice's first (or only) part."""
    if not shape.echo:
        return c.text, list(c.token_ids), c.logprobs
    text = "" if shape.token_ids else prompt_text
    prompt_entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    if shape.echo_only:
        return text, list(out.prompt_token_ids), prompt_entries
    entries = None if c.logprobs is None else [*prompt_entries, *c.logprobs]
    return text + c.text, [*out.prompt_token_ids, *c.token_ids], entries


def whole_choice(shape: CompletionShape, index: int, out: RequestOutput,
                 c: CompletionOutput, prompt_text: str, decode) -> dict:
    """One non-streamed choice. prompt_text: the prompt as text (echo); decode: token id
    -> text, for the prompt's first token, which has no logprob entry."""
    text, token_ids, entries = _echoed(shape, out, c, prompt_text)
    choice = {"index": index, "text": text, "logprobs": None,
              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
              "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)}
    if shape.k is not None and entries is not None:
        choice["logprobs"] = completion_logprobs(token_ids, entries, shape.k, 0,
                                                 shape.as_ids, decode)
    # null unless asked for: vLLM's non-streamed response states every field it has
    choice["prompt_token_ids"] = list(out.prompt_token_ids) if shape.token_ids else None
    choice["token_ids"] = (([] if shape.echo_only else list(c.token_ids)) if shape.token_ids
                           else None)
    return choice


class StreamedChoices:
    """The state of a stream's choices: the next text_offset of each, and whether its prompt
    was sent (echo, return_token_ids)."""

    def __init__(self, shape: CompletionShape, decode):
        self.shape, self.decode = shape, decode
        self.offsets: dict[int, int] = {}
        self.started: set[int] = set()
        self.num_tokens: dict[int, int] = {}

    def chunk_choice(self, index: int, out: RequestOutput, c: CompletionOutput,
                     prompt_text: str) -> dict | None:
        """The choice of one delta; None when it shows nothing yet (held-back text)."""
        shape, first = self.shape, index not in self.started
        self.num_tokens[index] = self.num_tokens.get(index, 0) + len(c.token_ids)
        if first and shape.echo:
            text, token_ids, entries = _echoed(shape, out, c, prompt_text)
        else:
            if shape.echo_only:
                return None  # the one token generated for echo with max_tokens 0
            text, token_ids, entries = c.text, list(c.token_ids), c.logprobs
            if not text and not token_ids and c.finish_reason is None:
                return None  # nothing new (vLLM sends a chunk for tokens whose text is
                # held back, with text "")
        choice = {"index": index, "text": text, "logprobs": None,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if shape.k is not None and entries is not None:
            offset = self.offsets.get(index, 0)
            lp = completion_logprobs(token_ids, entries, shape.k, offset, shape.as_ids,
                                     self.decode)
            self.offsets[index] = next_text_offset(lp, offset)
            choice["logprobs"] = lp
        if shape.token_ids:
            if first:
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
            choice["token_ids"] = ([] if shape.echo_only else list(c.token_ids))
        self.started.add(index)
        return choice
