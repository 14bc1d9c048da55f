"""Structured outputs: what constraints cost, in one engine and one run (issue 18, section 3).

Workload: `--num-prompts` requests (default 64) each constrained to one of 8 JSON schemas of
realistic size (nested objects, enums, arrays, string formats), plus as many constrained to
a regex or a choice. Temperature 1.0, fixed seeds, the same max_tokens; the engine is warmed
by one untimed run of each workload first. Three workloads over the same prompts and seeds:

  unconstrained   the same max_tokens, no constraint (the raw comparison)
  constrained     the constraints above
  length-matched  no constraint, but each request generates exactly as many tokens as its
                  constrained run did (max_tokens = that length, ignore_eos): the same
                  tokens per request, the same steps and the same rows per step

Constrained outputs end early (a closed JSON object, a short regex, a one-word choice), so
the raw run amortises prefill and the fixed cost of a step over far fewer tokens, and its
later steps carry few rows. The length-matched ratio is the one that says what the
constraints themselves cost; the raw ratio also counts what they save (shorter outputs).

Each of `--repeats` rounds runs the three workloads back to back, with async scheduling and
without (steps with constrained rows run synchronously under both, engine/core.py), both
orders reversed every other round; ratios are taken within a round and their median
printed, so drifting load on a shared machine moves both sides.

Reports:
  throughput   per scheduling mode and workload (medians over rounds): output tok/s, s,
               tokens, engine steps and mean sequences per step, host ms per step filling
               bitmasks and the rows filled, and filling's share of the engine's step time
  ratios       constrained / unconstrained (raw) and constrained / length-matched
  compile      a first compile of each schema (ms: llguidance, the tokenizer already built),
               and a warm-cache grammar setup (cache hit + matcher copy, ms per request)
  TTFT         one request alone: unconstrained, constrained with a schema never seen
               (compile on the path), and with the same schema again (warm cache)
  validity     every "stop" output parses and validates (jsonschema) or fullmatches

    python benchmarks/structured_output.py
    python benchmarks/structured_output.py --num-prompts 32 --repeats 3   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"},
        "address": {"type": "object", "properties": {
            "street": {"type": "string", "maxLength": 32}, "city": {"type": "string",
                                                                   "maxLength": 20},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]}},
     "required": ["name", "age", "address"]},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action",
                                                     "horror", "sci-fi"]}, "maxItems": 3},
        "released": {"type": "string", "format": "date"}},
     "required": ["title", "rating", "genres"]},
    {"type": "object", "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 10},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number", "minimum": 0}}, "required": ["sku", "quantity"]}},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]}},
     "required": ["order_id", "items", "status"]},
    {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
        "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "storm"]},
        "wind": {"type": "object", "properties": {
            "speed_kmh": {"type": "integer", "minimum": 0, "maximum": 300},
            "direction": {"enum": ["N", "NE", "E", "SE", "S", "SW", "W", "NW"]}},
            "required": ["speed_kmh", "direction"]}},
     "required": ["city", "temperature_c", "conditions"]},
    {"type": "object", "properties": {
        "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
        "is_admin": {"type": "boolean"},
        "roles": {"type": "array", "items": {"enum": ["reader", "writer", "owner"]},
                  "maxItems": 3},
        "created": {"type": "string", "format": "date-time"}},
     "required": ["username", "is_admin"]},
    {"type": "object", "properties": {
        "question": {"type": "string", "maxLength": 60},
        "answer": {"type": "string", "maxLength": 60},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "sources": {"type": "array", "items": {"type": "string", "format": "uri"},
                    "maxItems": 2}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {
        "event": {"type": "string", "maxLength": 30},
        "date": {"type": "string", "format": "date"},
        "attendees": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 20},
            "rsvp": {"enum": ["yes", "no", "maybe"]}}, "required": ["name", "rsvp"]},
            "maxItems": 3},
        "location": {"type": "string", "maxLength": 30}},
     "required": ["event", "date"]},
    {"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 15},
                     "maxItems": 4},
        "language": {"type": "string", "pattern": "^[a-z]{2}$"}},
     "required": ["sentiment", "score"]},
]
TOPICS = ["a person", "a movie", "an order", "the weather", "a user account", "a question",
          "an event", "a review"]
REGEXES = [r"[0-9]{3}-[0-9]{3}-[0-9]{4}", r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]",
           r"[A-Z][a-z]+ [A-Z][a-z]+", r"#[0-9a-f]{6}"]
CHOICES = [["positive", "negative", "neutral"], ["yes", "no"], ["red", "green", "blue"],
           ["Paris", "London", "Berlin", "Madrid"]]


def workload(n: int, max_tokens: int):
    """(prompts, constrained params, plain params, checks); check(text) -> valid."""
    import jsonschema
    from jaxllm import SamplingParams, StructuredOutputsParams

    prompts, constraints, checks = [], [], []
    for i in range(n):
        k = i % len(SCHEMAS)
        prompts.append(f"Return a JSON object describing {TOPICS[k]}:")
        constraints.append(StructuredOutputsParams(json=SCHEMAS[k]))
        checks.append(lambda t, s=SCHEMAS[k]: jsonschema.validate(json.loads(t), s) is None)
    for i in range(n):
        if i % 2 == 0:
            r = REGEXES[(i // 2) % len(REGEXES)]
            prompts.append(f"Give an example matching {r}:")
            constraints.append(StructuredOutputsParams(regex=r))
            checks.append(lambda t, r=r: re.fullmatch(r, t) is not None)
        else:
            c = CHOICES[(i // 2) % len(CHOICES)]
            prompts.append(f"Pick one of {', '.join(c)}:")
            constraints.append(StructuredOutputsParams(choice=c))
            checks.append(lambda t, c=c: t in c)
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                                  structured_outputs=c) for i, c in enumerate(constraints)]
    plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens)
             for i in range(len(prompts))]
    return prompts, constrained, plain, checks


def timed(llm, prompts, params):
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return outputs, seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


def length_matched(constrained, outputs):
    """Unconstrained params generating, per request, exactly the constrained output's tokens."""
    from jaxllm import SamplingParams
    return [SamplingParams(temperature=p.temperature, seed=p.seed, ignore_eos=True,
                           max_tokens=max(1, len(o.outputs[0].token_ids)))
            for p, o in zip(constrained, outputs)]


