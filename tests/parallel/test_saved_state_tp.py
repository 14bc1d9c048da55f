"""A saved state under tensor parallelism: `save_sharded_state` on a TP=2 engine (two host CPU
devices, in a subprocess: the device count is fixed at jax start-up) and `LLM(saved,
tensor_parallel_size=2)` restore every parameter bit for bit, split over both devices as
loaded, and generate the same greedy tokens; the state refuses another TP size."""

from __future__ import annotations

import os
import textwrap

import pytest

from host_devices import run_on_host_devices

pytestmark = pytest.mark.slow

_SCRIPT = textwrap.dedent("""
    import os, sys, tempfile
    sys.path[:0] = [{tests!r}]
    import jax
    import numpy as np
    from flax import nnx
    from jaxllm import LLM, SamplingParams
    from engine_e2e.tiny_model import build_tiny_llama_dir
    assert len(jax.devices()) == 2, jax.devices()
    d = build_tiny_llama_dir(tempfile.mkdtemp())
    small = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                 use_tqdm_on_load=False, dtype="float32", enforce_eager=True,
                 tensor_parallel_size=2)
    prompts = [{{"prompt_token_ids": [100 + i for i in range(n)]}} for n in (5, 23)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def leaves(llm):
        return {{".".join(map(str, p)): v.get_value()
                 for p, v in nnx.to_flat_state(llm.llm_engine.runner.state)}}

    loaded = LLM(d, **small)
    saved = os.path.join(tempfile.mkdtemp(), "saved")
    loaded.save_sharded_state(saved)
    restored = LLM(saved, **small)
    want, got = leaves(loaded), leaves(restored)
    assert want.keys() == got.keys()
    split = 0
    for name, w in want.items():
        g = got[name]
        assert g.sharding == w.sharding, (name, g.sharding, w.sharding)
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes(), name
        split += g.addressable_shards[0].data.shape != g.shape
    q = got["model.layers.0.self_attn.q_proj.kernel"]
    assert len(q.sharding.device_set) == 2 and q.addressable_shards[0].data.shape[1] * 2 == q.shape[1]
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
              for llm in (loaded, restored)]
    assert tokens[0] == tokens[1], tokens
    try:
        LLM(saved, **{{**small, "tensor_parallel_size": 1}})
    except ValueError as e:
        assert "tensor_parallel_size 2 (asked for 1)" in str(e), e
    else:
        raise AssertionError("a TP=2 state served at TP=1")
    print("split", split, "of", len(want))
    print("SAVED TP OK")
""")


def test_tp2_state_restores_sharded_and_generates_the_same_tokens():
    script = _SCRIPT.format(tests=os.path.dirname(os.path.dirname(__file__)))
    proc = run_on_host_devices(["-c", script], 2)
    assert "SAVED TP OK" in proc.stdout
    # q/k/v/o, gate/up/down of 2 layers and the embedding and LM head are split; norms not.
    assert "split 16 of 21" in proc.stdout, proc.stdout
