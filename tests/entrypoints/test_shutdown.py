"""vLLM's server shutdown tests (tests/entrypoints/openai/completion/test_shutdown.py of vLLM
0.32, and the engine-failure case of its earlier tests/entrypoints/openai/test_shutdown.py),
ported to `jaxllm serve` in its own process (fault_server.py: the tiny model, with every model
step slowed by JAXLLM_TEST_STEP_DELAY_S so that its requests stay in flight, and a request id
"die..." that kills the engine loop). One server per behaviour:

- SIGTERM with --shutdown-timeout 3 (vLLM's test_wait_timeout_completes_requests,
  test_wait_timeout_with_short_duration and test_request_rejection_during_shutdown): the
  requests in flight finish, new ones are refused, a stream that outlasts the timeout is
  aborted (its last chunk says finish_reason "abort", then `data: [DONE]`), the process exits
  within vLLM's bound (timeout + 10 s) with -SIGTERM, and its child (the chat-template
  sandbox) is gone;
- SIGTERM with --shutdown-timeout 0 (test_abort_timeout_exits_quickly and
  test_abort_timeout_fails_inflight_requests): every request in flight is aborted at once
  (finish_reason "abort", vLLM's), and the process exits within vLLM's 4 s;
- the engine dying (vLLM's older test_shutdown_on_engine_failure, which crashed its engine
  with a bad LoRA adapter; jaxllm refuses such an adapter with a 400, so the loop is killed
  here instead): the requests in flight get their error, a stream its error event, and the
  process exits by itself with status 1 within vLLM's 8 s.

Not ported: test_shutdown_on_engine_failure of 0.32 (it only SIGTERMs the server and expects
later calls to fail: the first case covers it), test_multi_api_server_shutdown (jaxllm
refuses --api-server-count above 1: one API server process).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from engine_e2e.tiny_model import build_tiny_llama_dir

from remote_server import RemoteServer

HERE = os.path.dirname(os.path.abspath(__file__))
ARGS = ["--served-model-name", "tiny", "--max-model-len", "256", "--max-num-seqs", "64",
        "--max-num-batched-tokens", "256", "--dtype", "float32", "--kv-cache-memory-bytes",
        str(256 << 20), "--enforce-eager", "true"]
DELAY_S = 0.05  # per model step: 8 tokens take ~0.4 s, 200 take ~10 s
SHORT = {"prompt": "Write a story: ", "max_tokens": 8, "ignore_eos": True}
LONG = {"prompt": "Write a story: ", "max_tokens": 200, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny_shutdown")))


def start(tiny_dir, *args) -> RemoteServer:
    return RemoteServer([tiny_dir, *ARGS, *args], log_level="info",
                        env={"JAXLLM_TEST_STEP_DELAY_S": str(DELAY_S)},
                        launcher=[sys.executable, os.path.join(HERE, "fault_server.py")])


def exit_within(server: RemoteServer, since: float, bound: float) -> tuple[int, float]:
    """-> (exit status, seconds from `since` to the exit); fails past `bound`."""
    try:
        status = server.proc.wait(timeout=max(0.0, since + bound - time.monotonic()))
    except subprocess.TimeoutExpired:
        server.proc.kill()
        pytest.fail(f"the server did not exit within {bound} s")
    elapsed = time.monotonic() - since
    server.log = server.proc.stdout.read()
    server.proc.stdout.close()
    return status, elapsed


def finish_reasons(events: list[str]) -> list:
    """The finish_reason of each chunk of a completion stream (its [DONE] aside)."""
    return [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events
            if e != "data: [DONE]" and json.loads(e[6:])["choices"]]


def assert_gone(pids: list[int]) -> None:
    alive = [p for p in pids if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"child processes {alive} outlived the server"


async def stream_events(http, url, body, events: list) -> None:
    """A stream's events into `events`, as they come (an exception ends it)."""
    async with http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line:
                events.append(line)


