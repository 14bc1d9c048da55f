"""The engine on a fake accelerator (its memory stats injected): the KV cache is sized from
the profiled largest bucket, every warmed-up bucket is checked against the reservation, and
with enforce_eager each bucket is checked as it compiles. The CPU default is covered by every
other engine test."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from jaxllm.config import EngineConfig
from jaxllm.llm_engine import LLMEngine
from jaxllm.runner.kv_cache import DeviceMemory, kv_bytes_per_block

from tiny_model import greedy

MiB = 1 << 20
FAKE = DeviceMemory(bytes_limit=200 * MiB, bytes_in_use=3 * MiB)


def _engine(tiny_model_dir, **overrides) -> LLMEngine:
    config = EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=4,
                          max_num_batched_tokens=8, max_model_len=128,
                          disable_log_stats=True, **overrides)
    return LLMEngine(config, use_tqdm=False, read_device_memory=lambda devices: FAKE)


def _generate(engine: LLMEngine) -> list[int]:
    engine.add_request(None, [100, 101, 102, 103, 104], greedy(4), request_id="a")
    while engine.has_unfinished_requests():
        outs = engine.step()
    return outs[0].outputs[0].token_ids


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["warmup", "eager"])
def test_cache_sized_from_the_compiled_step(tiny_model_dir, caplog, enforce_eager):
    with caplog.at_level(logging.INFO, logger="jaxllm.llm_engine"):
        engine = _engine(tiny_model_dir, enforce_eager=enforce_eager)
    runner, sizing = engine.runner, engine.kv_sizing
    per_block = kv_bytes_per_block(engine.model_config, 16, "float32")
    largest = (8, 8)  # T = max_num_batched_tokens, W = 128 / 16
    assert sizing.reserved_for.startswith(f"bucket {largest}: temporaries ")
    assert sizing.budget_bytes == int(0.9 * FAKE.bytes_limit)
    assert sizing.in_use_bytes == FAKE.bytes_in_use
    want = (sizing.budget_bytes - FAKE.bytes_in_use - sizing.reserved_bytes) // per_block
    assert runner.num_blocks == engine.kv_cache_manager.num_blocks == sizing.num_blocks == want
    assert [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("KV cache sizing")] == [
        f"{sizing.describe()}; profiled in " + caplog.records[-1].getMessage().split(
            "profiled in ")[-1]]
    if not enforce_eager:
        steps = runner.step_memory()
        assert sorted(steps) == [(2, 8), (4, 8), (8, 8)]
        # The profile's cache size (the most blocks that fit) is not the final one; the
        # step's needs are the same at both.
        assert steps[largest].reserve_bytes == sizing.reserved_bytes
        assert max(m.reserve_bytes for m in steps.values()) == sizing.reserved_bytes
        assert len(_generate(engine)) == 4
        return
    assert runner.step_memory() == {}  # nothing compiled beyond the profile
    # Buckets compiled while serving are checked as they come: one byte less reserved than
    # the largest bucket needs warns for it, not for the decode bucket (2, 8).
    engine.kv_sizing = dataclasses.replace(sizing, reserved_bytes=sizing.reserved_bytes - 1)
    with pytest.warns(RuntimeWarning) as record:
        assert len(_generate(engine)) == 4
    assert [str(w.message).split(" needs")[0] for w in record] == [
        f"the step compiled for bucket {largest}"]
    assert sorted(runner.step_memory()) == [(2, 8), (8, 8)]


def test_the_config_still_overrides_a_device(tiny_model_dir):
    engine = _engine(tiny_model_dir, enforce_eager=True, kv_cache_memory_bytes=64 * MiB)
    assert engine.kv_sizing is None
    per_block = kv_bytes_per_block(engine.model_config, 16, "float32")
    assert engine.runner.num_blocks == 64 * MiB // per_block
