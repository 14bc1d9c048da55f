"""vLLM's own entrypoint tests (tests/entrypoints/openai/ of vLLM 0.32), ported to the
in-process server and the `openai` client, plus a check that every response shape parses
with the client's pydantic models without a warning.

Adaptations, everywhere: the tiny random Llama with SmolLM2's tokenizer instead of vLLM's
models (Zephyr, Qwen2); max_model_len 64 and max_logprobs 20 (so vLLM's -1 logprobs become
20); a random model never says EOS, so finish_reason is "length" where vLLM's say "stop".
Each test names its source and any other adaptation. Ported elsewhere: the tool-use case of
test_return_token_ids (test_auto_tool_choice.py, whose app parses tool calls). Not ported:
LoRA and multimodal variants.
"""

from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from jaxllm.entrypoints.openai.completion_choices import (CompletionShape, StreamedChoices,
                                                          whole_choice)
from jaxllm.entrypoints.openai.logprobs_format import completion_logprobs
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput

from inprocess_app import error_of


@pytest.fixture(scope="module")
def server(inprocess_server):
    return inprocess_server  # conftest.py's, shared with the other in-process modules


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.engine.tokenizer


@pytest.fixture(autouse=True)
def idle_after(server):
    yield
    server.assert_idle()


def with_client(server, fn):
    """Run `await fn(client)` with an openai.AsyncOpenAI talking to the in-process app."""
    async def main():
        async with server.client() as http:
            client = openai.AsyncOpenAI(base_url="http://jaxllm/v1", api_key="unused",
                                        http_client=http)
            return await fn(client)

    return asyncio.run(main())


# ---- tests/entrypoints/openai/completion/test_completion_text_offset.py ------------------
# Adaptation: it drives vLLM's serving class with hand-made outputs; here the same outputs go
# through completion_choices.py (the part of jaxllm that builds them).

TOKENS = [(1, "abc"), (2, " de"), (3, "!")]
TEXT_DELTAS = ["ab", "c d", "e!"]  # stop=["\n\n"] holds one character back


def _output(text, idxs, finished):
    logprobs = [{TOKENS[i][0]: Logprob(-1.0, 1, TOKENS[i][1])} for i in idxs]
    return RequestOutput("r", "Hi", [9], None, [CompletionOutput(
        0, text, [TOKENS[i][0] for i in idxs], None, logprobs,
        "stop" if finished else None)], finished)


def test_stream_text_offset_matches_non_stream_with_stop_holdback():
    shape = CompletionShape(k=0, echo=False, echo_only=False, token_ids=False, as_ids=False)
    stream = StreamedChoices(shape, decode=None)
    offsets = []
    for i, text in enumerate(TEXT_DELTAS):
        out = _output(text, [i], i == len(TEXT_DELTAS) - 1)
        offsets += stream.chunk_choice(0, out, out.outputs[0], "Hi")["logprobs"]["text_offset"]
    whole = _output("".join(TEXT_DELTAS), [0, 1, 2], True)
    choice = whole_choice(shape, 0, whole, whole.outputs[0], "Hi", None)
    assert choice["logprobs"]["text_offset"] == [0, 3, 6]
    assert offsets == [0, 3, 6]


# ---- tests/entrypoints/openai/completion/test_completion_logprobs.py ---------------------

def test_completion_logprobs_handles_sampled_token_absent_from_step():
    decoded = []
    top = [{1: Logprob(-0.1, 1, "a"), 2: Logprob(-0.2, 2, "b")}]
    result = completion_logprobs([5], top, 2, 0,
                                 decode=lambda t: decoded.append(t) or "<special>")
    assert result["tokens"] == ["<special>"]
    assert result["token_logprobs"] == [None] and result["top_logprobs"] == [None]
    assert decoded == [5]


# ---- tests/entrypoints/openai/completion/test_completion.py: test_echo_logprob_completion -

@pytest.mark.parametrize("logprobs_arg", [1, 0])
def test_echo_logprob_completion(server, tokenizer, logprobs_arg):
    async def run(client):
        for prompt in ("Hello, my name is", [0, 0, 0, 0, 0]):
            completion = await client.completions.create(
                model="tiny", prompt=prompt, max_tokens=5, temperature=0.0, echo=True,
                logprobs=logprobs_arg)
            prompt_text = tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
            assert re.search(r"^" + re.escape(prompt_text), completion.choices[0].text)
            logprobs = completion.choices[0].logprobs
            assert len(logprobs.text_offset) > 5
            assert len(logprobs.token_logprobs) > 5 and logprobs.token_logprobs[0] is None
            assert len(logprobs.top_logprobs) > 5 and logprobs.top_logprobs[0] is None
            for top_logprobs in logprobs.top_logprobs[1:]:
                assert max(logprobs_arg, 1) <= len(top_logprobs) <= logprobs_arg + 1
            assert len(logprobs.tokens) > 5

    with_client(server, run)


