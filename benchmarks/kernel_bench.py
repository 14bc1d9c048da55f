"""Ragged paged attention: Pallas kernel vs the XLA reference, in bytes, FLOPs and time.

On a GPU: times both over decode-heavy and prefill-heavy batches (median of --repeats runs)
and prints achieved GB/s, % of HBM peak, TFLOP/s and the kernel/reference speed ratio.
On CPU: prints only what the shapes imply (bytes, FLOPs, the variant the kernel would pick,
the time at 70% of HBM peak) and runs nothing slow.

Bytes are the minimum any implementation must move: each sequence's K and V once per KV head
(all seq_len positions), q read and the output written once, plus the block tables. The
kernel re-reads K/V once per query tile (prefill) and relies on L2 for that, so % of peak for
prefill is a lower bound on the hardware's real traffic.

    python benchmarks/kernel_bench.py                  # all shapes
    python benchmarks/kernel_bench.py --only decode    # names containing "decode"
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

from jaxllm.kernels import paged_attention as pa
from jaxllm.kernels.gpu_compile import available_targets, target_info
from jaxllm.kernels import reference
from jaxllm.kernels import tuning

from machine import machine_header  # benchmarks/machine.py

# HBM bandwidth, bytes/s, of every packaged GPU target (jaxllm/kernels/targets/*.txtpb).
HBM_PEAK = {t: target_info(t).memory_bandwidth for t in available_targets()}
EFFICIENCY = 0.70  # the fraction of peak a well-tuned memory-bound kernel reaches

# Llama-3-8B
LLAMA3_8B = dict(layers=32, hidden=4096, q_heads=32, kv_heads=8, head_dim=128,
                 intermediate=14336, vocab=128256)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]  # cached tokens before the new ones
    Hq: int = 32
    Hkv: int = 8
    D: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"

    @property
    def seq_lens(self):
        return tuple(q + c for q, c in zip(self.q_lens, self.ctx_lens))

    @property
    def T(self):
        return sum(self.q_lens)

    def bytes_moved(self) -> int:
        item = jnp.dtype(self.dtype).itemsize
        kv = sum(self.seq_lens) * self.Hkv * self.D * 2 * item
        q_and_o = self.T * self.Hq * self.D * 2 * item
        tables = len(self.q_lens) * (-(-max(self.seq_lens) // self.block_size)) * 4
        return kv + q_and_o + tables

    def flops(self) -> int:
        # QK^T and PV: 2 * D multiply-adds each per (query head, visible key).
        visible = sum(sum(c + j + 1 for j in range(q)) for q, c in zip(self.q_lens,
                                                                      self.ctx_lens))
        return 4 * self.D * self.Hq * visible


CASES = [
    Case("decode 64 x 2k", (1,) * 64, (2047,) * 64),
    Case("decode 256 x 1k", (1,) * 256, (1023,) * 256),
    Case("decode 8 x 16k (split-KV)", (1,) * 8, (16383,) * 8),
    Case("decode 1 x 32k (split-KV)", (1,), (32767,)),
    Case("prefill 4 x 512", (512,) * 4, (0,) * 4),
    Case("chunked prefill 2 x 1024 over 4k prefix", (1024,) * 2, (4096,) * 2),
    Case("mixed 1024-token chunk + 63 decode x 2k", (1024,) + (1,) * 63, (0,) + (2047,) * 63),
]


def make_inputs(case: Case, seed: int = 0):
    rng = np.random.default_rng(seed)
    S, bs = len(case.q_lens), case.block_size
    pages_per_seq = [-(-n // bs) for n in case.seq_lens]
    max_blocks = max(pages_per_seq)
    num_blocks = 1 + sum(pages_per_seq)
    perm = rng.permutation(np.arange(1, num_blocks))
    block_tables = np.zeros((S, max_blocks), np.int32)
    start = 0
    for s, n in enumerate(pages_per_seq):
        block_tables[s, :n] = perm[start:start + n]
        start += n
    dtype = jnp.dtype(case.dtype)
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    cache_shape = (num_blocks, bs, case.Hkv, case.D)
    return dict(
        q=jax.random.normal(kq, (case.T, case.Hq, case.D), dtype),
        k_cache=jax.random.normal(kk, cache_shape, dtype),
        v_cache=jax.random.normal(kv, cache_shape, dtype),
        block_tables=jnp.asarray(block_tables),
        seq_lens=jnp.asarray(case.seq_lens, jnp.int32),
        query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(case.q_lens)]), jnp.int32),
        num_seqs=jnp.int32(S))


def median_seconds(fn, args, repeats):
    jax.block_until_ready(fn(**args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(**args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def variant(case: Case, target: str) -> str:
    S = len(case.q_lens)
    max_blocks = -(-max(case.seq_lens) // case.block_size)
    st, warps, stages = pa.plan((case.T, case.Hq, case.D), (1, case.block_size, case.Hkv, case.D),
                                (S, max_blocks), jnp.dtype(case.dtype), target=target)
    kind = f"split x{st.num_splits}" if st.num_splits > 1 else "plain"
    return f"{kind} m{st.block_m} n{st.block_n} w{warps} s{stages}"


def llama3_8b_decode_step(num_seqs=64, context=2048, itemsize=2):
    """Bytes one decode step of Llama-3-8B must move: all weights once, each sequence's KV."""
    c = LLAMA3_8B
    kv_dim = c["kv_heads"] * c["head_dim"]
    per_layer = (c["hidden"] * c["hidden"] * 2 + c["hidden"] * kv_dim * 2  # q, o, k, v
                 + 3 * c["hidden"] * c["intermediate"])  # gate, up, down
    weights = (per_layer * c["layers"] + c["vocab"] * c["hidden"]) * itemsize  # + lm head
    kv_read = num_seqs * context * kv_dim * 2 * itemsize * c["layers"]
    return weights, kv_read


