"""Static shapes: every device batch is padded up to a bucket from a small sorted list.

Owns: the bucket lists and the padding rule (one `bisect`). A step never runs at a shape
outside `BucketConfig.all_shapes()`, so compiling those at start-up is all the compiling
serving will ever do.

Three padded sizes per step:
  T  tokens             powers of two in [2, max_num_batched_tokens], and `extra_tokens` in
                        that range (speculative decoding's 1 + k: a batch-1 verify step runs
                        its 1 + k rows unpadded, not padded to the next power of two; the
                        kernels give a row the same bits in any T). Batch-1 decode runs at
                        T = 2 (one padding row), never T = 1: with a single row XLA turns the
                        KV write (a scatter) into a dynamic-update-slice that it cannot do in
                        place next to the attention's reads, and copies every layer's whole
                        cache per step (measured: 550 ms per step on a 1 GiB cache).
  S  sequences          tied to T: min(T, S_max); a step never has more sequences than
                        tokens, and tying them keeps the number of compiled shapes linear
  W  block-table width  blocks per sequence. Every attention backend reads only each
                        sequence's own pages, so the engine uses one width (max_model_len /
                        block_size); bucketed widths (powers of 4) remain for tools and tests.
"""

from __future__ import annotations

import bisect
import dataclasses


def power_of_two_buckets(lo: int, hi: int, base: int = 2) -> tuple[int, ...]:
    """Sorted powers of `base` from lo up, always ending exactly at hi."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= base
    out.append(hi)
    return tuple(out)


def pad_to_bucket(n: int, buckets: tuple[int, ...], what: str) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{what}={n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclasses.dataclass(frozen=True)
class BucketConfig:
    token_buckets: tuple[int, ...]
    max_seqs: int  # S_max: max_num_seqs
    width_buckets: tuple[int, ...]  # block-table widths

    @classmethod
    def create(cls, max_num_batched_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
               bucket_widths: bool, min_tokens: int = 2,
               extra_tokens: tuple[int, ...] = ()) -> "BucketConfig":
        if min_tokens < 2:
            raise ValueError(f"min_tokens must be >= 2 (see the module docstring), got "
                             f"{min_tokens}")
        tokens = power_of_two_buckets(min(min_tokens, max_num_batched_tokens),
                                      max_num_batched_tokens)
        tokens = tuple(sorted(set(tokens).union(
            t for t in extra_tokens if tokens[0] <= t <= max_num_batched_tokens)))
        widths = (power_of_two_buckets(min(4, max_blocks_per_seq), max_blocks_per_seq, base=4)
                  if bucket_widths else (max_blocks_per_seq,))
        return cls(tokens, max_num_seqs, widths)

    def seqs_for(self, padded_tokens: int) -> int:
        return min(padded_tokens, self.max_seqs)

    def pad(self, num_tokens: int, num_seqs: int, max_blocks: int) -> tuple[int, int, int]:
        """-> (T, S, W) for a step; S >= num_seqs holds because num_seqs <= num_tokens."""
        T = pad_to_bucket(num_tokens, self.token_buckets, "num_tokens")
        S = self.seqs_for(T)
        assert num_seqs <= S, (num_seqs, S)
        W = pad_to_bucket(max_blocks, self.width_buckets, "blocks per sequence")
        return T, S, W

    def all_shapes(self) -> list[tuple[int, int, int]]:
        return [(T, self.seqs_for(T), W) for T in self.token_buckets for W in self.width_buckets]
