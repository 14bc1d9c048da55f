"""The C++ GEMM (jaxllm/kernels/cpu_gemm.py, weights packed at load) against XLA:CPU's dot on
the same weights, at SmolLM2-135M's shapes, with this machine's multiply-add peak as the
roofline.

For each dtype (bfloat16, float32) and each shape (rows M x K -> N: q/o 576->576, k/v
576->192, gate/up 576->1536, down 1536->576, the LM head 576->49152), both products run
alternately --rounds times inside one process (so load from other processes hits both
alike); each row gives the medians in microseconds, GFLOP/s, the C++ kernel's % of the peak,
and XLA's time over the C++ kernel's. The peak is the library's own chain-free
vdpbf16ps / vfmadd231ps loop on every GEMM thread (JaxllmCpuGemmPeakGflops), the best of
--peak-runs short runs before each table (a loaded machine lowers a single
run; a figure over 100% says the peak was taken while something else ran).

    python benchmarks/cpu_gemm.py
    python benchmarks/cpu_gemm.py --rows 64 --rounds 20 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import machine_header  # noqa: E402  (benchmarks/machine.py)

SHAPES = {"q_proj/o_proj": (576, 576), "k_proj/v_proj": (576, 192),
          "gate/up_proj": (576, 1536), "down_proj": (1536, 576), "lm_head": (576, 49152)}


def peak_gflops(bf16: bool, threads: int) -> float:
    from jaxllm.kernels import cpu_gemm

    fn = cpu_gemm._library().lib.JaxllmCpuGemmPeakGflops
    fn.restype = ctypes.c_double
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_double)
    return fn(int(bf16), threads, 0.2)


def time_us(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args).block_until_ready()
    return (time.perf_counter() - t0) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 512])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                    choices=["bfloat16", "float32"])
    ap.add_argument("--peak-runs", type=int, default=5)
    args = ap.parse_args()
    print(machine_header(), flush=True)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.kernels import cpu_gemm

    threads = cpu_gemm.num_threads()
    rng = np.random.default_rng(0)
    for name in args.dtypes:
        dtype = jnp.dtype(name)
        if not cpu_gemm.availability(dtype):
            print(f"\n{name}: the C++ GEMM cannot run here: "
                  f"{cpu_gemm.availability(dtype).reason}")
            continue
        peak = max(peak_gflops(name == "bfloat16", threads) for _ in range(args.peak_runs))
        print(f"\n{name}: peak {peak:.0f} GFLOP/s on {threads} GEMM threads; medians of "
              f"{args.rounds} alternating rounds; load average {os.getloadavg()[0]:.1f}")
        print("| shape | M | C++ us | XLA us | C++ GFLOP/s | % of peak | XLA / C++ |\n"
              "|---|---|---|---|---|---|---|")
        for label, (k, n) in SHAPES.items():
            w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.05, dtype)
            packed = cpu_gemm.pack(w)
            ours = jax.jit(lambda x, p, n=n: cpu_gemm.gemm(x, p, n, dtype))
            xla = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32
                                               ).astype(dtype))
            for m in args.rows:
                x = jnp.asarray(rng.standard_normal((m, k), np.float32), dtype)
                ours(x, packed).block_until_ready()  # compile
                xla(x, w).block_until_ready()
                a, b = [], []
                for _ in range(args.rounds):
                    a.append(time_us(ours, x, packed))
                    b.append(time_us(xla, x, w))
                us, xla_us = statistics.median(a), statistics.median(b)
                gflops = 2 * m * k * n / us / 1e3
                print(f"| {label} {k}x{n} | {m} | {us:.0f} | {xla_us:.0f} | {gflops:.0f} | "
                      f"{100 * gflops / peak:.0f}% | {xla_us / us:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
