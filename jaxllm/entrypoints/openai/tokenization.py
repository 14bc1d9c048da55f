"""/tokenize: a prompt, or a conversation rendered by the chat template, as token ids (and
token strings on request), with vLLM's fields (TokenizeCompletionRequest and
TokenizeChatRequest: continue_final_message, tools, chat_template, chat_template_kwargs,
return_token_strs).

Owns only the reading of a TokenizeRequest into a response body. Never tokenizes or renders
on the event loop: the engine's input thread does (AsyncLLM.offload), and a request's own
chat template renders in the sandbox, as for a chat completion (serving.chat_prompt).
"""

from __future__ import annotations

from jaxllm.entrypoints.openai.protocol import TokenizeRequest


async def tokenize_response(serving, body: TokenizeRequest) -> dict:
    engine = serving.engine
    if (body.prompt is None) == (body.messages is None):
        raise ValueError("give exactly one of prompt and messages")
    if body.mm_processor_kwargs:
        raise ValueError("mm_processor_kwargs is not supported: jaxllm serves no multimodal "
                         "models")
    if body.messages is not None:
        explicit = body.model_fields_set
        if (body.continue_final_message and body.add_generation_prompt
                and "add_generation_prompt" in explicit):  # vLLM looks at the fields sent
            raise ValueError("Cannot set both `continue_final_message` and "
                             "`add_generation_prompt` to True.")
        chat = body.model_copy(update={"add_generation_prompt": body.add_generation_prompt
                                       and not body.continue_final_message})
        prompt = await serving.chat_prompt(chat, request_template(serving, body))
        tokens = prompt.token_ids
        if body.add_special_tokens:  # vLLM's default for messages is false
            tokens = await engine.offload(_encode, engine, prompt.text, True)
    else:
        add_special_tokens = body.add_special_tokens is not False  # true by default
        tokens = await engine.offload(_encode, engine, body.prompt, add_special_tokens)
    out = {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": tokens,
           "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = await engine.offload(engine.tokenizer.convert_ids_to_tokens,
                                                 tokens)
    return out


def request_template(serving, body: TokenizeRequest) -> str | None:
    """The request's own chat template (from the field or chat_template_kwargs; None: the
    server's), refused unless the server trusts request templates: /tokenize's and a chat
    completion's alike (serving_chat.py)."""
    template = body.chat_template
    if body.chat_template_kwargs and "chat_template" in body.chat_template_kwargs:
        template = body.chat_template_kwargs["chat_template"]
    if template is not None and serving.template_sandbox is None:
        raise ValueError("this request brings its own chat_template, which the server "
                         "refuses: chat templates run as code, and request templates are "
                         "accepted only with --trust-request-chat-template")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"chat_template must be a string, got {type(template).__name__}")
    return template


def _encode(engine, text: str, add_special_tokens: bool) -> list[int]:
    engine.engine.processor.check_text_length(text)  # the same length bound as a prompt's
    return engine.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


__all__ = ["tokenize_response"]
