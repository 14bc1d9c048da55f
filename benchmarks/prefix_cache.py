"""Automatic prefix caching: throughput with `enable_prefix_caching` on and off, same run.

Workloads (token ids from a fixed seed; greedy, EOS ignored, so every request produces
exactly --output-len tokens):

  shared   --num-prompts requests: one --prefix-len token system prompt, then 20..60
           (--suffix-len) unique tokens each. The cache should compute the prefix once.
  unique   the same number and lengths of prompts, every token random: a 0% hit rate, so
           what is measured is the cost of hashing and lookups (vLLM reports under 1%).

Both engines (the default model and config, only the flag differs) live in one process.
Each engine first runs every workload once untimed (the first execution of a compiled
bucket is slower, and the two engines would otherwise meet their buckets in different
runs). Each repeat then runs every (workload, engine) pair in turn, interleaved so that load from
other processes falls on both alike, and resets the prefix cache first, so no run hits what
the previous one left behind. The table shows medians over --repeats runs of wall time and
of this process's CPU time (less sensitive to other processes on a shared machine), and
the hit rate of the `jaxllm:prefix_cache_{queries,hits}` counters (tokens).

A cost of ~1% is below the noise of wall time on a busy machine, so the caching engine's
bookkeeping (hashing, lookups, offering blocks to the cache) is also timed directly: the
host time spent inside those calls, as a fraction of the run.

    python benchmarks/prefix_cache.py
    python benchmarks/prefix_cache.py --repeats 5 --num-prompts 32
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np

from machine import machine_header  # benchmarks/machine.py

QUERIES, HITS = "jaxllm:prefix_cache_queries", "jaxllm:prefix_cache_hits"


def make_workloads(args, vocab: int) -> dict[str, list[list[int]]]:
    rng = np.random.default_rng(args.seed)
    # Stay clear of the first 100 ids, which hold the special tokens of most vocabularies.
    prefix = rng.integers(100, vocab, args.prefix_len).tolist()
    suffix_lens = rng.integers(args.suffix_len[0], args.suffix_len[1] + 1, args.num_prompts)
    shared = [prefix + rng.integers(100, vocab, n).tolist() for n in suffix_lens]
    unique = [rng.integers(100, vocab, len(p)).tolist() for p in shared]
    return {"shared": shared, "unique": unique}


def counters(llm) -> tuple[int, int]:
    values = {m.name: m.value for m in llm.get_metrics() if m.name in (QUERIES, HITS)}
    return values[QUERIES], values[HITS]


class BookkeepingTimer:
    """Host seconds spent in the prefix-caching calls of one KVCacheManager (outermost
    calls only: they call each other)."""

    METHODS = ("update_block_hashes", "get_computed_blocks", "cache_blocks")

    def __init__(self, kv_cache_manager):
        self.seconds = 0.0
        self._depth = 0
        for name in self.METHODS:
            setattr(kv_cache_manager, name, self._wrap(getattr(kv_cache_manager, name)))
        pool = kv_cache_manager.block_pool
        pool.touch = self._wrap(pool.touch)

    def _wrap(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - t0
        return timed


def run_once(llm, prompts, params, timer):
    """One generate over an empty prefix cache -> dict of wall and CPU seconds, hit rate,
    bookkeeping seconds, token ids."""
    assert llm.llm_engine.scheduler.reset_prefix_cache(), "blocks still held between runs"
    q0, h0 = counters(llm)
    b0 = timer.seconds if timer else 0.0
    c0, t0 = time.process_time(), time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    q1, h1 = counters(llm)
    return dict(wall=wall, cpu=cpu, hit_rate=(h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
                bookkeeping=(timer.seconds if timer else 0.0) - b0,
                tokens=[list(o.outputs[0].token_ids) for o in outputs])


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--suffix-len", type=int, nargs=2, default=(20, 60))
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workloads", nargs="+", default=["shared", "unique"],
                   choices=["shared", "unique"])
    args = p.parse_args()
    print(machine_header(), flush=True)

    from jaxllm import LLM, SamplingParams

    engines = {}
    for caching in (True, False):
        t0 = time.perf_counter()
        engines[caching] = llm = LLM(model=args.model, enable_prefix_caching=caching,
                                     use_tqdm_on_load=False)
        e = llm.llm_engine
        print(f"LLM(enable_prefix_caching={caching}): {time.perf_counter() - t0:.1f} s "
              f"(warm-up {e.warmup_seconds:.1f} s, {e.runner.num_compiles} compiles, "
              f"{e.kv_cache_manager.num_blocks} KV blocks of {e.config.block_size}, "
              f"max_num_seqs {e.config.max_num_seqs}, max_num_batched_tokens "
              f"{e.config.max_num_batched_tokens})", flush=True)
    timer = BookkeepingTimer(engines[True].llm_engine.kv_cache_manager)
    vocab = engines[True].llm_engine.model_config.vocab_size
    workloads = {k: v for k, v in make_workloads(args, vocab).items() if k in args.workloads}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    n_prompt = {k: sum(map(len, v)) for k, v in workloads.items()}
    print(f"workloads: {args.num_prompts} prompts of {args.prefix_len} + "
          f"{args.suffix_len[0]}..{args.suffix_len[1]} tokens ({n_prompt}), "
          f"{args.output_len} output tokens each, greedy, {args.repeats} repeats", flush=True)

    for w, prompts in workloads.items():
        for caching, llm in engines.items():
            run = run_once(llm, prompts, params, None)
            print(f"  warm-up: {w:6s} caching {'on ' if caching else 'off'} "
                  f"{run['wall']:7.2f} s", flush=True)
    results = {(w, c): [] for w in workloads for c in engines}
    for r in range(args.repeats):
        for w, prompts in workloads.items():
            for caching, llm in engines.items():
                run = run_once(llm, prompts, params, timer if caching else None)
                results[w, caching].append(run)
                print(f"  repeat {r + 1}: {w:6s} caching {'on ' if caching else 'off'} "
                      f"{run['wall']:7.2f} s wall {run['cpu']:7.2f} s cpu  hit rate "
                      f"{run['hit_rate']:6.1%}  bookkeeping {1e3 * run['bookkeeping']:.1f} ms",
                      flush=True)

    def median(w, caching, key):
        return statistics.median(run[key] for run in results[w, caching])

    n_out = args.num_prompts * args.output_len
    print("\nworkload | prefix caching | median wall s | median cpu s | req/s | total tok/s | "
          "output tok/s | hit rate | speed-up (wall) | bookkeeping")
    print("--- | --- | --- | --- | --- | --- | --- | --- | --- | ---")
    for w in workloads:
        for caching in (True, False):
            wall = median(w, caching, "wall")
            book = median(w, caching, "bookkeeping")
            print(f"{w} | {'on' if caching else 'off'} | {wall:.2f} | "
                  f"{median(w, caching, 'cpu'):.2f} | {args.num_prompts / wall:.2f} | "
                  f"{(n_prompt[w] + n_out) / wall:.0f} | {n_out / wall:.1f} | "
                  f"{median(w, caching, 'hit_rate'):.1%} | "
                  f"{median(w, False, 'wall') / wall:.2f}x | "
                  f"{1e3 * book:.1f} ms ({book / wall:.3%})")
    print()
    for w in workloads:
        on_tokens, off_tokens = results[w, True][-1]["tokens"], results[w, False][-1]["tokens"]
        same = sum(a == b for a, b in zip(on_tokens, off_tokens)) / len(on_tokens)
        print(f"{w}: identical greedy tokens with caching on and off in {same:.0%} of "
              f"requests")
    if "unique" in workloads:
        for key in ("wall", "cpu"):
            ratio = median("unique", True, key) / median("unique", False, key)
            print(f"cost at a 0% hit rate ({key} time, medians): {100 * (ratio - 1):+.1f}%")
        book = median("unique", True, "bookkeeping") / median("unique", True, "wall")
        print(f"cost at a 0% hit rate (prefix-caching bookkeeping, timed directly): "
              f"{book:.3%} of the run")


if __name__ == "__main__":
    main()
