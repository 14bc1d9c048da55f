"""User text must be valid Unicode before a tokenizer, a template or a response sees it.

A Python string may hold a lone surrogate ("\\ud800"; JSON's "\\ud800" escape decodes to one),
which has no UTF-8 form: the tokenizer raises TypeError on it and a JSON response carrying it
cannot be encoded. Owns `check_text` (a ValueError naming the field) and `check_json_text`
(every string of a parsed JSON value, keys included, named by its path). Imports nothing from
jaxllm; never tokenizes.
"""

from __future__ import annotations

from typing import Any


def check_text(text: str, name: str) -> None:
    """ValueError naming `name` if `text` cannot be encoded as UTF-8. The message never holds
    the text itself, only an escaped form of the bad character, so it can always be sent."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode text: it holds the lone surrogate "
                         f"{text[e.start]!r} at character {e.start}") from None


def check_json_text(value: Any, name: str) -> None:
    """check_text on every string in a parsed JSON value (dicts, lists, scalars), keys
    included; the field is named by its path, e.g. `messages[1].content[0].text`. Walks with
    a stack, so a deeply nested body cannot exhaust the recursion limit."""
    stack = [(name, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            check_text(item, path)
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                if isinstance(key, str):
                    check_text(key, f"a key of {path}")
                children.append((f"{path}.{key}", child))
            stack.extend(reversed(children))  # the first bad field is the one reported
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed([(f"{path}[{i}]", child) for i, child in enumerate(item)]))
