"""Tensor parallelism through jax sharding: every parameter has logical axes, and a model
loaded onto a 2-device mesh (two host CPU devices, in a subprocess) computes the same logits
as the unsharded one."""

from __future__ import annotations

import os
import textwrap

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec

from jaxllm.models.config import ModelConfig
from jaxllm.models.sharding import logical_axes, partition_spec
from jaxllm.models.weights import abstract_model
from flax import nnx

from host_devices import run_on_host_devices

CFG = dict(architectures=["Qwen2ForCausalLM"], vocab_size=128, hidden_size=64,
           intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


def test_every_parameter_has_logical_axes_of_its_rank():
    cfg = ModelConfig.from_hf_config(CFG)
    _, state = nnx.split(abstract_model(cfg, jnp.float32))
    for path, var in nnx.to_flat_state(state):
        assert len(logical_axes(path)) == len(var.get_value().shape), path


def test_megatron_layout():
    assert partition_spec(("model", "layers", 0, "self_attn", "q_proj", "kernel")) == \
        PartitionSpec(None, "tp")
    assert partition_spec(("model", "layers", 0, "self_attn", "o_proj", "kernel")) == \
        PartitionSpec("tp", None)
    assert partition_spec(("model", "layers", 1, "mlp", "down_proj", "kernel")) == \
        PartitionSpec("tp", None)
    assert partition_spec(("model", "embed_tokens", "embedding")) == PartitionSpec("tp", None)
    assert partition_spec(("model", "norm", "weight")) == PartitionSpec(None)
    with pytest.raises(KeyError, match="rotary"):
        logical_axes(("model", "rotary", "weight"))


_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, os, sys
    sys.path[:0] = [{helpers!r}, os.path.dirname({helpers!r})]
    from helpers import tiny_hf_model, hf_numpy_state, prefill_logits
    from jaxllm.models.config import ModelConfig
    from jaxllm.models.sharding import Placement, make_mesh
    from jaxllm.models.weights import load_params
    assert len(jax.devices()) == 2, jax.devices()
    hf = tiny_hf_model("Qwen2Config", "Qwen2ForCausalLM", 0, **{cfg!r})
    cfg = ModelConfig.from_hf_config(hf.config.to_dict())
    state = hf_numpy_state(hf)
    plain = load_params(cfg, state.items(), jnp.float32)
    sharded = load_params(cfg, state.items(), jnp.float32, Placement(make_mesh(2)))
    q = sharded.model.layers[0].self_attn.q_proj.kernel[...]
    assert len(q.sharding.device_set) == 2 and q.addressable_shards[0].data.shape == (64, 32)
    ids = [3, 17, 5, 99, 42, 7, 8, 64, 1]
    err = np.abs(prefill_logits(plain, cfg, ids) - prefill_logits(sharded, cfg, ids)).max()
    print("tp2 max abs err", err)
    assert err < 1e-5, err
""")


def test_tp2_logits_match_unsharded():
    cfg = {k: v for k, v in CFG.items() if k != "architectures"}
    script = _SCRIPT.format(helpers=os.path.dirname(__file__), cfg=cfg)
    proc = run_on_host_devices(["-c", script], 2, timeout=600)
    assert "tp2 max abs err" in proc.stdout