# ---- tests/entrypoints/openai/test_return_tokens_as_ids.py --------------------------------
# Adaptation: the server flag (--return-tokens-as-token-ids) is the serving object's default,
# set on the shared server for the test instead of starting a second server.

@pytest.mark.parametrize("use_server_flag", [True, False])
def test_return_tokens_as_token_ids(server, tokenizer, monkeypatch, use_server_flag):
    extra = {}
    if use_server_flag:
        monkeypatch.setattr(server.app.state.serving, "return_tokens_as_token_ids", True)
    else:
        extra["return_tokens_as_token_ids"] = True

    async def run(client):
        completion = await client.completions.create(
            model="tiny", prompt="Say 'Hello, world! 🎉'", echo=True, temperature=0,
            max_tokens=10, logprobs=1, extra_body=extra)
        text = completion.choices[0].text
        token_strs = completion.choices[0].logprobs.tokens
        keys = [next(iter(top)) for top in completion.choices[0].logprobs.top_logprobs[1:]]
        assert token_strs[1:] == keys
        tokens = [int(token.removeprefix("token_id:")) for token in token_strs]
        assert text == tokenizer.decode(tokens, skip_special_tokens=True)
        response = await client.chat.completions.create(
            model="tiny", temperature=0, max_tokens=8, logprobs=True, extra_body=extra,
            messages=[{"role": "system", "content": "You like to respond in only emojis, "
                                                    "like 🎉"},
                      {"role": "user", "content": "Please write some emojis: 🐱🐶🎉"}])
        token_ids = [int(c.token.removeprefix("token_id:"))
                     for c in response.choices[0].logprobs.content]
        assert tokenizer.decode(token_ids, skip_special_tokens=True) == \
            response.choices[0].message.content

    with_client(server, run)


# ---- tests/entrypoints/openai/basic/test_return_token_ids.py ------------------------------

def test_basic_completion_with_emoji(server, tokenizer):
    async def run(client):
        prompt = "Complete this sentence with emojis: I love coding 🚀"
        completion = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=1,
            extra_body={"return_token_ids": True})
        choice = completion.choices[0]
        encoded = tokenizer.encode(prompt)
        ids = choice.prompt_token_ids
        assert any(ids[i:i + len(encoded)] == encoded for i in range(len(ids) - len(encoded) + 1))
        assert isinstance(choice.token_ids, list) and len(choice.token_ids) > 0
        assert tokenizer.decode(choice.token_ids).startswith(choice.text)
        without = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=1,
            extra_body={"return_token_ids": False})
        assert without.model_dump()["choices"][0].get("token_ids") is None

    with_client(server, run)


def test_comparison_with_prompt_logprobs_and_logprobs(server, tokenizer):
    async def run(client):
        completion = await client.completions.create(
            model="tiny", prompt="Hello, world! How are you today?", max_tokens=20,
            temperature=0, echo=True, logprobs=1,
            extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True,
                        "prompt_logprobs": 1})
        choice = completion.choices[0]
        assert choice.prompt_logprobs is not None and choice.logprobs is not None
        ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
        assert len(choice.token_ids) < len(ids)
        assert ids[-len(choice.token_ids):] == choice.token_ids
        assert "Hello, world" in tokenizer.decode(choice.prompt_token_ids)
        assert choice.text.endswith(tokenizer.decode(choice.token_ids))
        stream = await client.completions.create(
            model="tiny", prompt="Tell me a short fact about Python:", max_tokens=30,
            temperature=0, stream=True, echo=False, logprobs=1,
            extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
        prompt_ids, token_ids, logprob_ids, first = [], [], [], True
        async for chunk in stream:
            logprob_ids += [int(t.removeprefix("token_id:"))
                            for t in chunk.choices[0].logprobs.tokens]
            if first:
                prompt_ids, first = chunk.choices[0].prompt_token_ids, False
            token_ids += chunk.choices[0].token_ids
        assert len(prompt_ids) > 0 and token_ids == logprob_ids

    with_client(server, run)


def test_chat_completion_with_emoji_and_token_ids(server, tokenizer):
    messages = [{"role": "system", "content": "You like to use emojis in your responses."},
                {"role": "user", "content": "Repeat after me: I love cats 🐱"}]

    async def run(client):
        response = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=20, temperature=0, logprobs=True,
            extra_body={"return_token_ids": True})
        assert "prompt_token_ids" in response.model_dump()
        decoded_prompt = tokenizer.decode(response.prompt_token_ids)
        assert "I love cats 🐱" in decoded_prompt
        assert len(tokenizer.decode(response.choices[0].token_ids)) > 0
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=20, temperature=0, stream=True,
            extra_body={"return_token_ids": True})
        content, token_ids, first = "", [], True
        async for chunk in stream:
            if first:
                assert tokenizer.decode(chunk.prompt_token_ids) == decoded_prompt
                first = False
            else:
                assert "prompt_token_ids" not in chunk.model_dump()
            if chunk.choices:
                content += chunk.choices[0].delta.content or ""
                token_ids += chunk.choices[0].model_dump().get("token_ids") or []
        assert len(content) > 0 and tokenizer.decode(token_ids) == content

    with_client(server, run)


