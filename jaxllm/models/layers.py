"""Small numerically explicit layers: RMSNorm, rotary embeddings, gated MLP, paged attention.

Letters: T tokens, D model dim, N query heads, K kv heads, H head dim, F mlp dim.
Norms and RoPE angles are computed in float32 whatever the parameter dtype: in bf16 the
variance of a 4k-wide row and angles at position ~8k lose too many bits, and HF does the same.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.models.base import AttentionMetadata
from jaxllm.models.config import ModelConfig, RopeScaling
from jaxllm.models.hooks import NO_HOOKS, StepHooks


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))  # [dim]
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        y = x32 * jax.lax.rsqrt(var + self.eps)
        # HF casts back to the input dtype before the weight multiply; match it bit for bit.
        return self.weight[...] * y.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """[H/2] float32 inverse frequencies, with llama3 scaling when configured."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32)
                           / head_dim))
    inv = inv.astype(np.float32)
    if scaling is None:
        return inv
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def apply_rope(x_TNH, positions_T, inv_freq):
    """Non-interleaved ("rotate half") RoPE as in HF Llama; math in float32."""
    angles_TF = positions_T.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    cos_T1H = jnp.concatenate([jnp.cos(angles_TF)] * 2, axis=-1)[:, None, :]
    sin_T1H = jnp.concatenate([jnp.sin(angles_TF)] * 2, axis=-1)[:, None, :]
    x32 = x_TNH.astype(jnp.float32)
    half = x32.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos_T1H + rotated * sin_T1H).astype(x_TNH.dtype)


class Linear(nnx.Linear):
    """nnx.Linear that accumulates in float32 and returns the compute dtype (as torch's bf16
    linear does). Why not a plain bf16 dot: XLA:CPU runs bf16 x bf16 -> bf16 by converting
    both operands to f32 first, every weight on every step (measured: 64 ms against 5 ms for
    60 576x1536 weights at 2 rows), while bf16 x bf16 -> f32 runs natively."""

    def __call__(self, x):
        return super().__call__(x).astype(self.dtype)


def _linear(din: int, dout: int, bias: bool, dtype, rngs: nnx.Rngs) -> Linear:
    return Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=dtype,
                  preferred_element_type=jnp.float32, rngs=rngs)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs,
                 intermediate_size: int | None = None):
        D, F = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.gate_proj = _linear(D, F, False, dtype, rngs)
        self.up_proj = _linear(D, F, False, dtype, rngs)
        self.down_proj = _linear(F, D, False, dtype, rngs)

    def __call__(self, x_TD, ops):
        """ops: models/parallel.py ParallelOps (down_proj's input is split over devices)."""
        h_TF = jax.nn.silu(ops.linear(self.gate_proj, x_TD)) * ops.linear(self.up_proj, x_TD)
        return ops.row_parallel(self.down_proj, h_TF)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        D, N, K, H = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                      cfg.head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = N, K, H
        self.q_proj = _linear(D, N * H, cfg.attention_bias, dtype, rngs)
        self.k_proj = _linear(D, K * H, cfg.attention_bias, dtype, rngs)
        self.v_proj = _linear(D, K * H, cfg.attention_bias, dtype, rngs)
        self.o_proj = _linear(N * H, D, cfg.o_proj_bias, dtype, rngs)
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm on q and k, before RoPE
            self.q_norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        # A tuple of floats: static (part of the graphdef), baked into the step as a constant.
        self.inv_freq = tuple(float(f) for f in rope_inv_freq(H, cfg.rope_theta, cfg.rope_scaling))
        self.sm_scale = 1.0 / math.sqrt(H)

    def project_qk(self, x_TD, positions_T, ops):
        """The queries [T, N, H] and keys [T, K, H] attention compares, RoPE applied (also
        what jaxllm.research.lens draws attention patterns from)."""
        T = x_TD.shape[0]
        q_TNH = ops.linear(self.q_proj, x_TD).reshape(T, self.num_heads, self.head_dim)
        k_TKH = ops.linear(self.k_proj, x_TD).reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_TNH, k_TKH = self.q_norm(q_TNH), self.k_norm(k_TKH)
        return (apply_rope(q_TNH, positions_T, self.inv_freq),
                apply_rope(k_TKH, positions_T, self.inv_freq))

    def __call__(self, x_TD, kv, md: AttentionMetadata, ops, hooks: StepHooks = NO_HOOKS,
                 layer: int = 0):
        """ops: models/parallel.py ParallelOps: its attention writes the new K/V, then
        attends; o_proj's input is split over devices. hooks: the step's features at the
        per-head sites q, k, v (as attention reads them) and z (its output per head)."""
        T = x_TD.shape[0]
        q_TNH, k_TKH = self.project_qk(x_TD, md.positions, ops)
        v_TKH = ops.linear(self.v_proj, x_TD).reshape(T, self.num_kv_heads, self.head_dim)
        q_TNH, k_TKH = hooks.at("q", layer, q_TNH), hooks.at("k", layer, k_TKH)
        v_TKH = hooks.at("v", layer, v_TKH)
        o_TNH, kv = ops.attention(q_TNH, k_TKH, v_TKH, kv, md, sm_scale=self.sm_scale)
        o_TNH = hooks.at("z", layer, o_TNH)
        return ops.row_parallel(self.o_proj, o_TNH.reshape(T, -1)), kv
