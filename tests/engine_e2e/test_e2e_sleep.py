"""LLM.sleep / LLM.wake_up offline (vLLM's names), on the session's shared tiny engine: the
device buffers are really released, and generation after waking is unchanged. The server's
/sleep routes are tested in tests/entrypoints/test_frontend_routes.py."""

from __future__ import annotations

import jax
import pytest

from jaxllm import SamplingParams


def test_sleep_and_wake_up_give_the_same_tokens(tiny_llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    want = tiny_llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0]
    runner = tiny_llm.llm_engine.model_runner
    for level in (1, 2):
        arrays = jax.tree.leaves((runner.state, runner.kv_caches))
        tiny_llm.sleep(level)
        assert all(a.is_deleted() for a in arrays)
        assert tiny_llm.wake_up(["kv_cache"]) is False  # the weights still sleep
        assert tiny_llm.wake_up() is True
        got = tiny_llm.generate(["The capital of France is"], params,
                                use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    with pytest.raises(ValueError, match=r"level must be one of \[1, 2\], got 0"):
        tiny_llm.sleep(0)
    with pytest.raises(ValueError, match="tags must be among"):
        tiny_llm.wake_up(["scheduling"])
