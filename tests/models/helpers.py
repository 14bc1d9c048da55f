"""Test helpers: paged batches and the jitted model step, as the runner uses them.

Owns: turning per-sequence (new tokens, cached length, physical blocks) into one packed,
padded AttentionMetadata through the runner's own packer; a shuffled block pool so block
tables are non-contiguous and non-monotonic; NaN-filled KV caches (attention must never read
an unwritten slot); and a step jitted over (graphdef, state) with the caches donated. Tiny
random HF reference models come from `hf_random` (torch imported lazily). Never compares
numbers: the test modules own tolerances.

Packed layout, T = 16 rows, S = 4 sequences (2 real):

    rows:      | seq 0: 3 new | seq 1: 1 new | padding rows 4..15 (slot -> null block 0) |
    qsl:       0              3              4 = qsl[num_seqs] = qsl[2] = qsl[3] = qsl[4]
    seq_lens:  [cached0 + 3, cached1 + 1, 0, 0]
    positions: cached0, cached0 + 1, cached0 + 2, cached1, 0, 0, ...
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hf_random import tiny_hf_model  # noqa: F401  (re-exported for the model tests)
from jaxllm.messages import NewRequestData, SchedulerOutput
from jaxllm.models.base import AttentionMetadata, KVCache
from jaxllm.models.config import ModelConfig
from jaxllm.kernels.linear_methods import get_linear_method
from jaxllm.models.parallel import ParallelOps
from jaxllm.runner.buckets import BucketConfig
from jaxllm.runner.input_batch import InputBatch
from jaxllm.sampling_params import SamplingParams

NULL_BLOCK = 0

# The supported `model_type` values as the loader's errors list them, written out by hand:
# a new family must change this line (and the README's table) on purpose.
SUPPORTED_MODEL_TYPES = (
    "'gemma' (GemmaForCausalLM), 'gemma2' (Gemma2ForCausalLM), 'gemma3' (Gemma3ForCausalLM), "
    "'gemma3_text' (Gemma3ForCausalLM), "
    "'gpt2' (GPT2LMHeadModel), 'llama' (LlamaForCausalLM), 'mistral' (MistralForCausalLM), "
    "'mixtral' (MixtralForCausalLM), 'opt' (OPTForCausalLM), 'phi3' (Phi3ForCausalLM), "
    "'qwen2' (Qwen2ForCausalLM), 'qwen2_moe' (Qwen2MoeForCausalLM), 'qwen3' "
    "(Qwen3ForCausalLM), 'qwen3_moe' (Qwen3MoeForCausalLM)")


class ShuffledBlockPool:
    """Hands out physical blocks 1..num_blocks-1 in a seeded random order (0 is the null block)."""

    def __init__(self, num_blocks: int, seed: int):
        ids = np.arange(1, num_blocks)
        np.random.default_rng(seed).shuffle(ids)
        self._free = [int(i) for i in ids]

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("test block pool exhausted: raise num_blocks")
        return self._free.pop()


@dataclasses.dataclass
class PagedSequence:
    """One sequence's cache: its physical blocks and how many tokens they already hold."""

    block_ids: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0

    def reserve(self, num_tokens: int, pool: ShuffledBlockPool, block_size: int) -> None:
        """Allocate blocks until they cover `num_tokens` tokens in total."""
        while len(self.block_ids) * block_size < num_tokens:
            self.block_ids.append(pool.allocate())


def build_metadata(new_token_ids: Sequence[Sequence[int]], num_cached: Sequence[int],
                   block_ids: Sequence[Sequence[int]], *, block_size: int, max_blocks: int,
                   num_tokens_padded: int, num_seqs_padded: int) -> AttentionMetadata:
    """Pack sequences' new tokens into one [T] batch with T, S padded to the given buckets,
    through the runner's own packer (`InputBatch.prepare`).

    Sequence s feeds `new_token_ids[s]` at positions num_cached[s].., its K/V going to the
    slots of `block_ids[s]` (its logical-to-physical block table)."""
    S_real = len(new_token_ids)
    if not (len(num_cached) == len(block_ids) == S_real):
        raise ValueError("new_token_ids, num_cached and block_ids need one entry per sequence")
    for s, (tokens, cached, blocks) in enumerate(zip(new_token_ids, num_cached, block_ids)):
        if len(blocks) * block_size < cached + len(tokens) or len(blocks) > max_blocks:
            raise ValueError(f"seq {s}: {len(blocks)} blocks for {cached + len(tokens)} tokens "
                             f"(block_size {block_size}, max_blocks {max_blocks})")
        if NULL_BLOCK in blocks:
            raise ValueError(f"seq {s}: the null block {NULL_BLOCK} is not allocatable")
    params = SamplingParams(temperature=0.0, seed=0)
    # The cached tokens' ids are never read (their K/V is in the cache): zeros stand in.
    new = [NewRequestData(str(s), [0] * cached + list(tokens), [], params, list(blocks), cached)
           for s, (tokens, cached, blocks) in enumerate(zip(new_token_ids, num_cached,
                                                           block_ids))]
    num = {str(s): len(t) for s, t in enumerate(new_token_ids)}
    so = SchedulerOutput(new, [], num, sum(num.values()), set(), set())
    batch = InputBatch(max(num_seqs_padded, S_real), max_blocks * block_size, max_blocks,
                       block_size, eos_token_ids=[])
    batch.update_states(so)
    try:
        host = batch.prepare(so, BucketConfig((num_tokens_padded,), num_seqs_padded,
                                              (max_blocks,)))
    except (AssertionError, ValueError) as e:
        raise ValueError(f"{sum(num.values())} tokens / {S_real} seqs do not fit the bucket "
                         f"({num_tokens_padded}, {num_seqs_padded})") from e
    return jax.tree.map(jnp.asarray, AttentionMetadata(
        host.input_ids, host.positions, host.slot_mapping, batch.block_tables(host),
        host.seq_lens, host.query_start_loc, host.num_seqs))


