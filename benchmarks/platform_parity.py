"""The whole engine on one platform against another: greedy tokens for the same prompts and
the same engine configuration, e.g. a GPU (the "pallas" kernel, the device's matmuls) against
the CPU. benchmarks/gpu_check.sh runs it on a GPU.

Each side runs in its own subprocess, because JAX fixes its platform at first use
(JAX_PLATFORMS=<platform>). Both sides use enforce_eager (only the buckets the prompts need
are compiled) and the same max_num_seqs / max_num_batched_tokens / max_model_len, so the
batches, chunks and buckets are the same and only the platform (and attention backend)
differs. With --dtype float32 both sides set JAX_DEFAULT_MATMUL_PRECISION=highest: JAX rounds
f32 matmuls to TF32 on recent GPUs by default, which changes tokens by itself.

Prompts are natural text of 5 to ~700 tokens: the long ones cross many KV blocks and are
prefilled in several chunks. Reported: the fraction of requests whose tokens are identical,
the fraction of tokens before each request's first difference, and where requests diverge.
Exits 1 if fewer than --min-identical of the requests are identical or any request differs
in its first token.

    python benchmarks/platform_parity.py                          # cuda against cpu
    python benchmarks/platform_parity.py --platform cpu --backend xla   # CPU only: "xla"
                                                                  # against the CPU default
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from machine import machine_header  # benchmarks/machine.py

SENTENCES = [
    "The river runs past the old mill and under the stone bridge before it reaches the sea.",
    "In the morning the market fills with farmers selling bread, cheese and fresh vegetables.",
    "Scientists measured the temperature of the lake every hour for three years.",
    "The library keeps its oldest books in a cool room without windows.",
    "A small boat carried the letters across the bay twice a week.",
]
SHORT = [
    "The capital of France is", "Write a haiku about autumn leaves.",
    "What is the boiling point of water at sea level?", "List three prime numbers:",
    "Translate 'good morning' into Spanish:", "The three primary colors are",
    "Explain in one sentence why the sky is blue.", "def fibonacci(n):",
    "Once upon a time, in a small village,", "The largest planet in our solar system is",
    "Name a famous painting by Leonardo da Vinci.", "2 + 2 =",
]


def prompts(n: int) -> list[str]:
    """n prompts: the short ones, then passages of 1x, 4x and 12x the sentences (~70, ~280,
    ~830 tokens)."""
    long = [" ".join(SENTENCES * k) + " Summarize the text above:" for k in (1, 4, 12)]
    out = SHORT + long
    return [out[i % len(out)] for i in range(n)]


def child(args) -> None:
    from jaxllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, attention_backend=args.backend,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, enforce_eager=True, seed=0)
    start = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts(args.num_prompts), params, use_tqdm=False)
    runner = llm.llm_engine.runner
    import jax
    import numpy as np
    print(json.dumps({
        "platform": jax.default_backend(), "device": str(jax.devices()[0].device_kind),
        "backend": runner.attention_backend, "dtype": np.dtype(runner.kv_dtype).name,
        "startup_s": start, "generate_s": time.perf_counter() - t0,
        "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
        "tokens": [list(o.outputs[0].token_ids) for o in outs]}))


def run_side(args, platform: str, backend: str | None) -> dict:
    env = dict(os.environ, JAX_PLATFORMS=platform)
    if args.dtype == "float32":
        env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--dtype", args.dtype,
           "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
           "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-model-len", str(args.max_model_len)]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--backend", backend] if backend else []
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        sys.stderr.write(run.stderr[-4000:])
        raise SystemExit(f"the {platform} side failed (exit {run.returncode})")
    return json.loads(run.stdout.strip().splitlines()[-1])


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    firsts = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
              for x, y in zip(a, b)]
    prefix = sum(len(x) if f is None else f for x, f in zip(a, firsts))
    return {"identical": sum(f is None for f in firsts) / len(a),
            "prefix": prefix / sum(len(x) for x in a),
            "first_difference": firsts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--platform", default="cuda", help="JAX_PLATFORMS of the side under test")
    p.add_argument("--reference-platform", default="cpu")
    p.add_argument("--backend", default=None, help="attention backend (platform default)")
    p.add_argument("--reference-backend", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    p.add_argument("--num-prompts", type=int, default=15)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--min-identical", type=float, default=0.9)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    print(machine_header(), flush=True)

    sides = {"test": run_side(args, args.platform, args.backend),
             "reference": run_side(args, args.reference_platform, args.reference_backend)}
    result = compare(sides["test"]["tokens"], sides["reference"]["tokens"])
    for name, s in sides.items():
        print(f"{name}: {s['platform']} ({s['device']}), attention {s['backend']}, "
              f"{s['dtype']}, LLM() {s['startup_s']:.1f} s, generate {s['generate_s']:.1f} s "
              f"(with its lazy compiles)")
    test = sides["test"]
    n = len(test["tokens"])
    print(f"{n} prompts of {min(test['prompt_tokens'])}..{max(test['prompt_tokens'])} tokens, "
          f"{args.max_tokens} greedy tokens each, dtype {args.dtype}")
    print(f"identical requests: {result['identical']:.1%}; tokens before the first "
          f"difference: {result['prefix']:.1%}")
    for i, f in enumerate(result["first_difference"]):
        if f is not None:
            print(f"  request {i} ({test['prompt_tokens'][i]} prompt tokens) differs at "
                  f"output token {f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "sides": sides, **result}, fh, indent=1)
    if result["identical"] < args.min_identical or 0 in result["first_difference"]:
        print("FAIL: the platforms disagree beyond --min-identical or on a first token")
        raise SystemExit(1)
    print("PASS")


if __name__ == "__main__":
    main()
