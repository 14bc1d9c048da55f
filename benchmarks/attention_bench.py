"""CPU attention: backends "cpu" (kernels/cpu_attention.py, C++ through XLA FFI) and "xla"
(kernels/xla_attention.py) against kernels/reference.py, all timed in the same run, in
milliseconds per attention call of one layer (x30 for a SmolLM2 step).

Shapes are SmolLM2-135M's (9 query heads, 3 kv heads, head dim 64, block size 16, 30 layers).
"cpu" and "xla" always get the full block-table width W = 128 (2048 tokens): their cost must
not depend on it. The reference gets the width the runner's buckets {4, 16, 64, 128} would give
the batch. A bfloat16 cache is stored as uint16 bits, as the engine stores it on CPU
(kernels/backends.py BitsOnCpu); the reference reads real bf16.

Roofline: the KV bytes of the batch (every sequence's K and V read once) over the read bandwidth
measured here (a jitted sum over 1 GiB of f32, median of runs). "% roofline" is roofline time
over measured time, so 50% is the "within 2x" target.

    python benchmarks/attention_bench.py                   # every case, f32 and bf16
    python benchmarks/attention_bench.py --only decode64 --dtype float32 --repeats 9
    python benchmarks/attention_bench.py --ref-repeats 0     # skip the (slow) reference

What bounds "xla" on this 2-core machine (AMD EPYC, AVX-512; each timed in isolation):
  * Reading random 12 KB pages is latency-bound: a C loop with AVX-512 loads reads them at
    ~15 GB/s on one core and ~28 GB/s on two, against ~37 GB/s for a sequential sum.
  * XLA:CPU runs a while-loop body on one thread: two independent loops, or two independent
    chains in one body, took as long as one loop doing both.
  * Its gather fusion then copies f32 rows at ~10-13 GB/s (bf16: ~4-5 GB/s of bf16, the
    per-row overhead being paid per 128-byte head row) -- if its root is arithmetic. With the
    gather itself as the root the copy is scalar code (~2-3 GB/s). Gathers, dynamic-slice
    concatenations and dynamic-update-slice chains of pages all measured at or below this.
  * ynn batched dots with 3 query rows per kv head: ~13 us per 1024 keys with the keys as
    the left operand, ~27 us with them as the right one.
  So a pure-XLA decode tops out near a third of the sequential roofline before any compute;
  "xla" spends ~3/4 of a decode iteration in the two gathers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.kernels import cpu_attention, reference, xla_attention  # noqa: E402

from machine import machine_header  # noqa: E402  (benchmarks/machine.py)

N, K, H, P, LAYERS = 9, 3, 64, 16, 30
W_FULL = 128
RUNNER_WIDTHS = (4, 16, 64, 128)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]  # cached tokens before the new ones
    T: int  # token bucket
    S: int  # sequence bucket

    @property
    def seq_lens(self):
        return np.add(self.q_lens, self.ctx_lens)


def _ragged(mean: int, n: int, seed: int) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(int(x) for x in np.clip(rng.integers(mean // 4, 7 * mean // 4, n), 1,
                                         P * W_FULL - 1))


def cases() -> list[Case]:
    out = []
    for ctx in (256, 1024, 2048):
        c = min(ctx, P * W_FULL) - 1
        out.append(Case(f"decode64-uniform-{ctx}", (1,) * 64, (c,) * 64, 64, 64))
        out.append(Case(f"decode64-ragged-{ctx}", (1,) * 64, _ragged(ctx, 64, ctx), 64, 64))
    out.append(Case("decode64-63x100+1x2000", (1,) * 64, (99,) * 63 + (1999,), 64, 64))
    out.append(Case("mixed-2x224prefill+64decode", (224, 224) + (1,) * 64,
                    (0, 512) + (1023,) * 64, 512, 128))
    out.append(Case("prefill-512", (512,), (0,), 512, 8))
    out.append(Case("batch1-decode-1024", (1,), (1023,), 8, 8))
    return out


def make_inputs(case: Case, W: int, dtype, seed=0, bits=False):
    """`bits`: a 16-bit float cache as uint16 (the engine's CPU storage)."""
    rng = np.random.default_rng(seed)
    n = len(case.q_lens)
    seq_lens = np.zeros(case.S, np.int32)
    seq_lens[:n] = case.seq_lens
    pages = [-(-int(s) // P) for s in seq_lens[:n]]
    perm = rng.permutation(np.arange(1, 1 + sum(pages)))  # page 0: the null block
    bt = np.zeros((case.S, W), np.int32)
    start = 0
    for s, p in enumerate(pages):
        bt[s, :p] = perm[start:start + p]
        start += p
    shape = (1 + sum(pages), P, K, H)
    k = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    q = jnp.asarray(rng.standard_normal((case.T, N, H), np.float32), dtype)
    if bits and jnp.dtype(dtype).itemsize == 2:
        k, v = (jax.lax.bitcast_convert_type(a, jnp.uint16) for a in (k, v))
    qsl = np.zeros(case.S + 1, np.int32)
    qsl[1:n + 1] = np.cumsum(case.q_lens)
    qsl[n + 1:] = qsl[n]
    return (q, k, v, jnp.asarray(bt), jnp.asarray(seq_lens), jnp.asarray(qsl), jnp.int32(n))


def median_time(fn, args, repeats):
    jax.block_until_ready(fn(*args))  # compile + warm-up
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def read_bandwidth(repeats=7) -> float:
    x = jnp.ones((1 << 28,), jnp.float32)  # 1 GiB
    t = median_time(jax.jit(jnp.sum), (x,), repeats)
    return x.nbytes / t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run cases whose name contains this")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="both")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--ref-repeats", type=int, default=5, help="0: skip the reference")
    args = ap.parse_args()
    print(machine_header(), flush=True)
    if not cpu_attention.availability():
        raise SystemExit(f"backend cpu unavailable: {cpu_attention.availability().reason}")

    bw = read_bandwidth()
    print(f"read bandwidth (jitted sum over 1 GiB f32, median): {bw / 1e9:.1f} GB/s; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"cpu backend threads: {cpu_attention.num_threads()}")
    xla_fn = jax.jit(functools.partial(xla_attention.ragged_paged_attention, sm_scale=H ** -0.5))
    cpu_fn = jax.jit(functools.partial(cpu_attention.ragged_paged_attention, sm_scale=H ** -0.5))
    ref_fn = jax.jit(functools.partial(reference.ragged_paged_attention, sm_scale=H ** -0.5))
    dtypes = ("float32", "bfloat16") if args.dtype == "both" else (args.dtype,)
    print(f"{'case':30s} {'dtype':8s} {'KV MB':>7s} {'roof ms':>7s} {'cpu ms':>7s} {'x30':>6s} "
          f"{'%roof':>6s} {'GB/s':>5s} {'xla ms':>7s} {'%roof':>6s} {'xla/cpu':>7s} "
          f"{'ref W':>5s} {'ref ms':>8s}")
    for case in cases():
        if args.only not in case.name:
            continue
        max_pages = max(-(-int(s) // P) for s in case.seq_lens)
        ref_W = next(w for w in RUNNER_WIDTHS if w >= max_pages)
        for dtype in dtypes:
            dt = jnp.dtype(dtype)
            kv_bytes = int(np.sum(case.seq_lens)) * K * H * 2 * dt.itemsize
            inputs = make_inputs(case, W_FULL, dt, bits=True)
            t_cpu = median_time(cpu_fn, inputs, args.repeats)
            t_xla = median_time(xla_fn, inputs, args.repeats)
            t_ref = (median_time(ref_fn, make_inputs(case, ref_W, dt), args.ref_repeats)
                     if args.ref_repeats > 0 else float("nan"))
            roof = kv_bytes / bw
            print(f"{case.name:30s} {dtype:8s} {kv_bytes / 1e6:7.1f} {roof * 1e3:7.2f} "
                  f"{t_cpu * 1e3:7.2f} {t_cpu * LAYERS * 1e3:6.0f} {100 * roof / t_cpu:5.0f}% "
                  f"{kv_bytes / t_cpu / 1e9:5.1f} {t_xla * 1e3:7.2f} {100 * roof / t_xla:5.0f}% "
                  f"{t_xla / t_cpu:6.1f}x {ref_W:5d} {t_ref * 1e3:8.2f}", flush=True)


if __name__ == "__main__":
    main()
