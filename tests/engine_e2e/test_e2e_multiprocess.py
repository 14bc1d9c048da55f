"""Tensor parallelism over two processes on JAX's runtime: 2 processes x 2 host CPU devices
(gloo collectives, the coordinator on 127.0.0.1), `LLM(tensor_parallel_size=4, nnodes=2,
node_rank=R)` in each, as a user would start two nodes.

The leader's greedy and seeded tokens equal TP=1's, through both step paths (async
dispatch/fetch, and the synchronous execute_model) and prefix-cache hits; the KV cache is
split over the four devices; neither process compiles after its full warm-up; the follower's
constructor returns when the leader shuts down, and its engine refuses requests.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

from tiny_model import build_tiny_llama_dir

_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    rank, port, model_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    from jaxllm import LLM, SamplingParams

    t0 = time.perf_counter()
    ARGS = dict(max_num_seqs=4, max_num_batched_tokens=4, max_model_len=64, dtype="float32",
                use_tqdm_on_load=False)
    prompts = [{"prompt_token_ids": [100 + i for i in range(n)]} for n in (5, 23, 40)]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)]

    def tokens(outs):
        return [list(o.outputs[0].token_ids) for o in outs]

    llm = LLM(model_dir, tensor_parallel_size=4, nnodes=2, node_rank=rank, master_port=port,
              **ARGS)
    runner = llm.llm_engine.runner
    warm = runner.num_compiles  # steps, and the per-slot row uploads (runner/device_rows.py)
    assert runner.step_fns.num_compiles == len(runner.buckets.all_shapes()), runner.buckets
    if rank == 0:
        import jax
        assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 4, 2)
        k_cache = runner.kv_caches[0][0]
        assert len(k_cache.sharding.device_set) == 4
        assert k_cache.addressable_shards[0].data.shape[2] * 4 == k_cache.shape[2]
        first = llm.generate(prompts, params, use_tqdm=False)
        assert first[0].outputs[0].logprobs and len(first[0].outputs[0].logprobs) == 10
        llm.llm_engine.engine_core.async_scheduling = False  # the execute_model path
        again = llm.generate(prompts, params, use_tqdm=False)  # and prefix-cache hits
        cached = [o.num_cached_tokens for o in again]
        assert cached[1] >= 16 and cached[2] >= 32, cached
        assert runner.num_compiles == warm, "compiled after warm-up"
        tp4 = time.perf_counter() - t0
        # TP=1 on this process's first device; the follower waits for the next step, until
        # this script ends and the leader tells it to stop (at exit).
        single = LLM(model_dir, enforce_eager=True, **ARGS)
        expected = tokens(single.generate(prompts, params, use_tqdm=False))
        assert tokens(first) == expected, (tokens(first), expected)
        assert tokens(again) == expected, (tokens(again), expected)
        print("LEADER OK", json.dumps(expected), "cached", cached, "TP=4 part %.1f s" % tp4)
    else:
        # The constructor returned: the leader has shut down (at its exit).
        assert runner.num_compiles == warm, "compiled after warm-up"
        try:
            llm.generate(prompts, params, use_tqdm=False)
            raise AssertionError("a follower accepted a request")
        except RuntimeError as e:
            assert "node_rank 1 is a follower" in str(e), e
        print("FOLLOWER OK in %.1f s" % (time.perf_counter() - t0))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two(tmp_path, script: str, model_dir: str, timeout: float = 600):
    """Start ranks 0 and 1 of `script`; -> ([rc0, rc1], [(stdout, stderr)] * 2, seconds each
    took), both killed if still running after `timeout`."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    port = str(_free_port())
    paths = [(tmp_path / f"out{r}", tmp_path / f"err{r}") for r in range(2)]
    procs, start = [], time.monotonic()
    for r, (out, err) in enumerate(paths):
        with open(out, "w") as o, open(err, "w") as e:  # the child keeps its own copies
            procs.append(subprocess.Popen([sys.executable, "-c", script, str(r), port,
                                           model_dir], env=env, stdout=o, stderr=e))
    ended = [0.0, 0.0]
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < start + timeout:
            for r, p in enumerate(procs):
                if p.poll() is not None and not ended[r]:
                    ended[r] = time.monotonic() - start
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    ended = [e or time.monotonic() - start for e in ended]
    return ([p.returncode for p in procs], [(o.read_text(), e.read_text()) for o, e in paths],
            ended)


def report(codes, text) -> str:
    return "\n".join(f"--- rank {r}: rc {rc}\n{o[-2000:]}\n{e[-4000:]}"
                     for r, (rc, (o, e)) in enumerate(zip(codes, text)))


def test_tp4_over_two_processes_gives_the_tokens_of_tp1(tmp_path, tokenizer):
    model_dir = build_tiny_llama_dir(str(tmp_path / "model"), tokenizer, num_key_value_heads=4)
    codes, text, _ = run_two(tmp_path, _SCRIPT, model_dir)
    assert codes == [0, 0], report(codes, text)
    assert "LEADER OK" in text[0][0] and "FOLLOWER OK" in text[1][0], report(codes, text)
    print(text[0][0].strip().splitlines()[-1], "|", text[1][0].strip().splitlines()[-1])


_DYING_LEADER = textwrap.dedent("""
    import os, sys
    rank, port, model_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    from jaxllm import LLM
    llm = LLM(model_dir, tensor_parallel_size=4, nnodes=2, node_rank=rank, master_port=port,
              max_num_seqs=4, max_num_batched_tokens=4, max_model_len=64, enforce_eager=True,
              use_tqdm_on_load=False)
    if rank == 0:
        print("LEADER READY", flush=True)
        os._exit(3)  # dies without telling anyone
    print("FOLLOWER RETURNED")
""")


def test_a_dead_leader_ends_its_followers(tmp_path, tokenizer):
    """The follower waits in follow() for a step that never comes; the coordination service
    lived in the leader's process, and JAX's client ends the follower within seconds."""
    model_dir = build_tiny_llama_dir(str(tmp_path / "model"), tokenizer, num_key_value_heads=4)
    codes, text, ended = run_two(tmp_path, _DYING_LEADER, model_dir, timeout=300)
    assert codes[0] == 3 and "LEADER READY" in text[0][0], report(codes, text)
    assert codes[1] not in (0, None) and "FOLLOWER RETURNED" not in text[1][0], \
        report(codes, text)
    assert ended[1] - ended[0] < 60, (ended, report(codes, text))
    print(f"follower ended {ended[1] - ended[0]:.1f} s after the leader, rc {codes[1]}")
