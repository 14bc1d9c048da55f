"""LLM.sleep / LLM.wake_up offline (vLLM's names), on the session's shared tiny engine: the
device buffers are really released, and what comes back is bit for bit what left. No
generation here (no step to compile): the server's test (tests/entrypoints/
test_frontend_routes.py) checks levels 1 and 2 give the same tokens and logprobs after
waking. Level 2 is not run on this shared engine: it reads the checkpoint again, which
would undo any test's edit of the live weights."""

from __future__ import annotations

import jax
import numpy as np
import pytest


def test_sleep_level_1_releases_and_restores_the_same_arrays(tiny_llm):
    runner = tiny_llm.llm_engine.model_runner
    weights = jax.tree.leaves(runner.state)
    before = [np.asarray(a) for a in weights]
    before_kv = jax.tree.leaves(runner.kv_caches)
    arrays = weights + before_kv
    tiny_llm.sleep(1)
    assert all(a.is_deleted() for a in arrays)
    assert tiny_llm.wake_up(["kv_cache"]) is False  # the weights still sleep
    kv = jax.tree.leaves(runner.kv_caches)
    assert [(a.shape, a.dtype) for a in kv] == [(a.shape, a.dtype) for a in before_kv]
    # The same placement: a step's output cache may spell a one-device mesh's sharding as P()
    # where the fresh cache says P(None, None, "tp", None); both put every block on the same
    # device, which is what equivalence checks.
    assert all(a.sharding.is_equivalent_to(b.sharding, a.ndim) for a, b in zip(kv, before_kv))
    assert all(not np.asarray(a).any() for a in kv)  # a fresh, zero cache
    assert tiny_llm.wake_up() is True
    after = jax.tree.leaves(runner.state)
    assert [a.sharding for a in after] == [a.sharding for a in weights]
    assert all(np.array_equal(b, np.asarray(a)) for b, a in zip(before, after))
    with pytest.raises(ValueError, match=r"level must be one of \[1, 2\], got 0"):
        tiny_llm.sleep(0)
    with pytest.raises(ValueError, match="tags must be among"):
        tiny_llm.wake_up(["scheduling"])
