"""Rejection sampling of draft tokens against the target (Leviathan et al. 2023; vLLM v1's
RejectionSampler), as one traceable function over a padded batch.

Owns the accept / recover / bonus rule and its random streams. Never packs a batch, never
looks at a request, and never changes the target distribution: for every row the tokens it
returns are distributed as if sampled one by one from the target.

Shapes: S sequences, K = num_speculative_tokens (static), V vocabulary, P = K + 1.

Per row with m <= K drafts d_0 .. d_{m-1} (the rest padding):
  greedy rows (temperature < eps): accept d_j while argmax(target_j) == d_j; the first
    mismatch emits argmax(target_j);
  random rows: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); the first rejection
    emits a draw from norm(max(0, p_j - q_j)). N-gram drafts have no q: as in vLLM, q_j is
    the point mass on d_j, so d_j is accepted with probability p_j(d_j) and a rejection draws
    from p_j with d_j removed;
  all m accepted: the bonus token (the ordinary sample at the position after the last draft,
    passed in) is emitted.
  -> tokens_SP [S, P] (the first num_S valid), num_S = accepted + 1.

Random streams, per row (reproducible for a seeded request, independent of the batch): the
uniform that tests draft j and the uniform that recovers at j come from
fold_in(fold_in(key(seed), step_j), tag), tag 1 and 2, where step_j is the output index of
the token at j. The ordinary sampler folds no tag, so the streams never coincide.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxllm.kernels.cpu_argmax import argmax_first_here as argmax_first

ACCEPT_TAG = 1
RECOVER_TAG = 2


def _uniform_SK(seeds_S2: jax.Array, steps_SK: jax.Array, tag: int) -> jax.Array:
    def one(seed_2, step):
        key = jax.random.wrap_key_data(seed_2, impl="threefry2x32")
        key = jax.random.fold_in(jax.random.fold_in(key, step), tag)
        return jax.random.uniform(key, (), jnp.float32)

    per_row = jax.vmap(one, in_axes=(None, 0))
    return jax.vmap(per_row)(seeds_S2, steps_SK)


def _first_true(mask_SN: jax.Array) -> jax.Array:
    n = mask_SN.shape[-1]
    return jnp.min(jnp.where(mask_SN, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def _draw(weights_RV: jax.Array, u_R: jax.Array) -> jax.Array:
    """One inverse-CDF draw per row from unnormalised non-negative weights."""
    cdf_RV = jnp.cumsum(weights_RV, axis=-1)
    idx_R = _first_true(cdf_RV > (u_R * cdf_RV[:, -1])[:, None])
    return jnp.minimum(idx_R, weights_RV.shape[-1] - 1).astype(jnp.int32)


def rejection_sample(target_logits_SKV: jax.Array, draft_SK: jax.Array, num_drafts_S: jax.Array,
                     bonus_S: jax.Array, is_greedy_S: jax.Array, seeds_S2: jax.Array,
                     first_step_S: jax.Array, draft_probs_SKV: jax.Array | None = None
                     ) -> tuple[jax.Array, jax.Array]:
    """target_logits_SKV: the target's processed logits (temperature, top-k/top-p, min-p
    applied; -inf where excluded) at the K positions that verify the drafts; draft_SK the
    drafts (padding past num_drafts_S); bonus_S the ordinary sample after the last draft;
    first_step_S the output index of draft 0. draft_probs_SKV: the proposer's q (None: point
    masses, n-gram). -> (tokens_SP [S, K + 1] int32, num_S [S] int32)."""
    S, K, V = target_logits_SKV.shape
    argmax_SK = argmax_first(target_logits_SKV.reshape(S * K, V).astype(jnp.float32))
    return verify_drafts(argmax_SK.reshape(S, K), lambda: target_logits_SKV, draft_SK,
                         num_drafts_S, bonus_S, is_greedy_S, seeds_S2, first_step_S,
                         draft_probs_SKV)


def verify_drafts(target_argmax_SK: jax.Array, target_logits_fn: Callable[[], jax.Array],
                  draft_SK: jax.Array, num_drafts_S: jax.Array, bonus_S: jax.Array,
                  is_greedy_S: jax.Array, seeds_S2: jax.Array, first_step_S: jax.Array,
                  draft_probs_SKV: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """`rejection_sample` with the greedy rows' target argmax_SK given, and the processed
    target logits [S, K, V] as a function that is only traced where some row samples (a
    greedy batch never builds them: the caller may take the argmax over fewer rows, or
    over rows it already has)."""
    S, K = draft_SK.shape
    valid_SK = jnp.arange(K)[None, :] < num_drafts_S[:, None]
    steps_SK = first_step_S[:, None] + jnp.arange(K, dtype=jnp.int32)[None, :]
    target_argmax_SK = target_argmax_SK.astype(jnp.int32)

    def random_rows():
        target_logits_SKV = target_logits_fn()
        V = target_logits_SKV.shape[-1]
        probs_SKV = jax.nn.softmax(target_logits_SKV.astype(jnp.float32), axis=-1)
        p_draft_SK = jnp.take_along_axis(probs_SKV, draft_SK[:, :, None], axis=-1)[:, :, 0]
        if draft_probs_SKV is None:
            q_draft_SK = jnp.ones_like(p_draft_SK)
            residual_SKV = probs_SKV.at[jnp.arange(S)[:, None], jnp.arange(K)[None, :],
                                        draft_SK].set(0.0)
        else:
            q_draft_SK = jnp.take_along_axis(draft_probs_SKV, draft_SK[:, :, None],
                                             axis=-1)[:, :, 0]
            residual_SKV = jnp.maximum(probs_SKV - draft_probs_SKV, 0.0)
        u_accept_SK = _uniform_SK(seeds_S2, steps_SK, ACCEPT_TAG)
        # u < p / q  <=>  u * q < p (q > 0 for a proposed token); min(1, .) is implicit.
        ok_SK = u_accept_SK * q_draft_SK < p_draft_SK
        u_recover_SK = _uniform_SK(seeds_S2, steps_SK, RECOVER_TAG)
        # A residual that is all zeros (p == q exactly) cannot be rejected from; draw from p.
        residual_SKV = jnp.where(jnp.sum(residual_SKV, -1, keepdims=True) > 0, residual_SKV,
                                 probs_SKV)
        recovered_SK = _draw(residual_SKV.reshape(S * K, V),
                             u_recover_SK.reshape(-1)).reshape(S, K)
        return ok_SK, recovered_SK

    # The softmax, the uniforms and the residual draw only when some row samples (greedy
    # batches, padding rows included, skip them as the sampler skips its draw).
    random_ok_SK, recovered_SK = jax.lax.cond(
        jnp.all(is_greedy_S), lambda: (jnp.zeros((S, K), bool), target_argmax_SK),
        random_rows)
    greedy_ok_SK = target_argmax_SK == draft_SK
    ok_SK = jnp.where(is_greedy_S[:, None], greedy_ok_SK, random_ok_SK) & valid_SK
    num_accepted_S = _first_true(~ok_SK)  # leading accepted drafts (K when all)
    num_accepted_S = jnp.minimum(num_accepted_S, num_drafts_S)
    recovered_SK = jnp.where(is_greedy_S[:, None], target_argmax_SK, recovered_SK)

    # tokens: drafts up to the first rejection, then the recovered token there, or the bonus.
    j_SP = jnp.arange(K + 1, dtype=jnp.int32)[None, :]
    pad_SP = lambda x_SK: jnp.pad(x_SK, ((0, 0), (0, 1)))  # noqa: E731
    a_S1 = num_accepted_S[:, None]
    last_S = jnp.where(num_accepted_S < num_drafts_S,
                       jnp.take_along_axis(pad_SP(recovered_SK), a_S1, axis=1)[:, 0], bonus_S)
    tokens_SP = jnp.where(j_SP < a_S1, pad_SP(draft_SK),
                          jnp.where(j_SP == a_S1, last_S[:, None], 0)).astype(jnp.int32)
    return tokens_SP, (num_accepted_S + 1).astype(jnp.int32)
