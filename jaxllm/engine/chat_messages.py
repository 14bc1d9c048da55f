"""Chat messages as a request gives them -> as chat templates read them.

Owns the checks on a conversation (a non-empty list of {"role", "content"} dicts with a role
and text content; an assistant's content may be None beside its tool_calls) and what
templates are given: each content one string, and each assistant tool call's `arguments`
(JSON text on the wire) the value it holds. Shared by `LLM.chat` and the server. Never
renders a template (the processor and template_sandbox.py do) and never tokenizes.
"""

from __future__ import annotations

import json
from typing import Any

from jaxllm.unicode_text import check_json_text

# OpenAI's roles. Any other non-empty string is a custom role, passed to the chat template
# as it is (vLLM's CustomChatCompletionMessageParam): the template decides what it means.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_conversation(conversation: Any, index: int = 0) -> None:
    """A chat is a list of {"role", "content"} dicts with a role (one of CHAT_ROLES or a
    custom one) and text content (a string, or OpenAI's list of {"type": "text", "text"}
    parts)."""
    where = f"conversation {index}"
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"{where} must be a non-empty list of messages, got "
                         f"{type(conversation).__name__}")
    for j, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise ValueError(f"{where}, message {j} must be a dict with 'role' and 'content', "
                             f"got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}, message {j}: role must be a non-empty string (one of "
                             f"{CHAT_ROLES}, or a custom role), got {role!r:.80}")
        content = message.get("content")
        if role == "assistant" and content is None and message.get("tool_calls"):
            continue
        if isinstance(content, str):
            continue
        if isinstance(content, list) and all(
                isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str) for part in content):
            continue
        raise ValueError(f"{where}, message {j}: content must be a string or a list of "
                         f"{{'type': 'text', 'text': str}} parts, got {content!r:.80}")
    for j, message in enumerate(conversation):  # every field may reach the template
        check_json_text(message, f"{where}, message {j}")


def chat_messages(conversation: Any, index: int = 0) -> list[dict]:
    """A checked conversation as chat templates read it: each content one string, and the
    arguments of an assistant's tool calls a dict."""
    check_conversation(conversation, index)
    return [_tool_call_arguments(_text_content(m), f"conversation {index}, message {j}")
            for j, m in enumerate(conversation)]


def _text_content(message: dict) -> dict:
    """OpenAI's list of text parts joined into one string (as vLLM does for text models):
    chat templates expect a string; an assistant's content None (tool calls alone) is ""."""
    content = message.get("content")
    if isinstance(content, list):
        return {**message, "content": "\n".join(part["text"] for part in content)}
    if content is None:
        return {**message, "content": ""}
    return message


def _tool_call_arguments(message: dict, where: str) -> dict:
    """An assistant's tool_calls with each function's `arguments` (JSON text on the wire) as
    the value it holds, {} when empty: chat templates render them with `tojson` (vLLM
    does the same)."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or calls is None:
        return message
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
        raise ValueError(f"{where}: tool_calls must be a list of {{'function': {{'name', "
                         f"'arguments'}}}} dicts, got {calls!r:.80}")
    parsed = []
    for call in calls:
        arguments = call["function"].get("arguments")
        if not arguments:
            arguments = {}
        elif isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
                raise ValueError(f"{where}: tool call arguments are not JSON: "
                                 f"{type(e).__name__}: {e}") from None
        parsed.append({**call, "function": {**call["function"], "arguments": arguments}})
    return {**message, "tool_calls": parsed}
