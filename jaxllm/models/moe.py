"""Mixture-of-experts feed-forward block: top-k routing and the experts' grouped GEMMs.

Owns: the router (softmax over experts in float32, top k, optional renormalisation over the
chosen k), the expert FFN over (token, expert) pairs sorted by expert in two forms (XLA's
block-sparse `expert_ffn`, and `expert_ffn_grouped` over a grouped GEMM kernel such as
kernels/cpu_grouped_gemm.py; the linear method picks one, kernels/linear_methods.py), their
all-experts reference `expert_ffn_reference` (tests only), and `SparseMoeBlock`, the layer
Mixtral, Qwen2-MoE (with its sigmoid-gated shared expert) and Qwen3-MoE configure with
ModelConfig flags. Must never compute every expert on every token in the step (that is E/k
times the work; only the reference does it).

Letters: T tokens, D model dim, E experts, K experts per token (top k), F expert width,
P = T*K (token, expert) pairs, B rows per block, R = rows of the block layout; "2" in a
shape is the (gate, up) pair, stored side by side so one product gives both.

Why not `jax.lax.ragged_dot`: XLA:CPU (jaxlib 0.10) lowers it to a dense product against
all E experts under a mask (measured: 3.6 ms against 0.43 ms for the dense equivalent at
P=128, E=8, D=256, F=512): E/k times the work. Instead the pairs are sorted by expert and
each expert's run is padded to a multiple of B rows, so every block of B rows belongs to one
expert; one while loop runs only the blocks in use (a dynamic trip count), each a [B, D]
SwiGLU FFN against its expert's weights:

    pairs sorted by expert:   e0 e0 e0 | e1 | e3 e3 e3 e3 e3          (P = 9)
    block layout (B = 4):     e0 e0 e0 -- | e1 -- -- -- | e3 e3 e3 e3 | e3 -- -- --
                              block 0        block 1       block 2       block 3

The padding rows ("--", a zero row) cost at most E*B extra rows; B is chosen per bucket as
the power of two at or below P/E (between 8 and 64), so once P/E >= 8 the rows multiplied
are at most about twice the active ones, never E/k times. In smaller batches the blocks are
mostly padding rows, but such a step is bound by reading weights, and only the chosen
experts' weights are read. Measured (fastest of repeats, on a loaded 2-core machine) at
P=128, E=8, D=256, F=512: 2.7 ms against 1.6 ms for the dense equivalent's MLP (gate and up
as two products: 3.0 ms); gathering each block's expert weights into one batched product
was 3-10x slower (a copy of the weights per block); an unrolled loop over experts was no
faster, and its program grows with E.

Why `expert_ffn_grouped` on CPU (the "cpu" linear method): in bf16, XLA:CPU converts the
whole expert stack [E, D, 2, F] to f32 on every step, because each block's dot takes a
weight slice chosen at run time (the moe_step.py ratio to the dense equivalent was 2.25x in
bf16 against 1.27x in f32). The C++ grouped GEMM reads each chosen expert's [K, N] weight in
place, bf16 x bf16 with f32 accumulation, over the pairs sorted by expert without padding
rows (a group per expert, however uneven). Measured (moe_step.py --linear cpu, five runs on
the 2-core machine at load average 10-14): bf16 ratio 1.15-1.56, median 1.25, where XLA's
loop in the same rounds was 2.9-3.5; f32 1.10-1.37 (XLA's loop 0.9-1.5).

Under tensor parallelism each expert's FFN is split like a dense MLP (gate/up by columns of
F, down by rows): `ParallelOps.moe_experts` runs the linear method's expert FFN per shard on
F/tp columns and one all-reduce sums the [T, D] outputs. The linear method under a mesh is
"xla" (kernels/linear_methods.py), so a TP step runs `expert_ffn`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.models.config import ModelConfig
from jaxllm.models.layers import MLP, _linear


def route(router_logits_TE, top_k: int, renormalize: bool):
    """-> (weights [T, K] float32, expert ids [T, K] int32): softmax in float32 over the
    experts (as HF), the k largest, rescaled to sum to 1 when `renormalize`."""
    probs_TE = jax.nn.softmax(router_logits_TE.astype(jnp.float32), axis=-1)
    weights_TK, ids_TK = jax.lax.top_k(probs_TE, top_k)
    if renormalize:
        weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
    return weights_TK, ids_TK.astype(jnp.int32)


def block_rows(num_pairs: int, num_experts: int) -> int:
    """B: the power of two at or below the mean pairs per expert, within [8, 64] (static)."""
    mean = max(num_pairs // num_experts, 1)
    return max(8, min(64, 1 << (mean.bit_length() - 1)))


def _block_layout(ids_P, num_experts: int, B: int):
    """Where each pair goes in the block layout (see the module docstring).

    -> (row_P [P]: the row of the i-th pair in expert order; order_P [P]: the pairs in
        expert order; padded_end_E [E]: the end row of each expert's blocks; R: rows)."""
    P = ids_P.shape[0]
    R = (P // B + num_experts) * B  # sum over e of ceil(n_e / B) * B <= P + E*B
    order_P = jnp.argsort(ids_P, stable=True)  # pair indices sorted by expert
    sorted_ids_P = ids_P[order_P]
    count_E = jnp.bincount(ids_P, length=num_experts)
    padded_E = -(-count_E // B) * B
    start_E = jnp.cumsum(count_E) - count_E  # first sorted pair of each expert
    padded_end_E = jnp.cumsum(padded_E)
    row_start_E = padded_end_E - padded_E  # first row of each expert's blocks
    row_P = row_start_E[sorted_ids_P] + jnp.arange(P) - start_E[sorted_ids_P]  # sorted order
    return row_P, order_P, padded_end_E, R


def expert_ffn(x_TD, weights_TK, ids_TK, w_gate_up_ED2F, w_down_EFD):
    """sum_k weights[t, k] * FFN_{ids[t, k]}(x[t]) -> [T, D] float32, where FFN_e(x) =
    (silu(x W_gate[e]) * (x W_up[e])) W_down[e] (W_gate[e] = w_gate_up[e, :, 0]), each
    product accumulated in float32 and rounded to x's dtype (as a Linear layer). Only the
    (token, expert) pairs chosen run."""
    T, D = x_TD.shape
    K = ids_TK.shape[1]
    E = w_gate_up_ED2F.shape[0]
    B = block_rows(T * K, E)
    row_P, order_P, padded_end_E, R = _block_layout(ids_TK.reshape(-1), E, B)
    row_token_R = jnp.full((R,), T, jnp.int32).at[row_P].set(order_P // K)
    pair_row_P = jnp.zeros_like(row_P).at[order_P].set(row_P)
    block_expert = jnp.minimum(
        jnp.searchsorted(padded_end_E, jnp.arange(R // B) * B, side="right"), E - 1)
    x_RD = jnp.concatenate([x_TD, jnp.zeros((1, D), x_TD.dtype)])[row_token_R]

    def dot(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(x_TD.dtype)

    def block(b, y_RD):
        x_BD = jax.lax.dynamic_slice_in_dim(x_RD, b * B, B)
        e = block_expert[b]
        gu_B2F = dot(x_BD, w_gate_up_ED2F[e].reshape(D, -1)).reshape(B, 2, -1)
        h_BF = jax.nn.silu(gu_B2F[:, 0]) * gu_B2F[:, 1]
        return jax.lax.dynamic_update_slice_in_dim(y_RD, dot(h_BF, w_down_EFD[e]), b * B, 0)

    y_RD = jax.lax.fori_loop(0, padded_end_E[-1] // B, block,
                             jnp.zeros((R, D), x_TD.dtype))
    y_TKD = y_RD[pair_row_P].reshape(T, K, D).astype(jnp.float32)
    return jnp.sum(y_TKD * weights_TK.astype(jnp.float32)[:, :, None], axis=1)


def expert_ffn_grouped(x_TD, weights_TK, ids_TK, w_gate_up_ED2F, w_down_EFD, grouped_gemm):
    """`expert_ffn` over `grouped_gemm(x [M, K], w [E, K, N], group_end [E] int32, out_dtype)
    -> [M, N]` (kernels/cpu_grouped_gemm.py's contract): the P = T*K pairs sorted by expert,
    one group per expert (no padding rows); gate and up in one product, then down."""
    T, D = x_TD.shape
    K = ids_TK.shape[1]
    E, F = w_gate_up_ED2F.shape[0], w_gate_up_ED2F.shape[3]
    ids_P = ids_TK.reshape(-1)
    order_P = jnp.argsort(ids_P, stable=True)  # pair indices sorted by expert
    group_end_E = jnp.cumsum(jnp.bincount(ids_P, length=E)).astype(jnp.int32)
    x_PD = x_TD[order_P // K]
    gu_P2F = grouped_gemm(x_PD, w_gate_up_ED2F.reshape(E, D, 2 * F), group_end_E,
                          x_TD.dtype).reshape(-1, 2, F)
    h_PF = jax.nn.silu(gu_P2F[:, 0]) * gu_P2F[:, 1]
    y_PD = grouped_gemm(h_PF, w_down_EFD, group_end_E, x_TD.dtype)
    sorted_row_P = jnp.zeros_like(order_P).at[order_P].set(jnp.arange(order_P.shape[0]))
    y_TKD = y_PD[sorted_row_P].reshape(T, K, D).astype(jnp.float32)
    return jnp.sum(y_TKD * weights_TK.astype(jnp.float32)[:, :, None], axis=1)


def expert_ffn_reference(x_TD, weights_TK, ids_TK, w_gate_up_ED2F, w_down_EFD):
    """`expert_ffn` computed densely: every expert on every token, then the chosen k picked
    (E/k times the work; tests only)."""
    def dot(spec, a, b):
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(x_TD.dtype)

    h_TEF = (jax.nn.silu(dot("td,edf->tef", x_TD, w_gate_up_ED2F[:, :, 0]))
             * dot("td,edf->tef", x_TD, w_gate_up_ED2F[:, :, 1]))
    y_TED = dot("tef,efd->ted", h_TEF, w_down_EFD)
    y_TKD = jnp.take_along_axis(y_TED, ids_TK[:, :, None], axis=1).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", y_TKD, weights_TK.astype(jnp.float32))


class Experts(nnx.Module):
    """E SwiGLU FFNs stacked: gate_up_proj [E, D, 2, F] (gate, then up), down_proj
    [E, F, D] (the checkpoint's per-expert [out, in] tensors stacked and transposed by the
    family's adapt_checkpoint). Under TP both split along F (gate and up alike)."""

    def __init__(self, num_experts: int, D: int, F: int, *, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (num_experts, D, 2, F), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (num_experts, F, D), dtype))


class SparseMoeBlock(nnx.Module):
    """Router (`gate`, D -> E), experts, and, for Qwen2-MoE, a shared expert always on,
    scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        D, E = cfg.hidden_size, cfg.num_experts
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = _linear(D, E, False, dtype, rngs)
        self.experts = Experts(E, D, cfg.moe_intermediate_size, dtype=dtype, rngs=rngs)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, dtype=dtype, rngs=rngs,
                                     intermediate_size=cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = _linear(D, 1, False, dtype, rngs)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def __call__(self, x_TD, ops):
        """ops: models/parallel.py ParallelOps (the experts run per shard under it, by its
        linear method's expert FFN)."""
        weights_TK, ids_TK = route(ops.linear(self.gate, x_TD), self.top_k, self.renormalize)
        ex = self.experts
        y_TD = ops.moe_experts(x_TD, weights_TK, ids_TK, ex.gate_up_proj[...],
                               ex.down_proj[...])
        if self.shared_expert is None:
            return y_TD
        g_T1 = jax.nn.sigmoid(ops.linear(self.shared_expert_gate, x_TD))
        return y_TD + g_T1 * self.shared_expert(x_TD, ops)


def moe_or_dense_mlp(cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
    """`mlp_for_layer` of the MoE families (models/llama.py): sparse where the config says."""
    if cfg.is_moe_layer(layer):
        return SparseMoeBlock(cfg, dtype=dtype, rngs=rngs)
    return MLP(cfg, dtype=dtype, rngs=rngs)


__all__ = ["SparseMoeBlock", "expert_ffn", "expert_ffn_grouped", "expert_ffn_reference",
           "moe_or_dense_mlp", "route"]
