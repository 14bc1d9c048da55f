"""Load time and peak RSS of the default model: from the GGUF, and from an HF directory.

Each load runs in a fresh subprocess (so peak RSS is its own), after which the same process
reports its baseline (jax + jaxllm imported, nothing loaded) as the peer figure. The HF
directory is written once from the GGUF's dequantized tensors (float32 safetensors, two
shards), the layout hub checkpoints have. Medians over --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from machine import machine_header  # benchmarks/machine.py

_CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp
import jaxllm.models.resolve as R
def hwm_kib():  # VmHWM: this process's own peak (ru_maxrss would carry the parent's over exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
base = hwm_kib()
t0 = time.perf_counter()
model, cfg, _ = R.load_model(R.ResolvedModel(sys.argv[1], sys.argv[2], "bench"), jnp.float32)
jax.block_until_ready(jax.tree.leaves(model))
dt = time.perf_counter() - t0
peak = hwm_kib()
nbytes = sum(x.nbytes for x in jax.tree.leaves(model))
print(json.dumps({"seconds": dt, "peak_mib": peak / 1024, "baseline_mib": base / 1024,
                  "weights_mib": nbytes / 2**20}))
"""


def write_hf_dir(gguf_path: str, out: str) -> None:
    from jaxllm.models.gguf import gguf_to_hf_config, iter_gguf_tensors, open_gguf
    from jaxllm.models.safetensors_io import save_file

    reader = open_gguf(gguf_path)
    cfg = gguf_to_hf_config(reader)
    tensors = dict(iter_gguf_tensors(reader, cfg))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(out, shard))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {k: s for s, ks in shards.items() for k in ks}}, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)


def measure(kind: str, path: str, repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
        out = subprocess.run([sys.executable, "-c", _CHILD, kind, path], env=env,
                             capture_output=True, text=True, check=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(machine_header(), flush=True)
    from jaxllm.models.resolve import embedded_default_gguf

    gguf = embedded_default_gguf()
    with tempfile.TemporaryDirectory() as d:
        write_hf_dir(gguf, d)
        for kind, path in (("gguf", gguf), ("hf_dir", d)):
            r = measure(kind, path, args.repeats)
            print(f"{kind:7s}: load {r['seconds']:.2f} s, peak RSS {r['peak_mib']:.0f} MiB "
                  f"(baseline after imports {r['baseline_mib']:.0f} MiB, model adds "
                  f"{r['peak_mib'] - r['baseline_mib']:.0f} MiB; the f32 weights are "
                  f"{r['weights_mib']:.0f} MiB)")


if __name__ == "__main__":
    main()
