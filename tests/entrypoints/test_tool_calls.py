"""Reading constrained outputs back as tool calls (tool_calls.py), without a model: the
"required" array scanner at every split of its text, the deltas' exact shapes, and which
outputs count as tool calls."""

from __future__ import annotations

import json
import re

import pytest

from jaxllm.entrypoints.openai.tool_calls import (NamedToolCallReader, RequiredToolCallReader,
                                                  make_tool_call_id, stream_choices,
                                                  tool_call_delta, tool_choice_message)
from jaxllm.outputs import CompletionOutput

ARRAY = ('[ {"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "days": [1, {"a": 2}]}}'
         ' ,\n{"parameters" :{ "zone":"UTC" } , "name":"get_\\u0074ime"},'
         '{"name": "noop", "parameters": 7}]')
CALLS = [("get_weather", '{"city": "Pa\\"ris}", "days": [1, {"a": 2}]}'),
         ("get_time", '{ "zone":"UTC" }'), ("noop", "7")]


def read(reader, pieces):
    """(deltas as dicts, in order), fed piece by piece."""
    return [d.as_dict() for piece in pieces for d in reader.feed(piece)]


def joined(deltas) -> list[tuple[str, str]]:
    calls = []
    for d in deltas:
        if "id" in d:
            assert d["index"] == len(calls) and d["function"]["arguments"] == ""
            calls.append([d["function"]["name"], ""])
        else:
            assert d["index"] == len(calls) - 1
            calls[-1][1] += d["function"]["arguments"]
    return [tuple(c) for c in calls]


def test_required_array_read_whole():
    reader = RequiredToolCallReader()
    deltas = read(reader, [ARRAY])
    assert [d.get("id") is not None for d in deltas] == [True, False, True, False, True,
                                                         False]
    assert joined(deltas) == CALLS
    assert [(c["name"], c["arguments"]) for c in reader.calls] == CALLS
    assert [c["id"] for c in reader.calls] == [d["id"] for d in deltas if "id" in d]
    assert reader.complete()
    # Each call's arguments are its parameters' exact text.
    assert [json.loads(a) for _, a in CALLS] == [c["parameters"] for c in json.loads(ARRAY)]


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_required_array_read_in_pieces_gives_the_same_calls(step):
    pieces = [ARRAY[i:i + step] for i in range(0, len(ARRAY), step)]
    reader = RequiredToolCallReader()
    deltas = read(reader, pieces)
    assert joined(deltas) == CALLS
    assert all(d["function"]["arguments"] for d in deltas if "id" not in d)  # none empty


def test_every_two_piece_split_gives_the_same_calls():
    for cut in range(len(ARRAY) + 1):
        assert joined(read(RequiredToolCallReader(), [ARRAY[:cut], ARRAY[cut:]])) == CALLS


def test_arguments_wait_for_the_name_when_it_comes_second():
    reader = RequiredToolCallReader()
    assert read(reader, ['[{"parameters": {"zone": "CET"}, "na']) == []
    header, arguments = read(reader, ['me": "get_time"}'])
    assert header == {"index": 0, "id": reader.calls[0]["id"], "type": "function",
                      "function": {"name": "get_time", "arguments": ""}}
    assert arguments == {"index": 0, "function": {"arguments": '{"zone": "CET"}'}}
    assert not reader.complete()  # the array is still open
    assert read(reader, ["]"]) == [] and reader.complete()


def test_named_reader_sends_its_header_first():
    reader = NamedToolCallReader("f")
    first = read(reader, ['{"a"'])
    assert first == [{"index": 0, "id": reader.calls[0]["id"], "type": "function",
                      "function": {"name": "f", "arguments": ""}},
                     {"index": 0, "function": {"arguments": '{"a"'}}]
    assert read(reader, [""]) == []
    assert read(reader, [": 1}"]) == [{"index": 0, "function": {"arguments": ": 1}"}}]
    assert reader.calls[0]["arguments"] == '{"a": 1}' and reader.complete()


def test_whole_outputs_are_tool_calls_only_when_complete_and_stopped():
    message, finish = tool_choice_message(NamedToolCallReader("f"), '{"a": 1}', "stop")
    assert finish == "tool_calls" and message["content"] == ""
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "f",
                                                                "arguments": '{"a": 1}'}
    # Cut by max_tokens, or by a stop string before the JSON closed: text, no calls.
    assert tool_choice_message(NamedToolCallReader("f"), '{"a": 1}', "length") == (
        {"role": "assistant", "content": '{"a": 1}'}, "length")
    assert tool_choice_message(NamedToolCallReader("f"), '{"a"', "stop") == (
        {"role": "assistant", "content": '{"a"'}, "stop")
    deep = "[" * 100_000 + "]" * 100_000  # past Python's json recursion limit
    assert tool_choice_message(NamedToolCallReader("f"), deep, "stop") == (
        {"role": "assistant", "content": deep}, "stop")
    assert tool_choice_message(RequiredToolCallReader(), ARRAY[:-1], "stop") == (
        {"role": "assistant", "content": ARRAY[:-1]}, "stop")
    message, finish = tool_choice_message(RequiredToolCallReader(), ARRAY, "stop")
    assert finish == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in message["tool_calls"]] == CALLS


def test_stream_choices_of_each_output():
    def output(text, finish=None, logprobs=None):
        return CompletionOutput(1, text, [0], None, logprobs, finish, None)

    reader = RequiredToolCallReader()
    assert stream_choices(reader, output('[{"name": '), None) == []  # nothing to show yet
    header, arguments = stream_choices(reader, output('"g", "parameters": {'), None)
    assert header["index"] == 1 and header["delta"]["tool_calls"][0]["id"] is not None
    assert arguments["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}
    header_with_args = stream_choices(NamedToolCallReader("f"), output("{"), [{"x": 1}])
    assert [c["logprobs"] for c in header_with_args] == [[{"x": 1}], None]
    # No delta left but logprobs or a finish: one empty delta carries them.
    assert stream_choices(reader, output("}", logprobs=[{"y": 2}]), [{"y": 2}]) == [
        {"index": 1, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
         "logprobs": [{"y": 2}], "finish_reason": None, "stop_reason": None}]
    assert stream_choices(reader, output("}]", "stop"), None) == [
        {"index": 1, "delta": {}, "logprobs": None, "finish_reason": "tool_calls",
         "stop_reason": None}]
    cut = NamedToolCallReader("f")
    *_, last = stream_choices(cut, output('{"a', "length"), None)
    assert last["finish_reason"] == "length"


def test_ids_and_delta_shapes():
    ids = {make_tool_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch("chatcmpl-tool-[0-9a-f]{32}", i) for i in ids)
    assert tool_call_delta(2, "i", "f", "") == {"index": 2, "id": "i", "type": "function",
                                                "function": {"name": "f", "arguments": ""}}
    assert tool_call_delta(2, None, None, "{") == {"index": 2, "function": {"arguments": "{"}}
