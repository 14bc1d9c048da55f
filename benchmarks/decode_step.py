"""Milliseconds per decode step at batch 1 and batch 64, on the default model.

A decode step here is one `LLMEngine.step()` (schedule, jitted model step, jitted sampler,
update, detokenize) while every running request is decoding. Prints the median over
--steps steps after one untimed step per shape, and, as the peer in the same run, the
per-token cost ratio batch-64 / batch-1. Also prints warm-up time and compile count.
"""

from __future__ import annotations

import argparse
import statistics
import time

from jaxllm import LLM, SamplingParams

from machine import machine_header  # benchmarks/machine.py


def decode_ms(llm, batch, steps, prompt_len=16):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 8)
    for i in range(batch):
        engine.add_request(None, [100 + (i * 7 + j) % 1000 for j in range(prompt_len)], params)
    while any(engine.scheduler.running[i].num_computed_tokens < prompt_len
              for i in range(len(engine.scheduler.running))) or engine.scheduler.waiting:
        engine.step()  # prefill
    engine.step()  # first decode step of this shape: not timed
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    print(machine_header(), flush=True)
    llm = LLM(model=args.model, max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=256)
    engine = llm.llm_engine
    print(f"warm-up: {engine.warmup_seconds:.1f} s, {engine.runner.num_compiles} compiles")
    before = engine.runner.num_compiles
    b1 = decode_ms(llm, 1, args.steps)
    b64 = decode_ms(llm, 64, args.steps)
    print(f"decode step, batch 1: median {b1:.1f} ms ({1e3 / b1:.1f} tok/s)")
    print(f"decode step, batch 64: median {b64:.1f} ms ({64e3 / b64:.1f} tok/s)")
    print(f"per-token cost batch 64 / batch 1 = {b64 / 64 / b1:.3f}")
    print(f"compiles during the measurement: {engine.runner.num_compiles - before}")


if __name__ == "__main__":
    main()
