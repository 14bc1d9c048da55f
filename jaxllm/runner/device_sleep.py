"""The device side of sleep mode (jaxllm/engine/sleep.py decides when): release a runner's
weights and KV cache from the device, and bring them back.

Owns only these moves of jax arrays. Never decides whether sleeping is allowed (the engine
side refuses while requests are unfinished) and never touches a request.
"""

from __future__ import annotations

from collections.abc import Callable

import jax


class HostWeights:
    """The weights copied to host memory (sleep level 1), with where each array lived."""

    def __init__(self, state):
        leaves = jax.tree.leaves(state)
        self.arrays = jax.device_get(leaves)
        self.shardings = [a.sharding for a in leaves]

    def to_device(self, like):
        restored = [jax.device_put(h, s) for h, s in zip(self.arrays, self.shardings)]
        return jax.tree.unflatten(jax.tree.structure(like), restored)


def release(runner, keep_weights_on_host: bool) -> HostWeights | None:
    """Delete the device buffers of the runner's weights and KV cache; -> the host copy of
    the weights when asked for one."""
    jax.block_until_ready(jax.tree.leaves((runner.state, runner.kv_caches)))
    host = HostWeights(runner.state) if keep_weights_on_host else None
    for array in jax.tree.leaves((runner.state, runner.kv_caches)):
        array.delete()
    return host


def restore_weights(runner, host: HostWeights | None, reload_state: Callable[[], object]):
    """The weights back on the device: from the host copy, else read again."""
    if host is not None:
        runner.state = host.to_device(runner.state)
        return
    state = reload_state()
    if jax.tree.structure(state) != jax.tree.structure(runner.state):
        raise RuntimeError("the checkpoint read at wake_up has another structure")
    runner.state = state


def restore_kv_cache(runner) -> None:
    """A fresh, zero KV cache (no request holds a block while asleep)."""
    runner.reset_device_state()


__all__ = ["HostWeights", "release", "restore_kv_cache", "restore_weights"]
