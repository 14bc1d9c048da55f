"""Offline throughput, in the spirit of `vllm bench throughput`, against vLLM itself, HF
transformers and llama.cpp on the same token ids, in the same run.

Workload (issue 8's): N prompts of random token ids (fixed seed), input and output lengths
drawn uniformly from the given ranges, greedy, EOS ignored so every request produces exactly
its length. Each system runs the whole workload `--repeats` times after its own warm-up
(jaxllm and vLLM: `--warmup-runs` untimed runs of the whole workload, default 1, and
the prefix cache emptied before each timed run, so no run reuses an earlier one's prompts); the
medians are compared as output tok/s ratios, and the greedy tokens are compared with the peer
of the same dtype (fraction of requests whose tokens are identical, and of tokens before the
first difference). Every system runs in its own fresh process (vLLM in its own python), so
that its peak RSS (the kernel's VmHWM, load included) is its own.

Peers:
  jaxllm     LLM.generate, dtype "auto" (bf16 where it measures faster) and float32
  hf         transformers `generate`, static batches, left padding: float32 batch 8 and
             bfloat16 batch 64 (its best configuration on this CPU)
  llama.cpp  the model's GGUF (--llama-cpp-gguf, default the embedded Q4_1 file, whose
             dequantized weights are the ones jaxllm runs), all sequences in one batch,
             when llama-cpp-python is installed (it builds from source; kept out of CI)
  vllm       vLLM's offline LLM (benchmarks/vllm_peer.py) on the same weights, the GGUF
             dequantized: float32 and bfloat16, each with every core computing ("best"
             layout) and in vLLM's default layout (a core kept for its scheduler); when
             vllm is importable here or --vllm-python names a python that has it (vLLM pins
             its own torch, so it usually lives in a venv of its own; kept out of CI)

    python benchmarks/throughput.py                      # the issue's workload, all peers
    python benchmarks/throughput.py --peers jaxllm-auto hf-bf16 --repeats 3
    python benchmarks/throughput.py --peers jaxllm-auto jaxllm-f32 vllm-f32 vllm-bf16 \
        vllm-f32-default vllm-bf16-default --vllm-python ~/vllm-venv/bin/python
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from machine import machine_header  # benchmarks/machine.py
from hf_peer import dequantized_hf_dir, run_hf  # benchmarks/hf_peer.py
from vllm_peer import VLLM_PEERS, find_python, run_vllm  # benchmarks/vllm_peer.py

PEERS = ("jaxllm-auto", "jaxllm-f32", "hf-f32", "hf-bf16", "llama.cpp", *VLLM_PEERS)


def make_workload(n, input_len, output_len, vocab, seed):
    rng = np.random.default_rng(seed)
    ins = rng.integers(input_len[0], input_len[1] + 1, n)
    outs = rng.integers(output_len[0], output_len[1] + 1, n)
    # Stay clear of the first 100 ids, which hold the special tokens of most vocabularies.
    prompts = [rng.integers(100, vocab, k).tolist() for k in ins]
    return prompts, outs.tolist()


def run_jaxllm(args, prompts, outs, dtype):
    from jaxllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, seed=0)
    engine = llm.llm_engine
    print(f"  jaxllm {dtype}: LLM() {time.perf_counter() - t0:.1f} s (warm-up "
          f"{engine.warmup_seconds:.1f} s, {engine.runner.num_compiles} compiles, attention "
          f"{engine.runner.attention_backend.name}, dtype {np.dtype(engine.runner.kv_dtype).name})")
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o) for o in outs]
    for _ in range(args.warmup_runs):  # whole-workload runs, not timed
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    times, results = [], None
    for _ in range(args.repeats):
        llm.reset_prefix_cache()  # every run computes its prompts (vLLM's peer does the same)
        t0 = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        times.append(time.perf_counter() - t0)
    tokens = [list(r.outputs[0].token_ids) for r in results]
    assert [len(t) for t in tokens] == list(outs)
    del llm, engine
    gc.collect()
    return times, tokens


def run_llama_cpp(args, prompts, outs, gguf_path):
    """llama.cpp through llama-cpp-python's low-level API: every sequence in one batch."""
    from llama_cpp_peer import generate_batched  # benchmarks/llama_cpp_peer.py

    return generate_batched(gguf_path, prompts, outs, repeats=args.hf_repeats,
                            threads=os.cpu_count() or 1)


