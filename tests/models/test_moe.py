"""Mixtures of experts (models/moe.py, models/mixtral.py) against HF transformers, float32.

For Mixtral, Qwen3-MoE (a dense first layer by `mlp_only_layers`, norm_topk_prob) and
Qwen2-MoE (a sigmoid-gated shared expert, no renormalisation, k=3), tiny random models:
  * logits through the paged, jitted step within 1e-4 of HF over prefill, a chunked-prefill
    step and decode (test_parity_hf's schedule), for both linear methods' experts (XLA's
    block-sparse loop; "cpu": the C++ grouped GEMM, kernels/cpu_grouped_gemm.py);
  * greedy tokens identical to HF's `generate` through `jaxllm.LLM` (a 16-token budget, so
    the longer prompts are prefilled in chunks, then decode), with no compile on a second
    run over other tokens (other experts), and at TP=2 on host CPU devices (one subprocess
    for Mixtral and Qwen2-MoE), where the optimized HLO holds one all-reduce per layer's
    experts (the shared expert's included) and no collective shaped like an expert weight.
Routing ties: a token whose k-th and (k+1)-th router probabilities are closer than
ROUTER_MARGIN could pick different experts here and in HF for float-rounding reasons; the
router inputs of every reference run are recorded (forward hooks on HF's routers) and the
margin asserted, so the seeds below are known to route away from ties.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import hf_logits, hf_numpy_state, tiny_hf_model
from host_devices import run_on_host_devices
from test_parity_hf import NUM_DECODE_STEPS, PROMPT_LENS, VOCAB, run_paged

from jaxllm.kernels import cpu_gemm
from jaxllm.kernels.cpu_grouped_gemm import TARGET as GROUPED_GEMM
from jaxllm.kernels.linear_methods import get_linear_method
from jaxllm.models.config import ModelConfig
from jaxllm.models.moe import block_rows, expert_ffn, expert_ffn_reference
from jaxllm.models.weights import load_params

TOLERANCE = 1e-4
ROUTER_MARGIN = 1e-4
_COMMON = dict(num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-6,
               hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# family -> (HF config class, architecture, config, seed); the seeds route every token of
# both tests' inputs at least ROUTER_MARGIN away from a tie (asserted, see above).
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2), 0),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=48, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0]), 1),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(intermediate_size=48, moe_intermediate_size=32, num_experts=6,
                       num_experts_per_tok=3, norm_topk_prob=False,
                       shared_expert_intermediate_size=40), 3),
}
PROMPTS = [[100 + (7 * i) % 900 for i in range(n)] for n in (5, 23, 40)]
MAX_TOKENS = 8


def _min_router_margin(hf, runs) -> float:
    """Smallest gap between the k-th and (k+1)-th router probability over every token of
    every `runs` input at every sparse layer of HF model `hf`."""
    import torch

    k = hf.config.num_experts_per_tok
    logits = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: logits.append(out[0]))
             for name, m in hf.named_modules() if name.endswith("mlp.gate")]
    try:
        with torch.no_grad():
            for ids in runs:
                hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    assert logits, "no router ran"
    top = [torch.softmax(x.float(), -1).topk(k + 1, dim=-1).values for x in logits]
    return min(float((t[:, k - 1] - t[:, k]).min()) for t in top)


# The "cpu" linear method where its library runs (the CPU CI machine), else "xla" alone.
LINEARS = ["xla"] + (["cpu"] if jax.default_backend() == "cpu"
                     and cpu_gemm.availability(jnp.bfloat16) else [])


# "cpu" runs the same grouped-GEMM code for every family: Qwen3-MoE's differences from
# Mixtral (qk-norm, a dense layer) are outside the experts, and the engine test below runs all
# three families' experts through it (its default here) against HF's tokens.
@pytest.mark.parametrize("family, linear", [(f, "xla") for f in FAMILIES] + [
    (f, "cpu") for f in ("mixtral", "qwen2_moe") if "cpu" in LINEARS])
def test_logits_match_hf(family, linear):
    config_cls, arch, kwargs, seed = FAMILIES[family]
    hf = tiny_hf_model(config_cls, arch, seed=seed, vocab_size=VOCAB, **_COMMON, **kwargs)
    cfg = ModelConfig.from_hf_config(hf.config.to_dict())
    assert cfg.num_experts == kwargs.get("num_experts", kwargs.get("num_local_experts"))
    # The in-memory state of transformers >= 5: fused gate_up_proj / down_proj per layer.
    model = load_params(cfg, hf_numpy_state(hf).items(), jnp.float32)
    rng = np.random.default_rng(1)
    tokens = [rng.integers(0, VOCAB, n + NUM_DECODE_STEPS).tolist() for n in PROMPT_LENS]
    assert _min_router_margin(hf, tokens) > ROUTER_MARGIN
    refs = [hf_logits(hf, t) for t in tokens]
    errors = []
    for logits, rows in run_paged(model, cfg, tokens, block_size=4, seed=7, linear=linear):
        assert np.isfinite(logits).all()
        errors.append(max(float(np.abs(logits[r] - refs[s][p]).max()) for s, p, r in rows))
    print(f"\n[parity] {family} ({linear}): prefill {errors[0]:.2e}, chunked step {errors[1]:.2e}, "
          f"decode {max(errors[1:]):.2e}")
    assert max(errors) <= TOLERANCE, errors


@pytest.mark.parametrize("linear", LINEARS)
@pytest.mark.parametrize("T, skew", [(64, False), (64, True), (1, False)])
def test_expert_ffn_matches_all_experts_reference(T, skew, linear):
    """Each linear method's expert FFN (XLA's block-sparse loop, the grouped GEMM) against
    every-expert-on-every-token, E=8, k=2: random routing, every pair on one expert (one run
    of many blocks; six empty groups), and a single decode row."""
    E, K, D, F = 8, 2, 32, 24
    rng = np.random.default_rng(T + skew)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    w = jnp.asarray(rng.random((T, K)), jnp.float32)
    ids = np.stack([np.full(T, 5), np.full(T, 6)], 1) if skew else np.stack(
        [rng.permutation(E)[:K] for _ in range(T)])
    ws = [jnp.asarray(rng.standard_normal(s) * 0.2, jnp.float32)
          for s in ((E, D, 2, F), (E, F, D))]
    got = jax.jit(get_linear_method(linear).expert_ffn)(x, w, jnp.asarray(ids, jnp.int32), *ws)
    want = expert_ffn_reference(x, w, jnp.asarray(ids, jnp.int32), *ws)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_expert_ffn_never_multiplies_every_expert():
    """In the optimized HLO there are two dots, each of B = block_rows rows (a block of one
    expert: gate and up together, then down); none spans the E experts or all T*K pairs."""
    E, K, D, F, T = 8, 2, 32, 24, 64
    B = block_rows(T * K, E)
    args = (jnp.zeros((T, D)), jnp.zeros((T, K)), jnp.zeros((T, K), jnp.int32),
            jnp.zeros((E, D, 2, F)), jnp.zeros((E, F, D)))
    hlo = jax.jit(expert_ffn).lower(*args).compile().as_text()
    dots = [line.split("=")[1].split("dot(")[0].strip() for line in hlo.splitlines()
            if " dot(" in line]
    assert sorted(dots) == sorted([f"f32[{B},{2 * F}]{{1,0}}", f"f32[{B},{D}]{{1,0}}"])


@pytest.mark.skipif("cpu" not in LINEARS, reason="the cpu GEMM library cannot run here")
def test_grouped_experts_read_the_bf16_weights_in_place():
    """The "cpu" method's experts in bf16: the optimized HLO has two grouped-GEMM calls (gate
    and up, then down), each on the P = T*K pairs, and no dot and no f32 array as large as an
    expert stack (XLA's loop converted the whole stack to f32 every step)."""
    E, K, D, F, T = 8, 2, 64, 48, 64
    bf16 = jnp.bfloat16
    args = (jnp.zeros((T, D), bf16), jnp.zeros((T, K)), jnp.zeros((T, K), jnp.int32),
            jnp.zeros((E, D, 2, F), bf16), jnp.zeros((E, F, D), bf16))
    hlo = jax.jit(get_linear_method("cpu").expert_ffn).lower(*args).compile().as_text()
    calls = [line.split("=")[1].split("custom-call(")[0].strip() for line in hlo.splitlines()
             if f'custom_call_target="{GROUPED_GEMM}"' in line]
    assert sorted(calls) == sorted([f"bf16[{T * K},{2 * F}]{{1,0}}", f"bf16[{T * K},{D}]{{1,0}}"])
    assert " dot(" not in hlo
    stack = E * min(D * 2 * F, F * D)
    f32_sizes = [int(np.prod([int(d) for d in shape.split(",") if d]))
                 for shape in re.findall(r"f32\[([\d,]*)\]", hlo)]
    assert max(f32_sizes) < stack, max(f32_sizes)


def test_config_reads_each_family_and_rejects_bad_values():
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                num_attention_heads=4, moe_intermediate_size=16, num_experts_per_tok=2)
    # Qwen's config.json says num_experts, transformers >= 5 num_local_experts.
    for key in ("num_experts", "num_local_experts"):
        cfg = ModelConfig.from_hf_config(dict(base, architectures=["Qwen3MoeForCausalLM"],
                                              decoder_sparse_step=2, mlp_only_layers=[3],
                                              **{key: 8}))
        assert (cfg.num_experts, cfg.qk_norm, cfg.norm_topk_prob) == (8, True, False)
        assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    cfg = ModelConfig.from_hf_config(dict(base, architectures=["Qwen2MoeForCausalLM"],
                                          num_experts=4, shared_expert_intermediate_size=24))
    assert (cfg.attention_bias, cfg.o_proj_bias, cfg.shared_expert_intermediate_size) == (
        True, False, 24)
    cfg = ModelConfig.from_hf_config(dict(base, architectures=["MixtralForCausalLM"],
                                          num_local_experts=8))
    assert (cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.is_moe_layer(0)) == (
        48, True, True)
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, num_experts=4\]"):
        ModelConfig.from_hf_config(dict(base, architectures=["MixtralForCausalLM"],
                                        num_local_experts=4, num_experts_per_tok=5))
    with pytest.raises(ValueError, match="'mlp_only_layers' must be a list of layer indices"):
        ModelConfig.from_hf_config(dict(base, architectures=["Qwen3MoeForCausalLM"],
                                        num_experts=4, mlp_only_layers="0"))


