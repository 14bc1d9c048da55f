"""What activation capture costs: the throughput workload (benchmarks/throughput.py's, SmolLM2,
greedy, EOS ignored) on three engines in one run, medians of --repeats after one warm-up run
each (the runs interleave, so a slow minute of the machine hits all three alike):

  plain      LLM(...) without research: the step as it ships
  unused     LLM(research=ResearchConfig(capture_layers=L)): capture compiled in, no request
             asks for it (the step writes its [T, K, D] buffer, the host never fetches it)
  used       the same engine, every request capturing resid_post at the layers L, every
             position (prompt and generated): the buffer is fetched and cut every step

Targets (issue 17): unused >= 0.97x plain, used >= 0.8x plain. Tokens must be identical in
all three (capture never changes a value).

    python benchmarks/research_cost.py                 # layers 10 and 20, 3 repeats
"""

from __future__ import annotations

import argparse
import statistics
import time

from machine import machine_header  # benchmarks/machine.py
from throughput import make_workload  # benchmarks/throughput.py


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(16, 256))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    p.add_argument("--layers", type=int, nargs="+", default=[10, 20])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(machine_header(), flush=True)

    from jaxllm import LLM, SamplingParams
    from jaxllm.research import Capture, ResearchConfig

    common = dict(model=args.model, dtype=args.dtype, max_num_seqs=64,
                  max_num_batched_tokens=512, max_model_len=1024, seed=0)
    plain_llm = LLM(**common)
    research_llm = LLM(**common, research=ResearchConfig(capture_layers=tuple(args.layers)))
    vocab = plain_llm.llm_engine.model_config.vocab_size
    prompts, outs = make_workload(args.num_prompts, args.input_len, args.output_len, vocab, 0)
    requests = [{"prompt_token_ids": q} for q in prompts]
    plain = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o) for o in outs]
    used = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o,
                           extra_args={"capture": Capture()}) for o in outs]
    configs = {"plain": (plain_llm, plain), "unused": (research_llm, plain),
               "used": (research_llm, used)}
    n_out = sum(outs)
    times = {name: [] for name in configs}
    tokens = {}
    for run in range(args.repeats + 1):
        for name, (llm, params) in configs.items():
            # Every run computes its prompts: a capturing request never reads the prefix
            # cache, and the others must not read what an earlier run of theirs left there.
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            results = llm.generate(requests, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            tokens[name] = [list(r.outputs[0].token_ids) for r in results]
            if name == "used":
                captured = sum(len(r.outputs[0].activations) for r in results)
                expected = sum(len(q) + o - 1 for q, o in zip(prompts, outs))
                assert captured == expected, (captured, expected)
            if run:  # run 0 is the warm-up
                times[name].append(elapsed)
            print(f"  run {run} {name}: {elapsed:.2f} s", flush=True)
    assert tokens["plain"] == tokens["unused"] == tokens["used"], "capture changed tokens"
    print(f"\n{args.num_prompts} prompts, {n_out} output tokens, capture layers {args.layers} "
          f"(resid_post), dtype {args.dtype}")
    print("engine | median s | output tok/s | / plain")
    print("--- | --- | --- | ---")
    base = statistics.median(times["plain"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name} | {med:.2f} | {n_out / med:.1f} | {base / med:.3f}x")
    print("tokens identical in all three: yes")


if __name__ == "__main__":
    main()
