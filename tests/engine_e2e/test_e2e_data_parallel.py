"""Data parallel end to end: `data_parallel_size=2` on two host CPU devices (a subprocess, since
the device count is fixed at jax start-up), behind the OpenAI server's app.

Every request completes with the greedy text of a single engine; both replicas received
work; a request's `n` samples stay on one replica; /metrics shows each replica under its
`engine` label; an abort and a prefix-cache reset reach every replica; and when one
replica's loop dies, every stream on either replica gets EngineDeadError and /health says 503.
"""

from __future__ import annotations

import os
import textwrap

from host_devices import run_on_host_devices

_SCRIPT = textwrap.dedent("""
    import asyncio, os, re, sys, tempfile, time
    sys.path[:0] = [{here!r}, os.path.dirname({here!r})]
    import httpx, jax
    from jaxllm import LLM, AsyncEngineArgs, AsyncLLM, RequestOutputKind, SamplingParams
    from jaxllm.async_llm import EngineDeadError
    from jaxllm.entrypoints.openai.api_server import build_app
    from tiny_model import build_tiny_llama_dir

    t0 = time.perf_counter()
    assert len(jax.devices()) == 2, jax.devices()
    d = build_tiny_llama_dir(tempfile.mkdtemp())
    ARGS = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, dtype="float32",
                enforce_eager=True)
    shared = [100 + i for i in range(16)]  # one full block, shared by half the prompts
    prompts = [shared + [300 + i, 301 + i] if i % 2 else [500 + 7 * i + j for j in range(3 + i)]
               for i in range(12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    two = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True,
                         output_kind=RequestOutputKind.FINAL_ONLY)

    single = LLM(d, use_tqdm_on_load=False, **ARGS)
    expected = [o.outputs[0].text for o in single.generate(
        [{{"prompt_token_ids": p}} for p in prompts], greedy, use_tqdm=False)]
    expected_two = [c.token_ids for c in single.generate(
        {{"prompt_token_ids": prompts[3]}}, two, use_tqdm=False)[0].outputs]
    del single

    engine = AsyncLLM(AsyncEngineArgs(model=d, data_parallel_size=2, **ARGS))
    devices = [e.runner.kv_caches[0][0].sharding.device_set for e in engine.engines]
    assert devices == [{{jax.devices()[0]}}, {{jax.devices()[1]}}], devices
    app = build_app(engine, served_model_names=["tiny"])

    def successes(text):
        found = dict.fromkeys(("0", "1"), 0.0)
        for line in text.splitlines():
            m = re.match(r'jaxllm:request_success_total\\{{(.*)\\}} (\\S+)', line)
            if m and 'finished_reason="length"' in m.group(1):
                found[re.search(r'engine="(\\d)"', m.group(1)).group(1)] += float(m.group(2))
        return found

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://dp") as client:
            bodies = [dict(model="tiny", prompt=p, max_tokens=6, temperature=0.0,
                           ignore_eos=True) for p in prompts]
            replies = await asyncio.gather(*[client.post("/v1/completions", json=b)
                                             for b in bodies])
            assert [r.status_code for r in replies] == [200] * len(prompts), \\
                [r.text for r in replies]
            got = [r.json()["choices"][0] for r in replies]
            assert [c["finish_reason"] for c in got] == ["length"] * len(prompts)
            assert [r.json()["usage"]["completion_tokens"] for r in replies] == [6] * 12
            assert [c["text"] for c in got] == expected, ([c["text"] for c in got], expected)
            routed = list(engine.router.routed)
            assert all(n > 0 for n in routed) and sum(routed) == 12, routed
            by_engine = successes((await client.get("/metrics")).text)
            assert by_engine == {{"0": routed[0], "1": routed[1]}}, (by_engine, routed)
            print("DP requests", len(prompts), "routed", routed)

            # n = 2: both samples on one replica, with the single engine's seeded tokens.
            outs = [o async for o in engine.generate({{"prompt_token_ids": prompts[3]}}, two,
                                                     "pair")]
            assert [c.token_ids for c in outs[-1].outputs] == expected_two
            after = successes((await client.get("/metrics")).text)
            assert sorted(after[k] - by_engine[k] for k in after) == [0, 2], (after, by_engine)

            # An abort by id reaches whichever replica holds the request.
            long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
            streams = [engine.generate({{"prompt_token_ids": [700 + i] * 5}}, long, f"long-{{i}}")
                       for i in range(2)]
            firsts = [await anext(s) for s in streams]
            assert len({{engine.router.load[0], engine.router.load[1]}}) == 1  # one each
            await engine.abort(["long-0", "long-1"])
            lasts = [[o async for o in s][-1] for s in streams]
            assert [o.outputs[0].finish_reason for o in lasts] == ["abort", "abort"]
            for _ in range(200):
                if not any(e.has_unfinished_requests() for e in engine.engines):
                    break
                await asyncio.sleep(0.01)
            assert [e.kv_cache_manager.usage for e in engine.engines] == [0.0, 0.0]
            assert await engine.reset_prefix_cache() and not engine.router._owner

            # One replica's loop dies: every stream, on either replica, hears of it.
            def broken_step():
                raise MemoryError("replica 1 broke")
            engine.engines[1].step = broken_step
            results = await asyncio.gather(
                *[collect(engine.generate({{"prompt_token_ids": [800 + i] * 4}}, long))
                  for i in range(4)], return_exceptions=True)
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert (await client.get("/health")).status_code == 503
            for loop in engine.loops:
                loop.join(timeout=30)
            assert not any(loop.is_alive for loop in engine.loops)

    async def collect(stream):
        return [o async for o in stream]

    asyncio.run(main())
    engine.shutdown()
    print("DP OK in %.1f s" % (time.perf_counter() - t0))
""")


def test_dp2_behind_one_server_loses_no_request_and_matches_one_engine():
    script = _SCRIPT.format(here=os.path.dirname(__file__))
    proc = run_on_host_devices(["-c", script], 2)
    assert "DP OK" in proc.stdout
    print(proc.stdout.strip().splitlines()[-2:])
