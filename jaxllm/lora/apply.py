"""How the device adds the adapters' deltas at one projection: the two ways, as functions of
one signature, and the choice between them (made once per engine).

    apply(x_TK, y_TN, A_SLKR, B_SLRN, m_T, layer, num_adapters) -> y_TN

    x_TK, y_TN   the dense layer's input and output
    A_SLKR       lora.t.A [M + 1, L, K, R], B_SLRN lora.t.B [M + 1, L, R, N] (lora/feature.py)
    m_T          each token's adapter slot; M = num_adapters (the fill row): no adapter

Owns: `xla_apply` (a lax.switch per projection: no adapter / one adapter / several, in
XLA's dots; runs anywhere, under tensor parallelism too: the SPMD partitioner splits it as
the tables), `cpu_apply` (the C++ kernel of kernels/cpu_lora.py: one FFI call, each token's
own slot's tables read in place), and `choose_apply`. Must never: use the kernel under
tensor parallelism or off the cpu platform, or fall back to XLA on cpu without saying why
(kernels/cpu_lora.py warns once).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.kernels import cpu_lora


def xla_apply(x_TK, y_TN, A_SLKR, B_SLRN, m_T, layer: int, num_adapters: int):
    """Three branches (a lax.switch on m_T), in the tables' dtype, f32 sums:

        no token has an adapter:   y_TN unchanged
        one adapter s (and base):  xa_TR = (x_TK @ A[s, l]) * (m_T == s)      rank R only
                                   y_TN += xa_TR @ B[s, l]
        several adapters:          xa_TX = (x_TK @ A[:M, l] as [K, M*R]) * onehot(m_T)
                                   y_TN += xa_TX @ B[:M, l] as [M*R, N]
    """
    M = num_adapters
    A_MKR, B_MRN = A_SLKR[:, layer], B_SLRN[:, layer]
    x_TK = x_TK.astype(A_MKR.dtype)
    first = jnp.min(m_T)  # M: no token has an adapter
    alone = jnp.all((m_T == first) | (m_T == M))

    def add(d_TN):
        return (y_TN.astype(jnp.float32) + d_TN).astype(y_TN.dtype)

    def one_adapter():  # every token with an adapter has adapter slot `first`
        A_KR = jax.lax.dynamic_index_in_dim(A_MKR, first, 0, keepdims=False)
        B_RN = jax.lax.dynamic_index_in_dim(B_MRN, first, 0, keepdims=False)
        xa_TR = _dot(x_TK, A_KR).astype(A_KR.dtype) * (m_T == first)[:, None].astype(
            A_KR.dtype)
        return add(_dot(xa_TR, B_RN))

    def several():  # shrink against every slot at once, keep each token's own R columns
        _, K, R = A_MKR.shape
        A_KX = A_MKR[:M].transpose(1, 0, 2).reshape(K, M * R)
        B_XN = B_MRN[:M].reshape(M * R, -1)
        mask_TX = jnp.repeat(jax.nn.one_hot(m_T, M, dtype=A_KX.dtype), R, axis=1)
        return add(_dot(_dot(x_TK, A_KX).astype(A_KX.dtype) * mask_TX, B_XN))

    branch = jnp.where(first == M, 0, jnp.where(alone, 1, 2))
    return jax.lax.switch(branch, (lambda: y_TN, one_adapter, several))


def cpu_apply(x_TK, y_TN, A_SLKR, B_SLRN, m_T, layer: int, num_adapters: int):
    """The C++ kernel: tokens grouped by slot, each group's A [K, R] and B [R, N] read in
    place from the whole tables (no switch, no gather, no mask)."""
    return cpu_lora.lora_apply(x_TK.astype(A_SLKR.dtype), y_TN, A_SLKR, B_SLRN, m_T, layer,
                               num_adapters)


def choose_apply(dtype, single_device: bool):
    """`cpu_apply` on the cpu platform without tensor parallelism where the kernel can run
    for `dtype` tables (said once where it cannot); `xla_apply` elsewhere."""
    if not single_device or jax.default_backend() != "cpu":
        return xla_apply
    if not cpu_lora.availability(dtype):
        cpu_lora.warn_unavailable(dtype)
        return xla_apply
    return cpu_apply


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)
