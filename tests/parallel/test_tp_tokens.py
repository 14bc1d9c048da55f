"""Tensor parallelism end to end: `LLM(tensor_parallel_size=2 | 4)` on host CPU devices gives
the tokens of TP=1, greedy and seeded sampling, for every attention backend (each run per
shard under shard_map), with 2 KV heads kept once each at TP=2 and twice each at TP=4.

One subprocess (the device count is fixed at jax start-up) runs seven engines: TP=1 once, on
"xla" (float32 everywhere, so every backend's tokens can be compared with it exactly), and
TP=2 and 4 for each backend; the collectives these programs hold are checked in
test_tp_hlo.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

_SCRIPT = textwrap.dedent("""
    import json, logging, os, sys, tempfile
    sys.path[:0] = [{tests!r}]
    import jax
    from jaxllm import LLM, SamplingParams
    from engine_e2e.tiny_model import build_tiny_llama_dir
    assert len(jax.devices()) == 4, jax.devices()
    # head_dim 64: a size the Pallas kernel supports; 4 query heads over 2 KV heads.
    d = build_tiny_llama_dir(tempfile.mkdtemp(), hidden_size=128, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64)
    prompts = [{{"prompt_token_ids": [100 + i for i in range(n)]}} for n in (5, 23, 40)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("jaxllm").addHandler(handler)
    runs = [("xla", 1)] + [(b, tp) for b in ("xla", "cpu", "pallas_interpret") for tp in (2, 4)]
    for backend, tp in runs:
        llm = LLM(d, tensor_parallel_size=tp, attention_backend=backend, dtype="float32",
                  max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                  kv_cache_memory_bytes=1 << 20, enforce_eager=True,
                  use_tqdm_on_load=False)
        runner, logged = llm.llm_engine.runner, warnings[:]
        warnings.clear()
        outs = llm.generate(prompts, [greedy, seeded, greedy], use_tqdm=False)
        k = runner.kv_caches[0][0]
        print(json.dumps(dict(
            backend=backend, tp=tp, tokens=[o.outputs[0].token_ids for o in outs],
            kv_global=list(k.shape), kv_local=list(k.addressable_shards[0].data.shape),
            devices=len(k.sharding.device_set), logged=logged)), flush=True)
        del llm, runner, k
""")


@pytest.fixture(scope="module")
def runs():
    tests = os.path.dirname(os.path.dirname(__file__))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.format(tests=tests)], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    found = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {(r["backend"], r["tp"]): r for r in found}


@pytest.mark.parametrize("backend", ["xla", "cpu", "pallas_interpret"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tokens_equal_tp1(runs, backend, tp):
    assert runs[(backend, tp)]["tokens"] == runs[("xla", 1)]["tokens"]


@pytest.mark.parametrize("backend", ["xla", "cpu", "pallas_interpret"])
def test_cache_is_split_over_kv_heads(runs, backend):
    # KV heads of the model: 2; at TP=4 each is kept on two devices (4 in the layout).
    assert [(runs[key]["kv_global"][2], runs[key]["kv_local"][2], runs[key]["devices"])
            for key in (("xla", 1), (backend, 2), (backend, 4))] == [(2, 2, 1), (2, 1, 2),
                                                                     (4, 1, 4)]


def test_replicated_kv_heads_are_logged_with_their_cost(runs):
    cost = ("tensor_parallel_size=4 with 2 KV heads: each device keeps 1 KV head(s) "
            "(checkpoint heads [0, 0, 1, 1] across devices), so the KV cache holds 2x the "
            "bytes per token of an unreplicated cache (2x fewer tokens fit the same memory)")
    for backend in ("xla", "cpu", "pallas_interpret"):
        assert runs[(backend, 4)]["logged"] == [cost]
        assert runs[(backend, 2)]["logged"] == runs[("xla", 1)]["logged"] == []
