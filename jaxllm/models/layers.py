"""Small numerically explicit layers: RMSNorm, LayerNorm, rotary and learned positions,
gated and plain MLPs, paged attention.

Letters: T tokens, D model dim, N query heads, K kv heads, H head dim, F mlp dim,
R rotated dims of a head (H unless partial_rotary_factor < 1).
Norms and RoPE angles are computed in float32 whatever the parameter dtype: in bf16 the
variance of a 4k-wide row and angles at position ~8k lose too many bits, and HF does the same.
A family picks its norm, positional scheme and activation by ModelConfig flags (`make_norm`,
`Rope.from_config`, `activation`), never by a copy of these layers.
Per-layer attention options (a sliding window, its own RoPE base, soft-capped scores) are read
from ModelConfig at construction (`ModelConfig.layer_*`), so a layer's step is static.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.models.base import AttentionMetadata
from jaxllm.models.config import LongRopeScaling, ModelConfig, RopeScaling
from jaxllm.models.hooks import NO_HOOKS, StepHooks
from jaxllm.models.row_reduce import row_mean


class RMSNorm(nnx.Module):
    """unit_offset: Gemma's norm, which scales by (1 + weight) (checkpoints store weight)."""

    def __init__(self, dim: int, eps: float, *, dtype, unit_offset: bool = False):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype) if unit_offset
                                else jnp.ones((dim,), dtype))  # [dim]
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        var = row_mean(x32 * x32)  # not jnp.mean: its bits depend on the row count
        y = x32 * jax.lax.rsqrt(var + self.eps)
        if self.unit_offset:
            # Gemma (HF): the scale multiply in float32 too, and only then the cast.
            return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        # HF casts back to the input dtype before the weight multiply; match it bit for bit.
        return self.weight[...] * y.astype(x.dtype)


class LayerNorm(nnx.Module):
    """torch.nn.LayerNorm (weight and bias), statistics in float32 (OPT, GPT-2)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))  # [dim]
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))  # [dim]
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = row_mean(x32)  # not jnp.mean: its bits depend on the row count
        var = row_mean(jnp.square(x32 - mean))
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32)
                + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def rms_norm(cfg: ModelConfig, dim: int, dtype) -> RMSNorm:
    """The family's RMSNorm over `dim` (Gemma's (1 + weight) when the config says so)."""
    return RMSNorm(dim, cfg.rms_norm_eps, dtype=dtype, unit_offset=cfg.rms_norm_unit_offset)


def make_norm(cfg: ModelConfig, dim: int, *, dtype):
    """The family's norm over `dim`: RMSNorm, or LayerNorm with bias (cfg.norm_type)."""
    if cfg.norm_type == "layer":
        return LayerNorm(dim, cfg.rms_norm_eps, dtype=dtype)
    return rms_norm(cfg, dim, dtype)


def _gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def _gelu_erf(x):
    return jax.nn.gelu(x, approximate=False)


# config.json `hidden_act` / `activation_function` -> function (HF's ACT2FN names).
ACTIVATIONS = {
    "silu": jax.nn.silu, "swish": jax.nn.silu, "relu": jax.nn.relu,
    "gelu": _gelu_erf, "gelu_new": _gelu_tanh, "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,  # Gemma's GeGLU: gelu_pytorch_tanh
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"hidden_act {name!r} is not supported; supported: "
                         f"{', '.join(sorted(ACTIVATIONS))}") from None


class LearnedPositionEmbedding(nnx.Module):
    """A learned table of positions (OPT, GPT-2): row `offset + p` for position p. OPT's
    checkpoints keep 2 unused rows first (a fairseq padding convention), so offset=2."""

    def __init__(self, num_positions: int, dim: int, offset: int, *, dtype):
        self.embedding = nnx.Param(jnp.zeros((num_positions + offset, dim), dtype))  # [P, D]
        self.offset = offset

    def __call__(self, positions_T):
        """[T] int -> [T, D]. Under TP the table is replicated (models/sharding.py)."""
        return jnp.take(self.embedding[...], positions_T + self.offset, axis=0)


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


