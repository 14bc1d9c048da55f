"""`LLM()` of the default model (the embedded SmolLM2-135M Q4_1 GGUF) cold, warm from the cache's
safetensors copy of the GGUF, and warm from an orbax saved state of the same parameters
(`LLM.save_sharded_state`, models/saved_state.py): the evidence for keeping the safetensors
copy as the automatic cache.

Each start is a fresh subprocess with its own JAXLLM_CACHE_DIR, new for each repetition:
  cold               an empty cache: parse and dequantize the GGUF, write its safetensors
                     copy, pack; compile every bucket
  warm safetensors   LLM() again: the copy is read, cast, laid out and packed
  warm saved state   LLM(model=<saved>), saved by one more start from the same cache (its
                     save timed): the state is restored, nothing else; the compiled steps
                     are the same, so they come from the cache too
Reported: `LLM()` wall time and the load inside it (checkpoint.load_for_engine: the
checkpoint read and packed, or the state restored), medians over --repeats.

    python benchmarks/orbax_state.py --repeats 3
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
import jaxllm.llm_engine as llm_engine
from jaxllm import LLM
load = {}
real = llm_engine.load_for_engine
def timed(*args, **kwargs):
    t0 = time.perf_counter()
    loaded = real(*args, **kwargs)
    load["s"], load["source"] = time.perf_counter() - t0, loaded.source
    return loaded
llm_engine.load_for_engine = timed
model, save_to = sys.argv[1] or None, sys.argv[2]
t0 = time.perf_counter()
llm = LLM(model, use_tqdm_on_load=False)
row = {"llm_s": time.perf_counter() - t0, "load_s": load["s"], "source": load["source"]}
if save_to:
    t0 = time.perf_counter()
    llm.save_sharded_state(save_to)
    row["save_s"] = time.perf_counter() - t0
print(json.dumps(row))
"""


def start(cache: str, model: str = "", save_to: str = "") -> dict:
    env = {**os.environ, "JAXLLM_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", _CHILD, model, save_to],
                         env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(machine_header(), flush=True)
    runs: dict[str, list[dict]] = {"cold": [], "warm safetensors": [],
                                   "warm saved state": []}
    saves = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            saved = os.path.join(cache, "saved")
            runs["cold"].append(start(cache))
            runs["warm safetensors"].append(start(cache))
            saves.append(start(cache, save_to=saved)["save_s"])
            runs["warm saved state"].append(start(cache, model=saved))
    print(f"\nLLM() of the default model, medians of {args.repeats}")
    print("start | loaded from | LLM() s | load s")
    print("--- | --- | --- | ---")
    for name, rows in runs.items():
        sources = sorted({r["source"] for r in rows})
        print(f"{name} | {', '.join(sources)} | "
              f"{statistics.median(r['llm_s'] for r in rows):.1f} | "
              f"{statistics.median(r['load_s'] for r in rows):.2f}")
    print(f"save_sharded_state: {statistics.median(saves):.2f} s")


if __name__ == "__main__":
    main()