def nan_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype) -> KVCache:
    """Caches whose every slot is NaN until written: a read of an unwritten slot shows up."""
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    return [(jnp.full(shape, jnp.nan, dtype), jnp.full(shape, jnp.nan, dtype))
            for _ in range(cfg.num_hidden_layers)]


@functools.partial(jax.jit, static_argnames=("graphdef", "attention_backend", "linear"),
                   donate_argnames=("kv_caches",))
def _step(graphdef, state, md, kv_caches, attention_backend: str, linear: str):
    ops = ParallelOps.single_device(attention_backend, linear)
    m = nnx.merge(graphdef, state)
    hidden_TD, kv_caches = m(md, kv_caches, ops)
    return m.compute_logits(hidden_TD, ops), kv_caches


def jit_step(model, attention_backend: str = "xla", linear: str = "xla"):
    """-> step(md, kv_caches) -> (logits [T, V] f32, kv_caches), jitted over
    (graphdef, state) with the caches donated, as the model runner does it. One jitted
    function for every model: a model of the same graph (architecture, config) and the same
    shapes reuses the compiled program. linear: the linear method
    (kernels/linear_methods.py); a copy of the model's weights goes through its
    process_weights_after_loading, `model` stays as it is."""
    if linear != "xla":
        model = nnx.clone(model)
        model.process_weights_after_loading(get_linear_method(linear))
    graphdef, state = nnx.split(model)
    return lambda md, kv_caches: _step(graphdef, state, md, kv_caches=kv_caches,
                                       attention_backend=attention_backend, linear=linear)


def prefill_logits(model, cfg: ModelConfig, token_ids: Sequence[int], *, block_size: int = 4,
                   dtype=jnp.float32, seed: int = 0) -> np.ndarray:
    """[len, V] logits of one sequence prefilled alone through the paged, jitted step
    (shuffled blocks, T padded to a multiple of 16, one padding sequence)."""
    n = len(token_ids)
    num_blocks = -(-n // block_size) + 2
    pool = ShuffledBlockPool(num_blocks, seed)
    seq = PagedSequence()
    seq.reserve(n, pool, block_size)
    md = build_metadata([token_ids], [0], [seq.block_ids], block_size=block_size,
                        max_blocks=num_blocks, num_tokens_padded=-(-n // 16) * 16 + 16,
                        num_seqs_padded=2)
    logits, _ = jit_step(model)(md, nan_kv_caches(cfg, num_blocks, block_size, dtype))
    return np.asarray(logits)[:n]


def greedy_tokens(model, cfg: ModelConfig, ids: Sequence[int], steps: int, block_size: int = 16,
                  linear: str = "xla", step=None) -> list[int]:
    """`steps` greedy tokens after `ids`: a prefill, then `steps - 1` single-token decode
    steps over the paged cache (shuffled blocks, NaN-filled). The first EOS id is masked, as
    HF's min_new_tokens does, so that all `steps` run. step: a `jit_step(model, ...)` to
    reuse (its compiled shapes) across calls."""
    num_blocks = 16
    pool = ShuffledBlockPool(num_blocks, seed=3)
    seq = PagedSequence()
    step = step or jit_step(model, linear=linear)
    kv = nan_kv_caches(cfg, num_blocks, block_size, jnp.float32)
    tokens, new, cached = list(ids), list(ids), 0
    for _ in range(steps):
        seq.reserve(cached + len(new), pool, block_size)
        md = build_metadata([new], [cached], [seq.block_ids], block_size=block_size,
                            max_blocks=num_blocks, num_tokens_padded=-(-len(new) // 16) * 16,
                            num_seqs_padded=2)
        logits, kv = step(md, kv)
        row = np.array(logits[len(new) - 1])
        row[cfg.eos_token_id[0]] = -np.inf  # as HF's min_new_tokens does: run all `steps`
        nxt = int(row.argmax())
        cached += len(new)
        tokens.append(nxt)
        new = [nxt]
    return tokens[len(ids):]


# ---- HF reference models (PyTorch CPU, float32) ---------------------------------------------

def hf_numpy_state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def hf_logits(model, token_ids: Sequence[int]) -> np.ndarray:
    """[len, V] float32 logits of one sequence alone, no cache."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].float().numpy()
