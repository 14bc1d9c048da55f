"""`hermes`: calls written as `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks.

Owns how Hermes-style output (Hermes 2 Pro, Qwen 2.5 and their chat templates) splits into
content and calls; never decides what the response looks like. The rules, vLLM's:

* No `<tool_call>` anywhere: the whole output is content.
* Content is the text before the first `<tool_call>`; text between and after blocks is
  dropped. A block ends at the first `</tool_call>`; an unclosed last block runs to the end
  of the output (a model stopped by its EOS token often leaves it open).
* A block holds one JSON object with a string "name" and an "arguments" value (any JSON
  value, sent as its JSON text). Anything else is malformed, and makes the whole output
  content (see abstract_tool_parser.py for what a stream does).

While streaming content, a tail that could begin `<tool_call>` (`<`, `<tool_`, ...) is held
back until the next text decides it.
"""

from __future__ import annotations

import enum
import json

from jaxllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    FunctionCall, ToolParser, ToolParserManager, make_function_call)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class _State(enum.Enum):
    CONTENT = enum.auto()  # before the first block
    BLOCK = enum.auto()  # inside a block: its JSON until TOOL_CALL_END
    BETWEEN = enum.auto()  # after a block: dropped until the next TOOL_CALL_START


def partial_tag_length(text: str, start: int, tag: str) -> int:
    """Length of the longest tail of text[start:] that is a proper prefix of `tag`."""
    for length in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def parse_hermes_block(block: str) -> FunctionCall | None:
    try:
        obj = json.loads(block)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or "arguments" not in obj:
        return None
    return make_function_call(obj.get("name"), obj["arguments"])


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._state = _State.CONTENT
        self._cursor = 0  # where the scan goes on from
        self._end_search_from = 0  # in a block: where TOOL_CALL_END may begin

    def _scan(self, final: bool) -> None:
        text = self._text
        while True:
            if self._state is _State.BLOCK:
                end = text.find(TOOL_CALL_END, self._end_search_from)
                if end < 0 and not final:
                    # Each character is searched once, however many deltas the block takes.
                    self._end_search_from = max(self._cursor,
                                                len(text) - len(TOOL_CALL_END) + 1)
                    return
                closed = end >= 0
                body_end = end if closed else len(text)
                call = parse_hermes_block(text[self._cursor:body_end])
                if call is None:
                    self._give_up()
                    return
                self._emit_call(call, end + len(TOOL_CALL_END) if closed else len(text))
                self._cursor = self._pos
                self._state = _State.BETWEEN
                if not closed:
                    return
                continue
            start = text.find(TOOL_CALL_START, self._cursor)
            if start < 0:
                # Nothing in the tail can start a tag unless it is a prefix of one.
                safe = len(text) if final else (
                    len(text) - partial_tag_length(text, self._cursor, TOOL_CALL_START))
                self._cursor = safe
                if self._state is _State.CONTENT:
                    self._emit_content(safe)
                elif final:
                    self._drop(safe)
                return
            if self._state is _State.CONTENT:
                self._emit_content(start)
            # BETWEEN: the text since the last block stays unreported, so that a malformed
            # block after it turns it into content too.
            self._cursor = self._end_search_from = start + len(TOOL_CALL_START)
            self._state = _State.BLOCK
