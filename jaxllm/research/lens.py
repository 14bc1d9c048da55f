"""Reading captured activations through the model's own weights: the logit lens and
attention patterns.

Owns `logit_lens(llm, hidden_PD)`: hidden states [P, D] (a layer's captured resid_post, or
final_norm with `final_norm=False`) -> float32 logits [P, V], and
`attention_pattern(llm, layer, resid_pre_PD)`: the layer's causal (and, with a sliding window,
windowed) attention probabilities [N, P, P] of a sequence whose positions 0..P-1 were all
captured at resid_pre. Both run the
engine's loaded weights as stored (the linear method's layout, split over the mesh under
tensor parallelism) through the model's own modules; one jitted program per padded row
count (powers of two), compiled on first use. Never touches the engine's KV cache or its
compiled steps. Imports jax, so the engine never imports it (jaxllm/research/__init__.py
does not).
"""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_FNS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # runner -> lens
_PATTERN_FNS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # runner -> {layer: fn}


def _lens_fn(runner):
    fn = _FNS.get(runner)
    if fn is None:
        graphdef, ops = runner.graphdef, runner.ops

        def lens(state, h_PD, final_norm: bool):
            model = nnx.merge(graphdef, state)
            if final_norm:
                h_PD = model.model.norm(h_PD)
            return model.compute_logits(h_PD, ops)

        fn = _FNS[runner] = jax.jit(lens, static_argnums=2)
    return fn


def _pattern_fn(runner, layer: int):
    fns = _PATTERN_FNS.setdefault(runner, {})
    fn = fns.get(layer)
    if fn is None:
        graphdef, ops = runner.graphdef, runner.ops

        def pattern(state, x_PD, valid_P):
            block = nnx.merge(graphdef, state).model.layers[layer]
            P = x_PD.shape[0]
            q_PNH, k_PKH = block.self_attn.project_qk(
                block.input_layernorm(x_PD), jnp.arange(P, dtype=jnp.int32), ops)
            group = q_PNH.shape[1] // k_PKH.shape[1]  # query heads per KV head
            k_PNH = jnp.repeat(k_PKH, group, axis=1)
            scores_NPP = jnp.einsum("qnh,knh->nqk", q_PNH.astype(jnp.float32),
                                    k_PNH.astype(jnp.float32)) * block.self_attn.sm_scale
            cap = block.self_attn.logits_soft_cap
            if cap is not None:  # Gemma 2: scores c * tanh(s / c), as the kernels do
                scores_NPP = cap * jnp.tanh(scores_NPP / cap)
            causal = jnp.tril(jnp.ones((P, P), bool)) & valid_P[None, :]
            window = block.self_attn.sliding_window
            if window is not None:  # keys (q - window, q] only
                causal &= jnp.triu(jnp.ones((P, P), bool), 1 - window)
            return jax.nn.softmax(jnp.where(causal, scores_NPP, -jnp.inf), axis=-1)

        fn = fns[layer] = jax.jit(pattern)
    return fn


def _padded_rows(runner, hidden_PD, name: str) -> tuple[jax.Array, int]:
    h = np.asarray(hidden_PD, np.float32)
    D = runner.model_config.hidden_size
    if h.ndim != 2 or h.shape[1] != D:
        raise ValueError(f"{name} must have shape [P, {D}] (the hidden size), got {h.shape}")
    P = h.shape[0]
    rows = np.zeros((max(1, 1 << (P - 1).bit_length()), D), np.float32)
    rows[:P] = h
    return jax.device_put(jnp.asarray(rows, runner.kv_dtype), runner.replicated), P


def attention_pattern(llm, layer: int, resid_pre_PD) -> np.ndarray:
    """[N, P, P] float32: row q of head n is how position q attends to positions 0..q, from
    `resid_pre_PD` [P, D], the layer's input captured at positions 0..P-1 of one sequence."""
    runner = llm.llm_engine.runner
    num_layers = runner.model_config.num_hidden_layers
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in [0, {num_layers}), got {layer}")
    x, P = _padded_rows(runner, resid_pre_PD, "resid_pre_PD")
    valid = np.arange(x.shape[0]) < P
    return np.asarray(_pattern_fn(runner, layer)(runner.state, x, valid))[:, :P, :P]


def logit_lens(llm, hidden_PD, *, final_norm: bool = True) -> np.ndarray:
    """[P, D] hidden states -> [P, V] float32 logits of `llm`'s model. final_norm: apply the
    model's last norm first (True for a layer's residual stream; False for values captured
    at the final_norm site, which already went through it)."""
    runner = llm.llm_engine.runner
    h, P = _padded_rows(runner, hidden_PD, "hidden_PD")
    return np.asarray(_lens_fn(runner)(runner.state, h, final_norm))[:P]
