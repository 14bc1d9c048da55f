"""A response's `usage`: token counts, the prompt's cached tokens, and when a stream says them.

Owns vLLM's usage rules: prompt, completion and total tokens; `prompt_tokens_details`
({"cached_tokens": prompt tokens whose KV came from the prefix cache}) when the server states
them (vLLM's --enable-prompt-tokens-details, on by default in jaxllm); a stream's usage at
its end with stream_options.include_usage, and on every chunk too with
continuous_usage_stats (which needs include_usage, as in vLLM). Never counts a token itself:
the outputs did.
"""

from __future__ import annotations


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
          ) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def stream_usage(stream_options) -> tuple[bool, bool]:
    """-> (usage at the end, usage on every chunk)."""
    if stream_options is None:
        return False, False
    include = bool(stream_options.include_usage)
    return include, include and bool(stream_options.continuous_usage_stats)