def test_sigterm_finishes_requests_in_flight_refuses_new_ones_and_exits(tiny_dir):
    server = start(tiny_dir, "--shutdown-timeout", "3", "--trust-request-chat-template")
    # a request's own chat template starts the sandbox process: a child to clean up
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
    assert r.status_code == 200, r.text
    children = [c.pid for c in psutil.Process(server.proc.pid).children(recursive=True)]
    assert children

    async def main():
        results = []  # (sent after SIGTERM, outcome) per short request
        long_events: list = []
        sigterm_at = None

        async def looper(http):
            while sigterm_at is None or time.monotonic() - sigterm_at < 4:
                sent_after = sigterm_at is not None
                try:
                    r = await http.post(server.url + "/v1/completions", json=SHORT)
                    results.append((sent_after, r.status_code))
                except httpx.TransportError as e:
                    results.append((sent_after, type(e).__name__))
                    if sent_after:
                        return

        async with httpx.AsyncClient(timeout=30) as http:
            long = asyncio.create_task(stream_events(http, server.url, LONG, long_events))
            loopers = [asyncio.create_task(looper(http)) for _ in range(4)]
            while len(long_events) < 2 or len(results) < 4:
                await asyncio.sleep(0.05)
            done_before = len(results)  # the rest of those sent before were in flight
            server.proc.send_signal(signal.SIGTERM)
            sigterm_at = time.monotonic()
            await asyncio.gather(*loopers, long)
        return results, done_before, long_events, sigterm_at

    results, done_before, long_events, sigterm_at = asyncio.run(main())
    status, elapsed = exit_within(server, sigterm_at, 3 + 10)
    sent_before = [outcome for after, outcome in results if not after]
    sent_after = [outcome for after, outcome in results if after]
    print(f"\nexit {status} {elapsed:.1f} s after SIGTERM; requests sent before it: "
          f"{sent_before}, after: {sent_after}")
    # the four requests in flight at the signal finished; every later one was refused
    assert set(sent_before[:done_before]) == {200} and sent_before[done_before:] == [200] * 4
    assert len(sent_after) == 4 and not any(outcome == 200 for outcome in sent_after)
    # the stream outlasting the 3 s was aborted then, and ended as a stream does
    assert finish_reasons(long_events) == [None] * (len(long_events) - 2) + ["abort"]
    assert long_events[-1] == "data: [DONE]" and len(long_events) < LONG["max_tokens"]
    assert status == -signal.SIGTERM and 3 <= elapsed < 13
    assert "shutdown timeout (3.0 s) over: aborting the requests in flight" in server.log
    assert "Cancel" not in server.log  # no connection had to be cut
    assert "jaxllm: engine shut down" in server.log
    assert_gone(children)


def test_sigterm_with_shutdown_timeout_0_aborts_requests_in_flight_and_exits(tiny_dir):
    server = start(tiny_dir, "--shutdown-timeout", "0")

    async def main():
        async with httpx.AsyncClient(timeout=30) as http:
            requests = [asyncio.create_task(http.post(server.url + "/v1/completions",
                                                      json=LONG)) for _ in range(3)]
            events: list = []
            stream = asyncio.create_task(stream_events(http, server.url, LONG, events))
            while len(events) < 2:
                await asyncio.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            sigterm_at = time.monotonic()
            outcomes = await asyncio.gather(*requests, stream, return_exceptions=True)
            return outcomes, events, sigterm_at, time.monotonic() - sigterm_at

    outcomes, events, sigterm_at, ended_after = asyncio.run(main())
    status, elapsed = exit_within(server, sigterm_at, 4)
    print(f"\nexit {status} {elapsed:.1f} s after SIGTERM; in flight: "
          f"{[getattr(o, 'status_code', o) for o in outcomes]} after {ended_after:.1f} s")
    # each was aborted at once: the whole ones answered, the stream ended
    for response in outcomes[:3]:
        assert response.status_code == 200, response
        assert response.json()["choices"][0]["finish_reason"] == "abort"
        assert len(response.json()["choices"][0]["text"]) < 200
    assert outcomes[3] is None and events[-1] == "data: [DONE]"
    assert finish_reasons(events)[-1] == "abort"
    assert ended_after < 4
    assert status == -signal.SIGTERM
    assert "jaxllm: engine shut down" in server.log


def test_engine_death_fails_requests_in_flight_and_the_server_exits(tiny_dir):
    server = start(tiny_dir)

    async def main():
        async with httpx.AsyncClient(timeout=30) as http:
            events: list = []
            stream = asyncio.create_task(stream_events(http, server.url, LONG, events))
            while len(events) < 2:
                await asyncio.sleep(0.05)
            died_at = time.monotonic()
            dying = await http.post(server.url + "/v1/completions",
                                    json={**LONG, "request_id": "die"})
            await stream
            try:
                later = (await http.post(server.url + "/v1/completions", json=SHORT)).status_code
            except httpx.TransportError as e:
                later = type(e).__name__
            return dying, events, later, died_at

    dying, events, later, died_at = asyncio.run(main())
    status, elapsed = exit_within(server, died_at, 8)
    message = "the engine loop died: MemoryError: the injected death of the engine loop"
    assert (dying.status_code, dying.json()["error"]["message"]) == (503, message)
    assert events[-2:] == ["data: " + json.dumps({"error": {
        "message": message, "type": "ServiceUnavailableError", "param": None, "code": 503}}),
        "data: [DONE]"]
    # a request after the death: refused by the dead engine (503), or by a server gone
    assert later in (503, "ConnectError")
    print(f"\nexit {status} {elapsed:.1f} s after the engine died; a later request: {later}")
    assert status == 1
    assert "the engine died (the injected death of the engine loop): the server shuts " \
           "down" in server.log
    assert "jaxllm: engine shut down" in server.log
