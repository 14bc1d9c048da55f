"""Where a step's time goes, and how far each part is from this machine's roofline.

Splits one engine step into its phases on steady-state workloads and times each (medians):

  schedule   Scheduler.schedule()
  prepare    the runner's persistent input batch: apply the scheduler's diffs, pack the step
  device     the jitted step (model, logits, sampling) until its outputs are ready
  sampling   the sampler alone on the step's logits shape and metadata (part of "device")
  fetch      tokens (and logprobs) to the host, into the input batch
  output     Scheduler.update_from_output + OutputProcessor (detokenize, stop strings)

Phases are synchronised at their boundaries here, so "host %" is what a synchronous engine
would pay. "async step" is the median wall time of one `LLMEngine.step()` with async
scheduling on the same workload: there the host phases overlap the device.

The device step is set beside its roofline, from figures measured in the same run: the
read bandwidth (a jitted sum over 1 GiB) and the GEMM peak (jnp.dot at the step's own GEMM
shape and at 2048^3, in the model's dtype). FLOPs and bytes are counted by hand (every
weight read once, each sequence's KV read once up to its length, 2 FLOPs per parameter per
token, attention over each row's visible keys); XLA's own cost analysis is printed beside.
Attention alone (every layer's call on the step's real metadata) is set against its KV-read
roofline: KV bytes in context / bandwidth. "h2d KiB" is what the runner sent to the device
for the step (its arguments and the per-slot rows that changed), median over the steps.

`--bytes` measures only the bytes moved per step, at S=256 sequences decoding and
max_model_len=32768 (a block-table width of 2048 blocks of 16), against the layout before the
persistent batch moved to the device (47c4e60: the whole [S, W] block tables, [S, B, G] bad
words and [S, ceil(V/32)] allowed-token bits were step arguments, sent every step).

    python benchmarks/profile_step.py                  # dtype "auto", default scenarios
    python benchmarks/profile_step.py --dtype float32 --scenarios decode64@1024
    python benchmarks/profile_step.py --bytes
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import LLM, SamplingParams, llm_engine

from machine import machine_header  # benchmarks/machine.py


def median_ms(fn, repeats=7, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---- the machine -----------------------------------------------------------------------

def measure_bandwidth_gbs(num_bytes: int = 1 << 30) -> float:
    """Read bandwidth of a jitted sum over `num_bytes` of float32 (1 GiB by default; keep it
    well above the last-level cache)."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a))
    ms = median_ms(lambda: f(x).block_until_ready(), repeats=5)
    return num_bytes / (ms * 1e-3) / 1e9


def measure_gemm_gflops(m, k, n, dtype) -> float:
    a = jnp.ones((m, k), dtype)
    b = jnp.ones((k, n), dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    ms = median_ms(lambda: f(a, b).block_until_ready(), repeats=5)
    return 2 * m * k * n / (ms * 1e-3) / 1e9


# ---- scenarios -------------------------------------------------------------------------

def parse_scenario(text):
    """'decode64@1024' -> ('decode', 64, 1024); 'prefill512' -> ('prefill', 1, 512)."""
    kind, _, ctx = text.partition("@")
    if kind.startswith("decode"):
        return "decode", int(kind[6:]), int(ctx)
    if kind.startswith("prefill"):
        return "prefill", 1, int(kind[7:])
    raise ValueError(f"unknown scenario {text!r}")


def add_requests(engine, batch, context, vocab, max_tokens, seed=0):
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    for _ in range(batch):
        engine.add_request(None, rng.integers(100, vocab, context).tolist(), params)


def prefill_all(engine):
    """Step until every request is decoding (its whole prompt is in the KV cache)."""
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                               for r in sched.running):
        engine.step()


def drain(engine):
    """Abort what is left (decode scenarios stop after their timed steps) and settle."""
    engine.abort_request(list(engine.output_processor.parents))
    while engine.has_unfinished_requests():
        engine.step()


class PhaseTimer:
    def __init__(self):
        self.ms = {}
        self.h2d = []  # host-to-device bytes of each step

    def add(self, name, t0):
        self.ms.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)

    def medians(self, skip=0):
        return {k: statistics.median(v[skip:]) for k, v in self.ms.items()}


