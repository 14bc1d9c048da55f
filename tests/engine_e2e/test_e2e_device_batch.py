"""The persistent batch on the device, through the whole engine.

* After every step, in both scheduling modes and under preemption, each per-slot device
  table (block tables, bad words, allowed-token bits) equals its host mirror, and greedy
  tokens equal those of a roomy synchronous run.
* The host-to-device bytes of a constructed schedule are exactly the expected count: the
  step's arguments, plus 8 bytes per block-table entry that changed (padded to a bucket),
  plus an allowed-token row or bad-word entries only when a request that uses them joins,
  or when a later request in its slot does not.
* A request never reads the allowed ids or bad words its slot's previous occupant used.
* A failed step that consumed the device tables: they are rebuilt from the host mirrors.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxllm import SamplingParams
from jaxllm.engine.core import StepFailed
from jaxllm.sampling_limits import MAX_MIN_TOKENS_STOP_IDS, NO_TOKEN

from tiny_model import greedy, token_ids

PROMPTS = [[100 + (7 * i + j) % 500 for j in range(n)] for i, n in
           enumerate((3, 17, 40, 9, 64, 5, 23, 31))]
ALLOWED = [11, 500, 4000, 49000]


def params(i: int) -> SamplingParams:
    if i % 3 == 1:
        return greedy(12, allowed_token_ids=ALLOWED)
    if i % 3 == 2:
        return greedy(12, bad_words=["the", "hello world"])
    return greedy(12)


def assert_device_rows_are_the_mirrors(runner) -> None:
    for name, rows in runner.slot_rows.items():
        assert not rows.has_pending, name
        np.testing.assert_array_equal(np.asarray(rows.device), rows.host, err_msg=name)


def run_checking_every_step(llm) -> list[list[int]]:
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, params(i)) for i, p in enumerate(PROMPTS)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        assert_device_rows_are_the_mirrors(engine.runner)
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def roomy_tokens(tiny_llm):
    return token_ids(tiny_llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                  [params(i) for i in range(len(PROMPTS))], use_tqdm=False))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_device_rows_equal_the_mirrors_after_every_step(make_tiny_llm, roomy_tokens,
                                                        async_scheduling):
    llm = make_tiny_llm(num_gpu_blocks_override=12, max_model_len=128, max_num_seqs=4,
                        async_scheduling=async_scheduling)
    tokens = run_checking_every_step(llm)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert tokens == roomy_tokens
    for i, t in enumerate(tokens):
        if i % 3 == 1:
            assert set(t) <= set(ALLOWED)


# ---- bytes per step --------------------------------------------------------------------------

def step_argument_bytes(T: int, S: int) -> int:
    """The step's host arguments at bucket (T, S), field by field (runner/step.py)."""
    per_token = 5 * 4 + 2 * 1  # input_ids, positions, slot_mapping, slot_T, prompt targets;
    #                            from_device_T, wants_prompt_logprobs_T
    per_seq = 3 * 4 + 1  # seq_lens, logits_indices, slot_S; samples_S
    sampling = (6 * 4 + 8 + MAX_MIN_TOKENS_STOP_IDS * 4  # temperature .. num_logprobs,
                + 5 * 4)                                 # seeds, stop ids; penalties
    return T * per_token + S * per_seq + 4 * (S + 1) + 4 + S * sampling  # + qsl, num_seqs


@pytest.fixture(scope="module")
def one_slot_llm(make_tiny_llm):
    """One slot, so every request reuses it; W = 64 / 16 = 4 blocks. Synchronous: each
    engine step is one runner step."""
    return make_tiny_llm(max_num_seqs=1, max_num_batched_tokens=32, max_model_len=64,
                         async_scheduling=False)


def step_bytes(llm, prompt, sampling_params) -> list[dict[str, int]]:
    engine = llm.llm_engine
    engine.add_request(None, prompt, sampling_params)
    sent = []
    while engine.has_unfinished_requests():
        engine.step()
        sent.append(dict(engine.runner.last_step_h2d))
    return sent


