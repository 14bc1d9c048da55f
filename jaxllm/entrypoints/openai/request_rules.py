"""vLLM's rules across the fields of a completions or chat body, checked before they are parsed.

Owns the 400s vLLM's protocol classes give for combinations of fields (stream_options
without stream, prompt_logprobs on a stream, top_logprobs without logprobs, an empty `tools`,
continue_final_message with add_generation_prompt, ...), the defaults vLLM fills in before
parsing (a null max_tokens or top_logprobs), the fields jaxllm accepts but cannot honour
(refused with a 400 naming the field once they ask for something), and the cache_salt's
shape. Each error is a ParameterError naming its field. Never parses a field's own type
(pydantic does) and never touches the engine.

    vLLM fields, by what jaxllm does with them (counts in the module's tail)
    HONOURED    every field of the request classes not listed below
    NO_EFFECT   accepted, and nothing in jaxllm reads them (what they select does not exist
                here, or only concerns vLLM's render endpoints)
    REFUSED     accepted in their "off" value; anything else is a 400 saying why
"""

from __future__ import annotations

from typing import Any

from jaxllm.value_ranges import ParameterError

# vLLM's cache_salt bounds (generate/base/protocol.py).
MAX_CACHE_SALT_CHARS = 128
CACHE_SALT_FORBIDDEN = "@/\\\0"

# Accepted and without effect here, with why.
NO_EFFECT = {
    "user": "OpenAI's end-user id; vLLM ignores it too",
    "session_id": "a routing hint between vLLM replicas",
    "routed_experts_prompt_start": "no model here returns routed-expert data",
    "return_token_offsets": "used by vLLM's /render endpoints only",
    "mm_payload": "used by vLLM's /render endpoints only",
    "return_mm_kwargs": "used by vLLM's /render endpoints only",
    "kv_transfer_params": "no KV connector (disaggregated serving) here",
    "ec_transfer_params": "no encoder-cache connector here",
    "include_reasoning": "no reasoning parser here: nothing is split off as reasoning",
    "parallel_tool_calls": "tool calls are read as the tool parser finds them",
}

# Refused unless "off": field -> (is it off?, why it is refused).
REFUSED = {
    # vLLM's own 400 for every model without a FIM renderer (all but Mistral tokenizers)
    "suffix": (lambda v: v is None, "suffix is only supported for models with FIM "
                                    "completion rendering"),
    "watermarking": (lambda v: not v, "watermarking is not supported"),
    "logprob_token_ids": (lambda v: not v, "logprob_token_ids is not supported; use "
                                            "logprobs (the top-k) instead"),
    "repetition_detection": (lambda v: v is None, "repetition_detection is not supported"),
    "thinking_token_budget": (lambda v: v is None or v == -1,
                              "thinking_token_budget needs a reasoning parser, which jaxllm "
                              "does not have"),
    "mm_processor_kwargs": (lambda v: not v, "mm_processor_kwargs: this model takes no "
                                             "multimodal input"),
    "media_io_kwargs": (lambda v: not v, "media_io_kwargs: this model takes no multimodal "
                                         "input"),
}


def _refuse(message: str, param: str):
    raise ParameterError(message, param)


def _int_or_none(data: dict, name: str) -> None:
    value = data.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        _refuse(f"`{name}` must be an integer.", name)


def check_cache_salt(salt: Any) -> None:
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        _refuse("Parameter 'cache_salt' must be a non-empty string if provided.",
                "cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS or any(c in CACHE_SALT_FORBIDDEN for c in salt):
        _refuse(f"Parameter 'cache_salt' must be at most {MAX_CACHE_SALT_CHARS} characters "
                "and must not contain '@', '/', '\\', or NUL.", "cache_salt")


def check_body(kind: str, data: Any) -> Any:
    """vLLM's `mode="before"` validators of CompletionRequest / ChatCompletionRequest
    (kind: the class name), on the raw body; -> the body with vLLM's defaults filled in."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    chat = kind == "ChatCompletionRequest"
    check_cache_salt(data.get("cache_salt"))
    if data.get("stream_options") and not data.get("stream"):
        _refuse("Stream options can only be defined when `stream=True`.", "stream_options")
    for name, (is_off, why) in REFUSED.items():
        if name in data and not is_off(data[name]):
            _refuse(why, name)
    logprobs = "top_logprobs" if chat else "logprobs"
    for name in ("prompt_logprobs", logprobs):
        _int_or_none(data, name)
    prompt_logprobs = data.get("prompt_logprobs")
    if prompt_logprobs is not None:
        if data.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
            _refuse("`prompt_logprobs` are not available when `stream=True`.",
                    "prompt_logprobs")
        if prompt_logprobs < -1:
            _refuse("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
    k = data.get(logprobs)
    if k is not None and k < -1:
        _refuse(f"`{logprobs}` must be a positive value or -1.", logprobs)
    if data.get("use_beam_search") and data.get("stream"):
        _refuse("Streaming is not currently supported with beam search", "use_beam_search")
    if chat:
        _check_chat(data)
    else:
        if data.get("use_beam_search") and data.get("echo") and k is not None:
            _refuse("`echo` with `logprobs` is not supported with beam search because beam "
                    "search does not compute prompt logprobs.", "echo")
        if data.get("max_tokens", 16) is None:  # vLLM: null is the default, 16
            data["max_tokens"] = 16
    return data


def _check_chat(data: dict) -> None:
    if "top_logprobs" in data and data["top_logprobs"] is None:
        data["top_logprobs"] = 0
    k = data.get("top_logprobs")
    if k is not None and (k == -1 or k > 0) and not data.get("logprobs"):
        _refuse("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if data.get("tools") == []:
        _refuse("`tools` must not be an empty array. Either provide at least one tool or "
                "omit the field entirely.", "tools")
    if data.get("continue_final_message") and data.get("add_generation_prompt"):
        _refuse("Cannot set both `continue_final_message` and `add_generation_prompt` to "
                "True.", "continue_final_message")


# The counts the closing note gives: vLLM 0.32's fields of both request classes (union),
# by what jaxllm does with them; HONOURED is the rest.
def request_field_counts() -> dict[str, int]:
    from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    no_effect, refused = set(NO_EFFECT) & fields, set(REFUSED) & fields
    return {"honoured": len(fields - no_effect - refused), "no_effect": len(no_effect),
            "refused": len(refused)}
