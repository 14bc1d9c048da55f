"""tool_choice="auto" through the server's app (in-process, the tiny model) with the openai
client: a `structured_outputs` choice makes the model write exactly a Hermes-format output,
which the server's `hermes` parser reads back, whole and streamed token by token. Exact
contents, calls and finish reasons; a stream's pieces join to the non-streamed message.

Also the tool-use case of vLLM's test_return_token_ids (tests/entrypoints/openai/basic/
test_return_token_ids.py, vLLM 0.32; its other cases are in test_vllm_ports.py)."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest

from engine_e2e.tiny_model import build_tiny_llama_dir
from jaxllm import AsyncEngineArgs, AsyncLLM
from jaxllm.entrypoints.openai.api_server import build_app
from jaxllm.entrypoints.openai.serving import OpenAIServing

from inprocess_app import ENGINE

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time"}}]
# A system message keeps the template's default one (a long sentence) out of the prompt.
MESSAGES = [{"role": "system", "content": "."}, {"role": "user", "content": "Paris?"}]
CALLS_OUTPUT = ('Let me see. <tool_call>\n{"name": "get_weather", "arguments": {"city": '
                '"Par\\u00eds"}}\n</tool_call>\n<tool_call>{"name":"get_time","arguments":{}}'
                '</tool_call>')
CALLS = [("get_weather", '{"city": "París"}'), ("get_time", "{}")]
TEXT_OUTPUT = "No tools: 1 < 2 <tool"
ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    engine = AsyncLLM(AsyncEngineArgs(
        model=build_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny_auto_tools"))),
        **{**ENGINE, "max_model_len": 256}))
    app = build_app(engine, served_model_names=["tiny"], enable_auto_tools=True,
                    tool_parser="hermes")
    yield app
    engine.shutdown()


def client_run(app, fn):
    """`await fn(client)` with an openai.AsyncOpenAI talking to the in-process app."""
    async def one():
        transport = httpx.ASGITransport(app=app)
        async with openai.AsyncOpenAI(
                base_url="http://jaxllm/v1", api_key="unused", max_retries=0,
                http_client=httpx.AsyncClient(transport=transport, base_url="http://jaxllm",
                                              timeout=300)) as client:
            return await fn(client)

    return asyncio.run(one())


def chat(app, output: str, stream: bool, n: int = 1):
    """The response to MESSAGES with TOOLS (tool_choice left to its default, "auto") when
    the model can write nothing but `output`; a stream's chunks as a list."""
    async def one(client):
        response = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=0,
            stream=stream, n=n, extra_body={"structured_outputs": {"choice": [output]}})
        if not stream:
            return response
        return [chunk async for chunk in response]

    return client_run(app, one)


def test_auto_tool_calls_whole_and_streamed(app):
    choice, = chat(app, CALLS_OUTPUT, stream=False).choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me see. "
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == CALLS
    assert all(ID.fullmatch(c.id) and c.type == "function" for c in choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == 2

    # Two choices, each read by its own parser, their chunks interleaved.
    chunks = chat(app, CALLS_OUTPUT, stream=True, n=2)
    # vLLM's first chunks: one per choice, each with its role
    assert [[(c.index, c.delta.role) for c in chunk.choices] for chunk in chunks[:2]] == \
        [[(0, "assistant")], [(1, "assistant")]]
    content, calls, finishes = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}
    for chunk in chunks[2:]:
        c, = chunk.choices
        content[c.index] += c.delta.content or ""
        finishes[c.index].append(c.finish_reason)
        mine = calls[c.index]
        for d in c.delta.tool_calls or []:
            if d.id is not None:  # a call's header: its id, type and name, once
                assert ID.fullmatch(d.id) and d.type == "function"
                assert d.index == len(mine) and d.function.arguments == ""
                mine.append([d.function.name, ""])
            else:
                assert d.index == len(mine) - 1 and d.function.name is None
                mine[-1][1] += d.function.arguments
    for i in (0, 1):
        assert content[i] == "Let me see. "
        assert [tuple(c) for c in calls[i]] == CALLS
        assert finishes[i][-1] == "tool_calls" and set(finishes[i][:-1]) == {None}


def test_auto_without_tool_calls_is_content(app):
    choice, = chat(app, TEXT_OUTPUT, stream=False).choices
    assert (choice.message.content, choice.message.tool_calls) == (TEXT_OUTPUT, None)
    assert choice.finish_reason == "stop"
    chunks = chat(app, TEXT_OUTPUT, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == TEXT_OUTPUT
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_an_unknown_tool_call_parser_is_refused(app):
    with pytest.raises(ValueError) as e:
        OpenAIServing(app.state.serving.engine, ["tiny"], None, enable_auto_tools=True,
                      tool_parser="mistral")
    assert str(e.value) == ("invalid tool_call_parser: 'mistral' (choose from hermes, "
                            "llama3_json, llama4_json, pythonic)")


# ---- vLLM's tests/entrypoints/openai/basic/test_return_token_ids.py --------------------
# test_chat_completion_with_tool_use. Adaptations: the tiny random model; vLLM's test
# checks the tool call only "if one was made", which a random model never does, so a second
# request has the model write CALLS_OUTPUT (a structured_outputs choice) and the tool-call
# branch is checked for sure.
WEATHER_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string",
                     "description": "The city and state, e.g. San Francisco, CA"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"],
                 "description": "The unit of temperature"}},
        "required": ["location"]}}}]
WEATHER_MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "What's the weather like in Paris?"}]


def test_chat_completion_with_tool_use(app):
    tokenizer = app.state.serving.engine.tokenizer

    async def run(client):
        def create(return_token_ids: bool, **extra):
            return client.chat.completions.create(
                model="tiny", messages=WEATHER_MESSAGES, tools=WEATHER_TOOL,
                tool_choice="auto", max_tokens=100, temperature=0, logprobs=True,
                extra_body={"return_token_ids": return_token_ids, **extra})

        response = await create(True)
        choice = response.choices[0]
        assert isinstance(choice.token_ids, list) and isinstance(response.prompt_token_ids,
                                                                 list)
        prompt_text = tokenizer.decode(response.prompt_token_ids)
        assert "You are a helpful assistant" in prompt_text
        assert "What's the weather like in Paris?" in prompt_text
        assert len(tokenizer.decode(choice.token_ids)) > 0
        assert choice.message.content is not None
        # the random model's own words: no call, its content is every token it wrote
        assert choice.message.tool_calls is None
        assert choice.message.content == tokenizer.decode(choice.token_ids)
        assert [t.token for t in choice.logprobs.content] == [
            tokenizer.decode([t]) for t in choice.token_ids]

        # the model writes two tool calls: the tokens are the whole output, calls included,
        # and the EOS that ended it (as vLLM's, whose test notes the <|im_end|>)
        called = await create(True, structured_outputs={"choice": [CALLS_OUTPUT]})
        choice = called.choices[0]
        assert tokenizer.decode(choice.token_ids) == CALLS_OUTPUT + tokenizer.eos_token
        assert choice.finish_reason == "tool_calls"
        assert called.prompt_token_ids == response.prompt_token_ids
        assert choice.message.content == "Let me see. "
        assert choice.message.tool_calls[0].function.name == "get_weather"
        assert [(c.function.name, c.function.arguments)
                for c in choice.message.tool_calls] == CALLS

        without = await create(False)
        assert without.choices[0].token_ids is None and without.prompt_token_ids is None
        assert without.choices[0].message.content == response.choices[0].message.content

    client_run(app, run)
