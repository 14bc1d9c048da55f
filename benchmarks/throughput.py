"""Offline throughput, in the spirit of `vllm bench throughput`, optionally against HF.

Workload: N prompts of random token ids (fixed seed), input and output lengths drawn
uniformly from the given ranges, EOS ignored so every request produces exactly its length.
Prints requests/s, output tok/s and total tok/s; with `--compare hf`, HF transformers
`generate` runs the same workload in the same process (static batches, left padding, fp32,
PyTorch CPU) and the ratio is printed. Timings exclude model loading and warm-up.

    python benchmarks/throughput.py --num-prompts 64 --input-len 32 128 --output-len 32 128 \
        --compare hf
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def make_workload(n, input_len, output_len, vocab, seed):
    rng = np.random.default_rng(seed)
    ins = rng.integers(input_len[0], input_len[1] + 1, n)
    outs = rng.integers(output_len[0], output_len[1] + 1, n)
    # Stay clear of the first 100 ids, which hold the special tokens of most vocabularies.
    prompts = [rng.integers(100, vocab, k).tolist() for k in ins]
    return prompts, outs.tolist()


def run_jaxllm(args, prompts, outs):
    from jaxllm import LLM, SamplingParams

    llm = LLM(model=args.model, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, seed=0)
    params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=o)
              for o in outs]
    print(f"jaxllm warm-up: {llm.llm_engine.warmup_seconds:.1f} s, "
          f"{llm.llm_engine.runner.num_compiles} compiles")
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        times.append(time.perf_counter() - t0)
    got = sum(len(r.outputs[0].token_ids) for r in results)
    assert got == sum(outs), (got, sum(outs))
    return times, llm.get_tokenizer()


def run_hf(args, prompts, outs, model_path):
    import torch
    import transformers

    torch.manual_seed(0)
    if model_path.endswith(".gguf"):
        d, f = os.path.split(model_path)
        model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f,
                                                                  dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path,
                                                                  dtype=torch.float32)
    model.eval()
    pad = model.config.pad_token_id or 0
    times = []
    for _ in range(args.hf_repeats):
        t0 = time.perf_counter()
        for i in range(0, len(prompts), args.hf_batch_size):
            batch, batch_outs = prompts[i:i + args.hf_batch_size], outs[i:i + args.hf_batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            n = max(batch_outs)  # a static batch runs until its longest request is done
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0,
                               max_new_tokens=n, min_new_tokens=n, pad_token_id=pad)
        times.append(time.perf_counter() - t0)
    return times


def report(name, times, prompts, outs):
    t = statistics.median(times)
    n_in, n_out = sum(len(p) for p in prompts), sum(outs)
    print(f"{name}: median {t:.2f} s over {len(times)} runs | {len(prompts) / t:.2f} requests/s, "
          f"{n_out / t:.1f} output tok/s, {(n_in + n_out) / t:.1f} total tok/s")
    return n_out / t


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(32, 128))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--compare", choices=["hf"], default=None)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--hf-repeats", type=int, default=1, help="HF is slow: one run by default")
    args = p.parse_args()

    from jaxllm.models.resolve import resolve_model
    resolved = resolve_model(args.model)
    from jaxllm.tokenizer import get_tokenizer
    vocab = len(get_tokenizer(resolved.path))
    prompts, outs = make_workload(args.num_prompts, args.input_len, args.output_len, vocab,
                                  args.seed)
    print(f"workload: {len(prompts)} prompts, input {sum(map(len, prompts))} tokens, output "
          f"{sum(outs)} tokens (seed {args.seed}), model {resolved.name}")
    jax_times, _ = run_jaxllm(args, prompts, outs)
    ours = report("jaxllm", jax_times, prompts, outs)
    if args.compare == "hf":
        hf = report(f"hf transformers (batch {args.hf_batch_size})",
                    run_hf(args, prompts, outs, resolved.path), prompts, outs)
        print(f"output tok/s ratio jaxllm / hf = {ours / hf:.2f}")


if __name__ == "__main__":
    main()
