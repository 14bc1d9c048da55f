"""LoRA throughput: the peer workload of benchmarks/throughput.py run four ways in one
process, and the time to load an adapter.

    base       no adapter (an engine with enable_lora=False: the plain program)
    1 adapter  every request with the same adapter
    4 mixed    4 adapters, round robin over the requests (max_loras=4: all fit a step)
    16 swap    16 adapters, round robin, max_loras=4: adapters wait for a slot and are
               written into the device slots while serving (swapping)
    16 sched   the 16 swap workload on the base engine, its scheduler held to the same
               max_loras=4 rule (the adapters are never applied: no LoRA compute, no slot
               writes): the ceiling of 16 swap under the scheduling constraint alone

In 16 swap the time spent writing adapters into device slots (lora/feature.py `_write`, on
the host between steps) is measured too: its share of the run is the swap cost.

Adapters are random PEFT-format directories (rank --rank, every target module q/k/v/o/
gate/up/down, B != 0) written for the model's shapes; nothing is downloaded. Both engines
stay up; each mode runs once untimed (loads and compiles nothing new after that but the
swaps), then --repeats rounds of one timed run of each mode in turn (alternating, so a
shared machine's noise falls on every mode alike); each mode's output tok/s median is
reported with its ratio to base's. Load
time: reading and checking one adapter directory into host memory (jaxllm/lora/peft.py),
the mean over the 16.

    python benchmarks/lora.py                     # the default model (SmolLM2-135M)
    python benchmarks/lora.py --n 16 --repeats 1  # a short run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np

from machine import machine_header  # benchmarks/machine.py
from throughput import make_workload  # benchmarks/throughput.py

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: str, cfg, rank: int, seed: int) -> str:
    """A random PEFT adapter of every target module of every layer of `cfg`'s model."""
    from jaxllm.models.safetensors_io import save_file

    D, F, H = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    N, K = cfg.num_attention_heads * H, cfg.num_key_value_heads * H
    shapes = {"self_attn.q_proj": (D, N), "self_attn.k_proj": (D, K),
              "self_attn.v_proj": (D, K), "self_attn.o_proj": (N, D),
              "mlp.gate_proj": (D, F), "mlp.up_proj": (D, F), "mlp.down_proj": (F, D)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module, (k, n) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, k ** -0.5, (rank, k)).astype(
                np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.01, (n, rank)).astype(
                np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(TARGETS)}, f)
    return path


class WriteTimer:
    """Wraps the LoRA feature's slot writes: how many, and the seconds they took."""

    def __init__(self, feature):
        self.count, self.seconds, write = 0, 0.0, feature._write

        def timed(slot, model):
            t0 = time.perf_counter()
            write(slot, model)
            self.count += 1
            self.seconds += time.perf_counter() - t0
        feature._write = timed

    def reset(self):
        self.count, self.seconds = 0, 0.0


class SchedulingOnly:
    """The base engine as `engine`, its scheduler under the LoRA engine's max_loras rule
    while a run lasts (its requests carry adapters the base runner never applies)."""

    def __init__(self, base, max_loras: int):
        self.base, self.max_loras = base, max_loras

    def generate(self, *args, **kwargs):
        engine = self.base.llm_engine
        engine.scheduler.max_loras = self.max_loras
        engine.lora_manager.check = lambda params: None  # an instance attribute, removed below
        try:
            return self.base.generate(*args, **kwargs)
        finally:
            engine.scheduler.max_loras = None
            del engine.lora_manager.check

    def reset_prefix_cache(self):
        self.base.reset_prefix_cache()


def timed_run(llm, prompts, params, loras) -> float:
    """Output tok/s of one run."""
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False, lora_request=loras)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 256))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="compile buckets as they come (a quick check of the script)")
    args = ap.parse_args()
    print(machine_header(), flush=True)

    from jaxllm import LLM, SamplingParams
    from jaxllm.lora.request import LoRARequest

    engine_args = dict(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       enforce_eager=args.enforce_eager, seed=0)
    base = LLM(**engine_args)
    cfg = base.llm_engine.model_config
    prompts, outs = make_workload(args.n, args.input_len, args.output_len,
                                  cfg.vocab_size, seed=0)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o) for o in outs]

    root = tempfile.mkdtemp(prefix="jaxllm_lora_bench_")
    loras = [LoRARequest(f"a{i}", i + 1, write_adapter(f"{root}/a{i}", cfg, args.rank, i))
             for i in range(16)]
    llm = LLM(**engine_args, enable_lora=True, max_loras=4, max_cpu_loras=16,
              max_lora_rank=max(16, args.rank))
    manager = llm.llm_engine.lora_manager
    for lora in loras:  # host load (read + check) of each adapter, timed by the cache
        manager.cache.get(lora)
    load_ms = 1e3 * statistics.mean(manager.cache.load_seconds)
    modes = {"base": (base, None),
             "1 adapter": (llm, [loras[0]] * args.n),
             "4 mixed": (llm, [loras[i % 4] for i in range(args.n)]),
             "16 swap": (llm, [loras[i % 16] for i in range(args.n)]),
             "16 sched": (SchedulingOnly(base, 4), [loras[i % 16] for i in range(args.n)])}
    writes = WriteTimer(manager.feature)
    for engine, mode in modes.values():  # untimed: compiles and first loads
        timed_run(engine, prompts, params, mode)
    results = {name: [] for name in modes}
    swap_share, swap_writes = [], []
    for _ in range(args.repeats):
        for name, (engine, mode) in modes.items():
            writes.reset()
            t0 = time.perf_counter()
            results[name].append(timed_run(engine, prompts, params, mode))
            if name == "16 swap":
                swap_share.append(writes.seconds / (time.perf_counter() - t0))
                swap_writes.append(writes.count)

    ref = statistics.median(results["base"])
    print(f"\n{args.n} requests, input {args.input_len}, output {args.output_len}, "
          f"rank {args.rank}, dtype {args.dtype}")
    print(f"{'mode':<12}{'out tok/s':>12}{'vs base':>10}")
    for name, rates in results.items():
        med = statistics.median(rates)
        print(f"{name:<12}{med:>12.1f}{med / ref:>10.2f}")
    print(f"16 swap: {statistics.median(swap_writes)} slot writes a run, "
          f"{100 * statistics.median(swap_share):.1f}% of its time (median)")
    print(f"adapter load (read + check, host): {load_ms:.1f} ms mean over 16")
    print(f"load average {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
