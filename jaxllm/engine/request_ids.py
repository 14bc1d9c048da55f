"""Request ids in flight: the one request-id uniqueness check, and ids for requests without one.

Owns the set of ids that unfinished requests use: each parent's id and its `n` children's
(`"{index}_{request_id}"`, the ids the scheduler sees). One `RequestIds` serves every front
end of an engine and every data-parallel replica behind one front end, and an id is taken
from the moment a front end accepts the request, before any engine thread admits it:

    front end (any thread)          engine thread(s)
    reserve([("x", 2)])  -> takes x, 0_x, 1_x, or raises ValueError; nothing is queued
      ... admit ...                 OutputProcessor: the parent's last child ends
                                    -> release("x")  (outputs already built)

So `"0_x"` (n=1) and then `"x"` with n=2 collide here, as ValueError, instead of inside the
engine loop. Never looks at prompts, never schedules; thread-safe (one lock).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence


def child_request_ids(request_id: str, n: int) -> list[str]:
    """The ids the `n` samples of one request run under (the parent's own id when n == 1)."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


class RequestIds:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_parent: dict[str, frozenset[str]] = {}  # parent id -> every id it uses
        self._taken: set[str] = set()
        self._counter = itertools.count()

    def reserve(self, requests: Sequence[tuple[str | None, int]]) -> list[str]:
        """Take the ids of a batch, all or nothing. requests: (request_id or None, n) each;
        -> the parent ids, drawn ("0", "1", ..., skipping ids in use) where None was given.
        ValueError names the first id that is in flight or repeated within the batch."""
        with self._lock:
            batch: set[str] = set()
            plan: list[tuple[str, frozenset[str]]] = []
            for request_id, n in requests:
                if request_id is None:
                    request_id = self._draw(batch, n)
                elif not isinstance(request_id, str):
                    raise ValueError(f"request_id must be a str, got "
                                     f"{type(request_id).__name__}")
                ids = frozenset([request_id, *child_request_ids(request_id, n)])
                for rid in sorted(ids, key=lambda r: r != request_id):  # the parent's first
                    if rid in self._taken or rid in batch:
                        raise ValueError(_collision(request_id, n, rid))
                batch |= ids
                plan.append((request_id, ids))
            for request_id, ids in plan:
                self._by_parent[request_id] = ids
                self._taken |= ids
            return [request_id for request_id, _ in plan]

    def release(self, request_id: str) -> None:
        """The parent `request_id` has finished (or was aborted): its ids are free again."""
        with self._lock:
            self._taken -= self._by_parent.pop(request_id, frozenset())

    def __contains__(self, request_id: str) -> bool:
        """Is this id (a parent's or a child's) in flight?"""
        return request_id in self._taken

    def __len__(self) -> int:
        """Parents in flight."""
        return len(self._by_parent)

    def _draw(self, batch: set[str], n: int) -> str:
        while True:
            request_id = str(next(self._counter))
            ids = {request_id, *child_request_ids(request_id, n)}
            if not ids & self._taken and not ids & batch:
                return request_id


def _collision(request_id: str, n: int, rid: str) -> str:
    if rid == request_id:
        return (f"request_id {request_id!r} is already in flight: request ids must be unique "
                "among unfinished requests")
    return (f"request_id {request_id!r} with n={n} runs its samples as {rid!r}, an id already "
            "in flight: request ids, and the '<index>_<request_id>' ids of their n > 1 "
            "samples, must be unique among unfinished requests")
