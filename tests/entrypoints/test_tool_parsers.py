"""The tool-call parsers (hermes, llama3_json, pythonic): exact results for written outputs, and
a property per parser: random calls rendered in its format and streamed in random pieces
give the same calls and content as the non-streaming parse, which gives the calls rendered."""

from __future__ import annotations

import json
import keyword

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from jaxllm.entrypoints.openai.tool_parsers import (
    DeltaToolCall, ExtractedToolCallInformation, FunctionCall, ToolParserManager)

NOT_CALLS = object()  # expected: tools_called False, the whole output as content


def parse(name: str, output: str) -> ExtractedToolCallInformation:
    return ToolParserManager.get_tool_parser(name)().extract_tool_calls(output)


def stream(name: str, pieces: list[str]) -> tuple[str | None, list[FunctionCall]]:
    """Feed `pieces` as deltas; check each call's deltas (name first, once, with arguments
    "", then fragments; indices in order) and return the joined content and the calls."""
    parser = ToolParserManager.get_tool_parser(name)()
    messages, current = [], ""
    for piece in pieces:
        previous, current = current, current + piece
        messages.append(parser.extract_tool_calls_streaming(previous, current, piece))
    messages.append(parser.finish_streaming())
    content, deltas = "", []
    for message in messages:
        if message is not None:
            assert message.content or message.tool_calls  # never an empty message
            content += message.content or ""
            deltas += message.tool_calls
    calls: list[list] = []
    for delta in deltas:
        assert isinstance(delta, DeltaToolCall)
        if delta.name is not None:
            assert delta.index == len(calls) and delta.arguments == ""
            calls.append([delta.name, ""])
        else:
            assert delta.index == len(calls) - 1
            calls[-1][1] += delta.arguments
    return content or None, [FunctionCall(name=n, arguments=a) for n, a in calls]


def check(name: str, output: str, calls, content: str | None) -> None:
    """Non-streaming gives exactly (calls, content); streaming, in one piece and one character
    at a time, gives the same."""
    result = parse(name, output)
    if calls is NOT_CALLS:
        assert result == ExtractedToolCallInformation(False, [], output)
        calls, content = [], output or None
    else:
        assert result == ExtractedToolCallInformation(True, calls, content)
    assert stream(name, [output]) == (content, calls)
    assert stream(name, list(output)) == (content, calls)


F = FunctionCall

HERMES_CASES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [F("get_weather", '{"city": "Paris"}')], None),
    ('Let me check.\n<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
     '<tool_call>{"name": "b", "arguments": {}}</tool_call>',
     [F("a", '{"x": 1}'), F("b", "{}")], "Let me check.\n"),
    # An unclosed last block (the model stopped at EOS) still counts, as in vLLM.
    ('<tool_call>{"name": "a", "arguments": {"n": {"deep": [1, 2.5, null, true]}}}',
     [F("a", '{"n": {"deep": [1, 2.5, null, true]}}')], None),
    # Unicode is kept as characters, whether the model escaped it or not.
    ('Voilà <tool_call>{"name": "dire", "arguments": {"mot": "\\u00e9t\\u00e9 \u6771\u4eac'
     ' \U0001f600"}}</tool_call>', [F("dire", '{"mot": "été 東京 😀"}')], "Voilà "),
    # Text after a block is dropped; a `<` that is not a tag is content.
    ('a < b <tool <tool_call>{"name": "f", "arguments": "raw"}</tool_call> bye',
     [F("f", '"raw"')], "a < b <tool "),
    ('No tools here, just <tool_ca', NOT_CALLS, None),
    ('', NOT_CALLS, None),
    ('Hi <tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', NOT_CALLS, None),
    ('<tool_call>{"name": "f"}</tool_call>', NOT_CALLS, None),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', NOT_CALLS, None),
    ('<tool_call>["f", {}]</tool_call>', NOT_CALLS, None),
    ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', NOT_CALLS, None),
    ('<tool_call>{"name": "f", "arguments": {"x": "\\ud800"}}</tool_call>', NOT_CALLS, None),
]

LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
     [F("get_weather", '{"city": "Paris"}')], None),
    ('<|python_tag|>{"name": "a", "arguments": {"s": "};{"}} ; {"name": "b", '
     '"parameters": {"l": [{"m": []}]}}', [F("a", '{"s": "};{"}'), F("b", '{"l": [{"m": []}]}')],
     None),
    # "arguments" wins over "parameters"; text after the calls is dropped, as in vLLM.
    ('{"name": "f", "parameters": {"p": 1}, "arguments": {"a": "\u00e9"}}\nDone.',
     [F("f", '{"a": "é"}')], None),
    ('  \n{"name": "f", "arguments": {}};', [F("f", "{}")], None),
    ('The answer is {"name": "f", "arguments": {}}', NOT_CALLS, None),
    ('<|python_tag|>print(1)', NOT_CALLS, None),
    ('<|python_ta', NOT_CALLS, None),
    ('{"name": "f", "arguments": {"a": 1}', NOT_CALLS, None),
    ('{"name": "f", "arguments": {"a": 1}}}', [F("f", '{"a": 1}')], None),
    ('{"nom": "f", "arguments": {}}', NOT_CALLS, None),
]

PYTHONIC_CASES = [
    ('[get_weather(city="Paris")]', [F("get_weather", '{"city": "Paris"}')], None),
    ("[a(x=1, y=-2.5, z=True), b(), c(s='it''s', t=\"\"\"multi\nline)\"\"\", n=None,)]",
     [F("a", '{"x": 1, "y": -2.5, "z": true}'), F("b", "{}"),
      F("c", '{"s": "its", "t": "multi\\nline)", "n": null}')], None),
    ("[f(d={'k': [1, {'j': 'é東'}], \"q\": '\\'\\\\'}),]\n",
     [F("f", '{"d": {"k": [1, {"j": "é東"}], "q": "\'\\\\"}}')], None),
    ("[f(a=1,  # why\n b=')')]", [F("f", '{"a": 1, "b": ")"}')], None),
    ("[\n  f\n  (a=[1,\n 2]),\n  g()\n]", [F("f", '{"a": [1, 2]}'), F("g", "{}")], None),
    ("Sure: [f()]", NOT_CALLS, None),
    ("[1] is a citation", NOT_CALLS, None),
    ("[]", NOT_CALLS, None),
    ("[f(1)]", NOT_CALLS, None),
    ("[f(x=y)]", NOT_CALLS, None),
    ("[f(x=1+2)]", NOT_CALLS, None),
    ("[f(x=(1, 2))]", NOT_CALLS, None),
    ("[f(x=b'1')]", NOT_CALLS, None),
    ("[f(x=1e999)]", NOT_CALLS, None),
    ("[f(**{'a': 1})]", NOT_CALLS, None),
    ("[f(x={1: 2})]", NOT_CALLS, None),
    ("[mod.f()]", NOT_CALLS, None),
]


@pytest.mark.parametrize("output, calls, content", HERMES_CASES)
def test_hermes(output, calls, content):
    check("hermes", output, calls, content)


@pytest.mark.parametrize("output, calls, content", LLAMA_CASES)
def test_llama3_json(output, calls, content):
    check("llama3_json", output, calls, content)


@pytest.mark.parametrize("output, calls, content", PYTHONIC_CASES)
def test_pythonic(output, calls, content):
    check("pythonic", output, calls, content)


LATE_MALFORMED = [
    ("hermes", 'Hi<tool_call>{"name": "f", "arguments": {}}</tool_call> <tool_call>{bad',
     "Hi <tool_call>{bad"),
    ("llama3_json", '{"name": "f", "arguments": {}}; {"name": "g"}', '; {"name": "g"}'),
    ("pythonic", "[f(), g(b=)", ", g(b=)"),
    ("pythonic", "[f()] and more", " and more"),
]


@pytest.mark.parametrize("name, output, streamed_content", LATE_MALFORMED)
def test_a_stream_cannot_take_back_sent_calls(name, output, streamed_content):
    """A malformed call after a good one: non-streaming, the output is content (vLLM); the
    stream has sent the good call already, and sends the rest from its end as content."""
    assert parse(name, output) == ExtractedToolCallInformation(False, [], output)
    calls = [F("f", "{}")]
    assert stream(name, [output]) == stream(name, list(output)) == (streamed_content, calls)


def test_held_back_text_is_sent_once_decided():
    parser = ToolParserManager.get_tool_parser("hermes")()
    first = parser.extract_tool_calls_streaming("", "x <tool_", "x <tool_")
    assert first.content == "x " and first.tool_calls == []
    assert parser.extract_tool_calls_streaming("x <tool_", "x <tool_c", "c") is None
    assert parser.extract_tool_calls_streaming("x <tool_c", "x <tool_cat", "at").content == (
        "<tool_cat")


