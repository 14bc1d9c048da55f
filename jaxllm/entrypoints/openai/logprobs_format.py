"""OpenAI's two logprobs formats, from a CompletionOutput's logprobs.

Owns the legacy completions format (tokens, token_logprobs, top_logprobs, text_offset) and
chat's (content: one {token, logprob, bytes, top_logprobs} per token), and the lowest
logprob a response states. Never computes a logprob: the engine did.
"""

from __future__ import annotations

from jaxllm.outputs import CompletionOutput

# The lowest logprob a response states (vLLM's floor): a processed logprobs_mode gives -inf to
# masked tokens, which JSON cannot carry (the non-streaming response failed to encode).
LOGPROB_FLOOR = -9999.0


def _json_logprob(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def completion_logprobs(c: CompletionOutput, k: int, text_offset: int) -> dict | None:
    """OpenAI's legacy completions format: tokens, token_logprobs, top_logprobs, offsets."""
    if c.logprobs is None:
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        chosen = entry[token_id]
        tokens.append(chosen.decoded_token or "")
        token_logprobs.append(_json_logprob(chosen.logprob))
        tops.append({(lp.decoded_token or ""): _json_logprob(lp.logprob) for lp in entry.values()
                     if lp.rank is not None and lp.rank <= k} if k else None)
        offsets.append(text_offset)
        text_offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, k: int) -> dict | None:
    """Chat's format: one {token, logprob, bytes, top_logprobs} per generated token."""
    if c.logprobs is None:
        return None

    def item(lp):
        text = lp.decoded_token or ""
        return {"token": text, "logprob": _json_logprob(lp.logprob),
                "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        top = sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k),
                     key=lambda lp: lp.rank)
        content.append({**item(entry[token_id]), "top_logprobs": [item(lp) for lp in top]})
    return {"content": content}
