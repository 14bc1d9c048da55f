"""Speculative decoding (n-gram, or --draft-model) against speculation off, in the same run
(issue 23).

Workloads (all greedy):
  edit        an editing task: "fix the spelling mistakes in this text" over a passage with a
              few letters swapped (a different set per request), where the output copies the
              passage and prompt lookup finds its drafts. EOS is honoured, as a real edit
              stops when it is done (--output-len only caps it): tokens/s counts the tokens
              actually produced (the same in both engines, greedy outputs being identical);
  repetitive  "rename the function and repeat the code exactly" over a passage of code, EOS
              ignored: SmolLM2-135M rewrites the code instead and then wanders, so fewer
              drafts come back (kept to compare with earlier figures);
  peer        benchmarks/throughput.py's workload (random token ids, EOS ignored), where
              prompt lookup mostly finds nothing.
For each batch size (concurrent requests; default 1, 8, 64) both engines (the same model;
"off" in its best configuration, async scheduling on; "on" with k drafts per step, where
n-gram speculation turns async scheduling off) run the workload after one untimed pass of
the same workload, then --repeats timed passes each, alternately; times are medians.
Reported per row: output tok/s of each engine and
their ratio, acceptance rate (accepted / drafted tokens), mean acceptance length (tokens per
verified run, the bonus included: vLLM's definition), the proposer's hit rate (the share of
a row's decode steps that verified drafts: prompt lookup found a match, approximately, as a
run cut by EOS or max_tokens counts as whole), at batch 1 the inter-token latency
(wall time per output token), and the compiles that happened while timing (0 unless
--enforce-eager met a new bucket), and cost_model_steps_off_total: the steps whose draft
budget the cost model kept within their own token bucket (spec_decode/cost_model.py).
Greedy outputs are compared (they must be identical).

    python benchmarks/spec_decode.py                              # SmolLM2, the defaults
    python benchmarks/spec_decode.py --batch-sizes 1 --num-requests 2 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from machine import machine_header  # benchmarks/machine.py
from throughput import make_workload  # benchmarks/throughput.py

PASSAGE = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
'''


def repetitive_workload(tokenizer, n: int, output_len: int):
    """n chat prompts asking to copy the passage with one rename (a different name each)."""
    prompts = []
    for i in range(n):
        msg = [{"role": "user", "content": f"Rename the function to merge_{i} and repeat the "
                f"code exactly otherwise:\n\n{PASSAGE}"}]
        text = tokenizer.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(text)["input_ids"])
    return prompts, [output_len] * n


TEXT = (
    "The library opens every morning at nine and closes at six in the evening. Visitors can "
    "borrow up to five books at a time, and each loan lasts three weeks. Books that are "
    "returned late are charged a small fee for every day past the due date. The reading room "
    "on the second floor is kept quiet at all times, and food is not allowed there. Children "
    "under twelve must be accompanied by an adult after four in the afternoon. Computers are "
    "available near the entrance for anyone who needs to search the catalogue or print a "
    "document. Staff at the front desk are always happy to help with questions about the "
    "collection, membership cards, or upcoming events.")


def with_typos(text: str, i: int) -> str:
    """text with two interior letters swapped in every 7th longer word (offset by i)."""
    words = text.split(" ")
    for j, w in enumerate(words):
        if (j + i) % 7 == 0 and len(w) > 5 and w.isalpha():
            words[j] = w[:2] + w[3] + w[2] + w[4:]
    return " ".join(words)


def edit_workload(tokenizer, n: int, output_len: int):
    """n chat prompts asking to fix the typos of the passage (a different set each)."""
    prompts = []
    for i in range(n):
        msg = [{"role": "user", "content": "Fix the spelling mistakes in this text and write "
                f"out the corrected text:\n\n{with_typos(TEXT, i)}"}]
        text = tokenizer.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(text)["input_ids"])
    return prompts, [output_len] * n


def timed(llm, prompts, outs, ignore_eos=True):
    from jaxllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=ignore_eos)
              for m in outs]
    batch = [{"prompt_token_ids": p} for p in prompts]
    t0 = time.perf_counter()
    res = llm.generate(batch, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return dt, [list(r.outputs[0].token_ids) for r in res]


def spec_counts(llm):
    s = llm.llm_engine.scheduler.make_stats().spec_decoding
    return (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) if s else (0, 0, 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=(1, 8, 64))
    p.add_argument("--num-requests", type=int, default=0,
                   help="requests per row (default: 2 x the batch size)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per engine (median)")
    p.add_argument("--workloads", nargs="+", default=("edit", "repetitive", "peer"),
                   choices=("edit", "repetitive", "peer"))
    p.add_argument("--draft-model", default=None,
                   help="speculate with this draft model instead of n-gram lookup ('self': "
                        "the target as its own draft, which must accept every draft)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true",
                   help="compile buckets as they are first used (the warm-up pass) instead "
                        "of all at start-up")
    args = p.parse_args()

    from jaxllm import LLM

    print(machine_header())
    common = dict(model=args.model, dtype=args.dtype, max_num_seqs=max(args.batch_sizes),
                  max_model_len=1024, seed=0,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  enforce_eager=args.enforce_eager)
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                "prompt_lookup_min": 2}
    if args.draft_model:
        from jaxllm.models.resolve import DEFAULT_MODEL
        draft = (args.model or DEFAULT_MODEL) if args.draft_model == "self" else args.draft_model
        spec_cfg = {"model": draft, "num_speculative_tokens": args.k}
    off = LLM(**common, async_scheduling=True)
    on = LLM(**common, speculative_config=spec_cfg)
    tok = off.get_tokenizer()
    rows = []
    for workload in args.workloads:
        for batch in args.batch_sizes:
            n = args.num_requests or 2 * batch
            ignore_eos = workload != "edit"
            if workload == "edit":
                prompts, outs = edit_workload(tok, n, args.output_len)
            elif workload == "repetitive":
                prompts, outs = repetitive_workload(tok, n, args.output_len)
            else:
                prompts, outs = make_workload(n, (16, 256), (args.output_len,) * 2,
                                              off.llm_engine.model_config.vocab_size, 0)
            for llm in (off, on):
                llm.llm_engine.scheduler.max_num_seqs = batch  # the concurrency of this row
                timed(llm, prompts, outs, ignore_eos)  # untimed warm-up (and lazy compiles)
                llm.reset_prefix_cache()
            compiles = [llm.llm_engine.runner.num_compiles for llm in (off, on)]
            before = spec_counts(on)
            runs_off, runs_on = [], []
            for _ in range(args.repeats):
                for llm, runs in ((off, runs_off), (on, runs_on)):
                    runs.append(timed(llm, prompts, outs, ignore_eos))
                    llm.reset_prefix_cache()
            t_off, ids_off = statistics.median(t for t, _ in runs_off), runs_off[0][1]
            t_on, ids_on = statistics.median(t for t, _ in runs_on), runs_on[0][1]
            compiles = [llm.llm_engine.runner.num_compiles - c
                        for llm, c in zip((off, on), compiles)]
            drafts, drafted, accepted = (a - b for a, b in zip(spec_counts(on), before))
            steps_off = on.llm_engine.scheduler.spec_decoding.num_steps_off
            tokens = sum(len(ids) for ids in ids_off)  # produced (EOS may end them early)
            # Proposer calls in the timed passes: one per decode step of a row, each giving
            # a verified run (drafts) or one plain token (its first token is the prefill's).
            plain = args.repeats * (tokens - n) - drafts - accepted
            row = dict(workload=workload, batch=batch, requests=n, tokens=tokens,
                       ignore_eos=ignore_eos, load=open("/proc/loadavg").read().split()[0],
                       tok_s_off=round(tokens / t_off, 1), tok_s_on=round(tokens / t_on, 1),
                       speedup=round(t_off / t_on, 3),
                       acceptance_rate=round(accepted / drafted, 3) if drafted else 0.0,
                       mean_acceptance_length=round(1 + accepted / drafts, 3) if drafts else 1.0,
                       drafts=drafts, proposer_hit_rate=round(drafts / max(drafts + plain, 1), 3),
                       greedy_identical=ids_off == ids_on, compiles_while_timed=compiles,
                       cost_model_steps_off_total=steps_off)
            if batch == 1:
                # One request at a time: wall time per output token, its prefill included.
                row["itl_ms_off"] = round(1000 * t_off / tokens, 2)
                row["itl_ms_on"] = round(1000 * t_on / tokens, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
