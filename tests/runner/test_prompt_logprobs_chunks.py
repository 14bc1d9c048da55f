"""Prompt logprobs in chunks of rows: the same numbers as all rows at once, bit for bit, with
temporaries that follow the chunk rather than T x V; and in the step, one program per bucket
that still skips the work when no row asks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.models.base import AttentionMetadata
from jaxllm.models.config import ModelConfig
from jaxllm.models.llama import LlamaForCausalLM, init_kv_caches
from jaxllm.models.parallel import ParallelOps
from jaxllm.runner.sampler import (chunked_prompt_logprobs, compute_prompt_logprobs,
                                   prompt_logprobs_chunk_rows)
from jaxllm.runner.sampling_metadata import dummy_sampling_metadata
from jaxllm.runner.step import BatchMetadata, make_step_fn


def _lm_head(vocab: int, dim: int, dtype):
    w_VD = jax.random.normal(jax.random.key(1), (vocab, dim), dtype)
    return lambda h_CD: jnp.einsum("cd,vd->cv", h_CD, w_VD, preferred_element_type=jnp.float32)


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("dtype,k", [(jnp.float32, 5), (jnp.bfloat16, 1000)],
                         ids=["f32-top5", "bf16-whole-vocab"])
def test_chunks_give_the_unchunked_result_exactly(dtype, k):
    T, D, V = 20, 64, 1000
    logits_fn = _lm_head(V, D, dtype)
    hidden_TD = jax.random.normal(jax.random.key(0), (T, D), dtype)
    targets_T = jax.random.randint(jax.random.key(2), (T,), 0, V, jnp.int32)
    whole = jax.jit(lambda h, t: compute_prompt_logprobs(logits_fn(h), t, k))(hidden_TD,
                                                                              targets_T)
    # Chunks that do not divide T (padding rows), and one larger than T (a single call).
    for rows in (8, 64):
        chunked = jax.jit(lambda h, t: chunked_prompt_logprobs(logits_fn, h, t, k, rows))(
            hidden_TD, targets_T)
        assert chunked.topk_token_ids.shape == (T, k)
        _assert_same(chunked, whole)


def test_chunk_rows_follow_the_vocabulary():
    assert prompt_logprobs_chunk_rows(128256) == 128  # Llama 3: 64 MiB / (4 B x 128256) = 130
    assert prompt_logprobs_chunk_rows(49152) == 256  # SmolLM2: 341
    assert prompt_logprobs_chunk_rows(1 << 30) == 8  # wider than a chunk: the fewest rows
    assert prompt_logprobs_chunk_rows(1000, chunk_bytes=4000 * 40) == 32
    with pytest.raises(ValueError, match="vocab_size"):
        prompt_logprobs_chunk_rows(0)
    for rows in (0, 4, 12):
        with pytest.raises(ValueError, match="chunk_rows must be a positive multiple of 8"):
            chunked_prompt_logprobs(_lm_head(8, 4, jnp.float32), jnp.zeros((4, 4)),
                                    jnp.zeros(4, jnp.int32), 2, rows)


def test_temporaries_follow_the_chunk_not_t_times_v():
    D, V, k, rows = 64, 32000, 20, 64
    logits_fn = _lm_head(V, D, jnp.float32)

    def temp(T, chunk):
        fn = jax.jit(lambda h, t: chunked_prompt_logprobs(logits_fn, h, t, k, chunk))
        return fn.lower(jax.ShapeDtypeStruct((T, D), jnp.float32),
                        jax.ShapeDtypeStruct((T,), jnp.int32)).compile(
        ).memory_analysis().temp_size_in_bytes

    logits_bytes = lambda T: T * V * 4  # noqa: E731
    for T in (1024, 4096):
        assert temp(T, T) >= logits_bytes(T)  # unchunked: at least the [T, V] logits
        # Chunked: a few [rows, V] blocks, whatever T (plus [T, D]-sized padding copies).
        assert temp(T, rows) <= 4 * logits_bytes(rows) + 2 * T * D * 4
    assert temp(4096, rows) - temp(1024, rows) <= 2 * (4096 - 1024) * D * 4


# ---- in the step --------------------------------------------------------------------

def _tiny_step_inputs(cfg: ModelConfig, T: int, S: int, W: int, wants: bool):
    """One prefill sequence of T tokens in blocks 1.., every row asking for its logprob."""
    bs = 16
    positions = np.arange(T, dtype=np.int32)
    block_tables = np.zeros((S, W), np.int32)
    block_tables[0, :-(-T // bs)] = np.arange(1, 1 + -(-T // bs))
    seq_lens = np.zeros(S, np.int32)
    seq_lens[0] = T
    qsl = np.full(S + 1, T, np.int32)
    qsl[0] = 0
    tokens = (np.arange(T, dtype=np.int32) * 7 + 3) % cfg.vocab_size
    md = AttentionMetadata(input_ids=tokens, positions=positions,
                           slot_mapping=block_tables[0, positions // bs] * bs + positions % bs,
                           block_tables=block_tables, seq_lens=seq_lens, query_start_loc=qsl,
                           num_seqs=np.int32(1))
    logits_indices = np.zeros(S, np.int32)
    logits_indices[0] = T - 1
    bm = BatchMetadata(slot_T=np.zeros(T, np.int32), from_device_T=np.zeros(T, bool),
                       logits_indices_S=logits_indices,
                       slot_S=np.array([0] + [S] * (S - 1), np.int32),
                       samples_S=np.arange(S) == 0,
                       prompt_targets_T=np.roll(tokens, -1),
                       wants_prompt_logprobs_T=np.full(T, wants))
    return md, bm, dummy_sampling_metadata(S, vocab_size=cfg.vocab_size)


def test_step_prompt_logprobs_in_chunks_match_and_stay_one_program():
    cfg = ModelConfig.from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64,
        intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256))
    graphdef, abstract_state = nnx.split(nnx.eval_shape(
        lambda: LlamaForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)  # numpy weights: no per-initializer compile
    state = jax.tree.map(lambda a: (0.1 * rng.standard_normal(a.shape)).astype(a.dtype),
                         abstract_state)
    T, S, W = 40, 4, 4
    outputs = {}
    for chunk in (None, 16):  # None: 32768 rows fit 64 MiB at V = 512, so all 40 at once
        step = make_step_fn(graphdef, ParallelOps.single_device("xla"),
                            prompt_logprobs_chunk=chunk)
        history = jnp.zeros((S, 64), jnp.int32)
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype),
                                (state, init_kv_caches(cfg, 8, 16, jnp.float32), history,
                                 *_tiny_step_inputs(cfg, T, S, W, True)))
        lowered = step.lower(*abstract)
        # [T, V] logits exist only in the unchunked program; the chunked one has [16, V].
        text = lowered.as_text()
        assert ("tensor<40x512xf32>" in text) == (chunk is None)
        assert ("tensor<16x512xf32>" in text) == (chunk == 16)
        compiled = lowered.compile()  # one program serves both batches
        for wants in (True, False):
            # Fresh cache and history: the step consumes (donates) them.
            out, _, _ = compiled(state, init_kv_caches(cfg, 8, 16, jnp.float32),
                                 jnp.zeros_like(history), *_tiny_step_inputs(cfg, T, S, W, wants))
            outputs[chunk, wants] = jax.device_get(out)
    _assert_same(outputs[16, True].prompt_logprobs, outputs[None, True].prompt_logprobs)
    assert np.asarray(outputs[16, True].prompt_logprobs.topk_logprobs).any()
    # No row asks: the cond's other branch, zeros.
    assert not np.asarray(outputs[16, False].prompt_logprobs.topk_logprobs).any()
    _assert_same(outputs[16, True].sampled_token_ids, outputs[None, True].sampled_token_ids)