def test_incomplete_expert_set_is_named():
    cfg = ModelConfig.from_hf_config(dict(
        architectures=["MixtralForCausalLM"], vocab_size=16, hidden_size=8,
        intermediate_size=4, num_hidden_layers=1, num_attention_heads=2,
        num_local_experts=2, num_experts_per_tok=1))
    p = "model.layers.0.block_sparse_moe.experts"
    tensors = [(f"{p}.0.w1.weight", np.zeros((4, 8), np.float32)),
               (f"{p}.0.w3.weight", np.zeros((4, 8), np.float32)),
               (f"{p}.0.w2.weight", np.zeros((8, 4), np.float32))]
    with pytest.raises(ValueError) as err:
        load_params(cfg, tensors, jnp.float32)
    msg = str(err.value)
    assert "missing tensors: " in msg and "model.layers.0.mlp.experts.gate_up_proj" in msg
    assert f"unexpected tensors: {p}.0.w1.weight, {p}.0.w2.weight, {p}.0.w3.weight" in msg


# ---- through the engine ------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dirs():
    """family -> (HF directory as save_pretrained writes it: per-expert tensors, HF's greedy
    tokens for PROMPTS)."""
    import torch
    from engine_e2e.tiny_model import smollm2_tokenizer

    tokenizer, root, out = smollm2_tokenizer(), tempfile.mkdtemp(), {}
    for family, (config_cls, arch, kwargs, seed) in FAMILIES.items():
        hf = tiny_hf_model(config_cls, arch, seed=seed, vocab_size=len(tokenizer), **_COMMON,
                           **kwargs)
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            want = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
        # Every token of the sequences both sides run (prompt + greedy continuation).
        assert _min_router_margin(hf, [p + w for p, w in zip(PROMPTS, want)]) > ROUTER_MARGIN
        path = os.path.join(root, family)
        hf.save_pretrained(path)
        tokenizer.save_pretrained(path)
        out[family] = (path, want)
    return out


ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
              kv_cache_memory_bytes=1 << 20, enforce_eager=True, use_tqdm_on_load=False,
              enable_prefix_caching=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_hf_through_engine(model_dirs, family):
    from engine_e2e.tiny_model import greedy, token_ids
    from jaxllm import LLM

    path, want = model_dirs[family]
    llm = LLM(path, **ENGINE)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    assert token_ids(llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)) == want
    # Other tokens, the same lengths (no prefix cache: the same batches and buckets), so
    # other experts: routing is data, never a shape, and compiles nothing.
    compiles = llm.llm_engine.runner.num_compiles
    other = [{"prompt_token_ids": [t + 1 for t in p]} for p in PROMPTS]
    llm.generate(other, greedy(MAX_TOKENS), use_tqdm=False)
    assert llm.llm_engine.runner.num_compiles == compiles, "a routing compiled a new shape"


