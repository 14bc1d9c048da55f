"""Issue 15's repros against the server's app, in-process on the tiny model: numbers past
their width (bug 2), lone surrogates (bug 3), a top_p that float32 rounds to 0 and
max_completion_tokens=0 (bug 6), and the catch-all that keeps every 500 OpenAI's error JSON.
Each test asserts the exact status and message; the engine ends idle after each."""

from __future__ import annotations

import asyncio
import json
import logging
import math

import pytest

from jaxllm.entrypoints.openai.serving import OpenAIServing

from inprocess_app import error_of

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def server(inprocess_server):
    # The shared in-process server (conftest.py): request templates are trusted there.
    return inprocess_server


@pytest.fixture(autouse=True)
def idle_after(server):
    yield
    server.assert_idle()


def texts(response) -> list[str]:
    assert response.status_code == 200, response.text
    return [c["text"] if "text" in c else c["message"]["content"]
            for c in response.json()["choices"]]


def test_a_top_k_past_int32_fails_no_other_clients_request(server):
    # One such request failed the whole step: it killed another client's n-way request.
    seeded = {"prompt": "Hi", "temperature": 1, "seed": 1, "max_tokens": 4, "ignore_eos": True}
    many = {"prompt": "Hi", "n": 8, "temperature": 1, "seed": 2, "max_tokens": 4,
            "ignore_eos": True}

    async def both():
        async with server.client() as client:
            return await asyncio.gather(
                client.post("/v1/completions", json={**seeded, "top_k": 2**31}),
                client.post("/v1/completions", json=many))

    huge, other = asyncio.run(both())
    assert texts(huge) == texts(server.post("/v1/completions", seeded))  # k past V is off
    assert [c["finish_reason"] for c in other.json()["choices"]] == ["length"] * 8


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/completions", {"prompt": "Hi", "min_tokens": 2**31, "max_tokens": 2**31}, "max_tokens",
     "max_tokens must be in [1, 2147483647], got 2147483648."),
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2**31 - 1}, "max_tokens",
     "max_tokens=2147483647 does not fit: the prompt has 3 tokens and the model's maximum "
     "context length is 64, so max_tokens must be at most 61."),
    ("/v1/completions", {"prompt": [5] * 60}, "max_tokens",  # the default, 16, as vLLM's
     "max_tokens=16 does not fit: the prompt has 60 tokens and the model's maximum context "
     "length is 64, so max_tokens must be at most 4."),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens",
     "max_tokens must be in [1, 2147483647], got 0."),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens",
     "max_completion_tokens must be in [1, 2147483647], got 0."),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0, "max_tokens": 5},
     "max_completion_tokens", "max_completion_tokens must be in [1, 2147483647], got 0."),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2**31}, "max_tokens",
     "max_tokens must be in [1, 2147483647], got 2147483648."),
    ("/v1/completions", {"prompt": "Hi", "temperature": 1e39}, "temperature",
     "temperature must be in [0.0, 3.4028234663852886e+38], got 1e+39."),
    ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 1e-300}, "repetition_penalty",
     "repetition_penalty must be in [1.401298464324817e-45, 3.4028234663852886e+38], got "
     "1e-300."),
    ("/v1/completions", {"prompt": "Hi", "seed": 2**63}, "seed",
     "Input should be less than or equal to 9223372036854775807 (seed)"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -2}, "top_logprobs",
     "`top_logprobs` must be a positive value or -1."),  # vLLM's message
])
def test_numbers_past_their_width_are_400s_naming_the_field(server, path, body, param,
                                                            message):
    assert error_of(server.post(path, body), 400) == {
        "message": message, "type": "BadRequestError", "param": param, "code": 400}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("n", [16385, 2**31, 2**63, 10**400])
