"""`llama3_json` (alias `llama4_json`): Llama 3.x/4 JSON calls, `{"name": ..., "parameters": ...}`.

Owns how the JSON tool-call output of Llama 3.1+ chat templates splits into calls; never
decides what the response looks like. The rules:

* The output, after an optional `<|python_tag|>` and whitespace, must begin with `{`;
  otherwise it is all content (as vLLM's streaming path decides: a call comes first or not
  at all).
* One or more JSON objects separated by `;` (whitespace around it allowed). Each has a
  string "name" and its arguments under "arguments" or, as Llama's own template writes
  them, "parameters" ("arguments" wins if both are there). A malformed object makes the
  whole output content.
* When tools are called there is no content: text after the last object is dropped, as in
  vLLM.

An object ends at the brace that balances its first one (braces inside JSON strings do not
count), found by `JsonValueEnd` in both paths.
"""

from __future__ import annotations

import enum
import json

from jaxllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    FunctionCall, ToolParser, ToolParserManager, make_function_call)

BOT_TOKEN = "<|python_tag|>"
_WHITESPACE = " \t\n\r"


class _State(enum.Enum):
    START = enum.auto()  # deciding whether the output is calls
    OBJECT = enum.auto()  # the cursor is at a call's `{`
    AFTER = enum.auto()  # after a call: `;` and another call, or the end of the calls
    DROP = enum.auto()  # after the calls: everything is dropped


def skip_whitespace(text: str, start: int) -> int:
    while start < len(text) and text[start] in _WHITESPACE:
        start += 1
    return start


class JsonValueEnd:
    """Finds the index just past the bracket that balances text[start] (`{` or `[`),
    resuming where the last call stopped, so that a stream scans each character once.
    Brackets inside strings do not count; whether they match in kind is the JSON parser's
    business."""

    def __init__(self, start: int):
        self._i = start
        self._depth = 0
        self._in_string = False

    def find(self, text: str) -> int | None:
        """The end, or None if `text` (the same text, perhaps longer) ends first."""
        i = self._i
        while i < len(text):
            char = text[i]
            if self._in_string:
                if char == "\\":
                    if i + 1 == len(text):
                        break  # the escaped character has not come yet
                    i += 1
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
            i += 1
        self._i = i
        return None


def parse_llama_call(source: str) -> FunctionCall | None:
    try:
        obj = json.loads(source)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    if key not in obj:
        return None
    return make_function_call(obj.get("name"), obj[key])


@ToolParserManager.register_module("llama3_json", "llama4_json")
class Llama3JsonToolParser(ToolParser):

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._state = _State.START
        self._cursor = 0
        self._object_end = JsonValueEnd(0)

    def _start_object(self, start: int) -> None:
        self._cursor, self._state = start, _State.OBJECT
        self._object_end = JsonValueEnd(start)

    def _scan(self, final: bool) -> None:
        text = self._text
        while True:
            if self._state is _State.START:
                if not final and BOT_TOKEN.startswith(text):
                    return  # empty, or a prefix of the tag
                start = len(BOT_TOKEN) if text.startswith(BOT_TOKEN) else 0
                start = skip_whitespace(text, start)
                if start == len(text) and not final:
                    return
                if start == len(text) or text[start] != "{":
                    self._give_up()
                    return
                self._start_object(start)
            elif self._state is _State.OBJECT:
                end = self._object_end.find(text)
                if end is None:
                    if final:
                        self._give_up()
                    return
                call = parse_llama_call(text[self._cursor:end])
                if call is None:
                    self._give_up()
                    return
                self._emit_call(call, end)
                self._cursor, self._state = end, _State.AFTER
            elif self._state is _State.AFTER:
                i = skip_whitespace(text, self._cursor)
                if i < len(text) and text[i] == ";":
                    i = skip_whitespace(text, i + 1)
                if i == len(text):
                    if final:
                        self._drop(i)
                    return
                if text[i] == "{" and text[self._cursor:i].strip() == ";":
                    self._start_object(i)
                else:
                    self._state = _State.DROP
            else:
                self._drop(len(text))
                return