def profiled_step(engine, timer: PhaseTimer):
    """One synchronous engine step with each phase synchronised and timed. -> (so, host)."""
    from jaxllm.engine.request import RequestStatus
    from jaxllm.runner.model_runner import PendingStep

    runner = engine.runner
    t0 = time.perf_counter()
    so = engine.scheduler.schedule()
    timer.add("schedule", t0)
    t0 = time.perf_counter()
    runner.input_batch.update_states(so)
    host = runner.input_batch.prepare(so, runner.buckets)
    timer.add("prepare", t0)
    t0 = time.perf_counter()
    out = runner.run(host)
    jax.block_until_ready(out)
    timer.add("device", t0)
    timer.h2d.append(sum(runner.last_step_h2d.values()))
    t0 = time.perf_counter()
    runner_output = runner.fetch(PendingStep(host, out))
    timer.add("fetch", t0)
    t0 = time.perf_counter()
    engine_outputs = engine.scheduler.update_from_output(so, runner_output)
    _, stopped = engine.output_processor.process_outputs(engine_outputs)
    if stopped:
        engine.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
    timer.add("output", t0)
    return so, host


def sampling_ms(engine, host) -> float:
    """The sampler alone, on random logits of the step's [S, V] shape and its metadata."""
    from jaxllm.runner.sampler import sample_jit

    S = host.seq_lens.shape[0]
    batch = engine.runner.input_batch
    logits = jax.random.normal(jax.random.key(0), (S, engine.model_config.vocab_size))
    smd = host.sampling.replace(penalties=host.sampling.penalties.replace(
        token_ids=np.zeros((S, engine.config.max_model_len), np.int32)),
        bad_words=batch.bad_words.host[host.slot_S],
        allowed_token_bits=batch.allowed_token_bits.host[host.slot_S])
    return median_ms(lambda: jax.block_until_ready(sample_jit(logits, smd)))


def attention_ms(engine, host) -> float:
    """Every layer's attention call on this step's metadata (random q), as one jitted call."""
    runner, cfg = engine.runner, engine.model_config
    attn = runner.attention_backend.attention_fn()
    T = host.shape[0]
    q = jax.random.normal(jax.random.key(0), (T, cfg.num_attention_heads, cfg.head_dim),
                          runner.kv_dtype)

    @jax.jit
    def all_layers(q, caches, bt, sl, qsl, ns):
        outs = [attn(q, k, v, bt, sl, qsl, ns, sm_scale=cfg.head_dim ** -0.5)
                for k, v in caches]
        return sum(o.astype(jnp.float32).sum() for o in outs)

    args = (q, runner.kv_caches, runner.input_batch.block_tables(host), host.seq_lens,
            host.query_start_loc, host.num_seqs)
    return median_ms(lambda: all_layers(*args).block_until_ready())


def hand_counts(engine, so):
    """(FLOPs, weight bytes, KV bytes) of one step, counted from the model config and the
    step's SchedulerOutput (each sequence's KV is read once, up to its length)."""
    cfg = engine.model_config
    leaves = jax.tree.leaves(engine.runner.state)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
    num_params = sum(x.size for x in leaves)
    kv_item = engine.runner.kv_caches[0][0].dtype.itemsize
    per_token_kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    starts = {r.req_id: r.num_computed_tokens
              for r in [*so.scheduled_new_reqs, *so.scheduled_cached_reqs]}
    T = so.total_num_scheduled_tokens
    V, D = cfg.vocab_size, cfg.hidden_size
    # Every parameter once per token, except the embedding gather; the LM head runs on one
    # row per sequence.
    body_params = num_params - V * D * (1 if cfg.tie_word_embeddings else 2)
    flops = 2 * body_params * T + 2 * V * D * len(starts)
    kv_tokens = visible = 0
    for req_id, n in so.num_scheduled_tokens.items():
        start = starts[req_id]
        kv_tokens += start + n
        visible += n * start + n * (n + 1) // 2  # keys seen by the n new tokens, causally
    # QK^T and PV: 2 FLOPs each per (query head, head dim, visible key).
    flops += 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * visible
    return flops, weight_bytes, kv_tokens * per_token_kv * kv_item


def xla_cost(engine, host) -> tuple[float, float]:
    """(FLOPs, bytes accessed) of the compiled step, from XLA's cost analysis."""
    T, _, W = host.shape
    cost = engine.runner.step_fns.get((T, W)).cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def async_step_ms(engine, kind, batch, ctx, vocab, steps, max_tokens) -> float:
    """Median wall time of LLMEngine.step() with async scheduling, same workload."""
    core = engine.engine_core
    core.async_scheduling = True
    times = []
    if kind == "decode":
        add_requests(engine, batch, ctx, vocab, max_tokens=max_tokens, seed=2)
        prefill_all(engine)
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t0) * 1e3)
    else:
        for i in range(steps):
            add_requests(engine, 1, ctx, vocab, max_tokens=1, seed=10 + i)
            t0 = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            times.append((time.perf_counter() - t0) * 1e3)
    drain(engine)
    core.async_scheduling = False
    return statistics.median(times[1:])


