"""Embedding throughput: jaxllm's pooling runner against sentence-transformers (torch CPU) on
all-MiniLM-L6-v2 (the packaged default), the same 1,000 sentences, same run, at the same
precision on both sides: float32, and (--dtypes) bfloat16 (jaxllm dtype="bfloat16" against the
sentence-transformers model cast to torch.bfloat16).

Sentences: 8..128 tokens each (words drawn at random, seeded; lengths uniform), embedded
once per side after a warm-up. sentence-transformers runs at each of --st-batch-sizes and
its best is reported (it sorts by length and pads to the longest in a batch); jaxllm packs
whole sentences into its token buckets up to --max-num-batched-tokens. The two sides run
alternately --repeats times, so that load from other processes on a shared machine hits
both alike. Reported: the median time of each side over the repeats (sentence-transformers
at its best batch size by median), sentences/s, the ratio, and the largest cosine distance
(1 - cos) between the two sides' embeddings of a sentence, per precision.

    python benchmarks/embed.py                        # 1,000 sentences
    python benchmarks/embed.py --num-sentences 200 --st-batch-sizes 32 --dtypes float32  # quick
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import machine_header  # noqa: E402  (benchmarks/machine.py)

_WORDS = ("time people year way day man thing woman life child world school state family "
          "student group country problem hand part place case week company system program "
          "question work government number night point home water room mother area money "
          "story fact month lot right study book eye job word business issue side kind head "
          "house service friend father power hour game line end member law car city").split()


def sentences(tokenizer, n: int, seed: int = 0) -> list[str]:
    """n sentences whose token counts (with [CLS]/[SEP]) are uniform in [8, 128]."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target = rng.randint(8, 128)
        words = []
        while len(tokenizer(" ".join(words + ["x"]))["input_ids"]) <= target:
            words.append(rng.choice(_WORDS))
        out.append(" ".join(words))
    return out


def compare(dtype: str, args) -> None:
    """One precision: jaxllm and sentence-transformers alternately, --repeats times."""
    import torch
    from sentence_transformers import SentenceTransformer

    from jaxllm import LLM

    llm = LLM(runner="pooling", max_model_len=128, max_num_seqs=256,
              max_num_batched_tokens=args.max_num_batched_tokens, dtype=dtype)
    texts = sentences(llm.get_tokenizer(), args.num_sentences)
    lens = [len(o.prompt_token_ids) for o in llm.embed(texts, use_tqdm=False)]  # warm-up
    st = SentenceTransformer(llm.llm_engine.resolved_model.path, device="cpu")
    st = st.to(getattr(torch, dtype))
    st.max_seq_length = 128
    for bs in args.st_batch_sizes:
        st.encode(texts[:2 * bs], batch_size=bs)  # warm-up
    jax_runs, st_runs = [], {bs: [] for bs in args.st_batch_sizes}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        ours = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
        jax_runs.append(time.perf_counter() - t0)
        for bs in args.st_batch_sizes:
            t0 = time.perf_counter()
            ref = st.encode(texts, batch_size=bs, convert_to_tensor=True).float().numpy()
            st_runs[bs].append(time.perf_counter() - t0)
    jax_s = statistics.median(jax_runs)
    rows = [(statistics.median(runs), bs) for bs, runs in st_runs.items()]
    st_s, best_bs = min(rows)
    ours, ref = ours.astype(np.float64), ref.astype(np.float64)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)

    n = len(texts)
    print(f"\n{dtype}: {n} sentences, {min(lens)}..{max(lens)} tokens (mean "
          f"{np.mean(lens):.0f}), {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}, median of {args.repeats}, load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| engine | dtype | batch | s | sentences/s |\n|---|---|---|---|---|")
    print(f"| jaxllm | {dtype} | {args.max_num_batched_tokens} tokens | {jax_s:.2f} | "
          f"{n / jax_s:.1f} |")
    for secs, bs in rows:
        print(f"| sentence-transformers | {dtype} | {bs} | {secs:.2f} | {n / secs:.1f} |")
    print(f"{dtype}: jaxllm / best sentence-transformers (batch {best_bs}): "
          f"{st_s / jax_s:.2f}x; max cosine distance {float((1 - cos).max()):.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-sentences", type=int, default=1000)
    ap.add_argument("--st-batch-sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16"])
    args = ap.parse_args()
    print(machine_header(), flush=True)
    for dtype in args.dtypes:
        compare(dtype, args)


if __name__ == "__main__":
    main()