def print_model():
    weights, kv = llama3_8b_decode_step()
    bw = HBM_PEAK["h100"] * EFFICIENCY
    print("Llama-3-8B decode step, 64 sequences x 2048 context, bf16, 32 layers:")
    print(f"  KV cache read by attention: {kv / 1e9:8.2f} GB -> {kv / bw * 1e3:6.2f} ms")
    print(f"  weights read once:          {weights / 1e9:8.2f} GB -> {weights / bw * 1e3:6.2f} ms")
    print(f"  total:                      {(kv + weights) / 1e9:8.2f} GB -> "
          f"{(kv + weights) / bw * 1e3:6.2f} ms at {EFFICIENCY:.0%} of H100 HBM peak "
          f"({HBM_PEAK['h100'] / 1e12:.2f} TB/s)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run cases whose name contains this")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(machine_header(), flush=True)
    cases = [c for c in CASES if args.only in c.name]
    on_gpu = jax.default_backend() == "gpu"
    target = tuning.detect_target() if on_gpu else "h100"
    print_model()
    print()
    header = f"{'case':44} {'MB':>9} {'GFLOP':>8}  {'variant (' + target + ')':28}"
    if on_gpu:
        print(header + f" {'kernel ms':>10} {'GB/s':>7} {'%peak':>6} {'TFLOP/s':>8} "
                       f"{'xla ms':>9} {'speedup':>8}")
    else:
        print(header + f" {'ms@70% H100':>12} {'ms@70% A100':>12}   (CPU: nothing timed)")
    for case in cases:
        nbytes, flops = case.bytes_moved(), case.flops()
        line = f"{case.name:44} {nbytes / 1e6:9.1f} {flops / 1e9:8.1f}  {variant(case, target):28}"
        if not on_gpu:
            ideal = [nbytes / (HBM_PEAK[t] * EFFICIENCY) * 1e3 for t in ("h100", "a100")]
            print(line + f" {ideal[0]:12.3f} {ideal[1]:12.3f}")
            continue
        inputs = make_inputs(case)
        scale = case.D ** -0.5
        kernel = jax.jit(functools.partial(pa.ragged_paged_attention, sm_scale=scale))
        xla = jax.jit(functools.partial(reference.ragged_paged_attention, sm_scale=scale))
        t_kernel = median_seconds(kernel, inputs, args.repeats)
        t_xla = median_seconds(xla, inputs, args.repeats)
        peak = HBM_PEAK.get(target)
        pct = f"{nbytes / t_kernel / peak:6.1%}" if peak else "   n/a"
        print(line + f" {t_kernel * 1e3:10.3f} {nbytes / t_kernel / 1e9:7.0f} {pct} "
                     f"{flops / t_kernel / 1e12:8.1f} {t_xla * 1e3:9.3f} {t_xla / t_kernel:7.1f}x")


if __name__ == "__main__":
    main()
