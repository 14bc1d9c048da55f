"""Structured outputs and tool calls through `jaxllm serve` on the real SmolLM2, with the
openai client: response_format (json_schema, json_object), structured_outputs on both
endpoints, tool_choice named and "required" streamed and not (every sampled output is a
tool call whose arguments validate against the tool's schema, and a stream's fragments
concatenate to the non-streamed arguments of the same seed), every refused combination as
a 400 naming its field, and a conversation with tool calls and tool results rendered by a
request's template and by SmolLM2's own. One server for the module; few, short requests
(the CI budget)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from remote_server import RemoteServer

MODEL = "smol"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "The weather of a city"}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
NAMED = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
# Sampled, seeded: n=2 children per request, each its own seed. (One or two sequences
# decode at the same padded shape: few shapes to compile in this module.)
SAMPLED = dict(model=MODEL, messages=ASK, tools=TOOLS, n=2, temperature=1.0, seed=7,
               max_tokens=120)


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(["--served-model-name", MODEL, "--max-model-len", "512",
                        "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                        "--dtype", "float32", "--enforce-eager",
                        "--trust-request-chat-template"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def streamed_calls(chunks) -> dict[int, list[dict]]:
    """choice index -> its calls (id, name, arguments) put together from tool-call deltas,
    checking that each call's header comes first, once."""
    calls: dict[int, list[dict]] = {}
    finish = {}
    for chunk in chunks:
        for choice in chunk.choices:
            assert not choice.delta.content
            for d in choice.delta.tool_calls or []:
                mine = calls.setdefault(choice.index, [])
                if d.id is not None:
                    assert d.index == len(mine) and d.type == "function"
                    assert d.function.arguments == ""
                    mine.append({"id": d.id, "name": d.function.name, "arguments": ""})
                else:
                    assert d.index == len(mine) - 1 and d.function.name is None
                    mine[-1]["arguments"] += d.function.arguments
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert finish == {i: "tool_calls" for i in calls}
    return calls


def message_calls(choice) -> list[dict]:
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls]


def check_call(call: dict, names: list[str]) -> None:
    assert call["id"].startswith("chatcmpl-tool-") and len(call["id"]) == 14 + 32
    int(call["id"][14:], 16)
    assert call["name"] in names
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("tool_choice, names", [
    (NAMED, ["get_time"]),
    ("required", ["get_weather", "get_time"])])
def test_tool_calls_validate_and_stream_as_they_do_whole(client, tool_choice, names):
    whole = client.chat.completions.create(tool_choice=tool_choice, **SAMPLED)
    assert sorted(c.index for c in whole.choices) == [0, 1]
    by_index = {c.index: message_calls(c) for c in whole.choices}
    for calls in by_index.values():
        assert calls and (len(calls) == 1 or tool_choice == "required")
        for call in calls:
            check_call(call, names)
    streamed = streamed_calls(client.chat.completions.create(
        tool_choice=tool_choice, stream=True, **SAMPLED))
    for i, calls in by_index.items():
        assert [(c["name"], c["arguments"]) for c in streamed[i]] == \
            [(c["name"], c["arguments"]) for c in calls]


def test_a_tool_call_cut_by_length_is_no_tool_call(client):
    out = client.chat.completions.create(tool_choice=NAMED, **{**SAMPLED, "max_tokens": 3})
    assert out.usage.completion_tokens == 6
    for choice in out.choices:
        assert choice.finish_reason == "length" and not choice.message.tool_calls
        assert choice.message.content
    # A stream cannot take back the deltas it sent: it says "length" at the end.
    chunks = list(client.chat.completions.create(tool_choice=NAMED, stream=True,
                                                 **{**SAMPLED, "max_tokens": 3}))
    for choice in out.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert mine[-1].finish_reason == "length"
        assert "".join(d.function.arguments for c in mine
                       for d in c.delta.tool_calls or []) == choice.message.content