def test_bytes_per_step_are_exactly_the_expected_count(one_slot_llm):
    runner = one_slot_llm.llm_engine.runner
    # One block-table call: bucket 4 (max(1 slot, 4 blocks)) of (int32 index, int32 id).
    table_call = 4 * 8
    allowed_row = 4 + 49152 // 32 * 4  # slot + one whole row of bit words
    # The grammar bitmask and logit bias tables send nothing for rows that use neither (an
    # unbiased request's row equals the fill row its slot already holds).
    nothing = {"block_tables": 0, "bad_words": 0, "allowed_token_bits": 0, "logit_bias": 0,
               "grammar_bitmask": 0}

    # 16 prompt tokens fill block one; the first decode (position 16) appends block two.
    sent = step_bytes(one_slot_llm, list(range(100, 116)), greedy(3))
    assert sent == [{**nothing, "block_tables": table_call,
                     "step arguments": step_argument_bytes(16, 1)},
                    {**nothing, "block_tables": table_call,
                     "step arguments": step_argument_bytes(2, 1)},
                    {**nothing, "step arguments": step_argument_bytes(2, 1)}]

    # Allowed ids and bad words join the slot: one whole row, and one entry call.
    sent = step_bytes(one_slot_llm, [7, 8, 9],
                      greedy(2, allowed_token_ids=ALLOWED, bad_words=["hello"]))
    num_bad = int((runner.input_batch.bad_words.host[0] != NO_TOKEN).sum())
    assert 1 <= num_bad <= 16  # the smallest entry bucket
    joined = {"block_tables": table_call, "bad_words": 16 * 8,
              "allowed_token_bits": allowed_row, "logit_bias": 0, "grammar_bitmask": 0,
              "step arguments": step_argument_bytes(4, 1)}
    assert sent == [joined, {**nothing, "step arguments": step_argument_bytes(2, 1)}]
    # The next request uses neither: the slot's rows go back to their fill values once ...
    sent = step_bytes(one_slot_llm, [7, 8, 9], greedy(1))
    assert sent == [joined]
    # ... and never again.
    sent = step_bytes(one_slot_llm, [5, 6], greedy(1))
    assert sent[0]["bad_words"] == sent[0]["allowed_token_bits"] == 0
    assert runner.total_h2d_bytes >= sum(sum(s.values()) for s in sent)


def test_a_request_never_reads_its_slots_previous_allowed_ids_or_bad_words(make_tiny_llm,
                                                                           one_slot_llm):
    prompt = {"prompt_token_ids": [100 + i for i in range(9)]}
    fresh = token_ids(make_tiny_llm(max_num_seqs=1, max_num_batched_tokens=32,
                                    max_model_len=64).generate(prompt, greedy(6),
                                                               use_tqdm=False))
    restricted = token_ids(one_slot_llm.generate(
        prompt, greedy(6, allowed_token_ids=ALLOWED, bad_words=["the"]), use_tqdm=False))
    assert set(restricted[0]) <= set(ALLOWED) and restricted != fresh
    after = token_ids(one_slot_llm.generate(prompt, greedy(6), use_tqdm=False))
    assert after == fresh


# ---- failure recovery ------------------------------------------------------------------------

@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_device_rows_consumed_by_a_failed_step_are_rebuilt_from_the_mirrors(
        make_tiny_llm, monkeypatch, async_scheduling):
    llm = make_tiny_llm(max_num_seqs=2, async_scheduling=async_scheduling)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    baseline = token_ids(llm.generate(prompts, greedy(8), use_tqdm=False))
    runner = llm.llm_engine.runner
    real_run, calls = runner.run, {"n": 0}

    def run(host):
        calls["n"] += 1
        if calls["n"] == 3:  # a device failure: every donated array is gone
            for a in jax.tree.leaves((runner.kv_caches, runner._slot_tables())):
                a.delete()
            raise RuntimeError("injected")
        return real_run(host)

    monkeypatch.setattr(runner, "run", run)
    with pytest.raises(StepFailed):
        llm.generate(prompts, greedy(8), use_tqdm=False)
    assert_device_rows_are_the_mirrors(runner)
    monkeypatch.undo()
    assert token_ids(llm.generate(prompts, greedy(8), use_tqdm=False)) == baseline
    assert_device_rows_are_the_mirrors(runner)
