"""Serving benchmark, in the spirit of `vllm bench serve`: `jaxllm serve` under load, against
`LLM.generate` on the same workload in the same run.

Starts the real server in a subprocess, fires the throughput workload (token-id prompts,
greedy, EOS ignored) through /v1/completions with streaming at each concurrency, and reports
TTFT (time to first token), TPOT (time per output token after the first, per request) and
ITL (gaps between streamed chunks) as p50 / p99, request throughput and output tok/s. Then
stops the server and runs the same requests through `LLM.generate` in this process: the
ratio serving / offline output tok/s is the number that decides between a thread and a
process for the engine loop (goal: >= 0.9 at concurrency 64).

    python benchmarks/serve.py                            # concurrency 1, 16, 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import make_workload  # noqa: E402
from machine import machine_header  # noqa: E402  (benchmarks/machine.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine_args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", "from jaxllm.entrypoints.cli import main; "
                             "main()", "serve", *engine_args, "--host", "127.0.0.1", "--port",
                             str(port), "--uvicorn-log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(1200):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("the server exited")
        time.sleep(0.5)
    raise TimeoutError("server did not start")


async def one_request(http, url, prompt, max_tokens):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    chunk_times, text_tokens = [], 0
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                payload = json.loads(line[6:])
                if payload["choices"]:
                    chunk_times.append(time.perf_counter())
                    text_tokens += 1
    end = time.perf_counter()
    return {"ttft": chunk_times[0] - t0, "e2e": end - t0, "tokens": max_tokens,
            "itl": list(np.diff(chunk_times)),
            "tpot": (end - chunk_times[0]) / max(1, max_tokens - 1)}


async def run_load(url, prompts, outs, concurrency):
    sem = asyncio.Semaphore(concurrency)

    async def bounded(http, p, o):
        async with sem:
            return await one_request(http, url, p, o)

    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=512)) as http:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[bounded(http, p, o) for p, o in zip(prompts, outs)])
        return results, time.perf_counter() - t0


def pct(values, q):
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(16, 256))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompts-at-concurrency-1", type=int, default=8,
                   help="concurrency 1 runs this many requests (one at a time is slow)")
    p.add_argument("--max-model-len", type=int, default=1024)
    args = p.parse_args()
    print(machine_header(), flush=True)

    from jaxllm.models.resolve import resolve_model
    from jaxllm.tokenizer import get_tokenizer

    resolved = resolve_model(args.model)
    vocab = len(get_tokenizer(resolved.path))
    prompts, outs = make_workload(args.num_prompts, args.input_len, args.output_len, vocab, 0)
    engine_args = ([args.model] if args.model else []) + [
        "--max-model-len", str(args.max_model_len), "--max-num-seqs", "64",
        "--max-num-batched-tokens", "512"]
    proc, url = start_server(engine_args)
    rows = {}
    try:
        asyncio.run(run_load(url, prompts[:4], [8] * 4, 4))  # warm the connection pool
        for c in args.concurrency:
            n = args.prompts_at_concurrency_1 if c == 1 else len(prompts)
            results, wall = asyncio.run(run_load(url, prompts[:n], outs[:n], c))
            tokens = sum(r["tokens"] for r in results)
            rows[c] = dict(
                requests=n, wall=wall, req_s=n / wall, tok_s=tokens / wall,
                ttft=(pct([r["ttft"] for r in results], 50), pct([r["ttft"] for r in results], 99)),
                tpot=(pct([r["tpot"] for r in results], 50), pct([r["tpot"] for r in results], 99)),
                itl=(pct(sum((r["itl"] for r in results), []), 50),
                     pct(sum((r["itl"] for r in results), []), 99)))
            print(f"concurrency {c}: {n} requests in {wall:.1f} s", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)

    from jaxllm import LLM, SamplingParams

    llm = LLM(model=args.model, max_model_len=args.max_model_len, max_num_seqs=64,
              max_num_batched_tokens=512)
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=o) for o in outs]
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    offline = sum(outs) / statistics.median(times)

    print("\nconcurrency | requests | req/s | output tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms "
          "| ITL p50/p99 ms | serving / offline")
    print("--- | --- | --- | --- | --- | --- | --- | ---")
    for c, r in rows.items():
        print(f"{c} | {r['requests']} | {r['req_s']:.2f} | {r['tok_s']:.1f} | "
              f"{r['ttft'][0]:.0f} / {r['ttft'][1]:.0f} | {r['tpot'][0]:.1f} / {r['tpot'][1]:.1f}"
              f" | {r['itl'][0]:.1f} / {r['itl'][1]:.1f} | "
              + (f"{r['tok_s'] / offline:.2f}" if c == max(rows) else "-"))
    print(f"offline LLM.generate, same {len(prompts)} requests: {offline:.1f} output tok/s "
          f"(median of 3)")


if __name__ == "__main__":
    main()
