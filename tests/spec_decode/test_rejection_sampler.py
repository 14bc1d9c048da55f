"""The rejection sampler (jaxllm/spec_decode/rejection.py) against the distributions it must
preserve, on synthetic target logits over a small vocabulary.

Each test draws >= 20k independent rows in one jitted call (one seed per row) and compares
the empirical distribution of an emitted token with the target's by a chi-square test at
p > 0.01 (Leviathan et al.: speculative sampling leaves the target distribution unchanged),
plus exact checks of the greedy rule, the bonus token and seed reproducibility.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import gammaincc

from jaxllm.spec_decode.rejection import rejection_sample

V, K, N = 8, 3, 24_000
reject = jax.jit(rejection_sample)


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of counts ~ Multinomial(sum, probs) (cells with probability 0 must be empty)."""
    assert counts[probs == 0].sum() == 0, (counts, probs)
    keep = probs > 0
    expected = counts.sum() * probs[keep]
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return float(gammaincc((keep.sum() - 1) / 2, stat / 2))


def target(seed: int) -> np.ndarray:
    """[K, V] target logits with one excluded token per position (-inf, as top-k leaves)."""
    logits = np.random.default_rng(seed).normal(size=(K, V)).astype(np.float32)
    logits[:, -1] = -np.inf
    return logits


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def seeds(n: int, offset: int = 0) -> jax.Array:
    return jnp.stack([jnp.zeros(n, jnp.uint32), jnp.arange(offset, offset + n, dtype=jnp.uint32)],
                     axis=1)


def run(logits_KV, draft_K, *, draft_probs_KV=None, n=N, num_drafts=K, greedy=False):
    logits = jnp.broadcast_to(jnp.asarray(logits_KV), (n, K, V))
    q = None if draft_probs_KV is None else jnp.broadcast_to(jnp.asarray(draft_probs_KV),
                                                              (n, K, V))
    draft_SK = jnp.asarray(draft_K, jnp.int32)
    if draft_SK.ndim == 1:
        draft_SK = jnp.broadcast_to(draft_SK, (n, K))
    bonus = jnp.full(n, V + 5, jnp.int32)  # a marker: never a real token
    tokens, num = reject(logits, draft_SK, jnp.full(n, num_drafts, jnp.int32), bonus,
                         jnp.full(n, greedy), seeds(n), jnp.zeros(n, jnp.int32), q)
    return np.asarray(tokens), np.asarray(num)


def test_ngram_drafts_keep_the_first_token_distributed_as_the_target():
    logits = target(0)
    p = softmax(logits)
    draft = np.argsort(-p, axis=-1)[:, 1]  # the second most likely: often rejected
    tokens, num = run(logits, draft)
    assert 0 < (num > 1).mean() < 1  # both accepted and rejected rows
    first = np.bincount(tokens[:, 0], minlength=V)
    assert chi_square_p(first, p[0]) > 0.01
    # Given draft 0 accepted, the second emitted token follows the target at position 1.
    second = np.bincount(tokens[num > 1, 1], minlength=V)
    assert chi_square_p(second, p[1]) > 0.01
    # The test can fail: the draft's own point mass is not the target.
    assert chi_square_p(first, np.eye(V)[draft[0]] * 0.5 + p[0] * 0.5) < 0.01


def test_draft_probabilities_min_p_over_q_and_the_residual():
    logits = target(1)
    p = softmax(logits)
    rng = np.random.default_rng(7)
    q = softmax(rng.normal(size=(K, V)).astype(np.float32) * 2)
    draft_SK = np.stack([rng.choice(V, size=N, p=q[j]) for j in range(K)], axis=1)
    tokens, num = run(logits, draft_SK, draft_probs_KV=q)
    first = np.bincount(tokens[:, 0], minlength=V)
    assert chi_square_p(first, p[0]) > 0.01
    assert chi_square_p(np.bincount(tokens[num > 1, 1], minlength=V), p[1]) > 0.01


def test_greedy_accepts_while_the_argmax_matches_then_emits_it_or_the_bonus():
    logits = target(2)
    best = logits.argmax(-1)
    wrong = (best + 1) % (V - 1)
    cases = [([best[0], best[1], best[2]], 3, [*best, V + 5]),      # all: bonus
             ([best[0], wrong[1], best[2]], 3, [best[0], best[1]]),  # stop at 1
             ([wrong[0], best[1], best[2]], 3, [best[0]]),
             ([best[0], best[1], wrong[2]], 2, [best[0], best[1], V + 5])]  # 2 drafts only
    for draft, m, want in cases:
        tokens, num = run(logits, draft, num_drafts=m, greedy=True)
        assert (num == len(want)).all()
        assert (tokens[:, :len(want)] == want).all()


def test_seeded_rows_reproduce_whatever_the_batch():
    logits = target(3)
    draft = softmax(logits).argmax(-1)
    a, na = run(logits, draft)
    b, nb = run(logits, draft)
    assert (a == b).all() and (na == nb).all()
    # The same seeds in the reverse row order: each row's tokens follow its seed.
    n = jnp.full(N, K, jnp.int32)
    t, m = reject(jnp.broadcast_to(jnp.asarray(logits), (N, K, V)),
                  jnp.broadcast_to(jnp.asarray(draft, jnp.int32), (N, K)), n,
                  jnp.full(N, V + 5, jnp.int32), jnp.zeros(N, bool), seeds(N)[::-1],
                  jnp.zeros(N, jnp.int32), None)
    assert (np.asarray(m)[::-1] == na).all() and (np.asarray(t)[::-1] == a).all()