def test_response_format_and_structured_outputs(client, server):
    kw = dict(model=MODEL, messages=ASK, n=2, temperature=1.0, seed=3, max_tokens=60)
    out = client.chat.completions.create(response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER,
                                               "strict": True}}, **kw)
    for c in out.choices:
        assert c.finish_reason == "stop" and c.message.tool_calls is None
        jsonschema.validate(json.loads(c.message.content), WEATHER)
    out = client.chat.completions.create(response_format={"type": "json_object"},
                                         **{**kw, "max_tokens": 30})
    for c in out.choices:  # an object, or the start of one when cut by max_tokens
        assert (isinstance(json.loads(c.message.content), dict) if c.finish_reason == "stop"
                else c.message.content.lstrip().startswith("{"))
    out = client.chat.completions.create(
        extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}}, **kw)
    assert {c.message.content for c in out.choices} <= {"sunny", "rainy"}
    # The chat's own prompt as token ids: the steps run at shapes already compiled.
    prompt = httpx.post(server.url + "/tokenize", timeout=30,
                        json={"messages": ASK}).json()["tokens"]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                    temperature=1.0, seed=1, n=2, extra_body={
                                        "structured_outputs": {"regex": "[0-9]{2,3}"}})
    assert all(c.text.isdigit() and 2 <= len(c.text) <= 3 for c in out.choices)


@pytest.mark.parametrize("path, extra, param, message", [
    ("chat", {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "response_format: structured_outputs.json is invalid: "),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", 'response_format of type "json_schema" needs json_schema.schema'),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format.type", "Input should be"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "minProperties": "two"}}}},
     "response_format", "response_format: structured_outputs.json is invalid: "),
    ("chat", {"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex",
     "structured_outputs.regex is invalid: "),
    ("completions", {"structured_outputs": {"grammar": "start: foo"}},
     "structured_outputs.grammar", "structured_outputs.grammar is invalid: "),
    ("completions", {"structured_outputs": {"regex": "a", "json_object": True}},
     "structured_outputs", "You can only use one kind of structured outputs constraint"),
    ("chat", {"structured_outputs": {"pattern": "a"}}, "structured_outputs",
     "structured_outputs has an unknown field"),
    ("chat", {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "response_format", "structured_outputs and response_format each constrain the output"),
    ("chat", {"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
     "tool_choice", "response_format and tool_choice each constrain the output"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "The tool specified in `tool_choice` ('x') does not match any"),
    ("chat", {"tools": TOOLS, "tool_choice": {"function": {}}}, "tool_choice",
     'tool_choice must be "none", "auto", "required" or {"type": "function", '),
    ("chat", {"tool_choice": "required"}, "tool_choice",
     "When using `tool_choice`, `tools` must be set."),
    ("chat", {"tools": TOOLS}, "tool_choice", '"auto" tool choice requires '
                                              "--enable-auto-tool-choice"),
    ("chat", {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", '"auto" tool choice'),
    ("chat", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 5}}}}}],
        "tool_choice": "required"}, "tools", "tools: structured_outputs.json is invalid: "),
])
def test_bad_constraints_are_400s_naming_the_field(client, path, extra, param, message):
    create = (client.chat.completions.create if path == "chat"
              else client.completions.create)
    body = dict(messages=ASK) if path == "chat" else dict(prompt="Hi")
    with pytest.raises(openai.BadRequestError) as info:
        create(model=MODEL, max_tokens=4, extra_body=extra, **body)
    error = info.value.body
    assert error["param"] == param and error["message"].startswith(message), error
    assert error["type"] == "BadRequestError" and error["code"] == 400


def test_a_stream_s_bad_constraint_is_a_400_before_it_starts(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, stream=True,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "foo"}}})
    assert info.value.body["param"] == "response_format"


def test_tool_choice_none_renders_tools_but_generates_text(client, server):
    # "\n" as an expression: chat templates drop the newline right after a block tag.
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}[{{ c.id }} {{ c.function.name }} "
                "{{ c.function.arguments|tojson }}]{% endfor %}"
                "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{{ '\\n' }}"
                "{% endfor %}tools:{% for t in tools or [] %}{{ t.function.name }};"
                "{% endfor %}{{ '\\n' }}assistant:")
    conversation = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call1", "content": "sunny"}]
    rendered = (f"user:{ASK[0]['content']}\n"
                'assistant:[call1 get_weather {"city": "Paris", "days": 3}]\n'
                "tool:sunny(call1)\ntools:get_weather;get_time;\nassistant:")
    out = client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS,
                                         tool_choice="none", max_tokens=2, temperature=0,
                                         extra_body={"chat_template": template})
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content
    tokens = httpx.post(server.url + "/tokenize", timeout=30,
                        json={"prompt": rendered, "add_special_tokens": False}).json()
    assert out.usage.prompt_tokens == tokens["count"]
    # The server's own template (SmolLM2's, which shows no tools) takes the conversation too.
    out = client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS,
                                         tool_choice="none", max_tokens=2, temperature=0)
    tokens = httpx.post(server.url + "/tokenize", timeout=30,
                        json={"messages": conversation}).json()
    assert out.usage.prompt_tokens == tokens["count"] and out.choices[0].message.content
