"""Tool calls as OpenAI clients see them: ids, the message, and the streamed deltas.

Owns reading a constrained output back as tool calls, whole or as it streams:

    tool_choice={"function": {"name": N}}   the whole output is N's arguments (a JSON value)
    tool_choice="required"                  the output is [{"name": N, "parameters": {...}},
                                            ...]; RequiredToolCallReader (an exact scanner
                                            over the array text) says which call each
                                            character belongs to

and the shapes they go out in: `tool_call` (a message's entry), `tool_call_delta` (a
stream's entry: the first of a call carries its id, type and name with arguments "", the
later ones an arguments fragment each), `tool_calls_message`. A call's arguments are the
exact text the model generated for them (not re-serialized, unlike vLLM's `json.dumps` for
"required"), so a stream's fragments concatenate to exactly the non-streamed arguments.

An output is read as tool calls only when it finished by "stop" and is complete JSON; its
finish_reason is then "tool_calls", for a named choice too, streamed or not (vLLM says
"tool_calls" when it streamed tool calls, but "stop" for a whole named one). Cut by "length"
(or by a stop string), it keeps its finish_reason and the non-streamed message carries the
text as content, without tool calls (a truncated call is no call). A stream cannot take back
the deltas it sent: its last chunk says "length" (vLLM's says "tool_calls"). Never touches
the engine and never decides what is constrained (structured_request.py does).

A reader is any object with `feed(text) -> [ToolCallDelta]`, `complete() -> bool` and
`calls`: the tool-call parsers of tool_choice="auto" can plug theirs into `stream_choices`
and `tool_choice_message`.
"""

from __future__ import annotations

import dataclasses
import json
import uuid


def make_tool_call_id() -> str:
    """vLLM's random tool-call id: "chatcmpl-tool-" and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(id: str, name: str, arguments: str) -> dict:
    """One entry of a message's tool_calls."""
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_calls_message(calls: list[dict]) -> dict:
    """The assistant message of an output read as tool calls (each {"id", "name",
    "arguments"}); content "" as vLLM's."""
    return {"role": "assistant", "content": "",
            "tool_calls": [tool_call(c["id"], c["name"], c["arguments"]) for c in calls]}


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of call `index`: its header (id and name, arguments "") or an
    arguments fragment (id and name None)."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def as_dict(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def tool_call_delta(index: int, id: str | None, name: str | None, arguments: str) -> dict:
    """A stream's delta.tool_calls entry (see ToolCallDelta)."""
    return ToolCallDelta(index, id, name, arguments).as_dict()


class NamedToolCallReader:
    """tool_choice names one tool: the whole output is its arguments."""

    def __init__(self, name: str):
        self.calls = [{"id": make_tool_call_id(), "name": name, "arguments": ""}]
        self._started = False

    def feed(self, text: str) -> list[ToolCallDelta]:
        call, out = self.calls[0], []
        if not self._started:
            self._started = True
            out.append(ToolCallDelta(0, call["id"], call["name"], ""))
        if text:
            call["arguments"] += text
            out.append(ToolCallDelta(0, None, None, text))
        return out

    def complete(self) -> bool:
        return _parses(self.calls[0]["arguments"])


