"""The server's vLLM-flag routes, in-process on the tiny model with every option on:
/tokenize and /tokenizer_info (vLLM's tests/entrypoints/openai/test_tokenization.py),
/v1/models and /v1/models/{id} (test_models.py), /invocations, X-Request-Id, /load
(basic/test_basic.py::test_server_load), prompt_embeds, and async tokenization
(test_async_tokenization.py), /metrics against vLLM v1's metric list, and sleep mode
(test_sleep.py).

Adaptations for jaxllm, throughout: the tiny random Llama with SmolLM2's tokenizer and chat
template stands for vLLM's zephyr / Qwen models; max_model_len is the in-process app's 64;
no LoRA adapters (LoRA is a later issue), so test_models checks the one base model.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import jax
import pytest
import transformers
from prometheus_client.parser import text_string_to_metric_families

from engine_e2e.tiny_model import build_tiny_llama_dir
from inprocess_app import MAX_MODEL_LEN, InProcessApp, error_of
from jaxllm.entrypoints.openai.frontend import (PROMPT_EMBEDS_NEEDS_FLAG, FrontendOptions,
                                                check_prompt_embeds)

OPTIONS = FrontendOptions(enable_request_id_headers=True, enable_server_load_tracking=True,
                          enable_tokenizer_info_endpoint=True, enable_prompt_embeds=True,
                          enable_sleep_mode=True, allowed_origins=["http://ui.example"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny_frontend")))


@pytest.fixture(scope="module")
def server(model_dir):
    app = InProcessApp(model_dir, frontend=OPTIONS)
    yield app
    app.shutdown()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


# ---- test_tokenization.py ------------------------------------------------------------------

def test_tokenize_completions(server, tokenizer):
    prompt = "vllm1 This is a test prompt."
    for add_special in (False, True):
        result = server.post("/tokenize", {"add_special_tokens": add_special, "model": "tiny",
                                           "prompt": prompt}).json()
        tokens = tokenizer.encode(prompt, add_special_tokens=add_special)
        assert result == {"tokens": tokens, "count": len(tokens),
                          "max_model_len": MAX_MODEL_LEN, "token_strs": None}


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"location": {"type": "string"}}}}}]],
    ids=["chat", "chat_with_tools"])
def test_tokenize_chat(server, tokenizer, tools):
    for add_generation in (False, True):
        for add_special in (False, True):
            conversation = [{"role": "user", "content": "Hi there!"},
                            {"role": "assistant", "content": "Nice to meet you!"},
                            {"role": "user", "content": "Can I ask a question? vllm1"}]
            for continue_final in (False, True):
                if add_generation and continue_final:
                    continue
                if continue_final:
                    conversation.append({"role": "assistant", "content": "Sure,"})
                prompt = tokenizer.apply_chat_template(
                    conversation, tools=tools, add_generation_prompt=add_generation,
                    continue_final_message=continue_final, tokenize=False)
                tokens = tokenizer.encode(prompt, add_special_tokens=add_special)
                body = {"add_generation_prompt": add_generation,
                        "continue_final_message": continue_final,
                        "add_special_tokens": add_special, "messages": conversation,
                        "model": "tiny", **({"tools": tools} if tools else {})}
                result = server.post("/tokenize", body).json()
                assert result == {"tokens": tokens, "count": len(tokens),
                                  "max_model_len": MAX_MODEL_LEN, "token_strs": None}


def test_tokenize_chat_refusals(server):
    messages = [{"role": "user", "content": "hi"}]
    error = error_of(server.post("/tokenize", {"messages": messages,
                                               "add_generation_prompt": True,
                                               "continue_final_message": True}), 400)
    assert "Cannot set both `continue_final_message` and `add_generation_prompt`" in (
        error["message"])
    error = error_of(server.post("/tokenize", {"messages": messages,
                                               "chat_template": "{{ 'x' }}"}), 400)
    assert "--trust-request-chat-template" in error["message"]


def test_tokenize_with_return_token_strs(server, tokenizer):
    prompt = "This is a token_strs test prompt! vllm1"
    result = server.post("/tokenize", {"prompt": prompt, "model": "tiny",
                                       "return_token_strs": True}).json()
    tokens = tokenizer.encode(prompt, add_special_tokens=True)
    assert result == {"tokens": tokens, "count": len(tokens), "max_model_len": MAX_MODEL_LEN,
                      "token_strs": tokenizer.convert_ids_to_tokens(tokens)}


def test_detokenize(server, tokenizer):
    prompt = "This is a test prompt. vllm1"
    tokens = tokenizer.encode(prompt, add_special_tokens=False)
    assert server.post("/detokenize", {"model": "tiny", "tokens": tokens}).json() == {
        "prompt": prompt}


def test_tokenizer_info(server, tokenizer):
    result = server.get("/tokenizer_info").json()
    assert result["tokenizer_class"] == type(tokenizer).__name__
    assert "vocab_file" not in result and "merges_file" not in result
    field_types = {"add_bos_token": bool, "add_prefix_space": bool,
                   "clean_up_tokenization_spaces": bool, "split_special_tokens": bool,
                   "bos_token": str, "eos_token": str, "pad_token": str, "unk_token": str,
                   "chat_template": str, "errors": str, "model_max_length": int,
                   "additional_special_tokens": list, "added_tokens_decoder": dict}
    for field, kind in field_types.items():
        if result.get(field) is not None:
            assert isinstance(result[field], kind), field
    for token_id, info in (result.get("added_tokens_decoder") or {}).items():
        assert token_id.isdigit() and isinstance(info["special"], bool) and info["content"]
    assert result["eos_token"] == tokenizer.eos_token
    # consistent with /tokenize (vLLM's test_tokenizer_info_consistency_with_tokenize)
    assert result["model_max_length"] >= MAX_MODEL_LEN


# ---- test_models.py and GET /v1/models/{id} ------------------------------------------------

def test_models_list_and_retrieve(server, model_dir):
    served, = server.get("/v1/models").json()["data"]
    assert (served["id"], served["root"], served["object"]) == ("tiny", model_dir, "model")
    one = server.get("/v1/models/tiny").json()
    assert one == {**served, "created": one["created"]}
    error = error_of(server.get("/v1/models/other"), 404)
    assert error == {"message": "The model `other` does not exist.", "type": "NotFoundError",
                     "param": "model", "code": 404}


# ---- /invocations (SageMaker) ----------------------------------------------------------

def test_invocations_route_by_body_shape(server):
    completion = {"prompt": "Hello, my name is", "max_tokens": 5, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5,
            "temperature": 0}
    for path, body, kind in (("/v1/completions", completion, "text_completion"),
                             ("/v1/chat/completions", chat, "chat.completion")):
        direct, routed = server.post(path, body).json(), server.post("/invocations", body).json()
        assert routed["object"] == direct["object"] == kind
        # the same usage, but for the prompt's cached tokens: the second request of a
        # pair finds the first's blocks in the prefix cache
        counts = lambda usage: {k: v for k, v in usage.items()  # noqa: E731
                                if k != "prompt_tokens_details"}
        assert routed["choices"] == direct["choices"]
        assert counts(routed["usage"]) == counts(direct["usage"])
    error = error_of(server.post("/invocations", {"input": "hi"}), 400)
    assert error["message"] == ("Cannot find suitable handler for request. Expected one of: "
                                "['ChatCompletionRequest', 'CompletionRequest']")


# ---- headers, load, prompt embeddings ------------------------------------------------------

def test_request_id_header(server):
    async def two():
        async with server.client() as client:
            given = await client.get("/health", headers={"X-Request-Id": "my-id"})
            fresh = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
            return given, fresh

    given, fresh = asyncio.run(two())
    assert given.headers["x-request-id"] == "my-id"
    assert re.fullmatch(r"[0-9a-f]{32}", fresh.headers["x-request-id"])


def test_cors_answers_the_allowed_origin_only(server):
    async def preflight(origin):
        async with server.client() as client:
            return await client.options("/v1/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST"})

    allowed = run_and_get(lambda: preflight("http://ui.example"))
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "http://ui.example"
    refused = run_and_get(lambda: preflight("http://other.example"))
    assert "access-control-allow-origin" not in refused.headers


def test_server_load(server):
    """vLLM's test_server_load: 0, then 1 while a completion runs, then 0. (httpx's ASGI
    transport hands a response over only once it is complete, so the running request is a
    non-streamed one, watched from beside it.)"""
    async def run():
        async with server.client() as client:
            before = (await client.get("/load")).json()
            body = {"prompt": "Give me a long story", "max_tokens": 40, "temperature": 0,
                    "ignore_eos": True}
            task = asyncio.create_task(client.post("/v1/completions", json=body))
            seen = set()
            while not task.done():
                seen.add((await client.get("/load")).json()["server_load"])
                await asyncio.sleep(0.01)
            assert (await task).status_code == 200
            after = (await client.get("/load")).json()
            return before, seen, after

    before, seen, after = run_and_get(run)
    assert before == after == {"server_load": 0} and 1 in seen and seen <= {0, 1}
    server.assert_idle()


def run_and_get(coro_fn):
    return asyncio.run(coro_fn())


def test_prompt_embeds_are_refused_with_a_clear_400(server):
    error = error_of(server.post("/v1/completions", {"prompt_embeds": "UEsDBAAACAgAAAAAAAAAAA",
                                                     "max_tokens": 3}), 400)
    assert "torch.save pickle" in error["message"] and "without torch" in error["message"]
    with pytest.raises(ValueError, match=re.escape(PROMPT_EMBEDS_NEEDS_FLAG)):
        check_prompt_embeds(FrontendOptions(), "abc")  # vLLM's 400 without the flag
    error = error_of(server.post("/v1/completions", {"max_tokens": 3}), 400)
    assert "Either prompt or prompt_embeds must be provided" in error["message"]


# ---- test_async_tokenization.py ------------------------------------------------------------

@pytest.mark.serial  # /health's latency: alone
def test_tokenization_runs_off_the_event_loop_and_health_stays_fast(server, monkeypatch):
    """vLLM's test_healthcheck_response_time, made exact: every tokenizer call is recorded
    with its thread, and slowed by 0.1 s (a long prompt's tokenization), while 5 completions
    and 5 chats are admitted; /health must still answer at once, and no tokenizer call may
    have run on the event loop's thread."""
    tok_class = type(server.engine.tokenizer)
    threads: list[int] = []
    original = tok_class.__call__

    def slow_call(self, *args, **kwargs):
        threads.append(threading.get_ident())
        time.sleep(0.1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(tok_class, "__call__", slow_call)

    async def run():
        loop_thread = threading.get_ident()
        async with server.client() as client:
            # max_tokens past the context: each is tokenized, then refused (a 400, no step
            # to compile), as vLLM's 300k-token prompts are.
            bodies = [("/v1/completions", {"prompt": "A " * 20, "max_tokens": MAX_MODEL_LEN})
                      ] * 5 + [("/v1/chat/completions", {
                          "messages": [{"role": "user", "content": "A " * 20}],
                          "max_tokens": MAX_MODEL_LEN})] * 5
            tasks = [asyncio.create_task(client.post(p, json=b)) for p, b in bodies]
            await asyncio.sleep(0.15)  # the input thread is busy tokenizing
            t0 = time.monotonic()
            health = await client.get("/health")
            health_time = time.monotonic() - t0
            busy = not all(t.done() for t in tasks)
            responses = await asyncio.gather(*tasks)
            statuses = [r.status_code for r in responses]
            assert all("does not fit" in r.json()["error"]["message"] for r in responses)
        return loop_thread, health.status_code, health_time, busy, statuses

    loop_thread, status, health_time, busy, statuses = run_and_get(run)
    assert statuses == [400] * 10 and status == 200
    assert busy  # /health was asked while prompts were still being tokenized
    assert health_time < 0.1, health_time
    assert len(threads) >= 10 and loop_thread not in threads


# ---- /metrics: vLLM v1's list (vllm/v1/metrics/loggers.py, 0.32, default configuration) ----

_TOKENS = "request_tokens"  # vLLM's 1-2-5 series capped at max_model_len: 64 here
_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0]
_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
# name (after "vllm:") -> (type, labels besides model_name and engine, histogram buckets).
# Left out, as vLLM leaves them out by default: spec-decode, KV-connector, LoRA, KV residency,
# perf (MFU), watermark, corrupted-request and KV-fetch metrics.
VLLM_METRICS = {
    "num_requests_running": ("gauge", (), None),
    "num_requests_waiting": ("gauge", (), None),
    "num_requests_waiting_by_reason": ("gauge", ("reason",), None),
    "engine_sleep_state": ("gauge", ("sleep_state",), None),
    "kv_cache_usage_perc": ("gauge", (), None),
    "cache_config_info": ("gauge", None, None),  # labels: CacheConfig's keys and engine
    "prefix_cache_queries": ("counter", (), None),
    "prefix_cache_hits": ("counter", (), None),
    "external_prefix_cache_queries": ("counter", (), None),
    "external_prefix_cache_hits": ("counter", (), None),
    "mm_cache_queries": ("counter", (), None),
    "mm_cache_hits": ("counter", (), None),
    "num_preemptions": ("counter", (), None),
    "prompt_tokens": ("counter", (), None),
    "prompt_tokens_by_source": ("counter", ("source",), None),
    "prompt_tokens_cached": ("counter", (), None),
    "prompt_tokens_cached_by_source": ("counter", ("source",), None),
    "generation_tokens": ("counter", (), None),
    "request_success": ("counter", ("finished_reason",), None),
    "admission_rejections": ("counter", None, None),  # labels: model_name, reason
    "request_prompt_tokens": ("histogram", (), _TOKENS),
    "request_generation_tokens": ("histogram", (), _TOKENS),
    "iteration_tokens_total": ("histogram", (), [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                                 4096, 8192, 16384]),
    "request_max_num_generation_tokens": ("histogram", (), _TOKENS),
    "request_params_n": ("histogram", (), [1, 2, 5, 10, 20]),
    "request_params_max_tokens": ("histogram", (), _TOKENS),
    "time_to_first_token_seconds": ("histogram", (), _TTFT),
    "inter_token_latency_seconds": ("histogram", (), _ITL),
    "request_time_per_output_token_seconds": ("histogram", (), _ITL),
    "e2e_request_latency_seconds": ("histogram", (), _LATENCY),
    "request_queue_time_seconds": ("histogram", (), _LATENCY),
    "request_inference_time_seconds": ("histogram", (), _LATENCY),
    "request_prefill_time_seconds": ("histogram", (), _LATENCY),
    "request_decode_time_seconds": ("histogram", (), _LATENCY),
    "request_num_preemptions": ("histogram", (), [1, 2, 3, 4, 5, 10, 20]),
    "request_prefill_kv_computed_tokens": ("histogram", (), _TOKENS),
}
LABEL_VALUES = {"reason": {"capacity", "deferred"},
                "sleep_state": {"awake", "weights_offloaded", "discard_all"},
                "source": {"local_compute", "local_cache_hit", "external_kv_transfer", "device",
                           "host", "p2p", "disk", "external_unspecified"},
                "finished_reason": {"stop", "length", "abort", "error", "repetition"}}


def _scrape(server) -> dict:
    return {f.name: f for f in text_string_to_metric_families(server.get("/metrics").text)}


def _value(families, name, suffix="", **labels) -> float:
    return sum(s.value for s in families["jaxllm:" + name].samples
               if s.name == "jaxllm:" + name + suffix
               and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_are_vllms_names_types_labels_and_buckets(server):
    families = _scrape(server)
    ours = {name.removeprefix("jaxllm:") for name in families}
    assert ours == set(VLLM_METRICS), (ours - set(VLLM_METRICS), set(VLLM_METRICS) - ours)
    for name, (kind, labels, buckets) in VLLM_METRICS.items():
        family = families["jaxllm:" + name]
        assert family.type == kind, name
        for sample in family.samples:
            if labels is not None:
                assert set(sample.labels) - {"le"} == {"model_name", "engine", *labels}, name
                for label in labels:
                    assert sample.labels[label] in LABEL_VALUES[label], (name, sample.labels)
        if buckets is not None:
            want = [1, 2, 5, 10, 20, 50] if buckets == _TOKENS else buckets
            les = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
            assert les == [*map(float, want), float("inf")], name
    info, = families["jaxllm:cache_config_info"].samples
    assert info.value == 1 and info.labels["block_size"] == "16"
    assert int(info.labels["num_gpu_blocks"]) == server.engine.engine.kv_cache_manager.num_blocks
    rejections = families["jaxllm:admission_rejections"].samples
    assert {tuple(sorted(s.labels)) for s in rejections} == {("model_name", "reason")}


def test_request_histograms_count_what_requests_did(server):
    server.post("/v1/completions", {"prompt": "warm up", "max_tokens": 1})
    before = _scrape(server)
    bodies = [{"prompt": "The sky is", "max_tokens": 3, "temperature": 0, "ignore_eos": True},
              {"prompt": "Once upon a", "max_tokens": 5, "n": 2, "temperature": 1, "seed": 3,
               "ignore_eos": True}]
    usage = [server.post("/v1/completions", b).json()["usage"] for b in bodies]
    server.assert_idle()
    after = _scrape(server)

    def delta(name, suffix="", **labels):
        return _value(after, name, suffix, **labels) - _value(before, name, suffix, **labels)

    assert delta("request_params_n", "_count") == 2 and delta("request_params_n", "_sum") == 3
    assert delta("request_params_max_tokens", "_sum") == 8
    assert delta("request_generation_tokens", "_sum") == 3 + 10
    assert delta("request_max_num_generation_tokens", "_sum") == 3 + 5
    prompt = sum(u["prompt_tokens"] for u in usage)
    assert delta("request_prompt_tokens", "_sum") == prompt
    # Prompt token counters count each of the n samples' prompts, as vLLM's engine requests.
    per_sample = usage[0]["prompt_tokens"] + 2 * usage[1]["prompt_tokens"]
    by_source = sum(delta("prompt_tokens_by_source", "_total", source=s)
                    for s in ("local_compute", "local_cache_hit"))
    assert by_source == per_sample == delta("prompt_tokens", "_total")
    assert delta("prompt_tokens_cached", "_total") == 0  # 3-token prompts: no full block
    assert delta("request_prefill_kv_computed_tokens", "_sum") == prompt
    assert delta("request_success", "_total", finished_reason="length") == 3
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"request_{phase}_time_seconds", "_count") == 2
    assert delta("request_inference_time_seconds", "_sum") == pytest.approx(
        delta("request_prefill_time_seconds", "_sum")
        + delta("request_decode_time_seconds", "_sum"), abs=1e-6)
    assert delta("request_time_per_output_token_seconds", "_count") == 2
    assert delta("iteration_tokens_total", "_count") >= 5  # a prefill and the decode steps
    assert delta("iteration_tokens_total", "_sum") >= prompt + 13 - 2


# ---- test_sleep.py (runs last: it puts the engine to sleep and wakes it) -------------------

def test_sleep_mode_releases_and_restores_the_device_buffers(server):
    runner = server.engine.engine.model_runner
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "logprobs": 1}
    want = server.post("/v1/completions", body).json()["choices"][0]
    assert server.get("/is_sleeping").json() == {"is_sleeping": False}
    error = error_of(server.post("/sleep?level=3", {}), 400)
    assert "level must be one of [1, 2]" in error["message"]
    for level, state in ((1, "weights_offloaded"), (2, "discard_all")):
        arrays = jax.tree.leaves((runner.state, runner.kv_caches))
        assert server.post(f"/sleep?level={level}", {}).json() == {"status": "sleeping",
                                                                  "level": level}
        assert server.get("/is_sleeping").json() == {"is_sleeping": True}
        assert all(a.is_deleted() for a in arrays)  # weights and KV cache: released
        assert _value(_scrape(server), "engine_sleep_state", sleep_state=state) == 1
        assert _value(_scrape(server), "engine_sleep_state", sleep_state="awake") == 0
        error = error_of(server.post("/v1/completions", body), 503)
        assert "sleeping" in error["message"]
        if level == 2:  # the weights first, then the cache (vLLM's tags)
            assert server.post("/wake_up?tags=weights", {}).json() == {
                "status": "sleeping", "tags": ["weights"]}
        assert server.post("/wake_up", {}).json() == {"status": "awake", "tags": None}
        assert server.get("/is_sleeping").json() == {"is_sleeping": False}
        assert _value(_scrape(server), "engine_sleep_state", sleep_state="awake") == 1
        got = server.post("/v1/completions", body).json()["choices"][0]
        assert got["text"] == want["text"] and got["logprobs"] == want["logprobs"]

    # vLLM's own test posts the level as a form body, which vLLM (and jaxllm) ignore: level 1.
    async def form_sleep():
        async with server.client() as client:
            return await client.post("/sleep", data={"level": "3"})

    assert run_and_get(form_sleep).json() == {"status": "sleeping", "level": 1}
    assert server.post("/wake_up", {}).json()["status"] == "awake"
    server.assert_idle()