def compare(a, b):
    """(fraction of requests with identical tokens, fraction of tokens before the first
    difference)."""
    same = sum(x == y for x, y in zip(a, b)) / len(a)
    prefix = 0
    for x, y in zip(a, b):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
        prefix += k
    return same, prefix / sum(len(x) for x in a)


def vm_hwm_mib() -> float:
    """This process's peak RSS (VmHWM; ru_maxrss would carry a parent's over exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_here(args, peer: str, work: dict) -> dict:
    """One jaxllm, HF or llama.cpp peer in this process: times, tokens, peak RSS."""
    prompts, outs = work["prompts"], work["outs"]
    try:
        if peer.startswith("jaxllm"):
            times, tokens = run_jaxllm(args, prompts, outs,
                                       "auto" if peer == "jaxllm-auto" else "float32")
        elif peer.startswith("hf"):
            dtype, batch = (("float32", 8) if peer == "hf-f32"
                            else ("bfloat16", args.hf_bf16_batch_size))
            times, tokens = run_hf(prompts, outs, work["hf_path"], dtype, batch,
                                   repeats=args.hf_repeats)
        else:
            times, tokens = run_llama_cpp(args, prompts, outs, work["gguf_path"])
    except ImportError as e:
        return {"skipped": str(e)}
    return {"times": times, "tokens": tokens, "peak_rss_mib": vm_hwm_mib()}


def run_isolated(peer: str, work: dict) -> dict:
    """run_here in a fresh interpreter (this script, --child), so that the peak RSS is the
    peer's own and not that of the peers before it."""
    with tempfile.TemporaryDirectory(prefix="throughput_") as d:
        with open(os.path.join(d, "work.json"), "w") as f:
            json.dump(work, f)
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", peer, d]
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"{peer} failed")
        with open(os.path.join(d, "result.json")) as f:
            return json.load(f)


def child(args) -> None:
    peer, d = args.child
    with open(os.path.join(d, "work.json")) as f:
        work = json.load(f)
    result = run_here(args, peer, work)
    with open(os.path.join(d, "result.json"), "w") as f:
        json.dump(result, f)


def vllm_python(args) -> str | None:
    """The python to run the vLLM peers with; says which, or why they will not run."""
    wanted = [p for p in args.peers if p in VLLM_PEERS]
    if not wanted:
        return None
    python, found = find_python(args.vllm_python)
    print(f"vLLM peers: {found}" if python else f"vLLM peers not run ({', '.join(wanted)}): "
          f"{found}", flush=True)
    return python


