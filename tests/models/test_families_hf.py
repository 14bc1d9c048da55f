"""OPT, GPT-2 and Phi-3 against HF transformers (PyTorch CPU, float32), through the paged,
jitted step on test_parity_hf.py's schedule: a prefill step, a mixed step holding a second
prompt chunk over a cached first (chunked prefill), then decode steps, every row's logits
within 1e-4 of HF's. Each family's loading quirks are in its config: OPT's narrower word
embeddings (word_embed_proj_dim 32 against hidden 64, so project_in/out run) both pre- and
post-norm; GPT-2's Conv1D layout, fused c_attn and scale_attn_by_inverse_layer_idx; Phi-3's
fused qkv/gate_up, partial rotary, and LongRoPE's long factors with the attention factor; its
short factors (which vLLM's rule picks when max_model_len fits the original context) are
checked against HF's own tables, the arithmetic being the same. Half the cases run the "cpu" linear method (the engine's CPU
default at TP=1), half "xla". Greedy tokens through the engine at TP=2 are
tests/engine_e2e/test_e2e_families.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import hf_logits, hf_numpy_state, tiny_hf_model
from test_parity_hf import MAX_LEN, NUM_DECODE_STEPS, PROMPT_LENS, TOLERANCE, VOCAB, run_paged

from jaxllm.models.config import LongRopeScaling, ModelConfig
from jaxllm.models.registry import get_model_class
from jaxllm.models.weights import abstract_model, load_params

# One layer where the family's layers do not differ by index (compile time grows with layers;
# the per-layer cache loop is Llama's own); GPT-2's inverse-layer scaling needs two.
_OPT = dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=80, num_hidden_layers=1,
            num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
            pad_token_id=1, bos_token_id=2, eos_token_id=2)
_PHI3 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _longrope(original: int, partial: float = 0.75) -> dict:
    pairs = int(16 * partial) // 2  # head_dim 16
    return dict(original_max_position_embeddings=original, partial_rotary_factor=partial,
                rope_scaling=dict(type="longrope",
                                  short_factor=[1.0 + 0.3 * i for i in range(pairs)],
                                  long_factor=[1.5 + i for i in range(pairs)]))


# (name, config class, architecture, config, max_model_len told to the model or None, linear
# method: "cpu" is the C++ GEMM on packed weights, the engine's default on CPUs at TP=1)
CASES = [
    ("opt_pre_norm", "OPTConfig", "OPTForCausalLM", dict(_OPT, do_layer_norm_before=True),
     None, "xla"),
    ("opt_post_norm", "OPTConfig", "OPTForCausalLM", dict(_OPT, do_layer_norm_before=False),
     None, "cpu"),
    ("gpt2", "GPT2Config", "GPT2LMHeadModel",
     dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, n_inner=48,
          scale_attn_by_inverse_layer_idx=True, bos_token_id=0, eos_token_id=0), None, "cpu"),
    ("phi3", "Phi3Config", "Phi3ForCausalLM", _PHI3, None, "xla"),
    # Every sequence of the schedule is longer than 4 tokens: HF picks the long factors.
    ("phi3_longrope_long", "Phi3Config", "Phi3ForCausalLM", dict(_PHI3, **_longrope(4)), 256,
     "cpu"),
]


@pytest.mark.parametrize("name,config_cls,arch,kwargs,max_model_len,linear", CASES,
                         ids=[c[0] for c in CASES])
def test_logits_match_hf(name, config_cls, arch, kwargs, max_model_len, linear):
    hf = tiny_hf_model(config_cls, arch, seed=0, **kwargs)
    cfg = ModelConfig.from_hf_config(hf.config.to_dict())
    model = load_params(cfg, hf_numpy_state(hf).items(), jnp.float32)
    assert type(model) is get_model_class(cfg) and type(model).__name__ == arch
    if max_model_len is not None:
        model.configure_max_model_len(max_model_len)
        rope = model.model.layers[0].self_attn.rope
        assert rope.use_long and rope.mscale > 1 and MAX_LEN <= max_model_len

    rng = np.random.default_rng(1)
    tokens = [rng.integers(0, VOCAB, n + NUM_DECODE_STEPS).tolist() for n in PROMPT_LENS]
    refs = [hf_logits(hf, t) for t in tokens]
    assert min(float(np.std(r)) for r in refs) > 0.3, "degenerate reference logits"

    results = run_paged(model, cfg, tokens, block_size=4, seed=7, linear=linear)
    errors = []
    for logits, rows in results:
        assert np.isfinite(logits).all(), "NaN/inf in logits: a padding or unwritten slot leaked"
        errors.append(max(float(np.abs(logits[r] - refs[s][p]).max()) for s, p, r in rows))
    print(f"\n[parity] {name} ({linear}): prefill max abs err {errors[0]:.2e}, mixed chunked-prefill "
          f"step {errors[1]:.2e}, decode (8 steps) {max(errors[1:]):.2e}")
    assert max(errors) <= TOLERANCE, f"per-step errors {errors}"


def test_longrope_tables_and_the_choice_by_max_model_len():
    """Both factor sets and the attention factor equal HF's (its inv_freq within the original
    context, and beyond it); max_model_len above the original context takes the long ones."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = tiny_hf_model("Phi3Config", "Phi3ForCausalLM", seed=0, **dict(_PHI3, **_longrope(48)))
    cfg = ModelConfig.from_hf_config(hf.config.to_dict())
    model = abstract_model(cfg, jnp.float32)
    want_long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf.config, torch.device("cpu"), seq_len=49)
    rotary = hf.model.rotary_emb
    rope = model.model.layers[0].self_attn.rope
    # float32 tables; numpy's and torch's float32 pow may round one ulp apart.
    ulp = dict(rtol=2.5e-7, atol=0)
    np.testing.assert_allclose(rope.inv_freq, rotary.original_inv_freq.numpy(), **ulp)
    np.testing.assert_allclose(rope.long_inv_freq, want_long.numpy(), **ulp)
    assert not np.allclose(rope.inv_freq, rope.long_inv_freq, rtol=1e-3)
    assert rope.mscale == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert rope.use_long  # before the engine says otherwise: max_position_embeddings 256 > 48
    for max_model_len, long in ((48, False), (49, True)):
        model.configure_max_model_len(max_model_len)
        assert model.model.layers[0].self_attn.rope.use_long is long


