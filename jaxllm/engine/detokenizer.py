"""Incremental detokenization and stop strings, one object per request.

Owns the text of one completion. Never decides anything else about the request: `update`
reports a matched stop string and the caller sets `stop_reason` and finishes the request.
Pure Python (no jax), like the rest of jaxllm/engine.

Incremental decoding keeps two offsets into the token list (vLLM's approach):

    ids:   [ ...context... | already emitted .... | not yet emitted ]
                           ^prefix_offset         ^read_offset
    prefix_text = decode(ids[prefix:read]); new_text = decode(ids[prefix:])

new_text[len(prefix_text):] is emitted once it does not end in U+FFFD, i.e. once the bytes of a
multi-token character are complete; decoding from `prefix` rather than `read` gives the decoder
the left context it needs (sentencepiece drops a leading space at the start of a decode).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxllm.sampling_params import SamplingParams

# Prompt tokens decoded as left context before the first output token (vLLM uses 5 too).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of one completion, grown token by token.

    output_text: the whole text, exact at the end: equal to decoding all output tokens, except
    that it stops at a stop string (kept only with include_stop_str_in_output). While running,
    a character still missing bytes shows as U+FFFD at its end; `get_next_output_text` never
    shows it.
    """

    def __init__(self, tokenizer, params: SamplingParams, prompt_token_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.detokenize = params.detokenize
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces_between_special_tokens = params.spaces_between_special_tokens
        self.stop: list[str] = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.stop_buffer_length = params.output_text_buffer_length
        self.output_token_ids: list[int] = []
        self.stop_string: str | None = None

        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids) if self.detokenize else ""
        if self._prefix_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: its bytes would merge with ours. No context.
            self._ids, self._read_offset, self._prefix_text = [], 0, ""
        self._stable_text = ""  # emitted text: complete characters only
        self._last_output_offset = 0

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append new tokens; return the stop string they completed, or None.

        After a stop string the text is final and later tokens are ignored.
        """
        if self.stop_string is not None:
            return None
        if not self.detokenize:
            self.output_token_ids.extend(new_token_ids)
            return None
        # Text of tokens still inside min_tokens may not end a request: when several tokens
        # arrive at once, the stop check starts after the min_tokens-th token's text.
        check_from = len(self._stable_text)
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            self._ids.append(token_id)
            self._stable_text += self._decode_next()
            if len(self.output_token_ids) <= self.min_tokens:
                check_from = len(self._stable_text)
        if self.stop and len(self.output_token_ids) > self.min_tokens:
            self._check_stop_strings(len(self._stable_text) - check_from)
        return self.stop_string

    @property
    def output_text(self) -> str:
        if self.stop_string is not None or not self.detokenize:
            return self._stable_text
        pending = self._decode(self._ids[self._prefix_offset:])[len(self._prefix_text):]
        return self._stable_text + pending

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text for a streaming caller: while running, never an incomplete character and never
        the last `len(longest stop) - 1` characters (they may turn out to start a stop string).
        delta=True returns only what is new since the previous delta call."""
        text = self.output_text if finished else self._stable_text
        if not finished and self.stop_buffer_length:
            text = text[:max(0, len(text) - self.stop_buffer_length)]
        if not delta:
            return text
        new = text[self._last_output_offset:]
        self._last_output_offset = max(self._last_output_offset, len(text))
        return new

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False)

    def _decode_next(self) -> str:
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing visible yet, or a character still missing bytes
        emitted = new_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        return emitted

    def _check_stop_strings(self, num_new_chars: int) -> None:
        """Find the earliest stop string ending inside the new text, and cut the text there."""
        text = self._stable_text
        best: tuple[int, str] | None = None
        for stop in self.stop:
            # An occurrence must end in the new characters: older ones were checked already.
            start = max(0, len(text) - num_new_chars - len(stop) + 1)
            index = text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return
        index, self.stop_string = best
        end = index + len(self.stop_string) if self.include_stop_str_in_output else index
        self._stable_text = text[:end]
