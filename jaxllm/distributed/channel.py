"""Channel: ordered messages from the leader (process 0) to every follower, through the
key-value store of JAX's coordination service.

Owns the keys, the wire format (pickle: every process runs the same jaxllm, and the
coordination service only admits the processes of this job) and the waits. Never decides
what a message means (executor.py does).

    leader   send(m):  key <prefix>/<rank>/<seq> := pickle(m), for every follower rank
    follower recv():   blocking get of <prefix>/<rank>/<seq>, then delete it, seq += 1

Each follower reads and deletes its own copy, so no key outlives its reader and the leader
never waits for anyone: sending costs one set per follower (a small RPC to the service), one
message per engine step (executor.py batches the calls of a step).

Timeouts. A follower waits for the next message in POLL_SECONDS slices, forever while the
leader lives (a server may be idle for hours). It does not need a timeout to notice a dead
leader: the coordination service runs in the leader's process, and when it goes away JAX's
client in every follower aborts the process (measured: within seconds). A follower that dies
is reported by the service after `jax.distributed.initialize`'s heartbeat timeout (100 s by
default), and then every process aborts, the leader included.

JAX 0.10 has no public route to this store (`jax.distributed` offers initialize,
is_initialized and shutdown); jax's own compilation cache and checkpointing use the same
client, which `client()` is the one place to reach.
"""

from __future__ import annotations

import pickle

import jax

POLL_SECONDS = 60


def client():
    """The coordination service's client of this process (after jax.distributed.initialize)."""
    from jax._src import distributed

    if distributed.global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return distributed.global_state.client


def is_timeout(error: Exception) -> bool:
    return isinstance(error, jax.errors.JaxRuntimeError) and \
        str(error).startswith("DEADLINE_EXCEEDED")


class Channel:
    def __init__(self, prefix: str, rank: int, num_processes: int):
        self.prefix = prefix
        self.rank = rank
        self.num_processes = num_processes
        self._seq = 0
        self._client = client()

    def send(self, message) -> None:
        """Leader: queue `message` for every follower."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank in range(1, self.num_processes):
            self._client.key_value_set_bytes(f"{self.prefix}/{rank}/{self._seq}", data)
        self._seq += 1

    def recv(self):
        """Follower: the leader's next message, waiting as long as the leader lives."""
        key = f"{self.prefix}/{self.rank}/{self._seq}"
        while True:
            try:
                data = self._client.blocking_key_value_get_bytes(key, POLL_SECONDS * 1000)
                break
            except Exception as e:
                if not is_timeout(e):
                    raise
        self._client.key_value_delete(key)
        self._seq += 1
        return pickle.loads(data)

    def agree_min(self, name: str, value: int, timeout_s: int) -> int:
        """Every process: the smallest of every process's `value` (e.g. the KV blocks that
        fit, which device memory decides per process). Waits up to timeout_s for the
        slowest process, then removes its own key."""
        c = self._client
        key = f"{self.prefix}/agree/{name}"
        c.key_value_set(f"{key}/{self.rank}", str(value))
        values = [int(c.blocking_key_value_get(f"{key}/{rank}", timeout_s * 1000))
                  for rank in range(self.num_processes)]
        c.wait_at_barrier(key, timeout_s * 1000)  # everyone has read every key
        c.key_value_delete(f"{key}/{self.rank}")
        return min(values)
