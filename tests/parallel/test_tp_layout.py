"""The tensor-parallel layout (models/tp_layout.py) and the backend registry, exactly: which
checkpoint KV head each device keeps, the padded vocabulary, how checkpoint tensors are
rewritten, the errors that name both values, and the backends' answers about themselves."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.kernels import ATTENTION_BACKENDS, backends
from jaxllm.models.config import ModelConfig
from jaxllm.models.tp_layout import TensorParallelLayout


def _cfg(n, k, vocab=1000, mlp=1152, head_dim=4, **kw):
    return ModelConfig.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=8,
        intermediate_size=mlp, num_hidden_layers=1, num_attention_heads=n,
        num_key_value_heads=k, head_dim=head_dim, **kw))


@pytest.mark.parametrize("n,k,tp,heads", [
    (8, 2, 1, (0, 1)),
    (8, 2, 2, (0, 1)),                    # tp divides K: one head per device, no copy
    (8, 2, 4, (0, 0, 1, 1)),              # K divides tp: each head on tp / K devices
    (8, 2, 8, (0, 0, 0, 0, 1, 1, 1, 1)),
    (32, 8, 8, tuple(range(8))),          # Llama-3-8B at TP=8
    (9, 3, 3, (0, 1, 2)),                 # SmolLM2 at TP=3
    (9, 3, 9, (0, 0, 0, 1, 1, 1, 2, 2, 2)),
    (6, 3, 2, (0, 0, 1, 1, 2, 2)),        # neither divides: device 0 runs q heads 0-2
])                                        # (KV 0, 0, 1), device 1 q 3-5 (KV 1, 2, 2)
def test_kv_heads_each_device_keeps(n, k, tp, heads):
    layout = TensorParallelLayout.create(_cfg(n, k), tp)
    assert layout.kv_head_map == heads
    assert layout.model_config.num_key_value_heads == len(heads)
    # The kernels' rule on each device: local query head i reads local KV head i // g.
    per_dev, q_per_dev = len(heads) // tp, n // tp
    g = q_per_dev // per_dev
    for d in range(tp):
        for i in range(q_per_dev):
            assert heads[d * per_dev + i // g] == (d * q_per_dev + i) // (n // k)


def test_replication_is_described_with_its_cost():
    assert TensorParallelLayout.create(_cfg(8, 2), 2).describe_replication() is None
    text = TensorParallelLayout.create(_cfg(8, 2), 4).describe_replication()
    assert text == ("tensor_parallel_size=4 with 2 KV heads: each device keeps 1 KV head(s) "
                    "(checkpoint heads [0, 0, 1, 1] across devices), so the KV cache holds "
                    "2x the bytes per token of an unreplicated cache (2x fewer tokens fit "
                    "the same memory)")


@pytest.mark.parametrize("n,mlp,tp,message", [
    (9, 256, 2, "tensor_parallel_size=2 must divide the model's num_attention_heads=9 "
                r"\(each device runs whole query heads\); choose one of \[1, 3, 9\]"),
    (8, 100, 8, "tensor_parallel_size=8 must divide the model's intermediate_size=100 "
                r"\(each device runs whole MLP columns\); choose one of \[1, 2, 4\]"),
])
def test_sizes_that_do_not_split_name_both_values(n, mlp, tp, message):
    with pytest.raises(ValueError, match=message):
        TensorParallelLayout.create(_cfg(n, 1, mlp=mlp), tp)


def test_vocab_is_padded_to_a_multiple_of_tp():
    assert TensorParallelLayout.create(_cfg(8, 2, vocab=1001), 4).model_config.num_embeddings \
        == 1004
    cfg = TensorParallelLayout.create(_cfg(8, 2, vocab=1000), 4).model_config
    assert cfg.padded_vocab_size is None and cfg.num_embeddings == 1000


def test_checkpoint_tensors_are_rewritten_to_the_layout():
    layout = TensorParallelLayout.create(_cfg(8, 2, vocab=5, head_dim=2), 4)  # heads 0 0 1 1
    k = np.arange(2 * 2 * 8, dtype=np.float32).reshape(4, 8)  # [K * H, D]: head 0 rows 0-1
    bias = np.array([10, 11, 20, 21], np.float32)
    embed = np.ones((5, 8), np.float32)
    out = dict(layout.adapt([("model.layers.0.self_attn.k_proj.weight", k),
                             ("model.layers.0.self_attn.v_proj.bias", bias),
                             ("model.layers.0.self_attn.q_proj.weight", k),
                             ("model.embed_tokens.weight", embed)]))
    np.testing.assert_array_equal(out["model.layers.0.self_attn.k_proj.weight"],
                                  k[[0, 1, 0, 1, 2, 3, 2, 3]])
    np.testing.assert_array_equal(out["model.layers.0.self_attn.v_proj.bias"],
                                  [10, 11, 10, 11, 20, 21, 20, 21])
    assert out["model.layers.0.self_attn.q_proj.weight"] is k  # query heads are not touched
    np.testing.assert_array_equal(out["model.embed_tokens.weight"],
                                  np.concatenate([embed, np.zeros((3, 8), np.float32)]))


# ---- the backends ---------------------------------------------------------------------------

def test_registry_names_are_the_configurable_ones():
    assert tuple(backends.BACKENDS) == ATTENTION_BACKENDS


@pytest.mark.parametrize("name,platform,reason", [
    ("pallas", "cpu", "it runs on gpu, not cpu"),
    ("cpu", "gpu", "it runs on cpu, not gpu"),
])
def test_a_backend_that_cannot_run_here_is_a_value_error(name, platform, reason):
    with pytest.raises(ValueError, match=f'attention_backend="{name}" cannot run on platform '
                                         f'"{platform}": {reason}'):
        backends.select_backend(name, platform)


def test_unknown_backend():
    with pytest.raises(ValueError, match=r"attention_backend must be one of \('xla', 'cpu', "
                                         r"'pallas', 'pallas_interpret'\), got 'fast'"):
        backends.select_backend("fast", "cpu")


def test_defaults_and_storage():
    assert backends.select_backend(None, "gpu").name == "pallas"
    assert backends.select_backend(None, "cuda").name == "pallas"
    bf16 = np.dtype("bfloat16") if hasattr(np, "bfloat16") else backends.jnp.bfloat16
    assert backends.get_backend("cpu").kv_storage_dtype(bf16) == np.uint16
    assert backends.get_backend("xla").kv_storage_dtype(np.float32) == np.float32
    assert backends.get_backend("pallas").kv_storage_dtype(bf16) == bf16
    # Every backend has both attention options (test_attention_options.py: one that lacks
    # an option refuses it).
    assert all(b.supports_sliding_window and b.supports_logits_soft_cap
               for b in backends.BACKENDS.values())
