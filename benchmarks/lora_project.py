"""Where LoRA's time goes in a step: the adapters' deltas alone at every projection of
SmolLM2-135M (30 layers x q/k/v/o/gate/up/down, rank 16, max_loras 4, bf16), for a decode
step's rows (T=64) and one prefill chunk (T=512), each way of lora/apply.py and each case:

    none      no token has an adapter
    one       every token the same adapter
    mixed     4 adapters round robin over the tokens

Each is one jitted program: every projection's apply on a fixed x and y, the results
summed (the same sums in "base", which applies nothing: its time is subtracted). Ways and
cases alternate in each round (a shared machine's noise falls on all alike); medians in ms.

    python benchmarks/lora_project.py --rounds 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from machine import machine_header  # benchmarks/machine.py

SHAPES = {"q": (576, 576), "k": (576, 192), "v": (576, 192), "o": (576, 576),
          "gate": (576, 1536), "up": (576, 1536), "down": (1536, 576)}


def program(apply, L, M):
    def step(x_TD, x_TF, y_N, tables, m_T):
        total = jnp.float32(0)
        for layer in range(L):
            for t, (K, N) in SHAPES.items():
                x = x_TF if K == 1536 else x_TD
                y = y_N[N] + layer  # a fresh buffer, as a dense layer's output is
                if apply is not None:
                    y = apply(x, y, *tables[t], m_T, layer, M)
                total += jnp.sum(y.astype(jnp.float32))
        return total
    return jax.jit(step)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tokens", type=int, nargs="+", default=(64, 512))
    args = ap.parse_args()
    print(machine_header(), flush=True)
    from jaxllm.lora.apply import cpu_apply, xla_apply

    L, M, R, dtype = 30, 4, 16, jnp.bfloat16
    rng = np.random.default_rng(0)
    tables = {t: (jnp.asarray(rng.normal(0, 0.05, (M + 1, L, K, R)), dtype),
                  jnp.asarray(rng.normal(0, 0.05, (M + 1, L, R, N)), dtype))
              for t, (K, N) in SHAPES.items()}
    ways = {"base": program(None, L, M), "xla": program(xla_apply, L, M),
            "cpu": program(cpu_apply, L, M)}
    for T in args.tokens:
        x_TD = jnp.asarray(rng.normal(0, 1, (T, 576)), dtype)
        x_TF = jnp.asarray(rng.normal(0, 1, (T, 1536)), dtype)
        y_N = {N: jnp.asarray(rng.normal(0, 1, (T, N)), dtype) for N in (192, 576, 1536)}
        cases = {"none": np.full(T, M, np.int32), "one": np.zeros(T, np.int32),
                 "mixed": (np.arange(T) % M).astype(np.int32)}
        runs = {(w, c): (f, m) for w, f in ways.items() for c, m in cases.items()
                if w != "base" or c == "none"}
        for f, m in runs.values():
            f(x_TD, x_TF, y_N, tables, m).block_until_ready()
        times = {k: [] for k in runs}
        for _ in range(args.rounds):
            for k, (f, m) in runs.items():
                t0 = time.perf_counter()
                f(x_TD, x_TF, y_N, tables, m).block_until_ready()
                times[k].append(1e3 * (time.perf_counter() - t0))
        base = statistics.median(times[("base", "none")])
        print(f"\nT={T}: base (the sums alone) {base:.2f} ms; LoRA ms per step, all 210 "
              f"projections, base subtracted")
        print(f"{'case':<8}{'xla':>10}{'cpu':>10}{'xla/cpu':>10}")
        for c in cases:
            xla = statistics.median(times[("xla", c)]) - base
            cpu = statistics.median(times[("cpu", c)]) - base
            print(f"{c:<8}{xla:>10.2f}{cpu:>10.2f}{xla / max(cpu, 1e-3):>10.1f}")
        print(f"load {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
