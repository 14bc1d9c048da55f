"""A body's prompt tokenized as it asks: `add_special_tokens`, `truncate_prompt_tokens`,
`truncation_side` (vLLM's rules), and the prompt's text for `echo`.

Owns the tokenization options the processor's own defaults do not cover (a completion's text
tokenized without BOS, a chat's with it, a prompt cut to its last or first N tokens) and
runs on the engine's input thread (`AsyncLLM.offload`), never on the event loop. Length and
vocabulary checks stay the processor's, which sees the tokens this makes.

    truncate_prompt_tokens   None: no cut; N: keep N tokens; -1: keep max_model_len - 1
                             (a token of room for the output); more than max_model_len: 400
    truncation_side          "left" (the default, vLLM's tokenizers'): keep the last N;
                             "right": keep the first N
"""

from __future__ import annotations

from jaxllm.engine.processor import PromptInput, Processor
from jaxllm.value_ranges import ParameterError

DEFAULT_TRUNCATION_SIDE = "left"


def check_truncation(truncate: int | None, max_model_len: int) -> None:
    if truncate is not None and truncate > max_model_len:
        raise ParameterError(f"truncate_prompt_tokens={truncate} cannot be greater than "
                             f"max_model_len = {max_model_len}. Please request a smaller "
                             "truncation size.", "truncate_prompt_tokens")


def truncated(token_ids: list[int], truncate: int | None, side: str | None,
              max_model_len: int) -> list[int]:
    n = max_model_len - 1 if truncate == -1 else truncate
    if n is None or n >= len(token_ids):
        return token_ids
    if n == 0:
        return []
    return token_ids[-n:] if (side or DEFAULT_TRUNCATION_SIDE) == "left" else token_ids[:n]


def tokenized(processor: Processor, prompt: PromptInput, *, add_special_tokens: bool,
              truncate: int | None, side: str | None, with_text: bool) -> PromptInput:
    """The prompt with its token ids (and, with_text, its text: a token prompt's decoded
    ids, for echo). A truncated prompt's text is the text of the tokens kept."""
    ids = prompt.token_ids
    if ids is None:
        text = prompt.text
        if truncate is None:
            processor.check_text_length(text)
        elif len(text) > processor.max_prompt_chars:  # more than can be kept: cut first
            limit = processor.max_prompt_chars
            text = text[-limit:] if (side or DEFAULT_TRUNCATION_SIDE) == "left" else text[:limit]
        ids = processor.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    kept = truncated(list(ids), truncate, side, processor.max_model_len)
    text = prompt.text
    if (with_text and text is None) or len(kept) != len(ids):
        text = processor.tokenizer.decode(kept)
    return PromptInput(text, kept)
