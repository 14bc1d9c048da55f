"""A row's forward pass gives the same bits whatever the other rows of the step: the
property greedy speculative decoding rests on (a verify step runs 1 + k rows of a sequence,
padded to 8; plain decoding runs its row alone, padded to 2; if the two disagree in a bit,
the greedy tokens can diverge, as the SmolLM2 repetitive benchmark's did at token 68).

  * models/row_reduce.py row_mean: the same row's mean has the same bits in operands of 1
    to 64 rows (jnp.mean's do not on CPU: XLA's reduce order changes at 8 rows), and equals
    the float64 mean to float32 rounding;
  * a tiny float32 Llama's, and a tiny Mixtral's (3 of 4 experts per token), whole step (the engine's CPU kernels: attention backend "cpu",
    the platform's preferred linear method): a row's final hidden state, and its logits, are
    bit-identical alone (T = 2), first of a 5-row verify group (T = 8), among other
    sequences' rows (T = 16) and after another's 60-token prefill chunk (T = 64), over a random cache of a few hundred keys (the lone row's keys
    are split over the attention pool's threads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.kernels import backends
from jaxllm.kernels.linear_methods import choose_linear_method
from jaxllm.models.base import AttentionMetadata
from jaxllm.models.config import ModelConfig
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.models.mixtral import MixtralForCausalLM
from jaxllm.models.parallel import ParallelOps
from jaxllm.models.row_reduce import row_mean
from platform_choice import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU platform's kernels")


def test_row_mean_bits_do_not_depend_on_the_row_count():
    rng = np.random.default_rng(0)
    f = jax.jit(row_mean)
    for D in (576, 100, 7):
        x = np.asarray(rng.standard_normal((64, D)) * 3, np.float32)
        ref = np.asarray(f(x[:1]))[0]
        for T in (2, 3, 5, 8, 16, 64):
            assert np.array_equal(np.asarray(f(x[:T]))[0], ref), (D, T)
        want = x.astype(np.float64).mean(-1, keepdims=True)
        np.testing.assert_allclose(np.asarray(f(x)), want, rtol=2e-6, atol=1e-7)


BS, MAX_BLOCKS = 16, 32
CFG = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=256,
           intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)


# A mixture of experts adds its own reductions: the router's top-k weights and the sum of
# the chosen experts' outputs (models/moe.py), over k = 3 of 4 experts here.
MOE_CFG = dict(CFG, architectures=["MixtralForCausalLM"], intermediate_size=128,
               num_local_experts=4, num_experts_per_tok=3)
MODELS = {"llama": (CFG, LlamaForCausalLM), "mixtral": (MOE_CFG, MixtralForCausalLM)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def forward(request):
    hf_cfg, model_cls = MODELS[request.param]
    cfg = ModelConfig.from_hf_config(hf_cfg)
    method, _ = choose_linear_method(None, jnp.float32)
    model = model_cls(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    model.process_weights_after_loading(method)
    graphdef, state = nnx.split(model)
    ops = ParallelOps(ParallelOps.single_device("cpu").attention, method)
    assert backends.get_backend("cpu") is not None

    @jax.jit
    def fwd(state, caches, md):
        model = nnx.merge(graphdef, state)
        h_TD, _ = model(md, caches, ops)
        return h_TD, model.compute_logits(h_TD, ops)

    rng = np.random.default_rng(1)
    num_blocks = 4 * MAX_BLOCKS + 1
    shape = (num_blocks, BS, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(jnp.asarray(rng.standard_normal(shape), jnp.float32),
               jnp.asarray(rng.standard_normal(shape), jnp.float32)) for _ in range(2)]
    return fwd, state, caches


def step(seqs, T):
    """seqs: (token ids, first position, sequence index 0..3) packed in order into T rows."""
    ids, pos, slots, qsl, lens = [], [], [], [0], []
    for toks, p0, s in seqs:
        table = 1 + s * MAX_BLOCKS + np.arange(MAX_BLOCKS)
        for j, t in enumerate(toks):
            ids.append(t)
            pos.append(p0 + j)
            slots.append(table[(p0 + j) // BS] * BS + (p0 + j) % BS)
        qsl.append(len(ids))
        lens.append(p0 + len(toks))
    pad = T - len(ids)
    tables = np.stack([1 + s * MAX_BLOCKS + np.arange(MAX_BLOCKS) for _, _, s in seqs])
    i32 = lambda a: jnp.asarray(np.asarray(a), jnp.int32)  # noqa: E731
    return AttentionMetadata(i32(ids + [0] * pad), i32(pos + [0] * pad),
                             i32(slots + list(range(pad))), i32(tables), i32(lens), i32(qsl),
                             i32(len(seqs)))


def test_a_rows_hidden_state_and_logits_do_not_depend_on_the_other_rows(forward):
    fwd, state, caches = forward
    rng = np.random.default_rng(2)
    for p in (150, 301, 433):
        tok = int(rng.integers(512))
        drafts = rng.integers(512, size=4).tolist()
        others = [(rng.integers(512, size=3).tolist(), 200 + 97 * s, s) for s in (1, 2, 3)]
        layouts = {"alone": ([([tok], p, 0)], 2),
                   "first of 5": ([([tok] + drafts, p, 0)], 8),
                   "among others": (others[:2] + [([tok], p, 0)] + others[2:], 16),
                   "after a prefill chunk": ([(rng.integers(512, size=60).tolist(), 200, 1),
                                              ([tok], p, 0)], 64)}
        got = {}
        for name, (seqs, T) in layouts.items():
            row = sum(len(t) for t, _, _ in seqs[:[s for _, _, s in seqs].index(0)])
            h_TD, logits_TV = fwd(state, caches, step(seqs, T))
            got[name] = (np.asarray(h_TD[row]), np.asarray(logits_TV[row]))
        for name, (h, logits) in got.items():
            assert np.isfinite(h).all()
            assert np.array_equal(h, got["alone"][0]), f"{name} at position {p}: hidden state"
            assert np.array_equal(logits, got["alone"][1]), f"{name} at position {p}: logits"
