"""Tensor parallelism on a GPU node, compiled without a GPU: per-device memory and collective
bytes per layer of the runner's real step, for Llama-3-8B and Llama-3-70B shapes.

For each model and bucket the step is lowered for a TP mesh of compile-only GPU devices
(jaxllm/kernels/gpu_compile.py, default 8 x H100) and compiled through XLA's GPU pipeline.
It prints, per device:
  weights      bytes of this device's parameter shards (the layout's, models/tp_layout.py)
  KV / token   bytes one token of context costs on this device, and tokens that fit in
               --memory-utilization of the device's memory after weights and temporaries
  temp         the compiled step's temporary bytes (memory_analysis)
  collectives  from the optimized HLO: all-reduce bytes per layer (the Megatron pair), the
               embedding's all-reduce, the logits all-gathers; any other collective is listed
The peer is vLLM's layout for the same model: two all-reduces per layer of the bf16
activations [T, D]; the ratio is this step's bytes per layer over that.

    python benchmarks/tp_plan.py                       # both models, decode and prefill
    python benchmarks/tp_plan.py --models llama3-8b --tp 8 --target h100

Nothing here runs on a GPU: memory is the compiler's accounting of the program, not a
measurement of a device.
"""

from __future__ import annotations

import argparse
import math
import time

import jax

from jaxllm.kernels import gpu_compile as gc
from jaxllm.kernels import hlo_text, tuning
from jaxllm.kernels.backends import get_backend
from jaxllm.models.config import ModelConfig
from jaxllm.models.sharding import make_mesh
from jaxllm.runner.abstract_step import lower_abstract_step

from machine import machine_header  # benchmarks/machine.py

MODELS = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8),
}
BUCKETS = {"decode": (256, 256), "prefill": (8192, 256)}  # (T tokens, S sequences)
GIB = 1 << 30


def config(name: str) -> ModelConfig:
    return ModelConfig.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, head_dim=128,
        max_position_embeddings=131072, rope_theta=500000.0, **MODELS[name]))


def shard_bytes(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(tree))


def report(name, bucket, args):
    cfg = config(name)
    T, S = BUCKETS[bucket]
    W = args.max_model_len // 16
    mesh = make_mesh(args.tp, gc.target_devices(args.target, args.tp))
    t0 = time.perf_counter()
    step = lower_abstract_step(cfg, mesh, get_backend("pallas"), T=T, S=S, W=W,
                               num_blocks=args.num_blocks, max_num_seqs=S,
                               max_model_len=args.max_model_len)
    result = gc.compile_lowered(step.lowered, args.target)
    seconds = time.perf_counter() - t0
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    weights = shard_bytes(step.state)
    kv_per_block = shard_bytes(step.kv_caches) // args.num_blocks
    kv_per_token = kv_per_block // 16
    temp = result.memory.temp_size_in_bytes
    device_bytes = args.device_memory_gib * GIB * args.memory_utilization
    tokens = int((device_bytes - weights - temp) // kv_per_block) * 16
    found = hlo_text.collectives(result.hlo)
    reduces = [c for c in found if c.op == "all-reduce"]
    layer_reduces = [c for c in reduces if c.shape == (T, D)][:2 * L + 1]
    # The embedding's all-reduce is in the table's dtype; the layers reduce their matmuls'
    # float32 partial sums, so it is never the larger one.
    embed = min(c.nbytes for c in layer_reduces)
    per_layer = (sum(c.nbytes for c in layer_reduces) - embed) // L
    gathers = [c for c in found if c.op == "all-gather"]
    others = [c for c in found if c.op not in ("all-reduce", "all-gather")]
    vllm_per_layer = 2 * T * D * 2  # two bf16 all-reduces of [T, D]
    print(f"{name} {bucket} (T={T}, S={S}) on {args.tp} x {args.target}, "
          f"compiled in {seconds:.0f} s")
    print(f"  per device: weights {weights / GIB:.2f} GiB, temp {temp / GIB:.2f} GiB, KV "
          f"{kv_per_token} B/token ({kv_per_token * args.tp} B/token over the node, "
          f"= total / {args.tp}); {tokens} tokens of KV fit in "
          f"{args.memory_utilization:.0%} of {args.device_memory_gib} GiB")
    print(f"  all-reduces: {len(reduces)} ({len(layer_reduces)} of [T, D]); per layer "
          f"{per_layer / 2**20:.2f} MiB (dtypes {sorted({c.dtype for c in layer_reduces})}), "
          f"embedding {embed / 2**20:.2f} MiB; vLLM's bf16 pair per layer "
          f"{vllm_per_layer / 2**20:.2f} MiB, ratio {per_layer / vllm_per_layer:.2f}")
    print("  all-gathers: " + ", ".join(
        f"{c.dtype}{list(c.shape)} {c.nbytes / 2**20:.1f} MiB"
        f"{'' if c.in_entry else ' (prompt-logprobs branch)'}" for c in gathers))
    print(f"  other collectives: {[(c.op, c.shape) for c in others]}")
    kernels = [k for k in result.kernels if k.name.startswith("ragged_paged")]
    print(f"  attention kernels: {len(kernels)}, grid {sorted({k.grid for k in kernels})}, "
          f"problems {sum(len(gc.kernel_problems(result, k)) for k in kernels)}; "
          f"whole-cache copies {len(gc.full_cache_copies(result, step.kv_caches))}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--buckets", nargs="+", default=list(BUCKETS), choices=list(BUCKETS))
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--target", default="h100")
    p.add_argument("--device-memory-gib", type=float, default=80.0)
    p.add_argument("--memory-utilization", type=float, default=0.9)
    # Not a power of two: the copy check matches cache-sized arrays by element count, and at
    # 4096 blocks a 70B prefill's per-device q [8192, 8, 128] has the cache's 8388608.
    p.add_argument("--num-blocks", type=int, default=4099, help="KV blocks compiled in")
    p.add_argument("--max-model-len", type=int, default=8192)
    args = p.parse_args()
    print(machine_header(), flush=True)
    tuning.detect_target = lambda: args.target  # the tiles that GPU would pick
    for name in args.models:
        for bucket in args.buckets:
            report(name, bucket, args)


if __name__ == "__main__":
    main()