class StepLog:
    """Counts the engine's steps, the sequences each runs and the seconds spent in
    EngineCore.step, by wrapping the two (measurement only: the engine is unchanged)."""

    def __init__(self, core):
        self.steps = self.seqs = 0
        self.step_seconds = 0.0
        schedule, step = core.scheduler.schedule, core.step

        def counted_schedule():
            so = schedule()
            if not so.is_empty:
                self.steps += 1
                self.seqs += len(so.num_scheduled_tokens)
            return so

        def timed_step():
            t0 = time.perf_counter()
            try:
                return step()
            finally:
                self.step_seconds += time.perf_counter() - t0

        core.scheduler.schedule, core.step = counted_schedule, timed_step

    def snapshot(self) -> tuple[int, int, float]:
        return self.steps, self.seqs, self.step_seconds


def measured_run(llm, log: StepLog, manager, prompts, params) -> dict:
    """One timed generate: throughput, engine steps and sequences, mask filling."""
    llm.reset_prefix_cache()  # every run computes its prompts
    before = (*log.snapshot(), manager.num_mask_fills, manager.mask_fill_seconds,
              manager.num_mask_rows)
    outputs, seconds, ntok = timed(llm, prompts, params)
    after = (*log.snapshot(), manager.num_mask_fills, manager.mask_fill_seconds,
             manager.num_mask_rows)
    steps, seqs, step_s, fills, fill_s, fill_rows = (x - y for x, y in zip(after, before))
    return dict(tps=ntok / seconds, seconds=seconds, tokens=ntok, steps=steps,
                seqs=seqs, step_seconds=step_s, fills=fills, fill_seconds=fill_s,
                fill_rows=fill_rows, outputs=outputs)


