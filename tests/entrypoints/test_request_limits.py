"""vLLM's caps and the server's cheap bounds, each a 400 with OpenAI's error JSON before any
work: text too long to fit the model (measured before tokenizing), `n` over
max_n_sequences, too many prompts in one request, and a chat template the request brings
(refused unless the server trusts request templates, then rendered in the sandbox).

In-process over the tiny model (max_model_len 256): the app's /v1 routes through httpx's
ASGI transport.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from jaxllm import AsyncEngineArgs, AsyncLLM
from jaxllm.entrypoints.openai.api_server import build_app

from engine_e2e.tiny_model import SMALL, build_tiny_llama_dir

ARGS = {k: v for k, v in SMALL.items() if k != "use_tqdm_on_load"}
LIMIT = 256 * 81  # max_model_len times SmolLM2's longest token ("\n" and 80 spaces)
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tiny = build_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny_limits")))
    engine = AsyncLLM(AsyncEngineArgs(model=tiny, max_n_sequences=4, **ARGS))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def apps(engine):
    apps = {"default": build_app(engine, served_model_names=["tiny"],
                                 max_completion_prompts=2),
            "trusting": build_app(engine, served_model_names=["tiny"],
                                  trust_request_chat_template=True)}
    yield apps
    for app in apps.values():
        app.state.serving.close()


def post(app, path, body) -> httpx.Response:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                     base_url="http://test", timeout=300) as c:
            return await c.post(path, json=body)

    return asyncio.run(main())


def refused(response: httpx.Response, message: str, param: str | None = None) -> bool:
    assert (response.status_code, response.json()) == (400, {"error": {
        "message": message, "type": "BadRequestError", "param": param, "code": 400}})
    return True


def too_long(what: str, n: int) -> str:
    return (f"The {what} has {n} characters; the limit is {LIMIT} (the maximum model length "
            "of 256 tokens times 81, the most characters one token of this tokenizer spans), "
            "so it cannot fit and was refused without tokenizing it.")


def test_text_too_long_to_fit_is_refused_before_tokenizing(engine, apps):
    assert engine.engine.processor.max_prompt_chars == LIMIT
    app = apps["default"]
    for n in (LIMIT + 1, 10 << 20):  # issue 15's 10 MB prompt: 18 s of tokenizing before
        assert refused(post(app, "/v1/completions", {"prompt": "x" * n}),
                       too_long("prompt", n))
        assert refused(post(app, "/tokenize", {"prompt": "x" * n}), too_long("prompt", n))
    # At the bound the text is tokenized, and the token count decides.
    at_limit = post(app, "/v1/completions", {"prompt": "x" * LIMIT})
    assert at_limit.status_code == 400
    assert "is longer than the maximum model length of 256" in at_limit.json()["error"][
        "message"]


def test_a_chat_too_long_to_fit_is_refused_after_rendering(engine, apps):
    messages = [{"role": "user", "content": "y" * LIMIT}]
    rendered = engine.tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=True)
    assert refused(post(apps["default"], "/v1/chat/completions", {"messages": messages}),
                   too_long("rendered chat prompt", len(rendered)))


def test_n_is_capped_by_max_n_sequences(apps):
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 1.0, "seed": 1}
    assert refused(post(apps["default"], "/v1/completions", {**body, "n": 5}),
                   "n must be at most 4 (the engine's max_n_sequences), got 5", "n")
    ok = post(apps["default"], "/v1/completions", {**body, "n": 4})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_prompts_per_request_are_capped(apps):
    body = {"max_tokens": 1}
    assert refused(post(apps["default"], "/v1/completions", {**body, "prompt": ["a", "b", "c"]}),
                   "prompt holds 3 prompts; a request may hold at most 2 "
                   "(--max-completion-prompts)")
    assert refused(post(apps["default"], "/v1/completions",
                        {**body, "prompt": [[1], [2], [3]]}),
                   "prompt holds 3 prompts; a request may hold at most 2 "
                   "(--max-completion-prompts)")
    for prompt in (["a", "b"], [1, 2, 3, 4, 5]):  # token ids are one prompt
        assert post(apps["default"], "/v1/completions", {**body, "prompt": prompt}
                    ).status_code == 200


REFUSED_TEMPLATE = ("this request brings its own chat_template, which the server refuses: "
                    "chat templates run as code, and request templates are accepted only "
                    "with --trust-request-chat-template")


def test_request_templates_are_refused_unless_trusted(apps):
    for extra in ({"chat_template": "{{ messages }}"},
                  {"chat_template_kwargs": {"chat_template": "{{ messages }}"}}):
        assert refused(post(apps["default"], "/v1/chat/completions",
                            {"messages": MESSAGES, **extra}), REFUSED_TEMPLATE)


def test_a_trusted_request_template_renders_in_the_sandbox(engine, apps):
    body = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    server = post(apps["trusting"], "/v1/chat/completions", body).json()
    own = post(apps["trusting"], "/v1/chat/completions",
               {**body, "chat_template": engine.tokenizer.chat_template}).json()
    # The same prompt, so the same usage, except that the second finds the first's one full
    # 16-token block of its 31 prompt tokens in the prefix cache.
    assert own["usage"].pop("prompt_tokens_details") == {"cached_tokens": 16}
    server["usage"].pop("prompt_tokens_details")
    assert (own["usage"], own["choices"]) == (server["usage"], server["choices"])
    assert refused(post(apps["trusting"], "/v1/chat/completions",
                        {**body, "chat_template": "{{ 'ab' * 10000000 }}"}),
                   f"the chat template failed: SecurityError: '*' would build 20000000 "
                   f"items; the limit is {LIMIT}")