# ---- bytes per step ----------------------------------------------------------------------

def old_layout_bytes(runner, h2d: dict[str, int], S: int) -> int:
    """What the 47c4e60 layout sent for the same step: everything but the per-slot row diffs,
    plus the whole tables as step arguments (int32 block tables [S, W], int32 bad words
    [S, B, G], uint32 allowed-token bits [S, N])."""
    sent = sum(n for part, n in h2d.items() if part not in runner.slot_rows)
    return sent + sum(S * rows.row_size * rows.dtype.itemsize
                      for name, rows in runner.slot_rows.items())


@contextlib.contextmanager
def reported_max_length(max_len):
    """Loaded model configs report at least `max_len` positions. SmolLM2-135M allows 8192;
    the bytes measurement needs only the block-table width of a 32k context (W = 2048), its
    contexts stay under 100 tokens, where the model is what it always is (RoPE angles are
    computed per position, there is no table to outgrow)."""
    real = llm_engine.load_for_engine

    def load(*args, **kwargs):
        loaded = real(*args, **kwargs)
        cfg = loaded.model_config
        longer = max(max_len, cfg.max_position_embeddings)
        return dataclasses.replace(
            loaded, model_config=dataclasses.replace(cfg, max_position_embeddings=longer))

    llm_engine.load_for_engine = load
    try:
        yield
    finally:
        llm_engine.load_for_engine = real