_TP_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{tests!r}, {parallel!r}]
    from jaxllm import LLM, SamplingParams
    from jaxllm.models.weights import read_json
    from tp_facts import facts
    params = SamplingParams(temperature=0.0, max_tokens={max_tokens}, ignore_eos=True)
    for family, path in {paths!r}.items():
        llm = LLM(path, tensor_parallel_size=2, **{engine!r})
        outs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts!r}], params,
                            use_tqdm=False)
        case = dict(name=family, backend="xla", tp=2, T=16, S=4, W=16, num_blocks=16,
                    dtype="float32", config=read_json(path + "/config.json"))
        print(json.dumps(dict(facts(case), tokens=[list(o.outputs[0].token_ids)
                                                    for o in outs])), flush=True)
        del llm
""")


@pytest.fixture(scope="module")
def tp2(model_dirs):
    tests = os.path.dirname(os.path.dirname(__file__))
    script = _TP_SCRIPT.format(
        tests=tests, parallel=os.path.join(tests, "parallel"), max_tokens=MAX_TOKENS,
        paths={f: model_dirs[f][0] for f in TP_FAMILIES}, engine=ENGINE, prompts=PROMPTS)
    proc = run_on_host_devices(["-c", script], 2)
    found = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {f["case"]: f for f in found}


# Qwen3-MoE's experts run the same code at TP=2 as Mixtral's (its qk-norm is Qwen3's).
TP_FAMILIES = ("mixtral", "qwen2_moe")


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tp2_tokens_and_collectives(model_dirs, tp2, family):
    f, (_, want) = tp2[family], model_dirs[family]
    assert f["tokens"] == want
    T, D, L = 16, _COMMON["hidden_size"], _COMMON["num_hidden_layers"]
    # Per layer one [T, D] all-reduce after attention, one after the MLP or the experts
    # (Qwen2-MoE's shared expert's partial sum is added to the experts' before it: XLA
    # merges the two psums), plus the embedding lookup's.
    reduces = [c for c in f["collectives"] if c["op"] == "all-reduce"]
    assert [(c["shape"], c["in_entry"]) for c in reduces] == [([T, D], True)] * (2 * L + 1)
    assert {c["op"] for c in f["collectives"]} == {"all-reduce", "all-gather"}
    experts = [s for s in f["weight_shapes"] if len(s) == 3]
    assert experts and [c for c in f["collectives"] if c["shape"] in experts] == []
    assert not [c for c in f["collectives"] if c["op"] == "all-gather"
                and c["shape"][-1] != f["padded_vocab"]], "only logits are gathered"
