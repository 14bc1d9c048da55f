"""OpenAI's two logprobs formats, and vLLM's prompt_logprobs, from the engine's Logprob dicts.

Owns the legacy completions format (tokens, token_logprobs, top_logprobs, text_offset) and
chat's (content: one {token, logprob, bytes, top_logprobs} per token), vLLM's
`prompt_logprobs` response field, how a token is spelled (its text, or "token_id:<id>"
with return_tokens_as_token_ids), and the lowest logprob a response states. Never computes
a logprob: the engine did.

Which entries a position states (vLLM's rules): each dict holds the chosen token first, then
the top-n by rank. Completions state its first k + 1 entries (the chosen token and the top
k; k entries when the chosen token is among them), chat its first k; k = -1: all of them.

    text_offset: where each token starts in the text the response returns
    non-streamed   [0, len(t0), len(t0) + len(t1), ...]   (echo: from the prompt's start)
    streamed       each chunk goes on from the previous chunk's last token + its length,
                   never from the length of the chunk's text (a stop string's held-back
                   characters make that lag behind the tokens)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from jaxllm.outputs import Logprob

# The lowest logprob a response states (vLLM's floor): a processed logprobs_mode gives -inf to
# masked tokens, which JSON cannot carry (the non-streaming response failed to encode).
LOGPROB_FLOOR = -9999.0


def json_logprob(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def token_text(token_id: int, lp: Logprob | None, as_ids: bool) -> str:
    """A token as a response spells it: "token_id:<id>" (return_tokens_as_token_ids), else
    its decoded text."""
    if as_ids:
        return f"token_id:{token_id}"
    return (lp.decoded_token if lp is not None else None) or ""


def stated(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The entries a position states for top-k: the chosen token and the top k."""
    items = entry.items()
    return list(items) if k == -1 else list(itertools.islice(items, k + 1))


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[dict | None], k: int,
                        text_offset: int, as_ids: bool = False, decode=None) -> dict:
    """OpenAI's legacy completions format. entries: one dict per token, None for a prompt's
    first token (echo), which has no logprob and is spelled by decode(token id);
    text_offset: where the first token starts."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        if entry is None or token_id not in entry:  # no logprob for this token
            token = f"token_id:{token_id}" if as_ids else decode(token_id)
            token_logprobs.append(None)
            tops.append(None)
        else:
            chosen = entry[token_id]
            token = token_text(token_id, chosen, as_ids)
            token_logprobs.append(json_logprob(chosen.logprob))
            tops.append({token_text(t, lp, as_ids): json_logprob(lp.logprob)
                         for t, lp in stated(entry, k)})
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def next_text_offset(logprobs: dict | None, offset: int) -> int:
    """Where a stream's next chunk starts: after this chunk's last token."""
    if not logprobs or not logprobs["tokens"]:
        return offset
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict | None], k: int,
                  as_ids: bool = False, decode=None) -> dict:
    """Chat's format: one {token, logprob, bytes, top_logprobs} per token. top_logprobs are
    the position's first k entries (vLLM's rule: the chosen token, then the top ones by
    rank; the chosen token is the most likely one under greedy sampling); -1: all. A token
    without an entry is spelled by decode(token id), with vLLM's floor as its logprob.
    `bytes` are the decoded token's, even with as_ids (as vLLM's)."""

    def item(token_id, lp):
        text = token_text(token_id, lp, as_ids)
        return {"token": text, "logprob": json_logprob(lp.logprob),
                "bytes": list(text.encode("utf-8", errors="replace"))}

    content = []
    for token_id, entry in zip(token_ids, entries):
        if entry is None or token_id not in entry:
            text = f"token_id:{token_id}" if as_ids else decode(token_id)
            content.append({"token": text, "logprob": LOGPROB_FLOOR,
                            "bytes": list(text.encode("utf-8", errors="replace")),
                            "top_logprobs": []})
            continue
        chosen = entry[token_id]
        top = list(entry.items()) if k == -1 else list(itertools.islice(entry.items(), k))
        content.append({**item(token_id, chosen),
                        "bytes": (None if chosen.decoded_token is None else
                                  list(chosen.decoded_token.encode("utf-8", "replace"))),
                        "top_logprobs": [item(t, lp) for t, lp in top]})
    return {"content": content}


def prompt_logprobs_json(prompt_logprobs) -> list | None:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or {token id:
    {logprob, rank, decoded_token}}, logprobs floored as everywhere."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": json_logprob(lp.logprob), "rank": lp.rank,
                      "decoded_token": lp.decoded_token} for t, lp in entry.items()}
            for entry in prompt_logprobs]
