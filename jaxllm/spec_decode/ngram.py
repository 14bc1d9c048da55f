"""N-gram (prompt lookup) proposals from a request's own token history, on the host.

Owns `NgramProposer.propose` (the proposer interface of spec_decode/scheduling.py:
`begin_step(requests)`, nothing here, and `propose_for(request, k)`): vLLM's rule (ngram_proposer.py) in vectorized numpy instead
of a numba KMP loop. The longest suffix n-gram (n in [prompt_lookup_min, prompt_lookup_max])
that occurs earlier in the history is found; among its occurrences the earliest wins; the
draft is the (up to k) tokens that followed it. One `sliding_window_view` comparison per n,
no Python loop over tokens. Never sees a device or a Request.

    history  a b c d x a b c ?        suffix n=3: "a b c" (positions 5..7)
    match    a b c at 0..2            draft: d x a b ... (what followed it, up to k)
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    proposes_ahead = False  # a lookup at num_new_tokens needs no rows ahead

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def begin_step(self, requests) -> None:
        """Nothing ahead of time: a row's proposal is a lookup in its own history."""

    def propose_for(self, request, k: int) -> np.ndarray:
        return self.propose(np.asarray(request.all_token_ids, np.int64), k)

    def shutdown(self) -> None:
        pass

    def propose(self, token_ids: np.ndarray, k: int | None = None) -> np.ndarray:
        """Draft tokens (int32, length 0..k) for the history `token_ids` [N]."""
        k = self.k if k is None else min(k, self.k)
        t = np.asarray(token_ids, np.int64)
        N = t.shape[0]
        if k <= 0 or N < self.min_n + 1:
            return np.empty(0, np.int32)
        for n in range(min(self.max_n, N - 1), self.min_n - 1, -1):
            # Windows that start at 0 .. N-1-n, so none is the suffix itself.
            windows_WN = sliding_window_view(t[:N - 1], n)
            hits = np.flatnonzero((windows_WN == t[N - n:]).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return t[start:start + k].astype(np.int32)
        return np.empty(0, np.int32)