def test_manager():
    assert ToolParserManager.names() == ["hermes", "llama3_json", "llama4_json", "pythonic"]
    with pytest.raises(ValueError) as e:
        ToolParserManager.get_tool_parser("mistral")
    assert str(e.value) == ("invalid tool_call_parser: 'mistral' (choose from hermes, "
                            "llama3_json, llama4_json, pythonic)")


# -- properties -------------------------------------------------------------------------

# Text rich in the characters the parsers look at, so that splits land inside tags and keys.
TEXT = st.text(st.sampled_from(list('<>/_tool_call{}[]()"\'\\:;,= \n#aé東😀')) | st.characters(codec="utf-8"),
               max_size=12)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20)
    | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8)
IDENTIFIERS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True).filter(
    lambda s: not keyword.iskeyword(s))
CALLS = st.lists(st.tuples(IDENTIFIERS, st.dictionaries(IDENTIFIERS, JSON_VALUES, max_size=3)),
                 min_size=1, max_size=3)


def expected(calls) -> list[FunctionCall]:
    return [F(name, json.dumps(args, ensure_ascii=False)) for name, args in calls]


def split(output: str, cuts: list[int]) -> list[str]:
    points = sorted({cut % (len(output) + 1) for cut in cuts} | {0, len(output)})
    return [output[a:b] for a, b in zip(points, points[1:])]


def check_property(name: str, output: str, calls, content: str | None, cuts) -> None:
    assert parse(name, output) == ExtractedToolCallInformation(True, expected(calls), content)
    assert stream(name, split(output, cuts)) == (content, expected(calls))


CUTS = st.lists(st.integers(0, 10**6), max_size=40)
SETTINGS = settings(max_examples=60, deadline=None)


@SETTINGS
@given(CALLS, TEXT, st.booleans(), st.sampled_from([None, 1]), CUTS)
def test_hermes_property(calls, content, ascii_, indent, cuts):
    blocks = [json.dumps({"name": n, "arguments": a}, ensure_ascii=ascii_, indent=indent)
              for n, a in calls]
    assume("<tool_call>" not in content and not any("</tool_call>" in b for b in blocks))
    output = content + "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
    check_property("hermes", output, calls, content or None, cuts)


@SETTINGS
@given(CALLS, st.booleans(), st.booleans(), st.sampled_from(["arguments", "parameters"]),
       CUTS)
def test_llama3_json_property(calls, python_tag, ascii_, key, cuts):
    objects = [json.dumps({"name": n, key: a}, ensure_ascii=ascii_) for n, a in calls]
    output = ("<|python_tag|>" if python_tag else "") + "; ".join(objects)
    check_property("llama3_json", output, calls, None, cuts)


@SETTINGS
@given(CALLS, st.sampled_from([", ", ",\n ", ","]), CUTS)
def test_pythonic_property(calls, separator, cuts):
    # repr writes Python literals: quotes of either kind, escapes, negative numbers.
    rendered = [f"{n}({separator.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls]
    output = "[" + separator.join(rendered) + "]"
    check_property("pythonic", output, calls, None, cuts)


# Pieces of every parser's syntax, so that random outputs are half-formed calls of all kinds.
FRAGMENTS = st.sampled_from([
    "<tool_call>", "</tool_call>", "<|python_tag|>", '{"name": "f", "arguments": {"a": 1}}',
    '{"name": "g", "parameters": {}}', "; ", "[", "]", "f(a=1)", "g()", ", ", '"', "'", "{",
    "}", "(", ")", "x", " ", "\n", "\\", "#", "'''", "é"])


@settings(max_examples=150, deadline=None)
@given(st.lists(FRAGMENTS, max_size=12), CUTS,
       st.sampled_from(["hermes", "llama3_json", "pythonic"]))
def test_any_output_streams_the_same_in_any_pieces(fragments, cuts, name):
    """Whatever the output, how it is split does not change what the stream sends; and the
    stream agrees with the non-streaming parse unless it had to take back a call."""
    output = "".join(fragments)
    whole = stream(name, [output])
    assert stream(name, split(output, cuts)) == whole
    result = parse(name, output)
    if result.tools_called:
        assert whole == (result.content, result.tool_calls)
    elif not whole[1]:
        assert whole == (output or None, [])
