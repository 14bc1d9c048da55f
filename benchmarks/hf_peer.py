"""The HF transformers peer of benchmarks/throughput.py: `generate` in static batches with
left padding, and the dequantized HF directory it (and the vLLM peer) loads.

Owns: writing the GGUF's dequantized weights as an HF checkpoint directory, and timing
transformers' greedy `generate` over the workload. Never imported by jaxllm.
"""

from __future__ import annotations

import gc
import json
import os
import time


def dequantized_hf_dir(gguf_path: str, out: str) -> str:
    """An HF directory (config.json, safetensors, tokenizer) of the GGUF's dequantized float32
    weights: transformers >= 5 keeps a GGUF's weights packed and computes in float32 with
    casts, so its bfloat16 configuration needs plain weights (the same values jaxllm runs);
    vLLM loads the directory as a hub checkpoint, tokenizer files included."""
    from load_model import write_hf_dir  # benchmarks/load_model.py

    from jaxllm.tokenizer import get_tokenizer

    write_hf_dir(gguf_path, out)
    get_tokenizer(gguf_path).save_pretrained(out)
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


def run_hf(prompts, outs, model_path, dtype_name, batch_size, *, repeats):
    """(wall seconds of each run, greedy tokens of the last run)."""
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
    for _ in range(repeats):
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
