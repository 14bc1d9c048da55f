"""Which data-parallel replica serves a request: prefix-cache affinity first, then the
shortest queue.

Owns the router's own record of which replica last computed each prompt prefix (the chained
hashes of full blocks, engine/block_hash.py) and each replica's load (the requests routed to
it and not finished). Never reads a replica's block pool: the replicas run on their own
threads, and a record kept here is cheap and good enough, since a wrong guess (a prefix the
replica has evicted since) costs a recomputed prefix, never a wrong answer.

    route(prompt):  hashes h0 h1 h2 h3 of its full blocks
                    record:  h0 -> 1, h1 -> 1, h2 -> 0         longest known prefix: h2
                    -> replica 0, unless replica 0 has more than `max_imbalance` requests
                       more than the least loaded replica, which then gets it
                    record h0..h3 -> the chosen replica

All `n` samples of a request go with it (the front end routes the parent). Pure Python, no
locks: the front end calls it from its event loop only.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from jaxllm.engine.block_hash import BlockHash, hash_prefix


class DPRouter:
    def __init__(self, num_replicas: int, block_size: int, *, max_imbalance: int,
                 capacity: int, prefix_affinity: bool = True):
        """max_imbalance: how many more unfinished requests than the least loaded replica
        the replica holding a request's prefix may have and still get it (the engine uses
        max_num_seqs: beyond one full batch, queueing costs more than a recomputed prefix).
        capacity: prefixes remembered (the engine uses the replicas' KV blocks in all)."""
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.block_size = block_size
        self.max_imbalance = max_imbalance
        self.capacity = capacity
        self.prefix_affinity = prefix_affinity
        self.load = [0] * num_replicas
        self.routed = [0] * num_replicas  # requests ever routed to each replica
        self._owner: collections.OrderedDict[BlockHash, int] = collections.OrderedDict()

    def route(self, prompt_token_ids: Sequence[int]) -> int:
        """Choose the replica for a new request and count it there (call `finished` when it
        ends)."""
        hashes = hash_prefix(prompt_token_ids, self.block_size) if self.prefix_affinity else []
        least = min(range(len(self.load)), key=self.load.__getitem__)
        replica = least
        holder = next((self._owner[h] for h in reversed(hashes) if h in self._owner), None)
        if holder is not None and self.load[holder] - self.load[least] <= self.max_imbalance:
            replica = holder
        for h in hashes:
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
        self.load[replica] += 1
        self.routed[replica] += 1
        return replica

    def finished(self, replica: int) -> None:
        self.load[replica] -= 1

    def forget(self, replica: int) -> None:
        """The replica's prefix cache was reset: none of its prefixes is cached now."""
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]
