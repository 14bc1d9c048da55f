"""What every tool-call parser shares: the result types, the streaming driver, the registry.

Owns the interface the chat server calls for `tool_choice="auto"`:
`extract_tool_calls(model_output)` for a finished output and
`extract_tool_calls_streaming(previous_text, current_text, delta_text)` + `finish_streaming()`
for a stream, and `ToolParserManager`, the registry of parsers by the name given to
`--tool-call-parser`. Never builds OpenAI response bodies (the serving code does, with ids)
and never touches a tokenizer: parsers read text only.

One scanner per parser serves both paths. A subclass implements `_scan(final)`, which reads
`self._text` from where it last stopped and reports, in order, content to emit, calls that
are complete and valid, text to drop, or that the output is not (or no longer) tool calls
(`_give_up`: everything not yet reported is content from then on). The non-streaming result
is that scanner run once over the whole output with `final=True`, so the two paths agree by
construction wherever nothing has to be taken back:

* A call is reported only once its text is complete and has parsed, and its arguments are
  sent in one fragment, `json.dumps(arguments, ensure_ascii=False, allow_nan=False)` of the
  parsed value: the concatenated fragments equal the non-streaming `arguments` exactly.
  Each call streams as two `DeltaToolCall`s: its name (arguments ""), then its arguments.
* Text that could still become part of a tag is held back, never emitted as content.
* As in vLLM, an output with any malformed call is content as a whole (tools_called False).
  A stream cannot take back calls it has already sent, so there a malformed call after a
  good one turns the rest of the stream (from the end of the last good call) into content.

Arguments with a lone surrogate (JSON's "\\ud800" escape) or a non-finite number have no
valid JSON text: such a call counts as malformed. Function names are not checked against the
request's `tools`, as in vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class FunctionCall:
    """One complete call."""
    name: str
    arguments: str  # JSON text of the arguments value


@dataclass(frozen=True)
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[FunctionCall]
    content: str | None  # the text outside the calls (None if none)


@dataclass(frozen=True)
class DeltaToolCall:
    index: int  # which call of the output, 0-based
    name: str | None  # set exactly once, on the call's first delta
    arguments: str  # a fragment of the arguments JSON text ("" with the name)


@dataclass(frozen=True)
class DeltaMessage:
    content: str | None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


def make_function_call(name: Any, arguments: Any) -> FunctionCall | None:
    """The call `name(arguments)` with its arguments as JSON text, or None if the name is not
    a string or either has no valid JSON/UTF-8 text (NaN, infinity, a lone surrogate)."""
    if not isinstance(name, str) or not name:
        return None
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        (name + text).encode("utf-8")
    except (ValueError, TypeError, RecursionError):  # UnicodeEncodeError is a ValueError
        return None
    return FunctionCall(name=name, arguments=text)


class ToolParser:
    """One instance per choice of one request: it holds that stream's state."""

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools
        self._text = ""  # the output so far (current_text)
        self._pos = 0  # self._text[:_pos] has been reported (content, calls or dropped)
        self._num_calls = 0
        self._gave_up = False  # from _pos on, everything is content
        self._content: list[str] = []  # what the running scan reports
        self._calls: list[FunctionCall] = []

    # -- what subclasses implement ------------------------------------------------------------

    def _scan(self, final: bool) -> None:
        """Report what self._text allows from where the last scan stopped; `final`: no more
        text will come. Called only while the parser has not given up."""
        raise NotImplementedError

    # -- what _scan reports through --------------------------------------------------------

    def _emit_content(self, end: int) -> None:
        if end > self._pos:
            self._content.append(self._text[self._pos:end])
            self._pos = end

    def _emit_call(self, call: FunctionCall, end: int) -> None:
        self._calls.append(call)
        self._num_calls += 1
        self._pos = end

    def _drop(self, end: int) -> None:
        self._pos = max(self._pos, end)

    def _give_up(self) -> None:
        self._gave_up = True

    # -- the two paths ------------------------------------------------------------------

    def _advance(self, final: bool) -> tuple[str, list[FunctionCall]]:
        self._content, self._calls = [], []
        if not self._gave_up:
            self._scan(final)
        if self._gave_up:
            self._emit_content(len(self._text))
        return "".join(self._content), self._calls

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        """The calls of a finished output (stateless: this instance's stream is untouched)."""
        scanner = type(self)(self.tools)
        scanner._text = model_output
        content, calls = scanner._advance(final=True)
        if scanner._gave_up or not calls:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[],
                                                content=model_output)
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls,
                                            content=content or None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str) -> DeltaMessage | None:
        """What the stream may send now that the output is `current_text` (previous_text +
        delta_text); None when nothing is certain yet."""
        self._text = current_text
        return self._delta(*self._advance(final=False))

    def finish_streaming(self) -> DeltaMessage | None:
        """The rest, once the output is complete: held-back text and an unclosed last call."""
        return self._delta(*self._advance(final=True))

    def _delta(self, content: str, calls: list[FunctionCall]) -> DeltaMessage | None:
        first_index = self._num_calls - len(calls)
        deltas = []
        for index, call in enumerate(calls, start=first_index):
            deltas.append(DeltaToolCall(index=index, name=call.name, arguments=""))
            deltas.append(DeltaToolCall(index=index, name=None, arguments=call.arguments))
        if not content and not deltas:
            return None
        return DeltaMessage(content=content or None, tool_calls=deltas)


class ToolParserManager:
    """Parsers by the name `--tool-call-parser` takes."""

    tool_parsers: ClassVar[dict[str, type[ToolParser]]] = {}

    @classmethod
    def register_module(cls, *names: str):
        def register(parser: type[ToolParser]) -> type[ToolParser]:
            for name in names:
                cls.tool_parsers[name] = parser
            return parser
        return register

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls.tool_parsers)

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name not in cls.tool_parsers:
            raise ValueError(f"invalid tool_call_parser: {name!r} (choose from "
                             f"{', '.join(cls.names())})")
        return cls.tool_parsers[name]
