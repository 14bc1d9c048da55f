"""Embedding server throughput: many clients, one sentence each, against the offline batch.

A RAG front end sends one /v1/embeddings request per chunk, many at once. The pooling server
batches concurrent requests into shared steps (jaxllm/pooling/batching.py); this measures how
close that comes to `LLM.embed` over the same sentences in one call (the offline best), and
how far one request at a time falls behind. The app runs in this process (httpx's ASGI
transport: no sockets, so the figures are the engine's and the server's, not the network's).

Rows, each the median of --repeats alternating rounds over the same --num-sentences
sentences (benchmarks/embed.py's, 8..128 tokens):
  offline      LLM.embed(all sentences)
  concurrent   one request per sentence, all in flight at once (asyncio.gather)
  sequential   one request per sentence, each awaited before the next

    python benchmarks/embed_server.py
    python benchmarks/embed_server.py --num-sentences 128 --repeats 3 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from embed import sentences  # noqa: E402  (benchmarks/embed.py)
from machine import machine_header  # noqa: E402  (benchmarks/machine.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-sentences", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    print(machine_header(), flush=True)

    import httpx

    from jaxllm import LLM
    from jaxllm.entrypoints.openai.pooling_server import build_pooling_app

    llm = LLM(runner="pooling", max_model_len=128, max_num_seqs=256, dtype=args.dtype,
              max_num_batched_tokens=args.max_num_batched_tokens)
    texts = sentences(llm.get_tokenizer(), args.num_sentences)
    app = build_pooling_app(llm.llm_engine, served_model_names=["m"])

    async def serve(concurrent: bool):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://jaxllm",
                                     timeout=None) as http:
            def one(text):
                return http.post("/v1/embeddings", json={"input": text})
            if concurrent:
                responses = await asyncio.gather(*[one(t) for t in texts])
            else:
                responses = [await one(t) for t in texts]
        assert all(r.status_code == 200 for r in responses)

    modes = {"offline": lambda: llm.embed(texts, use_tqdm=False),
             "concurrent": lambda: asyncio.run(serve(True)),
             "sequential": lambda: asyncio.run(serve(False))}
    for run in modes.values():  # warm-up: every token bucket compiled
        run()
    times = {name: [] for name in modes}
    for _ in range(args.repeats):
        for name, run in modes.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    n = len(texts)
    base = statistics.median(times["offline"])
    print(f"\n{args.dtype}: {n} sentences, median of {args.repeats} alternating rounds, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| mode | s | sentences/s | / offline |\n|---|---|---|---|")
    for name, runs in times.items():
        s = statistics.median(runs)
        print(f"| {name} | {s:.2f} | {n / s:.1f} | {base / s:.2f}x |")


if __name__ == "__main__":
    main()
