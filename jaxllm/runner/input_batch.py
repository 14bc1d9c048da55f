"""Host side of the runner: per-request state and the padded numpy arrays for one step.

Owns: `CachedRequestState` (the runner's own copy of each live request, built only from
`SchedulerOutput` messages) and `prepare_inputs`, which packs one step. Never touches a
scheduler `Request`, never calls jax.

Packing of one step (T = 16 bucket, S = 4 bucket, block_size 4):

    request   computed  scheduled   rows of the packed batch
    A         0         5           0..4     positions 0..4   (prefill chunk)
    B         7         1           5        position 7       (decode)
    C         4         3           6..8     positions 4..6   (chunk over a cached prefix)
    padding                         9..15    slot_mapping -> null block 0

    query_start_loc = [0, 5, 6, 9, 9]    seq_lens = [5, 8, 7, 0]    num_seqs = 3
    logits_indices  = [4, 5, 8, 0]       (last row of each sequence; padding reads row 0)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxllm.engine.sched_output import SchedulerOutput
from jaxllm.runner.buckets import BucketConfig


@dataclasses.dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: Any
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        P = len(self.prompt_token_ids)
        return (self.prompt_token_ids[start:stop]
                + self.output_token_ids[max(start - P, 0):max(stop - P, 0)])


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Host numpy arrays for one step, already padded to (T, S, W)."""

    input_ids: np.ndarray        # [T] int32
    positions: np.ndarray        # [T] int32
    slot_mapping: np.ndarray     # [T] int32
    block_tables: np.ndarray     # [S, W] int32
    seq_lens: np.ndarray         # [S] int32
    query_start_loc: np.ndarray  # [S + 1] int32
    num_seqs: np.ndarray         # [] int32
    logits_indices: np.ndarray   # [S] int32, last packed row of each sequence
    req_ids: list[str]           # the real sequences, in row order
    samples: list[bool]          # per real sequence: does this step end its known tokens?

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.input_ids.shape[0], self.seq_lens.shape[0], self.block_tables.shape[1])


def update_states(states: dict[str, CachedRequestState], so: SchedulerOutput) -> None:
    """Apply one SchedulerOutput's diffs to the runner's request states."""
    for req_id in so.finished_req_ids | so.preempted_req_ids:
        states.pop(req_id, None)
    for new in so.scheduled_new_reqs:
        states[new.req_id] = CachedRequestState(
            new.req_id, list(new.prompt_token_ids), list(new.output_token_ids),
            new.sampling_params, list(new.block_ids), new.num_computed_tokens)
    for cached in so.scheduled_cached_reqs:
        st = states[cached.req_id]
        st.block_ids.extend(cached.new_block_ids)
        st.num_computed_tokens = cached.num_computed_tokens


def prepare_inputs(states: dict[str, CachedRequestState], so: SchedulerOutput,
                   buckets: BucketConfig, block_size: int) -> StepInputs:
    req_ids = [r.req_id for r in so.scheduled_new_reqs] + \
              [r.req_id for r in so.scheduled_cached_reqs]
    num_tokens = so.total_num_scheduled_tokens
    max_blocks = max(len(states[r].block_ids) for r in req_ids)
    T, S, W = buckets.pad(num_tokens, len(req_ids), max_blocks)

    input_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    # Padding rows write their (garbage) K/V into the null block 0, which nobody reads.
    slot_mapping = np.zeros(T, np.int32)
    block_tables = np.zeros((S, W), np.int32)
    seq_lens = np.zeros(S, np.int32)
    query_start_loc = np.zeros(S + 1, np.int32)
    logits_indices = np.zeros(S, np.int32)
    samples = []
    row = 0
    for i, req_id in enumerate(req_ids):
        st = states[req_id]
        n = so.num_scheduled_tokens[req_id]
        start = st.num_computed_tokens
        pos = np.arange(start, start + n, dtype=np.int32)
        blocks = np.asarray(st.block_ids, np.int32)
        input_ids[row:row + n] = st.token_slice(start, start + n)
        positions[row:row + n] = pos
        slot_mapping[row:row + n] = blocks[pos // block_size] * block_size + pos % block_size
        block_tables[i, :len(blocks)] = blocks
        seq_lens[i] = start + n
        row += n
        query_start_loc[i + 1] = row
        logits_indices[i] = row - 1
        samples.append(start + n >= st.num_tokens)
    query_start_loc[len(req_ids) + 1:] = row
    return StepInputs(input_ids, positions, slot_mapping, block_tables, seq_lens,
                      query_start_loc, np.asarray(len(req_ids), np.int32), logits_indices,
                      req_ids, samples)
