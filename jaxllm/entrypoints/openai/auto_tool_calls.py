"""tool_choice="auto": a tool parser's reading of the model's free text, as OpenAI bodies.

Owns the step from a parser's results (tool_parsers/, which read text and know nothing of
ids or chunks) to the response: the message of a finished output, and the chunks' choices
of a streamed one, in tool_calls.py's shapes. Each call gets its id here, when its header
goes out. Never parses text itself and never touches the engine.

    non-streaming   tools called: content = the text outside the calls (null if none),
                    tool_calls, finish_reason "tool_calls" (whatever the engine's, as vLLM);
                    otherwise the text as content and the engine's finish_reason
    streaming       content deltas and tool-call deltas in the order of the text, one
                    chunk each: a call's header (index, id, type, name, arguments "") and
                    then its arguments; the output's finish flushes what the parser held
                    back, and its finish_reason is "tool_calls" if any call was sent
"""

from __future__ import annotations

from jaxllm.entrypoints.openai.tool_calls import (ToolCallDelta, delta_choices,
                                                  make_tool_call_id, tool_call)
from jaxllm.entrypoints.openai.tool_parsers import DeltaMessage, ToolParser


def auto_tool_message(reader: AutoToolCallReader, text: str, finish_reason: str | None
                      ) -> tuple[dict, str | None]:
    """A finished output, read by a fresh reader's parser -> (its message, its
    finish_reason)."""
    info = reader.parser.extract_tool_calls(text)
    if not info.tools_called:
        return {"role": "assistant", "content": text}, finish_reason
    calls = [tool_call(make_tool_call_id(), c.name, c.arguments) for c in info.tool_calls]
    return {"role": "assistant", "content": info.content, "tool_calls": calls}, "tool_calls"


class AutoToolCallReader:
    """One streamed output of an "auto" request, read by its own parser instance."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.ids: list[str] = []  # the id of each call sent, by index

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def feed(self, delta_text: str) -> list[str | ToolCallDelta]:
        """What the stream sends for `delta_text`: content (str) and tool-call deltas, in
        the order of the text."""
        previous, self.text = self.text, self.text + delta_text
        return self._pieces(
            self.parser.extract_tool_calls_streaming(previous, self.text, delta_text))

    def finish(self) -> list[str | ToolCallDelta]:
        """What the parser held back, once the output is complete."""
        return self._pieces(self.parser.finish_streaming())

    def _pieces(self, message: DeltaMessage | None) -> list[str | ToolCallDelta]:
        if message is None:
            return []
        pieces: list[str | ToolCallDelta] = [message.content] if message.content else []
        for d in message.tool_calls:
            if d.name is not None:
                self.ids.append(make_tool_call_id())
                pieces.append(ToolCallDelta(d.index, self.ids[d.index], d.name, d.arguments))
            else:
                pieces.append(ToolCallDelta(d.index, None, None, d.arguments))
        return pieces


def auto_stream_choices(reader: AutoToolCallReader, c, logprobs) -> list[dict]:
    """One streamed piece of output `c` (a CompletionOutput delta) -> the chunks' choices
    (tool_calls.delta_choices): one per content or tool-call delta; none while the parser
    holds text back. Its finish_reason is "tool_calls" once a call was sent."""
    pieces = reader.feed(c.text)
    if c.finish_reason is not None:
        pieces += reader.finish()
    finish = "tool_calls" if reader.called and c.finish_reason is not None else c.finish_reason
    return delta_choices(c, [_delta(piece) for piece in pieces], logprobs, finish)


def _delta(piece: str | ToolCallDelta) -> dict:
    return {"content": piece} if isinstance(piece, str) else {"tool_calls": [piece.as_dict()]}
