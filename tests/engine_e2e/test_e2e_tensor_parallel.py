"""Tensor parallelism end to end: LLM(tensor_parallel_size=2) on two host CPU devices (in a
subprocess, since the device count is fixed at jax start-up) gives the tokens of TP=1, with
parameters and KV caches really split, after a full warm-up (so every compiled bucket and
sampler variant takes the sharded inputs)."""

from __future__ import annotations

import os
import textwrap

from host_devices import run_on_host_devices

_SCRIPT = textwrap.dedent("""
    import os, sys, tempfile
    sys.path[:0] = [{here!r}, os.path.dirname({here!r})]
    import jax
    from jaxllm import LLM, SamplingParams
    from tiny_model import build_tiny_llama_dir
    assert len(jax.devices()) == 2, jax.devices()
    d = build_tiny_llama_dir(tempfile.mkdtemp())
    prompts = [{{"prompt_token_ids": [100 + i for i in range(n)]}} for n in (5, 23, 40)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    runs = {{}}
    for tp in (1, 2):
        llm = LLM(d, tensor_parallel_size=tp, max_num_seqs=4, max_num_batched_tokens=32,
                  max_model_len=64, use_tqdm_on_load=False, dtype="float32")
        runner = llm.llm_engine.runner
        before = runner.num_compiles
        outs = llm.generate(prompts, [greedy, seeded, greedy], use_tqdm=False)
        assert runner.num_compiles == before, "compiled after warm-up"
        runs[tp] = [o.outputs[0].token_ids for o in outs]
        q = runner.state["model"]["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
        k_cache = runner.kv_caches[0][0]
        print("tp", tp, "q_proj devices", len(q.sharding.device_set),
              "shard", q.addressable_shards[0].data.shape,
              "kv shard", k_cache.addressable_shards[0].data.shape)
        if tp == 2:
            assert q.addressable_shards[0].data.shape[1] * 2 == q.shape[1]
            assert k_cache.addressable_shards[0].data.shape[2] * 2 == k_cache.shape[2]
    assert runs[1] == runs[2], runs
    print("TP OK")
""")


def test_tp2_generates_the_tokens_of_tp1():
    script = _SCRIPT.format(here=os.path.dirname(__file__))
    proc = run_on_host_devices(["-c", script], 2)
    assert "TP OK" in proc.stdout
