"""Step time of a tiny Mixtral at 64 decode rows against its dense equivalent.

The dense equivalent is a Llama with the same attention, embedding and layers whose MLP has
intermediate_size = k * (an expert's width): the same active parameters per token. Both
run the model's jitted step (the forward and the LM head over the 64 rows; each row one
sequence decoding at position CONTEXT, over a paged cache) with random weights, timed
alternately, median over --repeats. Prints both medians and their ratio (target <= 1.5).

The experts run the linear method's expert FFN (models/moe.py): with --linear cpu the C++
grouped GEMM, with xla XLA's block-sparse loop. With --linear cpu a third step, the same
Mixtral with XLA's expert loop (dense layers still "cpu"), is timed in the same rounds: the
grouped kernel's before/after on one machine load.

    python benchmarks/moe_step.py [--repeats 30] [--linear xla|cpu] [--dtype float32]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.kernels.backends import AttentionLayer, get_backend
from jaxllm.kernels.linear_methods import CpuGemmLinearMethod, LinearMethod, get_linear_method
from jaxllm.models.base import AttentionMetadata
from jaxllm.models.config import ModelConfig
from jaxllm.models.llama import init_kv_caches
from jaxllm.models.parallel import ParallelOps
from jaxllm.models.registry import get_model_class

from machine import machine_header  # benchmarks/machine.py

ROWS, CONTEXT, BLOCK = 64, 32, 16
MIXTRAL = ModelConfig(
    architecture="MixtralForCausalLM", vocab_size=2048, hidden_size=256,
    intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512)


def dense_equivalent(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(
        cfg, architecture="LlamaForCausalLM", num_experts=0, num_experts_per_tok=0,
        intermediate_size=cfg.num_experts_per_tok * cfg.moe_intermediate_size)


def decode_batch(cfg: ModelConfig) -> AttentionMetadata:
    """ROWS sequences, each decoding its token at position CONTEXT (blocks laid out in
    order after the null block 0)."""
    per_seq = -(-(CONTEXT + 1) // BLOCK)
    tables = 1 + np.arange(ROWS * per_seq, dtype=np.int32).reshape(ROWS, per_seq)
    rng = np.random.default_rng(0)
    return jax.tree.map(jnp.asarray, AttentionMetadata(
        input_ids=rng.integers(0, cfg.vocab_size, ROWS).astype(np.int32),
        positions=np.full(ROWS, CONTEXT, np.int32),
        slot_mapping=(tables[:, CONTEXT // BLOCK] * BLOCK + CONTEXT % BLOCK).astype(np.int32),
        block_tables=tables, seq_lens=np.full(ROWS, CONTEXT + 1, np.int32),
        query_start_loc=np.arange(ROWS + 1, dtype=np.int32), num_seqs=np.int32(ROWS)))


class CpuDenseXlaExperts(CpuGemmLinearMethod):
    """The "cpu" method's dense layers with XLA's expert loop: the grouped kernel's baseline."""

    name = "cpu"

    def expert_ffn(self, *args):
        return LinearMethod.expert_ffn(self, *args)


def make_step(cfg: ModelConfig, dtype, linear: LinearMethod):
    """-> a no-argument callable running one jitted step (the cache donated and kept)."""
    model = get_model_class(cfg)(cfg, dtype=dtype, rngs=nnx.Rngs(0))
    ops = ParallelOps(AttentionLayer(get_backend("xla")), linear)
    model.process_weights_after_loading(ops.linear_method)
    graphdef, state = nnx.split(model)
    md = decode_batch(cfg)
    kv = [init_kv_caches(cfg, 1 + ROWS * -(-(CONTEXT + 1) // BLOCK), BLOCK, dtype)]

    @functools.partial(jax.jit, donate_argnames=("kv_caches",))
    def step(state, md, kv_caches):
        m = nnx.merge(graphdef, state)
        hidden, kv_caches = m(md, kv_caches, ops)
        return m.compute_logits(hidden, ops), kv_caches

    def run():
        logits, kv[0] = step(state, md, kv_caches=kv[0])
        logits.block_until_ready()

    run()  # compile
    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--linear", default="xla", choices=["xla", "cpu"],
                   help="linear method of the dense layers (the experts always run XLA dots)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    print(machine_header(), flush=True)
    dtype = jnp.dtype(args.dtype)
    dense = dense_equivalent(MIXTRAL)
    linear = get_linear_method(args.linear)
    steps = {"mixtral": make_step(MIXTRAL, dtype, linear),
             "dense": make_step(dense, dtype, linear)}
    if args.linear == "cpu":
        steps["mixtral, XLA experts"] = make_step(MIXTRAL, dtype, CpuDenseXlaExperts())
    times = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, run in steps.items():  # alternately, so load changes hit both alike
            t0 = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - t0) * 1e3)
    med = {name: statistics.median(t) for name, t in times.items()}
    c = MIXTRAL
    print(f"{ROWS} decode rows, {c.num_hidden_layers} layers, D={c.hidden_size}, "
          f"E={c.num_experts}, k={c.num_experts_per_tok}, expert F={c.moe_intermediate_size}"
          f" (dense F={dense.intermediate_size}), {args.dtype}, linear={args.linear}")
    print(f"mixtral step: median {med['mixtral']:.2f} ms; dense equivalent: median "
          f"{med['dense']:.2f} ms ({args.repeats} repeats)")
    print(f"ratio mixtral / dense = {med['mixtral'] / med['dense']:.2f} (target <= 1.5); "
          f"of the fastest repeats: {min(times['mixtral']) / min(times['dense']):.2f}")
    if "mixtral, XLA experts" in med:
        xla = med["mixtral, XLA experts"]
        print(f"mixtral with XLA's expert loop: median {xla:.2f} ms, ratio to dense "
              f"{xla / med['dense']:.2f}; grouped kernel speed-up {xla / med['mixtral']:.2f}x")


if __name__ == "__main__":
    main()
