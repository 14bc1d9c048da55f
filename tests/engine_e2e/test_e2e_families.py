"""OPT (post-norm, narrow word embeddings), GPT-2 and Phi-3 (LongRoPE, partial rotary) through
the engine at tensor_parallel_size=2 on two host CPU devices: greedy tokens identical to HF
transformers float32, with prompts split over steps (max_num_batched_tokens=16: chunked
prefill), then decode; and a second identical `generate` compiles nothing (the family's step
is not traced again).

The three engines share one subprocess (the device count is fixed when jax starts). Logits
parity per step at TP=1, for the "xla" and "cpu" linear methods, is
tests/models/test_families_hf.py.
"""

from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest
from host_devices import run_on_host_devices
from tiny_model import SMALL, build_tiny_hf_dir, hf_greedy

pytestmark = pytest.mark.slow

# With 16 tokens a step: [A5 B11] [A1 B10 C5] [A1 B1 C1] then decode rows of three, B and C
# each split over steps (chunked prefill); max_tokens end all three on the same step, so
# every step is a 16- or a 4-token bucket (fewer compiles).
PROMPT_LENS = (5, 21, 6)
MAX_TOKENS = (10, 9, 8)
VOCAB = 512  # the SmolLM2 tokenizer's first 512 ids: a small LM head keeps the test cheap
# No prefix caching: a repeated workload then runs the very same steps (with it, the repeat
# would hit the cache and ask for other buckets, as it should).
ENGINE = dict(SMALL, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
              enable_prefix_caching=False)

# One layer each (compile time grows with layers; what differs per layer is in the logits
# tests).
FAMILIES = {
    "opt": ("OPTConfig", "OPTForCausalLM", dict(
        hidden_size=64, ffn_dim=80, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, do_layer_norm_before=False)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=1, n_head=4,
                                                   n_positions=64)),
    # Every prompt is longer than the original 4 positions and max_model_len 64 > 4: the
    # long factors, in HF and in the engine alike.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=64, intermediate_size=80, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=4,
        pad_token_id=0,
        partial_rotary_factor=0.75,
        rope_scaling=dict(type="longrope", short_factor=[1.0 + 0.3 * i for i in range(6)],
                          long_factor=[1.5 + i for i in range(6)]))),
}


_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{tests!r}]
    import jax
    from engine_e2e.test_e2e_warmup import jax_compile_events
    from jaxllm import LLM, SamplingParams
    assert len(jax.devices()) == 2, jax.devices()
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in {max_tokens}]
    for name, (d, prompts) in json.loads(sys.argv[1]).items():
        llm = LLM(d, tensor_parallel_size=2, **{engine!r})
        inputs = [{{"prompt_token_ids": p}} for p in prompts]
        run = lambda: [o.outputs[0].token_ids for o in llm.generate(inputs, greedy,
                                                                     use_tqdm=False)]
        tokens = run()
        with jax_compile_events() as events:
            again = run()
        print(json.dumps(dict(name=name, tokens=tokens, again=again, compiles=dict(events),
                              steps=llm.llm_engine.runner.num_compiles)), flush=True)
        del llm
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer):
    """name -> (HF's greedy tokens, what the TP=2 engine printed)."""
    rng = np.random.default_rng(3)
    dirs, want = {}, {}
    for name, (config_cls, arch, config) in FAMILIES.items():
        d = str(tmp_path_factory.mktemp(name))
        hf = build_tiny_hf_dir(d, config_cls, arch, tokenizer, seed=1, vocab_size=VOCAB,
                               **config)
        prompts = [rng.integers(0, VOCAB, n).tolist() for n in PROMPT_LENS]
        dirs[name] = (d, prompts)
        want[name] = [hf_greedy(hf, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    tests = os.path.dirname(os.path.dirname(__file__))
    script = _SCRIPT.format(tests=tests, max_tokens=list(MAX_TOKENS), engine=ENGINE)
    proc = run_on_host_devices(["-c", script, json.dumps(dirs)], 2, timeout=900)
    got = {r["name"]: r for r in map(json.loads, (
        line for line in proc.stdout.splitlines() if line.startswith("{")))}
    return {name: (want[name], got.get(name)) for name in FAMILIES}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_tp2_greedy_tokens_match_hf(runs, name):
    want, got = runs[name]
    assert got is not None, f"the engine printed nothing for {name}"
    assert got["tokens"] == want


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_repeated_workload_compiles_nothing(runs, name):
    want, got = runs[name]
    assert got["again"] == want
    assert got["compiles"] == {}, f"JAX compiled on a repeated workload: {got['compiles']}"
