"""Gemma, Gemma 2 and Gemma 3 through the engine: greedy tokens identical to HF transformers
(float32) at TP=2, with chunked prefill and a sliding window shorter than the prompts (TP=1
through the paged step: test_parity_hf.py; an engine start costs seconds on two cores).

The tiny random models of test_parity_hf.py's Gemma cases (SmolLM2's vocabulary, so that
LLM(dir) has a tokenizer) are written as HF directories here; one subprocess on two host CPU
devices runs an engine per family (max_num_batched_tokens=16: prompts of 23 and
30 tokens prefill in chunks), with the CPU defaults: the C++ attention kernel (window and
soft-cap, under shard_map) and the C++ GEMM. A second identical `generate` compiles nothing
(no tracing, lowering or XLA compile at all: the families' warm-up check of
tests/engine_e2e/test_e2e_families.py; no prefix caching, so the repeat runs the very same
steps).
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from host_devices import run_on_host_devices
from test_parity_hf import _COMMON, CASES

pytestmark = pytest.mark.slow

PROMPT_LENS = (5, 23, 30)
MAX_TOKENS = 8
GEMMA_CASES = [c for c in CASES if c.arch.startswith("Gemma")]

_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    from engine_e2e.test_e2e_warmup import jax_compile_events
    from jaxllm import LLM, SamplingParams
    assert len(jax.devices()) == 2, jax.devices()
    prompts = [{{"prompt_token_ids": ids}} for ids in {prompts!r}]
    greedy = SamplingParams(temperature=0.0, max_tokens={max_tokens}, ignore_eos=True)
    for name, d in {dirs!r}:
        llm = LLM(d, tensor_parallel_size=2, dtype="float32",
                  max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                  enforce_eager=True, use_tqdm_on_load=False, enable_prefix_caching=False)
        run = lambda: [list(o.outputs[0].token_ids)
                       for o in llm.generate(prompts, greedy, use_tqdm=False)]
        tokens = run()
        compiled = llm.llm_engine.runner.num_compiles
        with jax_compile_events() as events:
            again = run()
        print(json.dumps(dict(name=name, tokens=tokens, again=again, compiles=dict(events),
                              new_steps=llm.llm_engine.runner.num_compiles - compiled)),
              flush=True)
        del llm
""")


def _write_dir(case, out_dir: str, tokenizer):
    """The tiny HF model of `case` with SmolLM2's vocabulary, saved as an HF directory."""
    from hf_random import tiny_hf_model
    from jaxllm.models.safetensors_io import save_file

    kwargs = {**_COMMON, **case.kwargs, "vocab_size": len(tokenizer)}
    model = tiny_hf_model(case.config_cls, case.arch, 0, **kwargs)
    os.makedirs(out_dir)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(model.config.to_dict(), f)
    tokenizer.save_pretrained(out_dir)
    return model


def _hf_greedy(model, ids):
    import torch

    model.generation_config.eos_token_id = None  # run all MAX_TOKENS, as ignore_eos does
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                             dtype=torch.long), do_sample=False, max_new_tokens=MAX_TOKENS,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import numpy as np
    from engine_e2e.tiny_model import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(100, len(tokenizer) - 100, n).tolist() for n in PROMPT_LENS]
    root = tmp_path_factory.mktemp("gemma_engine")
    refs, dirs = {}, []
    for case in GEMMA_CASES:
        d = str(root / case.name)
        model = _write_dir(case, d, tokenizer)
        refs[case.name] = [_hf_greedy(model, ids) for ids in prompts]
        dirs.append((case.name, d))
    tests = os.path.dirname(os.path.dirname(__file__))
    script = _SCRIPT.format(prompts=prompts, max_tokens=MAX_TOKENS, dirs=dirs)
    proc = run_on_host_devices(["-c", f"import sys; sys.path[:0] = [{tests!r}]\n" + script],
                               2, timeout=1200)
    found = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return refs, {r["name"]: r for r in found}


@pytest.mark.parametrize("name", [c.name for c in GEMMA_CASES])
def test_greedy_tokens_match_hf_at_tp2(runs, name):
    refs, ours = runs
    assert ours[name]["tokens"] == refs[name]


@pytest.mark.parametrize("name", [c.name for c in GEMMA_CASES])
def test_repeated_workload_compiles_nothing(runs, name):
    refs, ours = runs
    assert ours[name]["again"] == refs[name]
    assert ours[name]["new_steps"] == 0, "the runner compiled a step on a repeated workload"
    assert ours[name]["compiles"] == {}, f"JAX compiled on a repeated workload: " \
                                         f"{ours[name]['compiles']}"