def print_summary(runs: dict, n_out: int) -> None:
    tps = {k: n_out / statistics.median(r["times"]) for k, r in runs.items()}
    print("\nsystem | median s | runs | output tok/s | peak RSS MiB")
    print("--- | --- | --- | --- | ---")
    for k, r in runs.items():
        print(f"{k} | {statistics.median(r['times']):.2f} | {len(r['times'])} | {tps[k]:.1f} | "
              f"{r['peak_rss_mib']:.0f}")
    print("peak RSS: VmHWM of the system's own process, load included; vLLM: the sum over its "
          "engine processes (its line above lists them), its front end not counted\n")
    vllm_best = max((k for k in VLLM_PEERS if k in runs), key=tps.get, default=None)
    if vllm_best:
        print(f"vLLM best: {vllm_best} (the fastest vLLM configuration that ran)")
    pairs = [("jaxllm-auto", vllm_best), ("jaxllm-auto", "vllm-bf16-default"),
             ("jaxllm-f32", "vllm-f32"), ("jaxllm-f32", "vllm-f32-default"),
             ("jaxllm-auto", "vllm-bf16"),
             ("jaxllm-auto", "hf-bf16"), ("jaxllm-auto", "llama.cpp"), ("jaxllm-f32", "hf-f32"),
             ("jaxllm-auto", "hf-f32"), ("jaxllm-f32", "llama.cpp")]
    for ours, peer in dict.fromkeys(pairs):
        if ours in runs and peer in runs:
            same, prefix = compare(runs[ours]["tokens"], runs[peer]["tokens"])
            print(f"{ours} / {peer}: {tps[ours] / tps[peer]:.2f}x output tok/s; identical "
                  f"greedy tokens in {same:.0%} of requests ({prefix:.1%} of tokens before "
                  f"the first difference)")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(16, 256))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="runs of jaxllm and vLLM")
    p.add_argument("--warmup-runs", type=int, default=1,
                   help="untimed runs of the whole workload before jaxllm's and vLLM's "
                        "timed ones (a first run is 20-40%% slower for both)")
    p.add_argument("--hf-repeats", type=int, default=3, help="runs of HF and llama.cpp")
    p.add_argument("--hf-bf16-batch-size", type=int, default=64,
                   help="HF bf16's static batch (64: its best for SmolLM2 on the 2-core "
                        "EPYC; a large vocabulary, e.g. Gemma 3's 262k, may do better at 16)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="jaxllm's (vLLM keeps its own CPU default)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    p.add_argument("--hf-weights", choices=["dequantized", "gguf"], default="dequantized",
                   help="HF loads a dequantized copy (default; its fastest at bf16) or the "
                        "GGUF as transformers packs it")
    p.add_argument("--llama-cpp-gguf", default=None,
                   help="GGUF for the llama.cpp peer (default: the model's own GGUF)")
    p.add_argument("--vllm-python", default=None,
                   help="a python that can import vllm (default: this one, if it can)")
    p.add_argument("--vllm-ld-preload", default=None,
                   help="LD_PRELOAD for the vLLM peers alone, e.g. tcmalloc and libiomp5 as "
                        "vLLM's CPU docs advise (default: none)")
    p.add_argument("--child", nargs=2, metavar=("PEER", "DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.child:
        return child(args)
    print(machine_header(), flush=True)

    from jaxllm.models.resolve import resolve_model
    from jaxllm.tokenizer import get_tokenizer

    resolved = resolve_model(args.model)
    vocab = len(get_tokenizer(resolved.path))
    prompts, outs = make_workload(args.num_prompts, args.input_len, args.output_len, vocab,
                                  args.seed)
    n_out = sum(outs)
    print(f"workload: {len(prompts)} prompts, input {sum(map(len, prompts))} tokens, output "
          f"{n_out} tokens (seed {args.seed}), greedy, EOS ignored, model {resolved.name}")
    python = vllm_python(args)
    peers = [p for p in args.peers if p not in VLLM_PEERS or python]
    hf_path = vllm_path = resolved.path
    dequantized = tempfile.TemporaryDirectory(prefix="hf_dequantized_")  # removed at exit
    if resolved.path.endswith(".gguf") and any(
            (p.startswith("hf") and args.hf_weights == "dequantized") or p in VLLM_PEERS
            for p in peers):
        # vLLM always runs the GGUF's values dequantized: the weights jaxllm runs.
        vllm_path = dequantized_hf_dir(resolved.path, dequantized.name)
        hf_path = vllm_path if args.hf_weights == "dequantized" else resolved.path
    work = {"prompts": prompts, "outs": outs, "hf_path": hf_path,
            "gguf_path": args.llama_cpp_gguf or resolved.path}
    runs = {}
    for peer in peers:
        print(f"running {peer} ...", flush=True)
        if peer in VLLM_PEERS:
            runs[peer] = run_vllm(python, peer, vllm_path, prompts, outs, repeats=args.repeats,
                                  warmup_runs=args.warmup_runs,
                                  max_num_seqs=args.max_num_seqs,
                                  max_model_len=args.max_model_len,
                                  ld_preload=args.vllm_ld_preload)
            print(f"  {peer}: {runs[peer]['info']}")
        else:
            runs[peer] = run_isolated(peer, work)
        if "skipped" in runs[peer]:
            print(f"  skipped: {runs.pop(peer)['skipped']}")
        else:
            print(f"  {peer}: runs {', '.join(f'{t:.2f}' for t in runs[peer]['times'])} s")
    print_summary(runs, n_out)


if __name__ == "__main__":
    main()
