"""The persistent input batch: slot-indexed host arrays of every request the runner holds.

Owns the runner's copy of each live request, built only from `SchedulerOutput` messages:
its tokens, counters, block table and sampling parameters, one row per slot. Rows change
only when a request joins (a slot is filled), leaves (the slot is freed) or grows (new block
ids, new tokens); packing a step is then a few vectorised numpy gathers, with no loop over
tokens or vocabulary. Never touches a scheduler `Request`, never calls jax (the runner
flushes the device rows below).

The rows the step reads by slot live on the device (`slot_rows()`, each a `DeviceRows`: the
block table, the bad words, the allowed-token bits): written here when a request joins or
grows, sent by the runner as diffs, gathered in the step by `slot_S`. A packed step carries
none of them.

Packing of one step (T = 16 bucket, S = 4 bucket, block_size 4):

    request   computed  scheduled   rows of the packed batch
    A         0         5           0..4     positions 0..4   (prefill chunk)
    B         7         1           5        position 7       (decode)
    C         4         3           6..8     positions 4..6   (chunk over a cached prefix)
    padding                         9..15    slot_mapping -> slots 0..3 of null block 0

    query_start_loc = [0, 5, 6, 9, 9]    seq_lens = [5, 8, 7, 0]    num_seqs = 3
    logits_indices  = [4, 5, 8, 0]       (last row of each sequence; padding reads row 0)

Counters per slot (async scheduling keeps one step in flight):

    num_tokens_known  tokens whose ids the host has (prompt, and outputs already fetched)
    num_tokens        known + sampled by dispatched steps (their ids are on the device)
    a row at a position >= num_tokens_known takes its id from the device (from_device_T).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxllm.messages import NewRequestData, SchedulerOutput
from jaxllm.runner.buckets import BucketConfig
from jaxllm.runner.device_rows import DeviceRows, entry_buckets, row_buckets
from jaxllm.runner.step_features import StepFeature
from jaxllm.runner.sampling_metadata import (ALL_LOGPROBS, MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS,
                                             NO_TOKEN, SamplingMetadata, SamplingSlots,
                                             allowed_token_bits, bad_words_rows)


@dataclasses.dataclass(frozen=True)
class HostStep:
    """Host numpy arrays for one step, padded to (T, S, W), plus what fetching needs. The
    block tables are not here: the step gathers them on the device (`InputBatch.block_tables`
    reads the same rows from the host mirror)."""

    input_ids: np.ndarray        # [T] int32 (0 where from_device)
    positions: np.ndarray        # [T] int32
    slot_mapping: np.ndarray     # [T] int32
    width: int                   # W, the block-table width bucket
    seq_lens: np.ndarray         # [S] int32
    query_start_loc: np.ndarray  # [S + 1] int32
    num_seqs: np.ndarray         # [] int32
    slot_T: np.ndarray           # [T] int32, R for padding rows
    from_device_T: np.ndarray    # [T] bool
    logits_indices: np.ndarray   # [S] int32
    slot_S: np.ndarray           # [S] int32, R for padding sequences
    samples_S: np.ndarray        # [S] bool
    prompt_targets_T: np.ndarray  # [T] int32
    wants_prompt_logprobs_T: np.ndarray  # [T] bool
    sampling: SamplingMetadata
    req_ids: list[str]           # the real sequences, in row order
    generations: np.ndarray      # [num_seqs] int64, slot occupancy id when packed
    # req_id -> (first row, end row, first prompt position scored, top-k asked) of its
    # prompt logprobs
    prompt_logprob_spans: dict[str, tuple[int, int, int, int]]
    # step feature name -> what it must remember of this step (StepFeature.prepare), for
    # the features that have something to fetch
    feature_records: dict = dataclasses.field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.input_ids.shape[0], self.seq_lens.shape[0], self.width)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 block_size: int, eos_token_ids: Sequence[int], vocab_size: int = 0,
                 features: tuple[StepFeature, ...] = ()):
        """features: the engine's step features; their per-slot tables join slot_rows()
        and they see every request that joins and every step packed."""
        R = max_num_reqs
        self.features = tuple(features)
        self.max_num_reqs = R
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.req_ids: list[str | None] = [None] * R
        self.req_id_to_slot: dict[str, int] = {}
        self._free_slots = list(range(R - 1, -1, -1))  # pop() hands out the lowest slot
        self._next_generation = 0
        self.generation = np.full(R, -1, np.int64)  # which occupancy of the slot this is
        self.token_ids = np.zeros((R, max_model_len), np.int32)
        self.num_prompt_tokens = np.zeros(R, np.int32)
        self.num_tokens_known = np.zeros(R, np.int32)
        self.num_tokens = np.zeros(R, np.int32)
        self.num_computed_tokens = np.zeros(R, np.int32)
        # Draft tokens this step (speculative decoding): in token_ids right after the known
        # ones, fed from the host like known tokens.
        self.num_draft_tokens = np.zeros(R, np.int32)
        self.num_blocks = np.zeros(R, np.int32)
        self.num_prompt_logprobs = np.full(R, -1, np.int32)
        self.sampling = SamplingSlots(R)
        self.vocab_size = vocab_size
        # Block ids past num_blocks are 0 (the null block). A decode step appends one block
        # per request every block_size tokens: entries, not rows.
        self.block_table = DeviceRows(R, (max_blocks_per_req,), np.int32, 0,
                                      entry_buckets=entry_buckets(max(R, max_blocks_per_req)))
        # A few short sequences per request at most: entries.
        self.bad_words = DeviceRows(R, (MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), np.int32,
                                    NO_TOKEN,
                                    entry_buckets=entry_buckets(MAX_BAD_WORDS
                                                                * MAX_BAD_WORD_TOKENS))
        # A restricting set clears most of its ceil(V / 32) words: whole rows.
        self.allowed_token_bits = DeviceRows(R, (-(-vocab_size // 32),), np.uint32,
                                             0xFFFFFFFF, row_buckets=row_buckets(R))

    def slot_rows(self) -> dict[str, DeviceRows]:
        """The per-slot tables the step reads on the device, by the step input they fill."""
        rows = {"block_tables": self.block_table, "bad_words": self.bad_words,
                "allowed_token_bits": self.allowed_token_bits}
        for feature in self.features:
            rows.update(feature.slot_rows())
        return rows

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_slot)

    # ---- rows join and leave -----------------------------------------------------------

    def add_request(self, new: NewRequestData) -> int:
        if new.req_id in self.req_id_to_slot:
            raise ValueError(f"request {new.req_id!r} is already in the input batch")
        slot = self._free_slots.pop()
        tokens = [*new.prompt_token_ids, *new.output_token_ids]
        self.req_ids[slot] = new.req_id
        self.req_id_to_slot[new.req_id] = slot
        self.generation[slot] = self._next_generation
        self._next_generation += 1
        self.token_ids[slot, :len(tokens)] = tokens
        self.num_prompt_tokens[slot] = len(new.prompt_token_ids)
        self.num_tokens_known[slot] = self.num_tokens[slot] = len(tokens)
        self.num_draft_tokens[slot] = 0
        self.num_computed_tokens[slot] = new.num_computed_tokens
        # The whole row, zeros past the request's blocks: only the columns that differ from
        # the slot's previous occupant are sent.
        row = np.zeros(self.block_table.row_size, np.int32)
        row[:len(new.block_ids)] = new.block_ids
        self.block_table.set_row(slot, row)
        self.num_blocks[slot] = len(new.block_ids)
        p = new.sampling_params
        self.num_prompt_logprobs[slot] = (-1 if p.prompt_logprobs is None else ALL_LOGPROBS
                                          if p.prompt_logprobs == -1 else p.prompt_logprobs)
        self.sampling.add(slot, p, p.seed, self.eos_token_ids)
        # Rows a request does not use are set back to their fill value: nothing is sent
        # unless the slot's previous occupant used them.
        self.bad_words.set_row(slot, bad_words_rows(p.bad_words_token_ids))
        self.allowed_token_bits.set_row(slot, allowed_token_bits(p.allowed_token_ids,
                                                                 self.vocab_size))
        for feature in self.features:
            feature.add_request(slot, new)
        return slot

    def remove_request(self, req_id: str) -> None:
        slot = self.req_id_to_slot.pop(req_id, None)
        if slot is None:
            return
        self.req_ids[slot] = None
        self.generation[slot] = -1
        self._free_slots.append(slot)
        self._free_slots.sort(reverse=True)

    def _cut_blocks(self, slot: int, num_blocks: int) -> None:
        """Keep the first num_blocks (the scheduler gave the rest back); null past them."""
        n = int(self.num_blocks[slot])
        if num_blocks < n:
            self.block_table.set(slot, np.arange(num_blocks, n), 0)
            self.num_blocks[slot] = num_blocks

    def _append_blocks(self, slot: int, block_ids: Sequence[int]) -> None:
        if not block_ids:
            return  # most decode steps: no new block
        n = int(self.num_blocks[slot])
        self.block_table.set(slot, np.arange(n, n + len(block_ids)), block_ids)
        self.num_blocks[slot] = n + len(block_ids)

    def update_states(self, so: SchedulerOutput) -> None:
        """Apply one SchedulerOutput's joins, leaves and diffs."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            self.add_request(new)
        for cached in so.scheduled_cached_reqs:
            slot = self.req_id_to_slot[cached.req_id]
            if cached.num_blocks_before is not None:
                self._cut_blocks(slot, cached.num_blocks_before)
            self._append_blocks(slot, cached.new_block_ids)
            self.num_computed_tokens[slot] = cached.num_computed_tokens
            self._set_drafts(slot, so.scheduled_spec_decode_tokens.get(cached.req_id, ()))
        for feature in self.features:
            feature.update_states(so, self.req_id_to_slot)

    def _set_drafts(self, slot: int, drafts: Sequence[int]) -> None:
        known = int(self.num_tokens_known[slot])
        self.token_ids[slot, known:known + len(drafts)] = drafts
        self.num_draft_tokens[slot] = len(drafts)

    # ---- one step ------------------------------------------------------------------------

    def prepare(self, so: SchedulerOutput, buckets: BucketConfig) -> HostStep:
        """Pack the scheduled rows (after `update_states`) and advance the counters: computed
        tokens by what is scheduled, and num_tokens by one for each sequence that samples."""
        req_ids = [r.req_id for r in so.scheduled_new_reqs] + \
                  [r.req_id for r in so.scheduled_cached_reqs]
        n = len(req_ids)
        slots = np.fromiter((self.req_id_to_slot[r] for r in req_ids), np.int64, n)
        num_sched = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), np.int32, n)
        total = int(num_sched.sum())
        T, S, W = buckets.pad(total, n, int(self.num_blocks[slots].max()))
        R, bs = self.max_num_reqs, self.block_size

        start = self.num_computed_tokens[slots]
        ends = np.cumsum(num_sched, dtype=np.int32)
        row_seq = np.repeat(np.arange(n), num_sched)  # [total] sequence of each row
        pos = (start[row_seq] + np.arange(total, dtype=np.int32)
               - (ends - num_sched)[row_seq]).astype(np.int32)
        row_slot = slots[row_seq]
        from_device = pos >= (self.num_tokens_known + self.num_draft_tokens)[row_slot]
        ids = np.where(from_device, 0, self.token_ids[row_slot, np.minimum(
            pos, self.max_model_len - 1)])

        input_ids = np.zeros(T, np.int32)
        input_ids[:total] = ids
        positions = np.zeros(T, np.int32)
        positions[:total] = pos
        # Padding rows write their (garbage) K/V into the null block 0, which nobody reads.
        slot_mapping = np.arange(T, dtype=np.int32) % bs
        slot_mapping[:total] = self.block_table.host[row_slot, pos // bs] * bs + pos % bs
        slot_T = np.full(T, R, np.int32)
        slot_T[:total] = row_slot
        from_device_T = np.zeros(T, bool)
        from_device_T[:total] = from_device
        seq_lens_real = start + num_sched
        seq_lens = np.zeros(S, np.int32)
        seq_lens[:n] = seq_lens_real
        query_start_loc = np.full(S + 1, total, np.int32)
        query_start_loc[0] = 0
        query_start_loc[1:n + 1] = ends
        logits_indices = np.zeros(S, np.int32)
        logits_indices[:n] = ends - 1
        slot_S = np.full(S, R, np.int32)
        slot_S[:n] = slots
        samples = seq_lens_real >= self.num_tokens[slots]
        samples_S = np.zeros(S, bool)
        samples_S[:n] = samples

        prompt_lens = self.num_prompt_tokens[slots]
        num_output = np.maximum(seq_lens_real - prompt_lens, 0).astype(np.int32)
        sampling = self.sampling.gather(slots, num_output, prompt_lens, S)
        targets, wants, spans = self._prompt_logprob_targets(
            T, req_ids, slots, start, num_sched, ends)

        self.num_computed_tokens[slots] = seq_lens_real
        self.num_tokens[slots[samples]] += 1
        step = HostStep(input_ids, positions, slot_mapping, W, seq_lens,
                        query_start_loc, np.asarray(n, np.int32), slot_T, from_device_T,
                        logits_indices, slot_S, samples_S, targets, wants, sampling, req_ids,
                        self.generation[slots].copy(), spans)
        for feature in self.features:
            record = feature.prepare(step)
            if record is not None:
                step.feature_records[feature.name] = record
        return step

    def block_tables(self, step: HostStep) -> np.ndarray:
        """[S, W] the block tables of a step just packed, from the host mirror: what the
        step gathers on the device (padding sequences read row R, all null blocks)."""
        return self.block_table.host[step.slot_S, :step.width]

    def _prompt_logprob_targets(self, T, req_ids, slots, start, num_sched, ends):
        """Row p of a request scores prompt token p + 1, so a chunk at positions start..stop-1
        yields prompt logprobs for tokens start+1..stop (the last prompt token has no row:
        the position after it predicts the first output)."""
        targets = np.zeros(T, np.int32)
        wants = np.zeros(T, bool)
        spans = {}
        for i in np.flatnonzero(self.num_prompt_logprobs[slots] >= 0):
            slot, first = slots[i], int(start[i])
            prompt_len = int(self.num_prompt_tokens[slot])
            stop = min(first + int(num_sched[i]), prompt_len - 1)
            if stop <= first:
                continue
            lo = int(ends[i] - num_sched[i])
            targets[lo:lo + stop - first] = self.token_ids[slot, first + 1:stop + 1]
            wants[lo:lo + stop - first] = True
            spans[req_ids[i]] = (lo, lo + stop - first, first + 1,
                                 int(self.num_prompt_logprobs[slot]))
        return targets, wants, spans

    def record_sampled(self, step: HostStep, sampled_SP: np.ndarray,
                       num_sampled_S: np.ndarray | None = None) -> list[list[int]]:
        """Write a fetched step's sampled tokens into the rows that still hold the same
        requests; -> the sampled ids per real sequence ([] where it did not sample).
        sampled_SP [S, P]: the first num_sampled_S[i] of row i (None: one each; more than
        one when a step feature emitted an accepted speculative run)."""
        sampled_SP = np.asarray(sampled_SP)
        if sampled_SP.ndim == 1:
            sampled_SP = sampled_SP[:, None]
        out = []
        for i, req_id in enumerate(step.req_ids):
            if not step.samples_S[i]:
                out.append([])
                continue
            n = 1 if num_sampled_S is None else int(num_sampled_S[i])
            tokens = [int(t) for t in sampled_SP[i, :n]]
            out.append(tokens)
            slot = step.slot_S[i]
            if self.generation[slot] != step.generations[i]:
                continue  # the request left (finished, preempted) after this step was sent
            known = int(self.num_tokens_known[slot])
            stop = min(known + n, self.max_model_len)
            self.token_ids[slot, known:stop] = tokens[:stop - known]
            self.num_tokens_known[slot] = known + n
            self.num_tokens[slot] += n - 1  # prepare counted one
        return out