def long_rope_inv_freq(rotary_dim: int, theta: float, factors) -> np.ndarray:
    """[R/2] float32 LongRoPE inverse frequencies: the plain ones divided by `factors`."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / rotary_dim
    return (1.0 / (np.asarray(factors, np.float32) * theta ** exponents)).astype(np.float32)


def apply_rope(x_TNH, positions_T, inv_freq, mscale: float = 1.0):
    """Non-interleaved ("rotate half") RoPE as in HF Llama on the first R = 2 * len(inv_freq)
    dims of each head (the rest pass through, partial_rotary_factor); cos and sin times
    `mscale` (LongRoPE's attention factor); math in float32."""
    angles_TF = positions_T.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    cos_T1R = jnp.concatenate([jnp.cos(angles_TF)] * 2, axis=-1)[:, None, :]
    sin_T1R = jnp.concatenate([jnp.sin(angles_TF)] * 2, axis=-1)[:, None, :]
    if mscale != 1.0:
        cos_T1R, sin_T1R = cos_T1R * mscale, sin_T1R * mscale
    x32 = x_TNH.astype(jnp.float32)
    R = cos_T1R.shape[-1]
    x_rot, x_pass = x32[..., :R], x32[..., R:]
    half = R // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = x_rot * cos_T1R + rotated * sin_T1R
    if x_pass.shape[-1]:
        out = jnp.concatenate([out, x_pass], axis=-1)
    return out.astype(x_TNH.dtype)


@dataclasses.dataclass(frozen=True)
class Rope:
    """A layer's rotary embedding, all static (hashable: part of the graphdef, baked into the
    step as constants). LongRoPE keeps both factor sets; which one runs is fixed per engine by
    the context length it serves, as vLLM does (`for_max_model_len`): switching per sequence
    would leave keys cached under the other factors."""

    inv_freq: tuple[float, ...]  # [R/2], the short factors' for LongRoPE
    long_inv_freq: tuple[float, ...] | None = None
    original_max_position_embeddings: int = 0
    mscale: float = 1.0
    use_long: bool = False

    @classmethod
    def from_config(cls, cfg: ModelConfig, layer: int = 0) -> "Rope":
        """Layer `layer`'s rotary embedding (Gemma 3's sliding layers have their own base)."""
        R = int(cfg.head_dim * cfg.partial_rotary_factor)
        theta, scaling = cfg.layer_rope(layer)
        if not isinstance(scaling, LongRopeScaling):
            return cls(tuple(float(f) for f in rope_inv_freq(R, theta, scaling)))
        for name in ("short_factor", "long_factor"):
            if len(getattr(scaling, name)) != R // 2:
                raise ValueError(f"longrope {name} has {len(getattr(scaling, name))} entries; "
                                 f"the model rotates {R} dims per head, so it needs {R // 2}")
        short, long = (tuple(float(f) for f in long_rope_inv_freq(R, theta, fs))
                       for fs in (scaling.short_factor, scaling.long_factor))
        original = scaling.original_max_position_embeddings
        return cls(short, long, original, scaling.attention_factor,
                   use_long=cfg.max_position_embeddings > original)

    def for_max_model_len(self, max_model_len: int) -> "Rope":
        if self.long_inv_freq is None:
            return self
        return dataclasses.replace(
            self, use_long=max_model_len > self.original_max_position_embeddings)

    def __call__(self, x_TNH, positions_T):
        inv_freq = self.long_inv_freq if self.use_long else self.inv_freq
        return apply_rope(x_TNH, positions_T, inv_freq, self.mscale)


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


class DenseMLP(nnx.Module):
    """fc1 -> activation -> fc2, with biases when cfg.mlp_bias (OPT, GPT-2)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        D, F = cfg.hidden_size, cfg.intermediate_size
        self.fc1 = _linear(D, F, cfg.mlp_bias, dtype, rngs)
        self.fc2 = _linear(F, D, cfg.mlp_bias, dtype, rngs)
        self.act = activation(cfg.hidden_act)

    def __call__(self, x_TD, ops):
        return ops.row_parallel(self.fc2, self.act(ops.linear(self.fc1, x_TD)))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs,
                 intermediate_size: int | None = None):
        D, F = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        self.gate_proj = _linear(D, F, False, dtype, rngs)
        self.up_proj = _linear(D, F, False, dtype, rngs)
        self.down_proj = _linear(F, D, False, dtype, rngs)
        self.act = activation(cfg.hidden_act)

    def __call__(self, x_TD, ops):
        """ops: models/parallel.py ParallelOps (down_proj's input is split over devices)."""
        h_TF = self.act(ops.linear(self.gate_proj, x_TD)) * ops.linear(self.up_proj, x_TD)
        return ops.row_parallel(self.down_proj, h_TF)


class Attention(nnx.Module):
    """layer: the layer's index, for its per-layer options (window, RoPE base, GPT-2's
    inverse-layer scale)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, layer: int = 0):
        D, N, K, H = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                      cfg.head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = N, K, H
        self.q_proj = _linear(D, N * H, cfg.attention_bias, dtype, rngs)
        self.k_proj = _linear(D, K * H, cfg.attention_bias, dtype, rngs)
        self.v_proj = _linear(D, K * H, cfg.attention_bias, dtype, rngs)
        self.o_proj = _linear(N * H, D, cfg.o_proj_bias, dtype, rngs)
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm on q and k, before RoPE
            self.q_norm = rms_norm(cfg, H, dtype)
            self.k_norm = rms_norm(cfg, H, dtype)
        else:
            self.q_norm = self.k_norm = None
        # None: learned positions, added to the embeddings instead (OPT, GPT-2).
        self.rope = (Rope.from_config(cfg, layer) if cfg.position_embedding == "rope"
                     else None)
        # OPT multiplies q by H**-0.5 before the product; the same scale here (as vLLM).
        # Gemma 2/3 scale scores by query_pre_attn_scalar ** -0.5 (head_dim by default).
        self.sm_scale = (1.0 / math.sqrt(cfg.query_pre_attn_scalar or H)
                         if cfg.attn_scale_by_head_dim else 1.0)
        if cfg.attn_scale_by_inverse_layer_idx:
            self.sm_scale /= layer + 1
        # The attention options (kernels/backends.py); static: part of the graphdef.
        self.sliding_window = cfg.layer_sliding_window(layer)
        self.logits_soft_cap = cfg.attn_logit_softcapping

    def project_qk(self, x_TD, positions_T, ops):
        """The queries [T, N, H] and keys [T, K, H] attention compares, RoPE applied (also
        what jaxllm.research.lens draws attention patterns from)."""
        T = x_TD.shape[0]
        q_TNH = ops.linear(self.q_proj, x_TD).reshape(T, self.num_heads, self.head_dim)
        k_TKH = ops.linear(self.k_proj, x_TD).reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_TNH, k_TKH = self.q_norm(q_TNH), self.k_norm(k_TKH)
        if self.rope is None:
            return q_TNH, k_TKH
        return self.rope(q_TNH, positions_T), self.rope(k_TKH, positions_T)

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
        o_TNH, kv = ops.attention(q_TNH, k_TKH, v_TKH, kv, md, sm_scale=self.sm_scale,
                                  sliding_window=self.sliding_window,
                                  logits_soft_cap=self.logits_soft_cap)
        o_TNH = hooks.at("z", layer, o_TNH)
        return ops.row_parallel(self.o_proj, o_TNH.reshape(T, -1)), kv
