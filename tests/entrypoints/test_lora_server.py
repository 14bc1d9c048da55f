"""LoRA over HTTP with the openai client (entrypoints/openai/lora_routes.py): --lora-modules
in both forms, /v1/models with `parent`, `model=<adapter>` selecting it (the tokens the
engine gives that adapter directly), an unknown model's 404, and the runtime
/v1/load_lora_adapter and /v1/unload_lora_adapter behind JAXLLM_ALLOW_RUNTIME_LORA_UPDATING.

The adapters are random PEFT-format directories (numpy) for the shared tiny Llama
(its parity with HF + peft is tests/engine_e2e/test_e2e_lora.py's). Apps are built over the
shared in-process engine; its adapters are removed again at the end.
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import openai
import pytest

from engine_e2e.tiny_model import TINY_CONFIG
from inprocess_app import error_of
from jaxllm import SamplingParams
from jaxllm.entrypoints.openai.api_server import build_app
from jaxllm.lora.request import LoRARequest
from lora_adapters import write_random_adapter

GREEDY = dict(max_tokens=5, temperature=0.0)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("server_loras")
    return [write_random_adapter(root / f"a{i}", TINY_CONFIG, seed=i) for i in range(3)]


@pytest.fixture
def lora_app(inprocess_server, adapter_dirs, monkeypatch):
    monkeypatch.setenv("JAXLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    engine = inprocess_server.engine
    app = build_app(engine, served_model_names=["tiny"], lora_modules=[
        f"sql={adapter_dirs[0]}",
        json.dumps({"name": "chat", "path": adapter_dirs[1], "base_model_name": "tiny"})])
    yield app
    manager = engine.engine.lora_manager
    for lora in manager.list_loras():
        manager.remove_lora(lora.lora_name)
    app.state.serving.close()
    inprocess_server.assert_idle()


def run(app, fn):
    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://jaxllm") as http:
            return await fn(openai.AsyncOpenAI(base_url="http://jaxllm/v1", api_key="unused",
                                               http_client=http), http)

    return asyncio.run(main())


async def direct(engine, prompt, lora):
    """The engine's own tokens for `prompt` with adapter `lora` (no HTTP)."""
    params = SamplingParams(max_tokens=GREEDY["max_tokens"], temperature=0.0)
    async for out in engine.generate({"prompt": prompt}, params, lora_request=lora):
        pass
    return out.outputs[0].token_ids


def test_served_adapters_listed_and_selected_by_model(lora_app, inprocess_server,
                                                      adapter_dirs):
    engine = inprocess_server.engine

    async def fn(client, http):
        models = {m.id: m for m in (await client.models.list()).data}
        assert list(models) == ["tiny", "sql", "chat"]
        assert models["sql"].parent == models["chat"].parent == "tiny"
        assert models["sql"].root == adapter_dirs[0]
        one = await client.models.retrieve("chat")
        assert (one.id, one.parent, one.root) == ("chat", "tiny", adapter_dirs[1])
        got = {}
        for name in ("tiny", "sql", "chat"):
            c = await client.completions.create(model=name, prompt="Hello", logprobs=0,
                                                **GREEDY)
            got[name] = c.choices[0].logprobs.tokens
            assert c.model == name
        chat = await client.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "Hi"}], **GREEDY)
        assert chat.model == "sql" and chat.choices[0].message.content is not None
        with pytest.raises(openai.NotFoundError) as e:
            await client.completions.create(model="nope", prompt="Hello", **GREEDY)
        assert e.value.status_code == 404
        assert "The model `nope` does not exist." in str(e.value)
        metrics = (await http.get("/metrics")).text
        assert ('jaxllm:lora_requests_info{max_lora="2",running_lora_adapters="",'
                'waiting_lora_adapters=""}') in metrics
        manager = engine.engine.lora_manager
        ids = {n: await direct(engine, "Hello", manager.get_lora(n) if n != "tiny" else None)
               for n in got}
        return got, ids

    got, ids = run(lora_app, fn)
    tokenizer = engine.tokenizer
    for name in got:  # each model's HTTP tokens are the engine's tokens for that adapter
        assert got[name] == [tokenizer.decode([t]) for t in ids[name]], name
    assert len({tuple(v) for v in ids.values()}) == 3  # the adapters change the output


def test_runtime_load_and_unload(lora_app, adapter_dirs, tmp_path):
    bad_config = tmp_path / "bad"
    os.makedirs(bad_config)
    (bad_config / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 64}')

    async def fn(client, http):
        ok = await http.post("/v1/load_lora_adapter",
                             json={"lora_name": "new", "lora_path": adapter_dirs[2]})
        assert ok.status_code == 200 and ok.text == (
            "Success: LoRA adapter 'new' added successfully.")
        assert "new" in [m.id for m in (await client.models.list()).data]
        c = await client.completions.create(model="new", prompt="Hello", **GREEDY)
        assert c.model == "new"
        errors = [await http.post("/v1/load_lora_adapter", json=body) for body in (
            {"lora_name": "x", "lora_path": str(tmp_path / "missing")},
            {"lora_name": "y", "lora_path": str(bad_config)},
            {"lora_name": "new", "lora_path": adapter_dirs[2]},
            {"lora_name": "tiny", "lora_path": adapter_dirs[2]})]
        gone = await http.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
        assert gone.status_code == 200
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="new", prompt="Hello", **GREEDY)
        again = await http.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
        return errors, again

    errors, again = run(lora_app, fn)
    messages = [error_of(e, 400)["message"] for e in errors]
    assert "adapter_config.json" in messages[0] and "max_lora_rank" in messages[1]
    assert "already loaded" in messages[2] and "conflicts with a served base" in messages[3]
    assert error_of(again, 404)["message"] == "The lora adapter 'new' cannot be found."


def test_runtime_routes_need_the_environment_variable(inprocess_server, monkeypatch,
                                                      adapter_dirs):
    monkeypatch.delenv("JAXLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    app = build_app(inprocess_server.engine, served_model_names=["tiny"])

    async def fn(client, http):
        return await http.post("/v1/load_lora_adapter",
                               json={"lora_name": "z", "lora_path": adapter_dirs[0]})

    try:
        assert run(app, fn).status_code == 404
        assert inprocess_server.engine.engine.lora_manager.list_loras() == []
    finally:
        app.state.serving.close()


def test_lora_request_object_is_checked():
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("a", 1, "")