def test_an_n_past_max_n_sequences_is_a_400_naming_n(server, path, n):
    # Nothing bounded n before the cap: 2^31 children would have been fanned out.
    body = {"prompt": "Hi"} if path == "/v1/completions" else CHAT
    assert error_of(server.post(path, {**body, "n": n, "temperature": 1}), 400) == {
        "message": f"n must be at most 16384 (the engine's max_n_sequences), got {n}",
        "type": "BadRequestError", "param": "n", "code": 400}


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "a\\ud800"]}', "prompt[1]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", '
                             '"text": "\\ud800"}]}]}', "messages[0].content[0].text"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                             '"chat_template": "\\ud800"}', "chat_template"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages[0].content"),
    ("/v1/completions", '{"prompt": "ok", "model": "\\ud800"}', "model"),
    ("/v1/completions", '{"prompt": "ok", "\\ud800": 1}', "a field name"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, field):
    # The tokenizer's TypeError was a plain-text 500 (bug 3).
    assert error_of(server.post(path, body), 400)["message"] == (
        f"{field} is not valid Unicode text: it holds the lone surrogate '\\ud800' at "
        f"character {1 if field == 'prompt[1]' else 0}")


def test_a_template_that_renders_a_lone_surrogate_is_a_400(server):
    body = {**CHAT, "chat_template": "{{ '%c' % 55296 }}"}
    assert error_of(server.post("/v1/chat/completions", body), 400)["message"] == (
        "the chat template's output for conversation 0 is not valid Unicode text: it holds "
        "the lone surrogate '\\ud800' at character 0")


def test_a_top_p_that_float32_rounds_to_zero_keeps_the_top_token(server):
    greedy = {**CHAT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    tiny = {**greedy, "temperature": 1, "top_p": 1e-300, "seed": 4}
    assert texts(server.post("/v1/chat/completions", tiny)) == texts(
        server.post("/v1/chat/completions", greedy))


@pytest.mark.parametrize("error", [RuntimeError("injected"), TypeError("injected")])
def test_an_internal_error_is_a_500_with_the_error_json_and_a_logged_traceback(
        server, monkeypatch, caplog, error):
    async def broken(self, req, model):
        raise error

    monkeypatch.setattr(OpenAIServing, "create_completion", broken)
    with caplog.at_level(logging.ERROR, logger="jaxllm.entrypoints.openai.api_server"):
        response = server.post("/v1/completions", {"prompt": "Hi"})
    body = error_of(response, 500)
    assert body == {"message": f"{type(error).__name__}: injected",
                    "type": "InternalServerError", "param": None, "code": 500}
    record, = [r for r in caplog.records if r.name == "jaxllm.entrypoints.openai.api_server"]
    assert record.getMessage() == "internal error answering POST /v1/completions"
    assert record.exc_info[1] is error  # the traceback goes to the log, not to the client


def test_a_failure_in_any_route_is_a_500_with_the_error_json(server, monkeypatch):
    def broken():
        raise KeyError("metrics")

    monkeypatch.setattr(server.engine, "get_metrics", broken)
    assert error_of(server.get("/metrics"), 500)["message"] == "KeyError: 'metrics'"


def test_a_minus_inf_logprob_is_stated_as_vllms_floor():
    # A processed logprobs_mode gives masked tokens -inf, which JSON cannot carry: the
    # non-streaming response failed to encode (a 400 for a valid request) and streams sent
    # the invalid token -Infinity.
    from jaxllm.entrypoints.openai.logprobs_format import chat_logprobs, completion_logprobs
    from jaxllm.outputs import CompletionOutput, Logprob

    entry = {7: Logprob(0.0, 1, "a"), 9: Logprob(-math.inf, 2, "b")}
    c = CompletionOutput(0, "a", [7], 0.0, [entry], "length")
    legacy = completion_logprobs(c.token_ids, c.logprobs, 2, 0)
    assert legacy["top_logprobs"] == [{"a": 0.0, "b": -9999.0}]
    chat = chat_logprobs(c.token_ids, c.logprobs, 2)
    assert [t["logprob"] for t in chat["content"][0]["top_logprobs"]] == [0.0, -9999.0]
    json.dumps([legacy, chat], allow_nan=False)  # what a JSON response needs
