"""The server under load, hostile and careless clients included, with /health measured.

The server runs in its own process (fault_server.py: `jaxllm serve` on the tiny model, with
--trust-request-chat-template and one engine fault armed), and /health is polled from yet
another process (health_poller.py), so that the latencies are the server's alone. Timings
depend on the machine: they are printed, and the issue's target (p99 <= 100 ms) asserted.

1. /health while a 10 MB prompt and the hostile template {{ 'ab' * 10000000 }} are sent one
   after the other for several seconds (issue 15's bug 5: they used to freeze the server for
   18 s and 58 s).
2. 256 concurrent clients (all connected within 2.5 s; 160 tokens each, 64 run at a time):
   a quarter leave mid-stream, a tenth send malformed bodies (the 10 MB prompt and the
   hostile template among them), one request trips the armed engine fault mid-run, the rest
   stream to their end. Every well-formed stream ends with `data: [DONE]`: normally, or
   after the error event of the one failed step it was in (a failed step fails every
   request it carried). Then nothing is left running and no KV block is used.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time

import httpx
import pytest

from engine_e2e.tiny_model import build_tiny_llama_dir

from remote_server import RemoteServer

pytestmark = pytest.mark.serial  # /health's latency and a fault timed mid-run: alone

HERE = os.path.dirname(os.path.abspath(__file__))
ARGS = ["--served-model-name", "tiny", "--max-model-len", "256", "--max-num-seqs", "64",
        "--max-num-batched-tokens", "256", "--dtype", "float32", "--kv-cache-memory-bytes",
        str(256 << 20), "--trust-request-chat-template"]
LIMIT = 256 * 81  # the prompt length bound: max_model_len x SmolLM2's longest token
BIG = json.dumps({"prompt": "x" * (10 << 20), "max_tokens": 4}).encode()  # 10 MB
HOSTILE = {"messages": [{"role": "user", "content": "hi"}],
           "chat_template": "{{ 'ab' * 10000000 }}"}
# (path, body, expected status): one in ten clients sends one of these.
MALFORMED = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", {"prompt": "x", "temperature": -1, "stream": True}, 400),
    ("/v1/completions", {"prompt": "x", "bogus_field": 1}, 400),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model", "stream": True}, 404),
    ("/v1/completions", {"prompt": [5] * 300, "stream": True}, 400),
    ("/v1/completions", {"prompt": "x", "n": 2, "temperature": 0}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": 5, "content": "x"}]}, 400),
    ("/v1/completions", BIG, 400),
    ("/v1/chat/completions", {**HOSTILE, "stream": True}, 400),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny = build_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny_load")))
    srv = RemoteServer([tiny, *ARGS], launcher=[sys.executable,
                                                os.path.join(HERE, "fault_server.py")])
    yield srv
    srv.stop()


def start_poller(server) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(HERE, "health_poller.py"),
                             server.url, "0.02"], stdout=subprocess.PIPE, text=True)


def health_p99(poller: subprocess.Popen) -> float:
    """Stop the poller; every poll answered 200; -> the p99 latency in ms (printed)."""
    poller.kill()
    lines = poller.communicate()[0].splitlines()
    polls = [line.split() for line in lines if len(line.split()) == 2]  # not a cut-off one
    assert polls and {status for _, status in polls} == {"200"}
    latencies = sorted(float(ms) for ms, _ in polls)
    p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
    print(f"\n/health: {len(latencies)} polls, p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
          f"max {latencies[-1]:.1f} ms")
    return p99


def assert_idle(server, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (server.value("jaxllm:num_requests_running"),
                server.value("jaxllm:num_requests_waiting"),
                server.value("jaxllm:kv_cache_usage_perc")) == (0, 0, 0):
            return
        time.sleep(0.2)
    raise AssertionError(f"engine not idle: {server.metrics()}")


def test_health_answers_within_100_ms_while_a_10mb_prompt_and_a_hostile_template_run(server):
    poller = start_poller(server)
    sent = 0
    t0 = time.perf_counter()
    with httpx.Client(timeout=60) as client:
        while time.perf_counter() - t0 < 7:
            big = client.post(server.url + "/v1/completions", content=BIG,
                              headers={"content-type": "application/json"})
            assert big.status_code == 400 and big.json()["error"]["message"].startswith(
                f"The prompt has {10 << 20} characters; the limit is {LIMIT} ")
            hostile = client.post(server.url + "/v1/chat/completions", json=HOSTILE)
            assert (hostile.status_code, hostile.json()["error"]["message"]) == (
                400, "the chat template failed: SecurityError: '*' would build 20000000 "
                     f"items; the limit is {LIMIT}")
            sent += 1
    p99 = health_p99(poller)
    print(f"{sent} pairs of a 10 MB prompt and the hostile template in 7 s")
    assert sent >= 5 and p99 <= 100


async def well_formed(http, url, rid: str, i: int, chat: bool, leave: bool
                      ) -> tuple[str, list[str]]:
    """-> (the request's id as the server reports it, the stream's events)."""
    if chat:
        path = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": f"Story {i}"}], "request_id": rid}
    else:
        path = "/v1/completions"
        body = {"prompt": f"Story {i}:", "request_id": rid}
        rid += "-0"  # the id of its one prompt
    body.update(max_tokens=160, temperature=0.8, seed=i, ignore_eos=True, stream=True)
    events = []
    async with http.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line:
                events.append(line)
                if leave and len(events) == 2:
                    break  # the client goes away mid-stream
    return rid, events


async def malformed(http, url, i) -> None:
    path, body, status = MALFORMED[i % len(MALFORMED)]
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if \
        isinstance(body, bytes) else {"json": body}
    r = await http.post(url + path, **kwargs)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def failed_event(rid: str) -> str:
    return "data: " + json.dumps({"error": {
        "message": f"Internal server error: the engine failed while generating request "
                   f"{rid!r}; it was stopped", "type": "InternalServerError", "param": None,
        "code": 500}})


def test_256_clients_with_disconnects_malformed_bodies_and_an_engine_fault(server):
    roles = ["malformed"] * 26 + ["leave"] * 64 + ["fault"] + ["stream"] * 165
    random.Random(15).shuffle(roles)
    poller = start_poller(server)

    async def client(http, i, role):
        await asyncio.sleep(i * 0.01)  # all arrive within 2.5 s, and stay open together
        if role == "malformed":
            return await malformed(http, server.url, i)
        if role == "fault":
            await asyncio.sleep(10 - i * 0.01)  # mid-run
            return await well_formed(http, server.url, "fault", i, chat=False, leave=False)
        return await well_formed(http, server.url, f"load-{i}", i, chat=i % 2 == 0,
                                 leave=role == "leave")

    async def main():
        limits = httpx.Limits(max_connections=300)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            return await asyncio.gather(*[client(http, i, r) for i, r in enumerate(roles)])

    t0 = time.perf_counter()
    results = asyncio.run(main())
    elapsed = time.perf_counter() - t0
    streams = [r for r, role in zip(results, roles) if role in ("stream", "fault")]
    errored = [rid for rid, events in streams if events[-2] == failed_event(rid)]
    for rid, events in streams:
        assert events[-1] == "data: [DONE]", (rid, events[-3:])
        if rid not in errored:  # it ran to its end
            last = json.loads(events[-2][6:])["choices"][0]
            assert last["finish_reason"] == "length", (rid, last)
    assert "fault-0" in errored and len(errored) <= 64  # the failed step's requests only
    assert_idle(server)
    p99 = health_p99(poller)
    print(f"256 clients in {elapsed:.1f} s: {len(streams) - len(errored)} streams completed, "
          f"{len(errored)} ended by the failed step's error event, 64 left mid-stream, "
          "26 malformed bodies refused")
    assert p99 <= 100