def _phi3_dict(**rope_scaling) -> dict:
    return dict(architectures=["Phi3ForCausalLM"], vocab_size=96, hidden_size=64,
                intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=4096, original_max_position_embeddings=1024,
                rope_scaling=rope_scaling)


def test_longrope_config_as_phi3_checkpoints_spell_it():
    """Older Phi-3 config.json files say "su"; the attention factor defaults from
    max_position_embeddings / original length (4), or is taken as given."""
    cfg = ModelConfig.from_hf_config(_phi3_dict(type="su", short_factor=[1] * 8,
                                                long_factor=[2.0] * 8))
    assert cfg.rope_scaling == LongRopeScaling(
        (1.0,) * 8, (2.0,) * 8, 1024, float(np.sqrt(1 + np.log(4) / np.log(1024))))
    given = ModelConfig.from_hf_config(_phi3_dict(
        rope_type="longrope", short_factor=[1] * 8, long_factor=[2] * 8, attention_factor=1.25))
    assert given.rope_scaling.attention_factor == 1.25


@pytest.mark.parametrize("rope_scaling,match", [
    (dict(type="longrope", long_factor=[2.0] * 8), "longrope scaling needs 'short_factor'"),
    (dict(type="longrope", short_factor=[1.0] * 8, long_factor="2"),
     "longrope scaling needs 'long_factor'"),
    (dict(type="yarn", factor=4.0), "rope_scaling type 'yarn' is not supported"),
])
def test_bad_longrope_config_names_the_key(rope_scaling, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config(_phi3_dict(**rope_scaling))


def test_longrope_factor_count_must_match_the_rotated_dims():
    cfg = ModelConfig.from_hf_config(_phi3_dict(type="longrope", short_factor=[1.0] * 5,
                                                long_factor=[2.0] * 5))
    with pytest.raises(ValueError, match="longrope short_factor has 5 entries; the model "
                                         "rotates 16 dims per head, so it needs 8"):
        abstract_model(cfg, jnp.float32)


def test_unknown_activation_is_named():
    d = dict(architectures=["OPTForCausalLM"], vocab_size=96, hidden_size=64, ffn_dim=80,
             num_hidden_layers=1, num_attention_heads=4, activation_function="gelu_10")
    cfg = ModelConfig.from_hf_config(d)
    with pytest.raises(ValueError, match="hidden_act 'gelu_10' is not supported; supported: "):
        abstract_model(cfg, jnp.float32)
