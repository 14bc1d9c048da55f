"""The jitted sampler: exact checks against argmax / numpy, seeded reproducibility, padding,
logprobs, and sampling frequencies. Most tests share S=4, V=32 so one compiled program serves
every mix of parameters (the sampler has no static variants)."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.messages import LogprobsLists
from jaxllm.runner.sampler import (apply_penalties, apply_top_k_top_p, logprobs_lists,
                                   prompt_logprobs_jit, sample_jit)
from jaxllm.runner.sampling_metadata import (SamplingRow, build_sampling_metadata,
                                             dummy_sampling_metadata, request_seed)
from jaxllm.sampling_params import SamplingParams

S, V, L = 4, 32, 16
EOS = 2


def make_logits(seed, num_rows=S, vocab=V):
    return np.array(jax.random.normal(jax.random.key(seed), (num_rows, vocab)) * 3.0)


def row(seed=0, prompt=(3, 4), output=(), **kwargs):
    """seed: the row's resolved seed (the request's own `seed` if kwargs has one)."""
    params = SamplingParams(**kwargs)
    return SamplingRow(params, seed if params.seed is None else params.seed, list(prompt),
                       list(output))


def run(rows, logits, num_seqs_padded=S):
    md = build_sampling_metadata(rows, num_seqs_padded=num_seqs_padded, eos_token_ids=[EOS],
                                 max_model_len=L)
    return md, jax.device_get(sample_jit(jnp.asarray(logits), md))


def test_greedy_is_argmax():
    logits = make_logits(0)
    md, out = run([row(temperature=0.0) for _ in range(3)], logits)
    np.testing.assert_array_equal(out.sampled_token_ids[:3], logits[:3].argmax(-1))
    # No row asked for logprobs: the branch that computes them did not run.
    assert not out.logprobs.topk_logprobs.any() and not out.logprobs.selected_ranks.any()


@pytest.mark.parametrize("step", [0, 1, 7])
def test_top_k_1_and_tiny_top_p_are_greedy(step):
    logits = make_logits(1)
    output = [5] * step
    rows = [row(seed=11, output=output, top_k=1), row(seed=12, output=output, top_p=1e-6),
            row(seed=13, output=output, temperature=0.0), row(seed=14, output=output, top_k=1,
                                                              top_p=1e-6, temperature=2.0)]
    md, out = run(rows, logits)
    np.testing.assert_array_equal(out.sampled_token_ids, logits.argmax(-1))


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46])
def test_top_p_that_float32_rounds_to_zero_still_samples_the_top_token(top_p):
    # Issue 15, bug 6: top_p=1e-300 is valid (> 0) but is 0.0 in float32; the top-p search
    # then kept no token and every row sampled token 0.
    assert np.float32(top_p) == 0.0
    logits = make_logits(1)
    assert (logits.argmax(-1) != 0).all()
    rows = [row(seed=21 + i, temperature=t, top_p=top_p) for i, t in enumerate((0.5, 1, 2, 7))]
    md, out = run(rows, logits)
    np.testing.assert_array_equal(out.sampled_token_ids, logits.argmax(-1))
    kept = jax.device_get(apply_top_k_top_p(jnp.asarray(logits), md.top_k, md.top_p))
    np.testing.assert_array_equal(np.isfinite(kept).sum(-1), [1] * S)


def top_k_top_p_numpy(x, k, p):
    """Sort-based reference: keep the top k, then the fewest top tokens reaching mass p."""
    order = np.argsort(-x)
    keep = np.zeros(len(x), bool)
    keep[order[:k or len(x)]] = True
    probs = np.exp(np.where(keep, x, -np.inf) - x.max())
    probs /= probs.sum()
    above = np.cumsum(probs[order]) - probs[order]  # mass strictly above each token
    if p < 1:
        keep[order[above >= p]] = False
    return keep


def test_top_k_top_p_threshold_search_matches_sorting():
    num_rows, vocab = 64, 300
    x = np.array(jax.random.normal(jax.random.key(7), (num_rows, vocab)) * 2.5, np.float32)
    rng = np.random.RandomState(0)
    k = rng.choice([0, 1, 2, 17, 299, 300, 1000], num_rows).astype(np.int32)
    p = rng.choice([1.0, 0.95, 0.5, 0.1, 1e-6], num_rows).astype(np.float32)
    got = np.isfinite(np.asarray(jax.jit(apply_top_k_top_p)(x, k, p)))
    for i in range(num_rows):
        np.testing.assert_array_equal(got[i], top_k_top_p_numpy(x[i].astype(np.float64), k[i],
                                                                  p[i]), err_msg=f"row {i}")


def test_min_p_keeps_only_tokens_near_the_top():
    logits = np.zeros((S, V), np.float32)
    logits[:, :4] = np.log([0.3, 0.25, 0.15, 0.1])  # rest share what is left, each < 0.5 * 0.3
    probs = np.exp(logits[0]) / np.exp(logits[0]).sum()
    allowed = set(np.flatnonzero(probs >= 0.5 * probs.max()).tolist())
    seen = collections.Counter()
    for step in range(25):
        rows = [row(seed=s, output=[9] * step, min_p=0.5) for s in range(S)]
        md, out = run(rows, logits)
        seen.update(out.sampled_token_ids.tolist())
    assert set(seen) <= allowed and len(seen) > 1


def penalties_numpy(logits, prompt, output, presence, frequency, repetition):
    x = logits.astype(np.float64).copy()
    for t in set(prompt) | set(output):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t, count in collections.Counter(output).items():
        x[t] -= frequency * count + presence
    return x


def test_penalties_match_numpy():
    logits = make_logits(2)
    cases = [dict(prompt=[1, 1, 5, 30], output=[5, 6, 6, 6, 0], presence_penalty=0.7,
                  frequency_penalty=-0.3, repetition_penalty=1.3),
             dict(prompt=[2], output=[], repetition_penalty=0.8),
             dict(prompt=[7, 8], output=[8, 9, 9], presence_penalty=-1.5, frequency_penalty=2.0)]
    rows = [row(prompt=c.pop("prompt"), output=c.pop("output"), **c) for c in cases]
    md = build_sampling_metadata(rows, num_seqs_padded=S, eos_token_ids=[EOS], max_model_len=L)
    got = np.asarray(jax.jit(apply_penalties)(jnp.asarray(logits), md.penalties))
    for i, r in enumerate(rows):
        p = r.params
        want = penalties_numpy(logits[i], r.prompt_token_ids, r.output_token_ids,
                               p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[3], logits[3])  # padding row untouched


def test_penalties_change_the_greedy_choice():
    logits = np.zeros((S, V), np.float32)
    logits[:, 6] = 2.0
    logits[:, 9] = 1.5
    _, out = run([row(temperature=0.0, output=[6, 6], frequency_penalty=0.5)], logits)
    assert out.sampled_token_ids[0] == 9


def test_a_tiny_repetition_penalty_saturates_instead_of_making_nan():
    # 1e-40 is a float32 subnormal: logit / 1e-40 overflows to +inf for any logit above ~3e-2,
    # and +inf made the processed scores NaN. Seen tokens with positive logits now tie at
    # float32's largest value, so sampling picks among them and every score is a number.
    logits = np.zeros((S, V), np.float32)
    logits[:, [3, 4]] = [0.5, 1.0]
    logits[:, 7] = 5.0  # unseen, and far ahead before the penalty
    rows = [row(seed=s, temperature=1.0, repetition_penalty=1e-40, prompt=(3, 4), logprobs=2)
            for s in range(S)]
    out = sample_modes(logits, rows, "processed_logprobs", 2)
    assert set(out.sampled_token_ids) <= {3, 4}
    assert not np.isnan(out.logprobs.topk_logprobs).any()
    np.testing.assert_allclose(out.logprobs.topk_logprobs, np.log(0.5), rtol=1e-6)


def test_a_top_k_past_int32_is_stored_as_off():
    # vLLM treats any k >= the vocabulary as off; 2**31 used to overflow the int32 slot array
    # and fail the whole step (issue 15, bug 2).
    logits = np.repeat(make_logits(3)[:1], S, axis=0)
    md, out = run([row(seed=9, top_k=2**31), row(seed=9, top_k=2**63), row(seed=9)], logits)
    np.testing.assert_array_equal(md.top_k[:3], [2**31 - 1, 2**31 - 1, 0])
    assert out.sampled_token_ids[0] == out.sampled_token_ids[1] == out.sampled_token_ids[2]


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = np.zeros((S, V), np.float32)
    logits[:, EOS], logits[:, 7], logits[:, 5] = 3.0, 2.0, 1.0
    rows = [row(temperature=0.0, output=[9], min_tokens=3, stop_token_ids=[7]),
            row(temperature=0.0, output=[9, 9, 9], min_tokens=3, stop_token_ids=[7]),
            row(temperature=0.0, output=[9], min_tokens=3, ignore_eos=True)]
    _, out = run(rows, logits)
    assert out.sampled_token_ids[:3].tolist() == [5, EOS, 7]


@pytest.mark.parametrize("seed", [1234, 2**40 + 5, -7])
def test_seeded_row_is_independent_of_the_batch(seed):
    target = make_logits(3, num_rows=1)[0]
    params = dict(temperature=0.9, top_p=0.95, seed=seed)  # the request's own seed
    alone, batched = [], []
    for step in range(8):
        out_ids = [0] * step
        logits = make_logits(100 + step, num_rows=8)
        logits[0] = target
        _, out = run([row(output=out_ids, **params)], logits[:S])
        alone.append(int(out.sampled_token_ids[0]))
        logits[5] = target
        others = [row(seed=s, output=[1] * s, temperature=1.0) for s in range(5)]
        _, out = run([*others, row(output=out_ids, **params)], logits, 8)
        batched.append(int(out.sampled_token_ids[5]))
    assert alone == batched and len(set(alone)) > 1


def generate(engine_seed, steps=6):
    """A toy engine loop: 3 unseeded requests, seeds from the engine seed and arrival index."""
    outputs = [[] for _ in range(3)]
    for step in range(steps):
        rows = [SamplingRow(SamplingParams(), request_seed(engine_seed, i), [3], outputs[i])
                for i in range(3)]
        _, out = run(rows, make_logits(200 + step) / 3.0)
        for i in range(3):
            outputs[i].append(int(out.sampled_token_ids[i]))
    return outputs


def test_same_engine_seed_same_run():
    assert request_seed(0, 1) == request_seed(0, 1) != request_seed(0, 2) != request_seed(1, 2)
    assert 0 <= request_seed(-5, 3) < 2**64
    assert generate(0) == generate(0)
    assert generate(0) != generate(1)


def test_one_program_serves_every_mix_and_padding_is_harmless():
    logits = np.zeros((S, V), np.float32)
    logits[1, 3] = 1e4  # extreme, finite values must not make NaN either
    logits[2] = -1e4
    out = jax.device_get(sample_jit(jnp.asarray(logits), dummy_sampling_metadata(S, L)))
    assert out.sampled_token_ids.shape == (S,)
    assert ((0 <= out.sampled_token_ids) & (out.sampled_token_ids < V)).all()
    compiled = sample_jit._cache_size()
    batches = [[row(temperature=0.0)], [row(temperature=0.5, logprobs=2)],
               [row(top_k=3, repetition_penalty=1.2)], [row(top_p=0.9, presence_penalty=1.0,
                                                            logprobs=0)],
               [row(min_p=0.2, min_tokens=3, stop_token_ids=[4], frequency_penalty=-1.0)]]
    for rows in batches:
        _, out = run(rows, logits)
        assert ((0 <= out.sampled_token_ids) & (out.sampled_token_ids < V)).all()
        assert all(np.isfinite(a).all() for a in jax.tree.leaves(out.logprobs))
    assert sample_jit._cache_size() == compiled  # serving never compiles again


def log_softmax_numpy(x):
    shifted = x.astype(np.float64) - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = make_logits(5)
    rows = [row(seed=1, temperature=0.7, logprobs=5, repetition_penalty=1.5, output=[1, 2]),
            row(seed=2, temperature=0.0, logprobs=0), row(seed=3, temperature=1.5, logprobs=20)]
    md, out = run(rows, logits)
    want = log_softmax_numpy(logits)
    lp = out.logprobs
    order = np.argsort(-want, axis=-1)[:, :20]
    np.testing.assert_array_equal(lp.topk_token_ids, order)
    np.testing.assert_allclose(lp.topk_logprobs, np.take_along_axis(want, order, -1), atol=1e-5)
    sampled = out.sampled_token_ids
    np.testing.assert_array_equal(lp.selected_token_ids, sampled)
    np.testing.assert_allclose(lp.selected_logprobs, want[np.arange(S), sampled], atol=1e-5)
    ranks = 1 + (want > want[np.arange(S), sampled][:, None]).sum(-1)
    np.testing.assert_array_equal(lp.selected_ranks, ranks)
    assert lp.selected_ranks[1] == 1  # the greedy row took the top token

    lists = logprobs_lists(lp, [0], num_logprobs=5)
    assert lists.logprob_token_ids == [[int(sampled[0]), *order[0, :5].tolist()]]
    assert lists.sampled_token_ranks == [int(ranks[0])]
    np.testing.assert_allclose(lists.logprobs[0][1:], want[0, order[0, :5]], atol=1e-5)
    assert logprobs_lists(lp, [1], num_logprobs=0) == LogprobsLists(
        [[int(sampled[1])]], [[pytest.approx(float(want[1, sampled[1]]), abs=1e-5)]], [1])


def test_prompt_logprobs():
    logits = make_logits(6, num_rows=6)
    targets = np.array([4, 9, 0, 31, 4, 4], np.int32)
    t = jax.device_get(prompt_logprobs_jit(jnp.asarray(logits), jnp.asarray(targets)))
    want = log_softmax_numpy(logits)
    np.testing.assert_allclose(t.selected_logprobs, want[np.arange(6), targets], atol=1e-5)
    np.testing.assert_array_equal(
        t.selected_ranks, 1 + (want > want[np.arange(6), targets][:, None]).sum(-1))
    np.testing.assert_array_equal(t.topk_token_ids, np.argsort(-want, -1)[:, :20])
    lists = logprobs_lists(t, slice(1, 4), num_logprobs=2)
    assert [ids[0] for ids in lists.logprob_token_ids] == [9, 0, 31]
    assert all(len(ids) == 3 for ids in lists.logprob_token_ids)


def expected_probs(x, temperature, top_k=0, top_p=1.0):
    p = np.exp(x / temperature - (x / temperature).max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros_like(p, bool)
    keep[order[:top_k or len(p)]] = True
    p = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
    above = np.cumsum(p[order]) - p[order]  # mass strictly above each token
    drop = order[above >= top_p]
    p[drop] = 0.0
    return p / p.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.5, 0, 1.0), (1.0, 3, 1.0),
                                                       (1.3, 0, 0.8)])
def test_sampling_frequencies(temperature, top_k, top_p):
    num_draws, vocab = 2048, 8
    x = np.array([1.0, 0.5, 0.2, 0.0, -0.5, -1.0, 0.3, 0.9], np.float32)
    md = dummy_sampling_metadata(num_draws, max_model_len=L)
    md.temperature[:] = temperature
    md.top_k[:] = top_k
    md.top_p[:] = top_p
    md.seeds[:] = (0, 42)
    md.steps[:] = np.arange(num_draws)  # one request's first 2048 steps
    out = sample_jit(jnp.broadcast_to(jnp.asarray(x), (num_draws, vocab)), md)
    freq = np.bincount(np.asarray(out.sampled_token_ids), minlength=vocab) / num_draws
    want = expected_probs(x.astype(np.float64), temperature, top_k, top_p)
    assert (freq[want == 0] == 0).all()
    tolerance = 4 * np.sqrt(want * (1 - want) / num_draws) + 1e-3
    assert (np.abs(freq - want) <= tolerance).all(), (freq, want)


def test_builder_errors():
    with pytest.raises(ValueError, match="5 rows do not fit the bucket num_seqs_padded=4"):
        build_sampling_metadata([row()] * 5, num_seqs_padded=4, eos_token_ids=[], max_model_len=L)
    with pytest.raises(ValueError, match="exceeds max_model_len=16"):
        build_sampling_metadata([row(prompt=[1] * 10, output=[2] * 7, presence_penalty=1.0)],
                                num_seqs_padded=4, eos_token_ids=[], max_model_len=L)
    with pytest.raises(ValueError, match="min_tokens supports at most 32"):
        build_sampling_metadata([row(min_tokens=2, stop_token_ids=list(range(3, 40)))],
                                num_seqs_padded=4, eos_token_ids=[EOS], max_model_len=L)


def test_logprobs_processor_builds_vllm_dicts():
    from jaxllm.engine.logprobs import LogprobsProcessor
    from jaxllm.outputs import Logprob

    proc = LogprobsProcessor(SamplingParams(logprobs=2, prompt_logprobs=1))
    assert proc.prompt_logprobs == [None] and proc.logprobs == [] and proc.cumulative_logprob == 0
    # step 1: sampled 7 is outside the top-2; step 2: sampled 3 is the top token
    proc.add_sample_logprobs(LogprobsLists([[7, 3, 5]], [[-3.0, -0.5, -1.0]], [4]))
    proc.add_sample_logprobs(LogprobsLists([[3, 3, 5]], [[-0.25, -0.25, -2.0]], [1]))
    assert proc.logprobs == [
        {7: Logprob(-3.0, 4), 3: Logprob(-0.5, 1), 5: Logprob(-1.0, 2)},
        {3: Logprob(-0.25, 1), 5: Logprob(-2.0, 2)}]
    assert proc.cumulative_logprob == -3.25
    proc.add_prompt_logprobs(LogprobsLists([[4, 9], [6, 6]], [[-2.0, -0.1], [-0.3, -0.3]], [3, 1]))
    assert proc.prompt_logprobs == [None, {4: Logprob(-2.0, 3), 9: Logprob(-0.1, 1)},
                                    {6: Logprob(-0.3, 1)}]
    off = LogprobsProcessor(SamplingParams())
    assert (off.logprobs, off.prompt_logprobs, off.cumulative_logprob) == (None, None, None)
    with pytest.raises(ValueError, match="did not ask for logprobs"):
        off.add_sample_logprobs(LogprobsLists([[1]], [[0.0]], [1]))


# ---- allowed_token_ids, bad_words, logprobs modes and widths --------------------------------

from jaxllm.runner.sampler import apply_bad_words, sample  # noqa: E402
from jaxllm.runner.sampling_metadata import (ALL_LOGPROBS, MAX_BAD_WORD_TOKENS,  # noqa: E402
                                             NO_TOKEN, bad_words_rows)


def bad_row(words, seed=0, prompt=(3, 4), output=(), **kwargs):
    """A row whose bad words are already token sequences (the processor's job at admission)."""
    r = row(seed, prompt, output, bad_words=["x"], **kwargs)
    r.params._bad_words_token_ids = [list(w) for w in words]
    return r


@pytest.mark.parametrize("vocab", [V, 40])  # 40: a partly used last bit word
def test_allowed_token_ids_restrict_and_leave_other_rows_identical(vocab):
    logits = make_logits(20, vocab=vocab)
    rows = [row(temperature=0.0, allowed_token_ids=[5, 7, vocab - 1]),
            row(seed=3, temperature=1.0, allowed_token_ids=[9]),
            row(temperature=0.0), row(seed=4, temperature=0.7, top_k=5)]
    md = build_sampling_metadata(rows, num_seqs_padded=S, eos_token_ids=[EOS], max_model_len=L,
                                 vocab_size=vocab)
    out = jax.device_get(sample_jit(jnp.asarray(logits), md))
    allowed = [5, 7, vocab - 1]
    assert out.sampled_token_ids[0] == allowed[int(logits[0, allowed].argmax())]
    assert out.sampled_token_ids[1] == 9
    # Rows that did not ask: exactly what they sample in a batch where no row restricts.
    plain = build_sampling_metadata([row(temperature=0.0), row(temperature=0.0), rows[2],
                                     rows[3]], num_seqs_padded=S, eos_token_ids=[EOS],
                                    max_model_len=L, vocab_size=vocab)
    ref = jax.device_get(sample_jit(jnp.asarray(logits), plain))
    np.testing.assert_array_equal(out.sampled_token_ids[2:], ref.sampled_token_ids[2:])


def test_allowed_token_ids_need_a_vocabulary():
    with pytest.raises(ValueError, match=r"allowed_token_ids must be in \[0, 0\)"):
        build_sampling_metadata([row(allowed_token_ids=[1])], num_seqs_padded=S,
                                eos_token_ids=[], max_model_len=L)


def bad_words_numpy(words, output):
    """vLLM v1's `_apply_bad_words_single_batch`: the banned last tokens."""
    banned = set()
    for word in words:
        if len(word) > len(output) + 1:
            continue
        prefix = word[:-1]
        if list(output[len(output) - len(prefix):]) == list(prefix) or not prefix:
            banned.add(word[-1])
    return banned


def test_bad_words_match_vllms_rule_on_the_output_history():
    rng = np.random.default_rng(0)
    G = MAX_BAD_WORD_TOKENS
    for case in range(40):
        prompt = list(rng.integers(0, 4, rng.integers(1, 5)))
        output = list(rng.integers(0, 4, rng.integers(0, 20)))
        words = [list(rng.integers(0, 4, rng.integers(1, 5))) for _ in range(rng.integers(1, 6))]
        if case == 0:  # a full-width word whose prefix is the whole output window
            output = list(range(G - 1))
            words = [list(range(G - 1)) + [3], [0] * G]
        history = np.zeros((1, 64), np.int32)
        history[0, :len(prompt) + len(output)] = prompt + output
        x = jax.device_get(apply_bad_words(
            jnp.zeros((1, 8), jnp.float32), jnp.asarray(bad_words_rows(words)[None]),
            jnp.asarray(history), jnp.array([len(prompt)]),
            jnp.array([len(prompt) + len(output)])))
        assert set(np.flatnonzero(np.isneginf(x[0]))) == bad_words_numpy(words, output), case


def test_bad_words_ignore_the_prompt_and_ban_in_the_sampler():
    logits = make_logits(21)
    top = logits.argsort(-1)[:, ::-1]
    rows = [bad_row([[top[0, 0]]], temperature=0.0),  # one token: always banned
            bad_row([[7, top[1, 0]]], output=[5, 7], temperature=0.0),  # prefix matches
            bad_row([[4, top[2, 0]]], prompt=(3, 4), temperature=0.0),  # prefix only in prompt
            row(temperature=0.0)]
    _, out = run(rows, logits)
    np.testing.assert_array_equal(out.sampled_token_ids,
                                  [top[0, 1], top[1, 1], top[2, 0], top[3, 0]])
    with pytest.raises(ValueError, match="bad_words supports at most"):
        bad_words_rows([[1] * (MAX_BAD_WORD_TOKENS + 1)])
    assert (bad_words_rows([[1, 2]])[0] == [NO_TOKEN] * (MAX_BAD_WORD_TOKENS - 2) + [1, 2]).all()


def sample_modes(logits, rows, mode, k):
    md = build_sampling_metadata(rows, num_seqs_padded=S, eos_token_ids=[EOS], max_model_len=L,
                                 vocab_size=V)
    return jax.device_get(sample_jit(jnp.asarray(logits), md, logprobs_mode=mode,
                                     max_num_logprobs=k))


def test_logprobs_modes_follow_vllms_sampler():
    logits = make_logits(22)
    rows = [row(temperature=0.0, repetition_penalty=1.5, prompt=(3, 4), logprobs=-1,
                allowed_token_ids=list(range(16))),
            row(seed=5, temperature=0.5, top_k=3, logprobs=-1, output=[9]),
            row(temperature=0.0), row(seed=6, temperature=2.0, logprobs=-1)]
    # The processed logits by hand: allowed ids, penalties (greedy row 0: unscaled) ...
    processed = logits.astype(np.float32).copy()
    processed[0, 16:] = -np.inf
    for t in (3, 4):
        processed[0, t] = processed[0, t] / 1.5 if processed[0, t] > 0 else processed[0, t] * 1.5
    processed[1] = processed[1] / np.float32(0.5)  # ... temperature and top_k for random rows
    processed[1, processed[1].argsort()[:-3]] = -np.inf
    processed[3] = processed[3] / np.float32(2.0)
    raw = logits.astype(np.float32)
    expected = {"raw_logits": raw, "raw_logprobs": log_softmax_numpy(raw),
                "processed_logits": processed, "processed_logprobs": log_softmax_numpy(processed)}
    sampled = None
    for mode, scores in expected.items():
        out = sample_modes(logits, rows, mode, -1)
        assert out.logprobs.topk_logprobs.shape == (S, V)  # max_logprobs=-1: the vocabulary
        if sampled is None:
            sampled = out.sampled_token_ids
        np.testing.assert_array_equal(out.sampled_token_ids, sampled)  # modes never sample
        for i in (0, 1, 3):
            np.testing.assert_allclose(out.logprobs.topk_logprobs[i], np.sort(scores[i])[::-1],
                                       rtol=1e-5, atol=1e-5, err_msg=f"{mode} row {i}")
            np.testing.assert_allclose(out.logprobs.selected_logprobs[i],
                                       scores[i, sampled[i]], rtol=1e-5, atol=1e-5)
    assert sampled[0] == processed[0].argmax() and sampled[1] in processed[1].argsort()[-3:]


def test_logprobs_width_is_the_engines_max_logprobs():
    logits = make_logits(23)
    rows = [row(temperature=0.0, logprobs=2), row(temperature=0.0, logprobs=-1)]
    for k, width in [(5, 5), (0, 0), (-1, V), (V + 10, V)]:
        out = sample_modes(logits, rows, "raw_logprobs", k)
        assert out.logprobs.topk_token_ids.shape == (S, width)
    md = build_sampling_metadata(rows, num_seqs_padded=S, eos_token_ids=[EOS], max_model_len=L)
    assert md.num_logprobs[1] == ALL_LOGPROBS
    out = sample_modes(logits, rows, "raw_logprobs", -1)
    lists = logprobs_lists(out.logprobs, [1], int(md.num_logprobs[1]))
    assert len(lists.logprob_token_ids[0]) == V + 1  # the sampled token, then every token
    assert sorted(lists.logprob_token_ids[0][1:]) == list(range(V))
    pl = jax.device_get(prompt_logprobs_jit(jnp.asarray(logits), jnp.zeros(S, jnp.int32), k=V))
    assert pl.topk_token_ids.shape == (S, V)


def test_sample_is_unchanged_when_no_row_asks():
    """The default mode and width give what the sampler gave before these features: checked
    through the raw logprobs of a mixed batch against numpy."""
    logits = make_logits(24)
    rows = [row(temperature=0.0, logprobs=3), row(seed=7, temperature=0.8, logprobs=1)]
    md = build_sampling_metadata(rows, num_seqs_padded=S, eos_token_ids=[EOS], max_model_len=L)
    out = jax.device_get(jax.jit(sample)(jnp.asarray(logits), md))
    np.testing.assert_allclose(out.logprobs.topk_logprobs[:2],
                               np.sort(log_softmax_numpy(logits))[:2, ::-1][:, :20], atol=1e-5)


def test_argmax_first_is_numpys_argmax_with_ties_and_masked_rows():
    from jaxllm.runner.sampler import argmax_first

    rng = np.random.default_rng(3)
    x = rng.integers(-3, 3, (16, 300)).astype(np.float32)  # many ties per row
    x[5] = -np.inf  # a fully masked row: index 0, as argmax
    x[6, 299] = 7.0  # the maximum at the last index
    assert argmax_first(jnp.asarray(x)).tolist() == np.argmax(x, axis=-1).tolist()
