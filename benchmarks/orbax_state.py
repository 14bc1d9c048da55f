"""`LLM()` of the default model (the embedded SmolLM2-135M Q4_1 GGUF), cold and warm: from the
orbax saved state (models/state_cache.py), from the safetensors copy of the GGUF alone (what
a warm start read before saved states), and with nothing cached.

Each start is a fresh subprocess with its own JAXLLM_CACHE_DIR:
  cold            an empty cache: parse and dequantize the GGUF, write its safetensors copy,
                  pack, save the state; compile every bucket
  cold, no state  the same without saving the state (the start before saved states)
  warm safetensors  a cache the cold start filled, its saved states out of sight: the
                  safetensors copy is read, cast, laid out and packed
  warm orbax      the same cache, states in: the state is restored
"no state" and "warm safetensors" hide the saved states from the engine in the child
(checkpoint.find_cached_state finds nothing, checkpoint.save_state writes nothing), which is
exactly the load path before them. Reported: `LLM()` wall time and the load inside it
(checkpoint.load_for_engine: the checkpoint, the packing, the state saved or restored),
medians over --repeats starts.

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
import jaxllm.models.checkpoint as checkpoint
from jaxllm import LLM
if sys.argv[1] == "without_states":
    checkpoint.find_cached_state = lambda resolved, key: None
    checkpoint.save_state = lambda *args, **kwargs: None
load = {}
real = llm_engine.load_for_engine
def timed(*args, **kwargs):
    t0 = time.perf_counter()
    loaded = real(*args, **kwargs)
    load["s"], load["source"] = time.perf_counter() - t0, loaded.source
    return loaded
llm_engine.load_for_engine = timed
t0 = time.perf_counter()
llm = LLM(use_tqdm_on_load=False)
print(json.dumps({"llm_s": time.perf_counter() - t0, "load_s": load["s"],
                  "source": load["source"]}))
"""


def start(cache: str, states: bool) -> dict:
    env = {**os.environ, "JAXLLM_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", _CHILD,
                          "with_states" if states else "without_states"],
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
    runs: dict[str, list[dict]] = {"cold": [], "cold, no state": [], "warm safetensors": [],
                                   "warm orbax": []}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            runs["cold"].append(start(cache, states=True))
            runs["warm orbax"].append(start(cache, states=True))
            runs["warm safetensors"].append(start(cache, states=False))
        with tempfile.TemporaryDirectory() as cache:
            runs["cold, no state"].append(start(cache, states=False))
    print(f"\nLLM() of the default model, medians of {args.repeats}")
    print("start | loaded from | LLM() s | load s (checkpoint or state, packing, saving)")
    print("--- | --- | --- | ---")
    for name, rows in runs.items():
        sources = sorted({r["source"] for r in rows})
        print(f"{name} | {', '.join(sources)} | "
              f"{statistics.median(r['llm_s'] for r in rows):.1f} | "
              f"{statistics.median(r['load_s'] for r in rows):.2f}")


if __name__ == "__main__":
    main()
