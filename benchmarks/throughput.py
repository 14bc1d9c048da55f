"""Offline throughput, in the spirit of `vllm bench throughput`, against HF transformers (and
llama.cpp when llama-cpp-python is installed) on the same token ids, in the same run.

Workload (issue 8's): N prompts of random token ids (fixed seed), input and output lengths
drawn uniformly from the given ranges, greedy, EOS ignored so every request produces exactly
its length. Each system runs the whole workload `--repeats` times after its own warm-up; the
medians are compared as output tok/s ratios, and the greedy tokens are compared with the peer
of the same dtype (fraction of requests whose tokens are identical, and of tokens before the
first difference).

Peers:
  jaxllm     LLM.generate, dtype "auto" (bf16 on a CPU with bf16 matrix units) and float32
  hf         transformers `generate`, static batches, left padding: float32 batch 8 and
             bfloat16 batch 64 (its best configuration on this CPU)
  llama.cpp  the model's GGUF (--llama-cpp-gguf, default the embedded Q4_1 file, whose
             dequantized weights are the ones jaxllm runs), all sequences in one batch,
             when llama-cpp-python is installed (it builds from source; kept out of CI)

    python benchmarks/throughput.py                      # the issue's workload, all peers
    python benchmarks/throughput.py --peers jaxllm-auto hf-bf16 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import statistics
import time

import numpy as np

from machine import machine_header  # benchmarks/machine.py

PEERS = ("jaxllm-auto", "jaxllm-f32", "hf-f32", "hf-bf16", "llama.cpp")


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
    times, results = [], None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        times.append(time.perf_counter() - t0)
    tokens = [list(r.outputs[0].token_ids) for r in results]
    assert [len(t) for t in tokens] == list(outs)
    del llm, engine
    gc.collect()
    return times, tokens


def dequantized_hf_dir(gguf_path: str, out: str) -> str:
    """An HF directory (config.json + safetensors) of the GGUF's dequantized float32 weights:
    transformers >= 5 keeps a GGUF's weights packed and computes in float32 with casts, so
    its bfloat16 configuration needs plain weights (the same values jaxllm runs)."""
    from load_model import write_hf_dir  # benchmarks/load_model.py

    write_hf_dir(gguf_path, out)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config.setdefault("architectures", ["LlamaForCausalLM"])
    config.setdefault("model_type", "llama")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    index_path = os.path.join(out, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    index.setdefault("metadata", {})  # transformers >= 5 requires the key
    with open(index_path, "w") as f:
        json.dump(index, f)
    return out


def run_hf(args, prompts, outs, model_path, dtype_name, batch_size):
    import torch
    import transformers

    torch.manual_seed(0)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    if model_path.endswith(".gguf"):
        d, f = os.path.split(model_path)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    print(f"  hf {dtype_name} b{batch_size}: weights from "
          f"{'the packed GGUF' if model_path.endswith('.gguf') else 'a dequantized HF dir'}")
    model.eval()
    pad = model.config.pad_token_id or 0
    times, tokens = [], [None] * len(prompts)
    for _ in range(args.hf_repeats):
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            batch, batch_outs = prompts[i:i + batch_size], outs[i:i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            n = max(batch_outs)  # a static batch runs until its longest request is done
            with torch.no_grad():
                gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                     max_new_tokens=n, min_new_tokens=n, pad_token_id=pad)
            for j, o in enumerate(batch_outs):
                tokens[i + j] = gen[j, width:width + o].tolist()
        times.append(time.perf_counter() - t0)
    del model
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(16, 256))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hf-repeats", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    p.add_argument("--hf-weights", choices=["dequantized", "gguf"], default="dequantized",
                   help="HF loads a dequantized copy (default; its fastest at bf16) or the "
                        "GGUF as transformers packs it")
    p.add_argument("--llama-cpp-gguf", default=None,
                   help="GGUF for the llama.cpp peer (default: the model's own GGUF)")
    args = p.parse_args()
    print(machine_header(), flush=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

    from jaxllm.models.resolve import resolve_model
    from jaxllm.tokenizer import get_tokenizer

    resolved = resolve_model(args.model)
    vocab = len(get_tokenizer(resolved.path))
    prompts, outs = make_workload(args.num_prompts, args.input_len, args.output_len, vocab,
                                  args.seed)
    n_out = sum(outs)
    print(f"workload: {len(prompts)} prompts, input {sum(map(len, prompts))} tokens, output "
          f"{n_out} tokens (seed {args.seed}), greedy, EOS ignored, model {resolved.name}")
    hf_path = resolved.path
    if resolved.path.endswith(".gguf") and args.hf_weights == "dequantized" and any(
            peer.startswith("hf") for peer in args.peers):
        hf_path = dequantized_hf_dir(resolved.path, tempfile.mkdtemp(prefix="hf_dequantized_"))
    runs = {}
    for peer in args.peers:
        print(f"running {peer} ...", flush=True)
        if peer == "jaxllm-auto":
            runs[peer] = run_jaxllm(args, prompts, outs, "auto")
        elif peer == "jaxllm-f32":
            runs[peer] = run_jaxllm(args, prompts, outs, "float32")
        elif peer == "hf-f32":
            runs[peer] = run_hf(args, prompts, outs, hf_path, "float32", 8)
        elif peer == "hf-bf16":
            runs[peer] = run_hf(args, prompts, outs, hf_path, "bfloat16", 64)
        else:
            try:
                runs[peer] = run_llama_cpp(args, prompts, outs,
                                           args.llama_cpp_gguf or resolved.path)
            except ImportError as e:
                print(f"  skipped: {e}")
    tps = {k: n_out / statistics.median(t) for k, (t, _) in runs.items()}
    print("\nsystem | median s | runs | output tok/s")
    print("--- | --- | --- | ---")
    for k, (t, _) in runs.items():
        print(f"{k} | {statistics.median(t):.2f} | {len(t)} | {tps[k]:.1f}")
    print()
    pairs = [("jaxllm-auto", "hf-bf16"), ("jaxllm-auto", "llama.cpp"), ("jaxllm-f32", "hf-f32"),
             ("jaxllm-auto", "hf-f32"), ("jaxllm-f32", "llama.cpp")]
    for ours, peer in pairs:
        if ours in runs and peer in runs:
            same, prefix = compare(runs[ours][1], runs[peer][1])
            print(f"{ours} / {peer}: {tps[ours] / tps[peer]:.2f}x output tok/s; identical "
                  f"greedy tokens in {same:.0%} of requests ({prefix:.1%} of tokens before "
                  f"the first difference)")


if __name__ == "__main__":
    main()