class RequiredToolCallReader:
    """tool_choice="required": reads `[{"name": ..., "parameters": ...}, ...]` as it grows.

    An exact scanner, one character at a time, of JSON the grammar already made valid: it
    tracks strings (and their escapes) and the nesting depth, and at depth 2 (a call's
    object) the key being read and whether its value has started.

        [ { "name" : "f" , "parameters" : { "x" : 1 } } , { ... } ]
        1 2 ------ 2 --- 2 ------------ 2 3 ------- 3 2 1 2 ... 1 0   <- depth after the char

    A call's header goes out once its name string is complete; its `parameters` value
    (from its first character to its last, inner whitespace included) goes out as
    arguments fragments, held back until the header if the name comes second."""

    def __init__(self):
        self.calls: list[dict] = []  # {"id", "name" (None until read), "arguments"}
        self.text = ""
        self.done = False  # the array closed
        self._depth = 0
        self._in_string = self._escape = False
        self._slot = "key"  # at depth 2: "key", "value" (after ':'), "in_value"
        self._key: str | None = None
        self._token: str | None = None  # a depth-2 string being read (a key, or the name)
        self._in_args = self._scalar_args = False
        self._pending = ""  # the current call's arguments not yet sent

    def feed(self, text: str) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        self.text += text
        for ch in text:
            self._step(ch, out)
        self._flush(out)
        return out

    def complete(self) -> bool:
        return self.done and _parses(self.text)

    def _step(self, ch: str, out: list[ToolCallDelta]) -> None:
        if self._in_string:
            self._take(ch)
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                if self._depth == 2:
                    self._in_args = False  # a string value of parameters ends here
                    self._string_done(out)
            return
        if self._scalar_args and (ch in ",}" or ch.isspace()):
            self._in_args = self._scalar_args = False  # a number, bool or null ended
        if self._depth == 2 and self._slot == "value" and not ch.isspace():
            self._slot = "in_value"
            if self._key == "parameters":
                self._in_args = True
                self._scalar_args = ch not in '{["'
        self._take(ch)
        if ch == '"':
            self._in_string = True
            if self._depth == 2:
                self._token = ""
        elif ch in "{[":
            self._depth += 1
            if self._depth == 2:  # a call starts
                self.calls.append({"id": make_tool_call_id(), "name": None, "arguments": ""})
                self._slot, self._key, self._pending = "key", None, ""
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 2:
                self._in_args = False  # an object or array value of parameters ended
            elif self._depth == 1:
                self._flush(out)  # a call ended
            elif self._depth == 0:
                self.done = True
        elif self._depth == 2 and ch == ":":
            self._slot = "value"
        elif self._depth == 2 and ch == ",":
            self._slot = "key"

    def _take(self, ch: str) -> None:
        if self._in_args:
            self.calls[-1]["arguments"] += ch
            self._pending += ch
        if self._token is not None:
            self._token += ch

    def _string_done(self, out: list[ToolCallDelta]) -> None:
        value, self._token = json.loads('"' + self._token), None
        if self._slot == "key":
            self._key = value
        elif self._key == "name":
            call = self.calls[-1]
            call["name"] = value
            out.append(ToolCallDelta(len(self.calls) - 1, call["id"], value, ""))
            self._flush(out)

    def _flush(self, out: list[ToolCallDelta]) -> None:
        if self.calls and self.calls[-1]["name"] is not None and self._pending:
            out.append(ToolCallDelta(len(self.calls) - 1, None, None, self._pending))
            self._pending = ""


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python parses
        return False
    return True


def tool_reader(tool_choice: str, tool_name: str | None):
    """The reader of one output for a constraint's tool_choice ("named" or "required")."""
    if tool_choice == "named":
        return NamedToolCallReader(tool_name)
    return RequiredToolCallReader()


def finish_reason_of(reader, finish_reason: str | None) -> str | None:
    """"tool_calls" for a complete output that stopped; any other finish as it was."""
    if finish_reason == "stop" and reader.complete():
        return "tool_calls"
    return finish_reason


def stream_choices(reader, c, logprobs) -> list[dict]:
    """One streamed output `c` (a CompletionOutput's delta) read as tool calls -> the
    choices of the chunks it becomes (see `delta_choices`); none for text that is no part of
    a call's header or arguments (`[{"name": ` between calls)."""
    return delta_choices(c, [{"tool_calls": [d.as_dict()]} for d in reader.feed(c.text)],
                         logprobs, finish_reason_of(reader, c.finish_reason))


def delta_choices(c, deltas: list[dict], logprobs, finish_reason: str | None) -> list[dict]:
    """The chunks' choices of one streamed output `c`: one per delta, the logprobs on the
    first and `finish_reason` (when `c` finished) on the last, an empty delta carrying them
    if no delta is left; none if there is nothing to carry."""
    choices = [{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None,
                "stop_reason": None} for delta in deltas]
    if not choices:
        if c.finish_reason is None and logprobs is None:
            return []
        choices = [{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": None,
                    "stop_reason": None}]
    choices[0]["logprobs"] = logprobs
    if c.finish_reason is not None:
        choices[-1].update(finish_reason=finish_reason, stop_reason=c.stop_reason)
    return choices


def tool_choice_message(reader, text: str, finish_reason: str | None
                        ) -> tuple[dict, str | None]:
    """A whole (non-streamed) output read by a fresh reader -> (message, finish_reason)."""
    reader.feed(text)
    finish = finish_reason_of(reader, finish_reason)
    if finish != "tool_calls":
        return {"role": "assistant", "content": text}, finish
    return tool_calls_message(reader.calls), finish


__all__ = ["make_tool_call_id", "tool_call", "tool_call_delta", "tool_calls_message",
           "ToolCallDelta", "NamedToolCallReader", "RequiredToolCallReader", "tool_reader",
           "finish_reason_of", "tool_choice_message", "stream_choices", "delta_choices"]
