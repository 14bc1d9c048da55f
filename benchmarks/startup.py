"""Start-up time and peak memory: `LLM()` cold and warm, against HF transformers' peak RSS on
the same workload, in the same run.

Each measurement is a fresh subprocess (its own imports, its own VmHWM):
  cold   LLM() with an empty cache directory (JAXLLM_CACHE_DIR: no compiled steps, no
         converted GGUF), then the workload
  warm   the same again, with the directory the cold run filled
  hf     transformers at bfloat16, one static batch of --hf-batch (its best configuration on
         this CPU, benchmarks/throughput.py), from the GGUF as transformers packs it and from
         a dequantized HF directory (what benchmarks/throughput.py runs)

The workload is benchmarks/throughput.py's (N prompts of random token ids, greedy, EOS
ignored), by default a smaller one so that HF's run is short. Reported per process: wall
time of `import jaxllm` and of `LLM()`, and VmHWM (peak resident set) after `LLM()` and after
the workload. Medians over --repeats runs (the cold run's cache directory is new each time).

    python benchmarks/startup.py
    python benchmarks/startup.py --repeats 3 --num-prompts 64
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

_JAXLLM_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import jaxllm
from jaxllm import LLM, SamplingParams
t_import = time.perf_counter() - t0
def hwm_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
args = json.loads(sys.argv[1])
t0 = time.perf_counter()
llm = LLM(max_model_len=args["max_model_len"])
t_llm = time.perf_counter() - t0
after_llm = hwm_mib()
params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o) for o in args["outs"]]
llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], params, use_tqdm=False)
print(json.dumps({"import_s": t_import, "llm_s": t_llm, "compiles": llm.llm_engine.runner.num_compiles,
                  "rss_after_load_mib": after_llm, "rss_peak_mib": hwm_mib()}))
"""

_HF_CHILD = r"""
import json, os, sys, time
import torch, transformers
def hwm_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
args = json.loads(sys.argv[1])
t0 = time.perf_counter()
if args["hf_path"].endswith(".gguf"):
    d, f = os.path.split(args["hf_path"])
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.bfloat16).eval()
else:
    model = transformers.AutoModelForCausalLM.from_pretrained(args["hf_path"], dtype=torch.bfloat16).eval()
t_load = time.perf_counter() - t0
after_load = hwm_mib()
prompts, outs, b = args["prompts"], args["outs"], args["batch"]
with torch.no_grad():
    for i in range(0, len(prompts), b):
        chunk = prompts[i:i + b]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                       max_new_tokens=max(outs[i:i + b]), min_new_tokens=max(outs[i:i + b]))
print(json.dumps({"load_s": t_load, "rss_after_load_mib": after_load, "rss_peak_mib": hwm_mib()}))
"""


def run_child(code: str, args: dict, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", code, json.dumps(args)], env=env,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(16, 256))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--hf-batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--peers", nargs="+", default=["jaxllm", "hf"], choices=["jaxllm", "hf"])
    args = p.parse_args()
    print(machine_header(), flush=True)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from throughput import make_workload

    from jaxllm.models.resolve import resolve_model
    from jaxllm.tokenizer import get_tokenizer

    resolved = resolve_model(None)
    vocab = len(get_tokenizer(resolved.path))
    prompts, outs = make_workload(args.num_prompts, args.input_len, args.output_len, vocab, 0)
    work = {"prompts": prompts, "outs": outs, "max_model_len": args.max_model_len,
            "batch": args.hf_batch}
    print(f"workload: {len(prompts)} prompts, input {sum(map(len, prompts))}, output "
          f"{sum(outs)} tokens; {os.cpu_count()} cores")
    hf_paths = {}
    if "hf" in args.peers:
        from hf_peer import dequantized_hf_dir
        hf_paths = {"gguf": resolved.path,
                    "dequantized": dequantized_hf_dir(resolved.path, tempfile.mkdtemp())}
    cold, warm = [], []
    hf = {name: [] for name in hf_paths}
    for _ in range(args.repeats):
        if "jaxllm" in args.peers:
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "JAXLLM_CACHE_DIR": cache}
                cold.append(run_child(_JAXLLM_CHILD, work, env))
                warm.append(run_child(_JAXLLM_CHILD, work, env))
        for name, path in hf_paths.items():
            hf[name].append(run_child(_HF_CHILD, {**work, "hf_path": path}, dict(os.environ)))
    print("\nrun | import s | LLM() / load s | compiles | peak RSS after load MiB | peak RSS MiB")
    print("--- | --- | --- | --- | --- | ---")
    for name, rows in (("jaxllm cold", cold), ("jaxllm warm", warm)):
        if rows:
            print(f"{name} | {median(rows, 'import_s'):.1f} | {median(rows, 'llm_s'):.1f} | "
                  f"{median(rows, 'compiles'):.0f} | {median(rows, 'rss_after_load_mib'):.0f} | "
                  f"{median(rows, 'rss_peak_mib'):.0f}")
    for name, rows in hf.items():
        print(f"hf bf16 b{args.hf_batch} ({name}) | - | {median(rows, 'load_s'):.1f} | - | "
              f"{median(rows, 'rss_after_load_mib'):.0f} | {median(rows, 'rss_peak_mib'):.0f}")
    for name, rows in hf.items():
        for ours, mine in (("cold", cold), ("warm", warm)):
            if mine:
                print(f"peak RSS jaxllm {ours} / hf ({name}): "
                      f"{median(mine, 'rss_peak_mib') / median(rows, 'rss_peak_mib'):.2f}")


if __name__ == "__main__":
    main()
