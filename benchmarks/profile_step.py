"""Where a step's time goes, and how far each part is from this machine's roofline.

Splits `LLMEngine.step()` into its phases (schedule, input preparation, the device step,
sampling, update + output processing) on steady-state workloads, times each (medians), and
puts the device step beside its roofline:

  * the machine's read bandwidth and GEMM peak, measured here in the same run
    (a jitted sum over 1 GiB; jnp.dot at the step's own GEMM shape and at 2048^3);
  * the step's FLOPs and bytes, counted by hand (weights once, KV read once per sequence
    up to its length, 2 FLOPs per parameter per token) and from XLA's cost analysis;
  * attention alone: every layer's attention call on the step's real metadata, against
    its KV-read roofline (KV bytes in context / bandwidth).

    python benchmarks/profile_step.py                 # default dtype, default scenarios
    python benchmarks/profile_step.py --dtype float32 --scenarios decode64@1024
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import LLM, SamplingParams


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

def measure_bandwidth_gbs() -> float:
    x = jnp.ones((1 << 28,), jnp.float32)  # 1 GiB
    f = jax.jit(lambda a: jnp.sum(a))
    ms = median_ms(lambda: f(x).block_until_ready(), repeats=5)
    del x
    return (1 << 30) / (ms * 1e-3) / 1e9


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


def fill(engine, batch, context, vocab):
    """Add `batch` greedy requests with prompts of `context` tokens and prefill them."""
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=64)
    for _ in range(batch):
        engine.add_request(None, rng.integers(100, vocab, context).tolist(), params)
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        engine.step()
        if not sched.running and not sched.waiting:
            break


def drain(engine):
    while engine.has_unfinished_requests():
        engine.step()


class PhaseTimer:
    def __init__(self):
        self.ms = {}

    def add(self, name, t0):
        self.ms.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)

    def medians(self):
        return {k: statistics.median(v) for k, v in self.ms.items()}


def profiled_step(engine, timer: PhaseTimer):
    """One engine step with its phases timed separately (device work is synchronised at
    each phase boundary so that the time lands in the phase that caused it)."""
    from jaxllm.engine.request import RequestStatus

    t0 = time.perf_counter()
    so = engine.scheduler.schedule()
    timer.add("schedule", t0)
    parts = runner_phases(engine.runner, so)
    runner_output = None
    for name, fn in parts:
        t0 = time.perf_counter()
        runner_output = fn()
        timer.add(name, t0)
    t0 = time.perf_counter()
    engine_outputs = engine.scheduler.update_from_output(so, runner_output)
    finished, stopped = engine.output_processor.process_outputs(engine_outputs)
    if stopped:
        engine.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
    timer.add("update+output", t0)
    return so


def runner_phases(runner, so):
    """The runner's execute_model split into (prepare, device, sample) callables; the last
    returns the ModelRunnerOutput."""
    from jaxllm.messages import ModelRunnerOutput
    from jaxllm.models.base import AttentionMetadata
    from jaxllm.runner.input_batch import prepare_inputs, update_states
    from jaxllm.runner.sampling_metadata import SamplingRow, build_sampling_metadata

    box = {}

    def prepare():
        update_states(runner.requests, so)
        inp = prepare_inputs(runner.requests, so, runner.buckets, runner.block_size)
        box["inp"] = inp
        box["md"] = jax.device_put(AttentionMetadata(
            inp.input_ids, inp.positions, inp.slot_mapping, inp.block_tables, inp.seq_lens,
            inp.query_start_loc, inp.num_seqs))
        box["idx"] = jax.device_put(inp.logits_indices)
        jax.block_until_ready((box["md"], box["idx"]))

    def device():
        inp = box["inp"]
        logits, _, runner.kv_caches = runner.step_fns.get(inp.shape)(
            runner.state, runner.kv_caches, box["md"], box["idx"])
        box["logits"] = logits.block_until_ready()

    def sample():
        inp = box["inp"]
        states = [runner.requests[r] for r in inp.req_ids]
        rows = [SamplingRow(st.sampling_params, st.sampling_params.seed, st.prompt_token_ids,
                            st.output_token_ids) for st in states]
        smd = build_sampling_metadata(rows, num_seqs_padded=inp.shape[1],
                                      eos_token_ids=runner.eos_token_ids,
                                      max_model_len=runner.max_model_len)
        sampled = np.asarray(runner.sample_fns.get((inp.shape[1], smd.variant))(
            box["logits"], smd).sampled_token_ids)
        out = []
        for i, st in enumerate(states):
            if inp.samples[i]:
                st.output_token_ids.append(int(sampled[i]))
                out.append([int(sampled[i])])
            else:
                out.append([])
        return ModelRunnerOutput(req_ids=inp.req_ids, sampled_token_ids=out)

    return [("prepare", prepare), ("device", device), ("sample", sample)]


def attention_ms(engine, so):
    """Every layer's attention call on this step's metadata (random q), as one jitted call."""
    from jaxllm.kernels import default_attention_backend, get_attention_fn
    from jaxllm.models.base import AttentionMetadata
    from jaxllm.runner.input_batch import prepare_inputs

    runner, cfg = engine.runner, engine.model_config
    backend = engine.config.attention_backend or default_attention_backend()
    attn = get_attention_fn(backend)
    # The state of the last profiled step is still in the runner: rebuild its inputs.
    inp = prepare_inputs(runner.requests, so, runner.buckets, runner.block_size)
    T = inp.shape[0]
    q = jax.random.normal(jax.random.key(0), (T, cfg.num_attention_heads, cfg.head_dim),
                          runner.kv_caches[0][0].dtype)
    md = AttentionMetadata(inp.input_ids, inp.positions, inp.slot_mapping, inp.block_tables,
                           inp.seq_lens, inp.query_start_loc, inp.num_seqs)

    @jax.jit
    def all_layers(q, caches, md):
        outs = [attn(q, k, v, md.block_tables, md.seq_lens, md.query_start_loc, md.num_seqs,
                     sm_scale=cfg.head_dim ** -0.5) for k, v in caches]
        return sum(o.astype(jnp.float32).sum() for o in outs)

    return median_ms(lambda: all_layers(q, runner.kv_caches, md).block_until_ready())


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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--scenarios", nargs="+",
                   default=["decode64@256", "decode64@1024", "decode1@128", "prefill512"])
    p.add_argument("--steps", type=int, default=9)
    args = p.parse_args()

    bw = measure_bandwidth_gbs()
    print(f"machine: read bandwidth {bw:.1f} GB/s (jitted sum over 1 GiB)")
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=512,
              max_model_len=2048, seed=0)
    engine = llm.llm_engine
    dtype = engine.runner.kv_caches[0][0].dtype
    cfg = engine.model_config
    peaks = {shape: measure_gemm_gflops(*shape, dtype)
             for shape in [(64, cfg.hidden_size, cfg.intermediate_size), (2048, 2048, 2048)]}
    for (m, k, n), g in peaks.items():
        print(f"machine: {jnp.dtype(dtype).name} GEMM {m}x{k}x{n}: {g:.0f} GFLOP/s")
    peak = max(peaks.values())
    print(f"engine: dtype {jnp.dtype(dtype).name}, warm-up {engine.warmup_seconds:.1f} s, "
          f"{engine.runner.num_compiles} compiles\n")

    header = ("scenario", "step ms", "schedule", "prepare", "device", "sample",
              "update+out", "host %", "device % roofline", "attn ms", "attn % roofline")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    vocab = cfg.vocab_size
    for text in args.scenarios:
        kind, batch, ctx = parse_scenario(text)
        timer = PhaseTimer()
        if kind == "decode":
            fill(engine, batch, ctx, vocab)
            so = None
            for _ in range(args.steps + 2):
                so = profiled_step(engine, timer)
            counts = hand_counts(engine, so)
            attn_ms = attention_ms(engine, so)
            drain(engine)
            timer.ms = {k: v[2:] for k, v in timer.ms.items()}  # drop the first two
        else:
            rng = np.random.default_rng(1)
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
            so = None
            for _ in range(args.steps):
                engine.add_request(None, rng.integers(100, vocab, ctx).tolist(), params)
                so = profiled_step(engine, timer)
                counts = hand_counts(engine, so)
                drain(engine)
            attn_ms = float("nan")
        med = timer.medians()
        total = sum(med.values())
        host = total - med["device"]
        flops, wbytes, kvbytes = counts
        roof_ms = max((wbytes + kvbytes) / (bw * 1e9), flops / (peak * 1e9)) * 1e3
        attn_roof_ms = kvbytes / (bw * 1e9) * 1e3
        print(f"  {text}: {flops / 1e9:.1f} GFLOP, weights {wbytes / 2**20:.0f} MiB, KV "
              f"{kvbytes / 2**20:.0f} MiB -> roofline {roof_ms:.1f} ms")
        row = [text, f"{total:.1f}", f"{med['schedule']:.1f}", f"{med['prepare']:.1f}",
               f"{med['device']:.1f}", f"{med['sample']:.1f}", f"{med['update+output']:.1f}",
               f"{100 * host / total:.0f}%", f"{100 * roof_ms / med['device']:.0f}%",
               f"{attn_ms:.1f}", f"{100 * attn_roof_ms / attn_ms:.0f}%" if kind == "decode"
               else "-"]
        print(" | ".join(row))


if __name__ == "__main__":
    main()
