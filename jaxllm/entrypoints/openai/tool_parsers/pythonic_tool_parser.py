"""`pythonic`: calls written as a Python list, `[get_weather(city="Paris"), get_time()]`.

Owns how pythonic tool-call output (Llama 3.2, Llama 4, ToolACE) splits into calls; never
evaluates anything: each call is parsed with `ast` and only literals are read. The rules:

* The output must begin with `[`; otherwise it is all content (as in vLLM).
* The list holds one or more calls `name(key=value, ...)` separated by commas (a trailing
  comma is allowed). A name is a plain identifier; arguments are keyword arguments only; a
  value is a literal: a string, a number (a sign allowed), True, False, None, or a list or a
  dict (string keys) of literals. Anything else (`[]`, positional arguments, `**kwargs`,
  names, expressions, tuples, bytes, non-finite numbers) makes the whole output content.
* After the closing `]` only whitespace may follow; other text makes the output content (in
  vLLM the whole output no longer parses). A stream has already sent the calls then, and
  sends that text as content.

A call ends at the `)` that balances its first `(`, found by `PythonCallEnd`, which knows
Python's strings (single, double, triple-quoted, escapes) and comments; the call's text is
then parsed alone. Arguments become JSON: `json.dumps({key: value}, ensure_ascii=False)`.
"""

from __future__ import annotations

import ast
import enum
from typing import Any

from jaxllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    FunctionCall, ToolParser, ToolParserManager, make_function_call)
from jaxllm.entrypoints.openai.tool_parsers.llama_tool_parser import skip_whitespace


class NotACall(Exception):
    """The text at a call's position cannot be a call, whatever follows."""


class NotALiteral(Exception):
    pass


class PythonCallEnd:
    """Finds the index just past the `)` closing a call that starts at text[start], resuming
    where the last call stopped."""

    def __init__(self, start: int):
        self._start = start
        self._i = start
        self._depth = 0  # 0 while reading the name
        self._quote: str | None = None  # the open string's delimiter: ' " ''' or \"\"\"
        self._in_comment = False

    def find(self, text: str) -> int | None:
        """The end, or None if `text` ends first; NotACall if it cannot be a call."""
        i = self._i
        while i < len(text):
            char = text[i]
            if self._depth == 0:
                if char == "(" and i > self._start:
                    self._depth = 1
                elif char.isalnum() or char == "_":
                    if i > self._start and text[i - 1].isspace():
                        raise NotACall  # two words
                elif not (char.isspace() and i > self._start):
                    raise NotACall
            elif self._in_comment:
                self._in_comment = char != "\n"
            elif self._quote is not None:
                if char == "\\":
                    if i + 1 == len(text):
                        break  # the escaped character has not come yet
                    i += 1
                elif char == self._quote[0]:
                    if text.startswith(self._quote, i):
                        i += len(self._quote) - 1
                        self._quote = None
                    elif self._quote.startswith(text[i:]):
                        break  # `'` or `''` at the end may begin the closing `'''`
            elif char in "'\"":
                if text[i:i + 3] == char * 3:
                    self._quote = char * 3
                    i += 2
                elif text[i:] in (char, char * 2):
                    break  # an empty string, or a triple quote still coming
                else:
                    self._quote = char
            elif char == "#":
                self._in_comment = True
            elif char in "([{":
                self._depth += 1
            elif char in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
            i += 1
        self._i = i
        return None


def literal_value(node: ast.expr) -> Any:
    """The JSON-able value of a literal expression; NotALiteral for anything else."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, bool, int, float)):
            return node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = node.operand
        if (isinstance(operand, ast.Constant) and isinstance(operand.value, (int, float))
                and not isinstance(operand.value, bool)):
            return -operand.value if isinstance(node.op, ast.USub) else operand.value
    elif isinstance(node, ast.List):
        return [literal_value(element) for element in node.elts]
    elif isinstance(node, ast.Dict):
        value = {}
        for key, item in zip(node.keys, node.values):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise NotALiteral  # `**other` has key None; keys must be strings
            value[key.value] = literal_value(item)
        return value
    raise NotALiteral


def parse_pythonic_call(source: str) -> FunctionCall | None:
    try:
        # In parentheses, as inside the list: a line break before `(` is no statement end.
        node = ast.parse(f"({source})", mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
        return None
    arguments = {}
    try:
        for keyword in node.keywords:
            if keyword.arg is None:
                return None  # **kwargs
            arguments[keyword.arg] = literal_value(keyword.value)
    except (NotALiteral, RecursionError):
        return None
    return make_function_call(node.func.id, arguments)


class _State(enum.Enum):
    START = enum.auto()  # deciding whether the output is a list
    CALL = enum.auto()  # a call (or, after a comma, the list's end) comes next
    IN_CALL = enum.auto()  # reading a call until its closing parenthesis
    AFTER = enum.auto()  # after a call: `,` or `]`
    END = enum.auto()  # after the list: only whitespace may follow


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(ToolParser):

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._state = _State.START
        self._cursor = 0
        self._call_end = PythonCallEnd(0)

    def _scan(self, final: bool) -> None:
        text = self._text
        while not self._gave_up:
            i = skip_whitespace(text, self._cursor)
            if self._state is not _State.IN_CALL and i == len(text):
                if not final:
                    return
                if self._state is _State.END:
                    self._drop(i)
                else:
                    self._give_up()  # an empty output, or a list never closed
                return
            if self._state is _State.START:
                if text[0] != "[":
                    self._give_up()
                    return
                self._cursor, self._state = 1, _State.CALL
            elif self._state is _State.CALL:
                if text[i] == "]" and self._num_calls > 0:
                    self._cursor, self._state = i + 1, _State.END  # `[f(),]`
                else:
                    self._cursor, self._state = i, _State.IN_CALL
                    self._call_end = PythonCallEnd(i)
            elif self._state is _State.IN_CALL:
                self._scan_call(final)
                if self._state is _State.IN_CALL:
                    return
            elif self._state is _State.AFTER:
                if text[i] == ",":
                    self._cursor, self._state = i + 1, _State.CALL
                elif text[i] == "]":
                    self._cursor, self._state = i + 1, _State.END
                else:
                    self._give_up()
            else:
                self._drop(self._cursor)  # the `]`: what follows is content
                self._give_up()

    def _scan_call(self, final: bool) -> None:
        try:
            end = self._call_end.find(self._text)
        except NotACall:
            self._give_up()
            return
        if end is None:
            if final:
                self._give_up()
            return
        call = parse_pythonic_call(self._text[self._cursor:end])
        if call is None:
            self._give_up()
            return
        self._emit_call(call, end)
        self._cursor, self._state = end, _State.AFTER