def bytes_per_step(model, dtype, steps, num_seqs=256, max_model_len=32768):
    """Host-to-device bytes of each decode step with `num_seqs` sequences, before and after."""
    steps = max(steps, 48)  # three block boundaries per sequence (block_size 16)
    with reported_max_length(max_model_len):
        llm = LLM(model=model, dtype=dtype, max_num_seqs=num_seqs, max_num_batched_tokens=512,
                  max_model_len=max_model_len, seed=0, async_scheduling=False,
                  enforce_eager=True, kv_cache_memory_bytes=1 << 30)
    engine = llm.llm_engine
    runner = engine.runner
    vocab = engine.model_config.vocab_size
    # Short contexts (16..31 prompt tokens) staggered over a block, so that block appends
    # spread over the steps as they would in serving; the block-table width is what
    # max_model_len makes it, whatever the contexts.
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 64)
    for i in range(num_seqs):
        engine.add_request(None, rng.integers(100, vocab, 16 + i % 16).tolist(), params)
    prefill_all(engine)
    after, before, parts = [], [], {}
    for _ in range(steps):
        engine.step()
        h2d = runner.last_step_h2d
        after.append(sum(h2d.values()))
        before.append(old_layout_bytes(runner, h2d, num_seqs))
        for part, n in h2d.items():
            parts.setdefault(part, []).append(n)
    assert len(engine.scheduler.running) == num_seqs, "every sequence decodes every step"
    longest = max(r.num_tokens for r in engine.scheduler.running)
    drain(engine)
    W = runner.buckets.width_buckets[-1]
    name = engine.metrics.labels["model_name"]
    print(f"bytes per decode step, {name} ({vocab} vocab): "
          f"S={num_seqs} sequences decoding, max_model_len={max_model_len} (block-table "
          f"width W={W}; the model's own config says 8192, raised for the width only), "
          f"{steps} steps. Contexts are short (16..{longest} tokens): the bytes depend on "
          f"W and on the block appends (one per sequence every {runner.block_size} steps, "
          f"staggered), not on the context length.")
    print(f"  before (47c4e60 layout): mean {statistics.mean(before) / 1024:.1f} KiB, "
          f"max {max(before) / 1024:.1f} KiB")
    print(f"  after  (device rows):    mean {statistics.mean(after) / 1024:.2f} KiB, "
          f"max {max(after) / 1024:.2f} KiB")
    print(f"  ratio (means): {statistics.mean(before) / statistics.mean(after):.0f}x")
    for part, ns in parts.items():
        print(f"    {part:>20}: mean {statistics.mean(ns):9.1f} B, max {max(ns):7d} B")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--scenarios", nargs="+",
                   default=["decode64@256", "decode64@1024", "decode1@128", "prefill512"])
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=3.0,
                   help="KV cache budget: 64 sequences of 1k tokens must fit without preemption")
    p.add_argument("--bytes", action="store_true",
                   help="only the host-to-device bytes per step at S=256, max_model_len=32768")
    args = p.parse_args()
    print(machine_header(), flush=True)
    if args.bytes:
        return bytes_per_step(args.model, args.dtype, args.steps)

    bw = measure_bandwidth_gbs()
    print(f"machine: read bandwidth {bw:.1f} GB/s (jitted sum over 1 GiB)")
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=512,
              max_model_len=args.max_model_len, seed=0, async_scheduling=False,
              kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30))
    engine = llm.llm_engine
    dtype = jnp.dtype(engine.runner.kv_dtype)
    cfg = engine.model_config
    peaks = {shape: measure_gemm_gflops(*shape, dtype)
             for shape in [(64, cfg.hidden_size, cfg.intermediate_size), (2048, 2048, 2048)]}
    for (m, k, n), g in peaks.items():
        print(f"machine: {jnp.dtype(dtype).name} GEMM {m}x{k}x{n}: {g:.0f} GFLOP/s")
    peak = max(peaks.values())
    print(f"engine: dtype {jnp.dtype(dtype).name}, attention {engine.runner.attention_backend.name}, "
          f"warm-up {engine.warmup_seconds:.1f} s, {engine.runner.num_compiles} compiles\n")

    header = ("scenario", "step ms", "schedule", "prepare", "device", "(sampling)", "fetch",
              "output", "host %", "async step ms", "device % roofline", "attn ms",
              "attn % roofline", "h2d KiB")
    rows, notes = [], []
    vocab = cfg.vocab_size
    for text in args.scenarios:
        kind, batch, ctx = parse_scenario(text)
        timer = PhaseTimer()
        if kind == "decode":
            add_requests(engine, batch, ctx, vocab, max_tokens=args.max_model_len - ctx)
            prefill_all(engine)
            for _ in range(args.steps + 2):
                so, host = profiled_step(engine, timer)
            counts = hand_counts(engine, so)
            attn = attention_ms(engine, host)
            samp = sampling_ms(engine, host)
            cost = xla_cost(engine, host)
            drain(engine)
            med = timer.medians(skip=2)
        else:
            for i in range(args.steps):
                add_requests(engine, 1, ctx, vocab, max_tokens=1, seed=10 + i)
                so, host = profiled_step(engine, timer)
                counts = hand_counts(engine, so)
                drain(engine)
            attn, samp, cost = float("nan"), sampling_ms(engine, host), xla_cost(engine, host)
            med = timer.medians(skip=1)
        asynchronous = async_step_ms(engine, kind, batch, ctx, vocab, args.steps,
                                     args.max_model_len - ctx)
        total = sum(med.values())
        host_ms = total - med["device"]
        flops, wbytes, kvbytes = counts
        roof_ms = max((wbytes + kvbytes) / (bw * 1e9), flops / (peak * 1e9)) * 1e3
        attn_roof_ms = kvbytes / (bw * 1e9) * 1e3
        notes.append(f"  {text}: {flops / 1e9:.2f} GFLOP, weights {wbytes / 2**20:.0f} MiB, KV "
                     f"{kvbytes / 2**20:.0f} MiB -> roofline {roof_ms:.1f} ms "
                     f"(KV alone {attn_roof_ms:.1f} ms); XLA cost analysis "
                     f"{cost[0] / 1e9:.2f} GFLOP, {cost[1] / 2**20:.0f} MiB")
        rows.append([text, f"{total:.1f}", f"{med['schedule']:.2f}", f"{med['prepare']:.2f}",
                     f"{med['device']:.1f}", f"{samp:.1f}", f"{med['fetch']:.2f}",
                     f"{med['output']:.2f}", f"{100 * host_ms / total:.1f}%",
                     f"{asynchronous:.1f}", f"{100 * roof_ms / med['device']:.0f}%",
                     f"{attn:.1f}", f"{100 * attn_roof_ms / attn:.0f}%" if kind == "decode"
                     else "-", f"{statistics.median(timer.h2d) / 1024:.1f}"])
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for row in rows:
        print(" | ".join(row))
    print("\n".join(notes))


if __name__ == "__main__":
    main()
