"""Capture, steering and head ablation under tensor parallelism: `LLM(tensor_parallel_size=2,
research=...)` on 2 host CPU devices gives TP=1's tokens and activations (per-head sites
arrive whole, their heads gathered from both devices), and a plain request beside steered
and ablated ones keeps TP=1's plain tokens.
"""

from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest

from host_devices import run_on_host_devices

pytestmark = pytest.mark.slow

_SCRIPT = textwrap.dedent("""
    import json, sys, tempfile
    sys.path[:0] = [{tests!r}]
    import jax
    import numpy as np
    from jaxllm import LLM, SamplingParams
    from jaxllm.research import Ablate, Capture, ResearchConfig, Steer
    from engine_e2e.tiny_model import build_tiny_llama_dir
    assert len(jax.devices()) == 2, jax.devices()
    d = build_tiny_llama_dir(tempfile.mkdtemp(), hidden_size=128, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32)
    research = ResearchConfig(capture_layers=(0, 1), capture_sites=("resid_post", "q", "z"),
                              steer_layers=(1,), ablate_layers=(0,))
    v = np.linspace(-1, 1, 128).astype(np.float32)
    cap = Capture()
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                             extra_args={{"capture": cap, "steer": Steer(1, v, 2.0)}}),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                             extra_args={{"capture": cap, "ablate": Ablate(0, (1, 2))}})]
    prompts = [{{"prompt_token_ids": [100 + i for i in range(n)]}} for n in (5, 23, 11)]
    result = {{}}
    for tp in (1, 2):
        llm = LLM(d, tensor_parallel_size=tp, dtype="float32", max_num_seqs=4,
                  max_num_batched_tokens=32, max_model_len=64, kv_cache_memory_bytes=1 << 20,
                  enforce_eager=True, use_tqdm_on_load=False, research=research)
        outs = llm.generate(prompts, params, use_tqdm=False)
        result[tp] = dict(
            tokens=[o.outputs[0].token_ids for o in outs],
            acts=[{{name: o.outputs[0].activations[name].tolist()
                    for name in o.outputs[0].activations.keys()}}
                  if o.outputs[0].activations is not None else None for o in outs])
    print(json.dumps(result))
""")


def test_research_under_tensor_parallelism_gives_tp1s_results(tmp_path):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "tp_research.py"
    script.write_text(_SCRIPT.format(tests=tests))
    proc = run_on_host_devices([str(script)], count=2)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    one, two = result["1"], result["2"]
    assert one["tokens"] == two["tokens"]
    for a, b in zip(one["acts"], two["acts"]):
        if a is None:
            assert b is None
            continue
        assert set(a) == set(b) and "layers.1.z" in a
        for name in a:
            # TP sums o_proj and down_proj over devices: a float32 reassociation (1.5e-5
            # measured on values near 5), within the capture's 1e-4.
            np.testing.assert_allclose(np.array(b[name]), np.array(a[name]), atol=1e-4)
    z = np.array(two["acts"][2]["layers.0.z"])
    assert z.shape[1:] == (4, 32) and np.all(z[:, [1, 2]] == 0)