def valid(text: str, check) -> bool:
    try:
        return bool(check(text))
    except Exception:
        return False


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64, help="per half of the workload")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="rounds (medians)")
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from machine import machine_header  # benchmarks/machine.py
    print(machine_header(), flush=True)

    from jaxllm import LLM, SamplingParams, StructuredOutputsParams
    llm = LLM(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, use_tqdm_on_load=False)
    manager = llm.llm_engine.engine_core.scheduler.structured_output_manager
    core = llm.llm_engine.engine_core
    prompts, constrained, plain, checks = workload(args.num_prompts, args.max_tokens)
    print(f"workload: {len(prompts)} requests ({args.num_prompts} JSON over {len(SCHEMAS)} "
          f"schemas, {args.num_prompts} regex/choice), temperature 1.0, max_tokens "
          f"{args.max_tokens}; engine max_num_seqs {args.max_num_seqs}", flush=True)

    log = StepLog(core)
    timed(llm, prompts, plain)  # warm-up, untimed: every grammar compiled and cached
    outputs, _, constrained_tokens = timed(llm, prompts, constrained)
    matched = length_matched(constrained, outputs)
    timed(llm, prompts, matched)
    # TTFT: one request alone, max_tokens=1, on the warm engine.
    one = lambda c: SamplingParams(temperature=1.0, seed=0, max_tokens=1,  # noqa: E731
                                   structured_outputs=c)
    _, ttft_plain, _ = timed(llm, prompts[:1], [one(None)])
    fresh = StructuredOutputsParams(json={**SCHEMAS[0], "title": "never seen"})
    _, ttft_cold, _ = timed(llm, prompts[:1], [one(fresh)])
    _, ttft_warm, _ = timed(llm, prompts[:1], [one(fresh)])

    workloads = [("unconstrained", plain), ("constrained", constrained),
                 ("length-matched", matched)]
    runs = {}  # (async_scheduling, workload) -> one dict per round
    for r in range(args.repeats):
        for async_scheduling in (True, False)[::-1 if r % 2 else 1]:
            core.async_scheduling = async_scheduling
            for name, params in workloads[::-1] if r % 2 else workloads:
                runs.setdefault((async_scheduling, name), []).append(
                    measured_run(llm, log, manager, prompts, params))
    core.async_scheduling = True
    print_runs(runs, workloads, constrained_tokens)

    # Compile: each schema first (fresh cache keys), then its warm setup.
    cold, warm = [], []
    for k, schema in enumerate(SCHEMAS):
        c = StructuredOutputsParams(json={**schema, "description": f"bench {time.time()} {k}"})
        t0 = time.perf_counter()
        manager.grammar_init(c).future.result()
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        request = manager.grammar_init(c)
        request.future.result()
        request.is_ready()
        warm.append(time.perf_counter() - t0)
    print(f"\nfirst compile per schema: mean {1e3 * sum(cold) / len(cold):.1f} ms, max "
          f"{1e3 * max(cold):.1f} ms; warm-cache setup: mean {1e3 * sum(warm) / len(warm):.3f} "
          f"ms per request")
    print(f"TTFT (1 request, 1 token): unconstrained {1e3 * ttft_plain:.0f} ms, new schema "
          f"{1e3 * ttft_cold:.0f} ms, same schema again {1e3 * ttft_warm:.0f} ms")

    for async_scheduling in (True, False):
        outputs = runs[async_scheduling, "constrained"][-1]["outputs"]
        stops = [(o.outputs[0].text, chk) for o, chk in zip(outputs, checks)
                 if o.outputs[0].finish_reason == "stop"]
        ok = sum(valid(t, chk) for t, chk in stops)
        print(f"validity ({'async' if async_scheduling else 'sync'}): {ok}/{len(stops)} "
              f"finished outputs valid; {len(outputs) - len(stops)} of {len(outputs)} "
              f"reached max_tokens")


def print_runs(runs: dict, workloads, constrained_tokens: int) -> None:
    med = lambda rs, key: statistics.median(r[key] for r in rs)  # noqa: E731
    print(f"\nmedians over {len(next(iter(runs.values())))} rounds")
    print(f"{'scheduling':<10} {'workload':<15} {'tok/s':>8} {'s':>7} {'tokens':>7} "
          f"{'steps':>6} {'seqs/step':>9} {'mask ms/step':>12} {'rows/fill':>9} "
          f"{'fill % of steps':>15}")
    for (async_scheduling, name), rs in runs.items():
        fills = med(rs, "fills")
        per = f"{1e3 * med(rs, 'fill_seconds') / fills:.2f}" if fills else "-"
        rows = f"{med(rs, 'fill_rows') / fills:.1f}" if fills else "-"
        share = (f"{100 * statistics.median(r['fill_seconds'] / r['step_seconds'] for r in rs):.1f}"
                 if fills else "-")
        tokens = {r["tokens"] for r in rs}
        print(f"{'async' if async_scheduling else 'sync':<10} {name:<15} {med(rs, 'tps'):>8.1f} "
              f"{med(rs, 'seconds'):>7.2f} {'/'.join(map(str, sorted(tokens))):>7} "
              f"{med(rs, 'steps'):>6.0f} {med(rs, 'seqs') / med(rs, 'steps'):>9.1f} {per:>12} "
              f"{rows:>9} {share:>15}")
    changed = {r["tokens"] for (_, n), rs in runs.items() if n == "constrained" for r in rs}
    if changed != {constrained_tokens}:
        print(f"note: constrained runs made {sorted(changed)} tokens, the warm-up (whose "
              f"lengths the length-matched runs use) {constrained_tokens}")

    def ratio(async_scheduling, a, b):
        return statistics.median(x["tps"] / y["tps"] for x, y in
                                 zip(runs[async_scheduling, a], runs[async_scheduling, b]))

    for async_scheduling in (True, False):
        print(f"{'async' if async_scheduling else 'sync'}: constrained / unconstrained "
              f"{ratio(async_scheduling, 'constrained', 'unconstrained'):.2f} (raw), "
              f"constrained / length-matched "
              f"{ratio(async_scheduling, 'constrained', 'length-matched'):.2f}")


if __name__ == "__main__":
    main()
