"""Sleep mode (vLLM's `sleep(level)` / `wake_up(tags)` / `is_sleeping()`): give the device
memory back while no request runs, then take it again.

    level 1: the weights are copied to host memory and their device buffers deleted; the
             KV cache's device buffers are deleted (its contents are lost, and with them
             every cached prefix).
    level 2: the weights' and the KV cache's device buffers are deleted and nothing is
             kept; wake_up reads the weights from the checkpoint again.

wake_up(tags): "weights" and/or "kv_cache" (vLLM's tags; None: both). A fresh, zero KV cache
comes back with "kv_cache"; the engine stays asleep until both are back.

Owns only this state and its rules; the moves of device arrays are the runner's
(ModelRunner.release_device_memory / restore_device_memory, runner/device_sleep.py). Runs on
the engine thread (through the engine loop's "call"), like every other touch of the engine.
Never sleeps with requests in flight (it refuses), never imports jax, and never lets a step
run while asleep: the front end refuses requests until wake_up (async_llm.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

SLEEP_LEVELS = (1, 2)
WAKE_UP_TAGS = ("weights", "kv_cache")


class SleepMode:
    def __init__(self, engine, reload_state: Callable[[], object]):
        """engine: the LLMEngine (its runner's state and kv_caches move); reload_state:
        -> the weights' nnx state read from the checkpoint again (level 2's wake_up)."""
        self.engine = engine
        self.reload_state = reload_state
        self.level: int | None = None
        self.asleep: set[str] = set()  # the tags still asleep
        self._host_weights = None  # level 1: the weights' host copy

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def sleep(self, level: int = 1) -> None:
        if level not in SLEEP_LEVELS:
            raise ValueError(f"level must be one of {list(SLEEP_LEVELS)}, got {level!r}")
        engine = self.engine
        if engine.has_unfinished_requests():
            raise ValueError("cannot sleep while requests are unfinished")
        if self.is_sleeping:
            return  # as vLLM: sleeping again is a no-op
        if not engine.reset_prefix_cache():  # the KV contents go: so do the cached prefixes
            raise ValueError("cannot sleep while KV blocks are held")
        self._host_weights = engine.model_runner.release_device_memory(
            keep_weights_on_host=level == 1)
        self.level, self.asleep = level, set(WAKE_UP_TAGS)
        engine.metrics.sleep_level = level
        logger.info("sleeping at level %d: the weights' and the KV cache's device buffers "
                    "are released", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = list(WAKE_UP_TAGS) if tags is None else tags
        bad = [t for t in tags if t not in WAKE_UP_TAGS]
        if bad:
            raise ValueError(f"tags must be among {list(WAKE_UP_TAGS)}, got {bad[0]!r}")
        weights = "weights" in tags and "weights" in self.asleep
        kv_cache = "kv_cache" in tags and "kv_cache" in self.asleep
        self.engine.model_runner.restore_device_memory(weights, kv_cache, self._host_weights,
                                                       self.reload_state)
        if weights:
            self._host_weights = None
        self.asleep -= {t for t, back in (("weights", weights), ("kv_cache", kv_cache)) if back}
        if not self.asleep:
            self.level = None
            self.engine.metrics.sleep_level = 0
            logger.info("awake: weights and KV cache are back on the device")


__all__ = ["SLEEP_LEVELS", "SleepMode", "WAKE_UP_TAGS"]