# ---- tests/entrypoints/openai/chat_completion/test_chat_echo.py ----------------------------
# Adaptations: max_tokens=5 (a random model runs to the context's end), so finish_reason is
# "length"; prompt_logprobs 20 for -1 (max_logprobs is 20 here).

@pytest.mark.parametrize("echo", [True, False])
def test_chat_session_with_echo_and_continue_final_message(server, echo):
    saying = "Here is a common saying about apple. An apple a day, keeps"

    async def run(client):
        completion = await client.chat.completions.create(
            model="tiny", max_tokens=5,
            messages=[{"role": "user", "content": "tell me a common saying"},
                      {"role": "assistant", "content": saying}],
            extra_body={"echo": echo, "continue_final_message": True,
                        "add_generation_prompt": False})
        choice, = completion.choices
        assert choice.finish_reason == "length"
        assert (saying in choice.message.content) == echo
        assert choice.message.role == "assistant"

    with_client(server, run)


def test_chat_prompt_logprobs(server):
    async def run(client):
        completion = await client.chat.completions.create(
            model="tiny", max_tokens=1, extra_body={"prompt_logprobs": 20},
            messages=[{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "Beijing is the capital of which country?"}])
        assert completion.prompt_logprobs is not None and len(completion.prompt_logprobs) > 0

    with_client(server, run)


# ---- max_completion_tokens (OpenAI's name; vLLM's test_chat.py) ---------------------------

def test_max_completion_tokens_wins_over_max_tokens(server):
    async def run(client):
        out = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], temperature=0,
            max_completion_tokens=5, max_tokens=3, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"

    with_client(server, run)


# ---- every response shape parses with the openai client's models, warnings being errors --
# Two shapes are OpenAI's (and vLLM's) wire format but not declared by the client's types,
# which the client builds without validating (the ports above read them through it): echo's
# first token, whose token_logprob and top_logprobs are null, and a completion chunk's null
# finish_reason before the last chunk.

def test_responses_validate_against_the_openai_models(server):
    c = {"prompt": "Hi", "max_tokens": 3, "temperature": 0, "logprobs": 2,
         "return_token_ids": True, "prompt_logprobs": 1}
    ch = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
          "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
          "prompt_logprobs": 1, "return_prompt_text": True}
    usage = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    Completion.model_validate(server.post("/v1/completions", c).json()).model_dump()
    ChatCompletion.model_validate(server.post("/v1/chat/completions", ch).json()).model_dump()
    for path, body, model in (("/v1/completions", c, Completion),
                              ("/v1/chat/completions", ch, ChatCompletionChunk)):
        stream = {**body, "stream": True, **usage, "prompt_logprobs": None}
        lines = [line for line in server.post(path, stream).text.splitlines() if line]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            chunk = json.loads(line[6:])
            if model is Completion and chunk["choices"] and \
                    chunk["choices"][0]["finish_reason"] is None:
                continue
            model.model_validate(chunk).model_dump()
    beams = {"prompt": "Hi", "max_tokens": 2, "n": 2, "use_beam_search": True}
    Completion.model_validate(server.post("/v1/completions", beams).json()).model_dump()
    error_of(server.post("/v1/completions", {**beams, "stream": True}), 400)
