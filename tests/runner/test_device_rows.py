"""The persistent batch's per-slot device rows (runner/device_rows.py), exactly: which
uploads a change makes, and that the device copy equals the host mirror after a scripted
run of joins, block appends, preemptions, removals and slot reuse through the input batch.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.messages import CachedRequestData, NewRequestData, SchedulerOutput
from jaxllm.runner.buckets import BucketConfig
from jaxllm.runner.device_rows import DeviceRows, entry_buckets, row_buckets
from jaxllm.runner.input_batch import InputBatch
from jaxllm.sampling_limits import NO_TOKEN
from jaxllm.sampling_params import SamplingParams

ONES = 0xFFFFFFFF


def placed(rows: DeviceRows) -> DeviceRows:
    rows.place(None)
    return rows


def assert_device_is_mirror(rows: DeviceRows) -> None:
    assert not rows.has_pending
    np.testing.assert_array_equal(np.asarray(rows.device), rows.host)


def test_bucket_lists():
    assert entry_buckets(2048) == (16, 64, 256, 1024, 2048)
    assert entry_buckets(4) == (4,)
    assert row_buckets(256) == (1, 2, 4, 8)
    assert row_buckets(3) == (1, 2, 3)


def test_entries_are_sent_once_with_their_last_value_padded_to_a_bucket():
    rows = DeviceRows(4, (8,), np.int32, 0, entry_buckets=(4, 16))
    rows.set(1, [0, 1], [7, 9])
    rows.set(1, [1], [5])  # written twice before a flush: sent once, last value
    rows.set(2, [3], [0])  # equal to the mirror: nothing to send
    [u] = rows.updates()
    assert u.kind == "entries"
    # flat index = slot * 8 + column; padding indexes past the table ((R + 1) * 8 = 40).
    np.testing.assert_array_equal(u.index, [8, 9, 40, 40])
    np.testing.assert_array_equal(u.values, [7, 5, 0, 0])
    assert u.nbytes == 4 * 4 + 4 * 4


def test_a_change_larger_than_the_largest_bucket_goes_in_several_calls():
    rows = placed(DeviceRows(4, (8,), np.int32, 0, entry_buckets=(4, 16)))
    rows.set_row(0, np.arange(1, 9))
    rows.set_row(3, np.arange(11, 17).tolist() + [0, 0])  # 6 changed (2 stay 0)
    assert [(u.kind, len(u.index)) for u in rows.updates()] == [("entries", 16)]
    rows.set_row(2, np.arange(21, 29))  # 22 entries: 16 + 6 -> buckets 16 and 16
    assert [len(u.index) for u in rows.updates()] == [16, 16]
    assert rows.flush() == 2 * 16 * 8
    assert_device_is_mirror(rows)
    np.testing.assert_array_equal(rows.host[3], [11, 12, 13, 14, 15, 16, 0, 0])


def test_dense_rows_go_whole_and_a_table_may_allow_both():
    rows = placed(DeviceRows(5, (6,), np.uint32, ONES, row_buckets=(1, 2)))
    for slot in (4, 0, 2):
        rows.set_row(slot, np.arange(6) + slot)
    # Slots sorted, chunks of the largest bucket (2), padding rows name slot R + 1 = 6.
    [a, b] = rows.updates()
    assert (a.kind, a.index.tolist(), b.index.tolist()) == ("rows", [0, 2], [4])
    np.testing.assert_array_equal(a.values, [np.arange(6), np.arange(6) + 2])
    assert rows.flush() == (2 * 4 + 2 * 24) + (4 + 24)
    assert_device_is_mirror(rows)
    np.testing.assert_array_equal(rows.host[5], [ONES] * 6)  # the fill row, untouched

    both = DeviceRows(3, (6,), np.int32, 0, entry_buckets=(4,), row_buckets=(1,))
    both.set(0, [2], [5])  # one element: an 8-byte entry beats a 28-byte row
    both.set_row(1, [1, 2, 3, 4, 5, 6])  # six elements: 48 bytes of entries, 28 of row
    assert [(u.kind, u.index.tolist()) for u in both.updates()] == [("rows", [1]),
                                                                    ("entries", [2, 24, 24, 24])]


def test_set_rows_sends_whole_only_the_rows_that_differ():
    rows = placed(DeviceRows(5, (6,), np.uint32, ONES, row_buckets=(1, 4)))
    new = np.full((3, 6), ONES, np.uint32)
    new[0, 1] = 7  # slot 3 differs in one element; slot 0 stays all ones
    new[2] = np.arange(6)  # slot 1 differs everywhere
    rows.set_rows([3, 0, 1], new)
    [u] = rows.updates()
    assert (u.kind, u.index.tolist()) == ("rows", [1, 3, 6, 6])  # sorted, padded to 4 with R + 1
    np.testing.assert_array_equal(u.values[:2], [new[2], new[0]])
    rows.flush()
    assert_device_is_mirror(rows)
    rows.set_rows([3, 1], new[[0, 2]])  # as they are: nothing to send
    assert not rows.has_pending
    for slots, match in (([0, 0], "distinct"), ([5], r"slot must be in \[0, 5\)")):
        with pytest.raises(ValueError, match=match):
            rows.set_rows(slots, new[:len(slots)])

    both = DeviceRows(3, (6,), np.int32, 0, entry_buckets=(4,), row_buckets=(1,))
    both.set_rows([0, 1], [[0, 0, 5, 0, 0, 0], [1, 2, 3, 4, 5, 6]])  # chosen per row
    assert [(u.kind, u.index.tolist()) for u in both.updates()] == [("rows", [1]),
                                                                    ("entries", [2, 24, 24, 24])]


def test_a_row_sent_whole_drops_its_earlier_entries():
    rows = DeviceRows(2, (6,), np.int32, 0, entry_buckets=(4,), row_buckets=(1,))
    rows.set(0, [0], [1])
    rows.set_row(0, [9, 9, 9, 9, 9, 9])
    assert [(u.kind, u.index.tolist()) for u in rows.updates()] == [("rows", [0])]


def test_the_fill_row_and_other_slots_outside_the_table_are_refused():
    rows = DeviceRows(2, (4,), np.int32, 0, entry_buckets=(4,))
    for slot in (2, -1):
        with pytest.raises(ValueError, match=r"slot must be in \[0, 2\)"):
            rows.set(slot, [0], [1])
    with pytest.raises(ValueError, match="entry_buckets or row_buckets"):
        DeviceRows(2, (4,), np.int32, 0)


def test_a_failed_flush_keeps_everything_pending(monkeypatch):
    rows = placed(DeviceRows(2, (4,), np.int32, 0, entry_buckets=(4,)))
    rows.set(1, [2], [7])

    def broken(key):
        raise RuntimeError("device gone")

    with monkeypatch.context() as m:
        m.setattr(rows._fns, "get", broken)
        with pytest.raises(RuntimeError, match="device gone"):
            rows.flush()
    assert rows.has_pending
    assert rows.flush() == 4 * 8
    assert_device_is_mirror(rows)


def test_place_rebuilds_a_consumed_copy_from_the_mirror():
    rows = placed(DeviceRows(2, (4,), np.int32, 0, entry_buckets=(4,)))
    rows.set(0, [0, 1], [3, 4])
    rows.flush()
    rows.device.delete()  # what a failed computation leaves of a donated array
    rows.set(1, [3], [5])
    rows.place(None)
    assert_device_is_mirror(rows)
    assert rows.host[0].tolist() == [3, 4, 0, 0] and rows.host[1].tolist() == [0, 0, 0, 5]


def test_updates_are_donated_and_compiled_once_per_bucket():
    rows = placed(DeviceRows(64, (256,), np.int32, 0, entry_buckets=(4, 16),
                             row_buckets=(1,)))
    rows.warmup()
    assert rows.num_compiles == 3
    before = rows.device
    rows.set(0, [1], [3])
    rows.flush()
    assert before.is_deleted() and rows.num_compiles == 3
    for key, fn in rows._fns.items():  # written in place: no copy of the table
        memory = fn.memory_analysis()
        assert memory.alias_size_in_bytes == rows.host.nbytes, key
        assert memory.temp_size_in_bytes < rows.host.nbytes // 4, key


# ---- through the input batch: a scripted run -----------------------------------------------

BS = 4  # block size
R = 3   # slots


def new(req_id, prompt, blocks, output=(), computed=0, bad_words_token_ids=None,
        **params) -> NewRequestData:
    p = SamplingParams(**params)
    p.seed = 0
    if bad_words_token_ids:  # as the processor fills it at admission
        p.bad_words = ["w"] * len(bad_words_token_ids)
        p._bad_words_token_ids = bad_words_token_ids
    return NewRequestData(req_id, list(prompt), list(output), p, list(blocks), computed)


def so_of(new=(), cached=(), finished=(), preempted=()) -> SchedulerOutput:
    num = {m.req_id: n for m, n in [*new, *cached]}
    return SchedulerOutput([m for m, _ in new], [m for m, _ in cached], num,
                           sum(num.values()), set(finished), set(preempted))


def run_step(batch: InputBatch, so: SchedulerOutput) -> dict[str, int]:
    """What the runner does with one step's rows: apply, pack, flush; -> bytes per table.
    Checks that the device copies equal the mirrors and that the step's gathered block
    tables are the packed ones."""
    batch.update_states(so)
    step = batch.prepare(so, BucketConfig.create(32, R, 8, bucket_widths=True))
    sent = {name: rows.flush() for name, rows in batch.slot_rows().items()}
    for rows in batch.slot_rows().values():
        assert_device_is_mirror(rows)
    table = np.asarray(batch.block_table.device)
    np.testing.assert_array_equal(table[step.slot_S, :step.width], batch.block_tables(step))
    return sent


def test_scripted_joins_appends_preemptions_and_slot_reuse():
    batch = InputBatch(R, 32, 8, BS, eos_token_ids=[2], vocab_size=100)
    for rows in batch.slot_rows().values():
        rows.place(None)
    table = batch.block_table.host
    # Entry bucket: max(R, 8 blocks) = 8 -> (8,): 8 x (4 + 4) bytes per call.
    call = 8 * 8

    sent = run_step(batch, so_of(new=[(new("A", range(10, 19), [5, 6, 7]), 9),
                                      (new("B", range(30, 35), [8, 9]), 5)]))
    assert sent == {"block_tables": call, "bad_words": 0, "allowed_token_bits": 0}
    assert table[:2].tolist() == [[5, 6, 7, 0, 0, 0, 0, 0], [8, 9, 0, 0, 0, 0, 0, 0]]

    # Decode: A needs no block, B appends one (block 11).
    sent = run_step(batch, so_of(cached=[(CachedRequestData("A", [], 9), 1),
                                         (CachedRequestData("B", [11], 5), 1)]))
    assert sent["block_tables"] == call and table[1, :3].tolist() == [8, 9, 11]
    sent = run_step(batch, so_of(cached=[(CachedRequestData("A", [], 10), 1),
                                         (CachedRequestData("B", [], 6), 1)]))
    assert sent["block_tables"] == 0  # nothing changed, nothing sent

    # B is preempted; C joins its slot with one block: B's stale 9 and 11 are cleared.
    sent = run_step(batch, so_of(new=[(new("C", [1, 2], [12]), 2)],
                                 cached=[(CachedRequestData("A", [], 11), 1)],
                                 preempted={"B"}))
    assert batch.req_id_to_slot == {"A": 0, "C": 1}
    assert table[1].tolist() == [12, 0, 0, 0, 0, 0, 0, 0] and sent["block_tables"] == call

    # A finishes; B resumes (prompt + its outputs so far) into slot 0 with new blocks;
    # a request with allowed ids and bad words takes slot 2.
    sent = run_step(batch, so_of(
        new=[(new("B", range(30, 35), [13, 14], output=[40, 41]), 7),
             (new("D", [3], [15], allowed_token_ids=[4, 70],
                  bad_words_token_ids=[[7, 8], [9]]), 1)],
        cached=[(CachedRequestData("C", [], 2), 1)], finished={"A"}))
    slots = batch.req_id_to_slot
    assert (slots["B"], slots["D"]) == (0, 2)
    assert table[0].tolist() == [13, 14, 0, 0, 0, 0, 0, 0]
    assert batch.allowed_token_bits.host[2].tolist() == [1 << 4, 0, 1 << (70 - 64), 0]
    words = batch.bad_words.host[2]
    assert words[0, -2:].tolist() == [7, 8] and words[1, -1] == 9
    assert (words[0, :-2] == NO_TOKEN).all() and (words[2:] == NO_TOKEN).all()
    # The allowed bits (ceil(100 / 32) = 4 words) go as one whole row: slot + 16 bytes; the
    # 3 bad-word tokens as entries in the smallest bucket (16).
    assert sent == {"block_tables": call, "bad_words": 16 * 8, "allowed_token_bits": 4 + 16}

    # Later requests in other slots, or steps without joins, send none of it again.
    sent = run_step(batch, so_of(cached=[(CachedRequestData("B", [], 7), 1),
                                         (CachedRequestData("C", [], 3), 1),
                                         (CachedRequestData("D", [], 1), 1)]))
    assert sent == {"block_tables": 0, "bad_words": 0, "allowed_token_bits": 0}

    # D leaves; E, which uses neither, takes slot 2: both rows go back to their fill value.
    sent = run_step(batch, so_of(new=[(new("E", [5, 6], [16]), 2)], finished={"D"}))
    assert batch.req_id_to_slot["E"] == 2
    assert (batch.allowed_token_bits.host[2] == ONES).all()
    assert (batch.bad_words.host[2] == NO_TOKEN).all()
    assert sent == {"block_tables": call, "bad_words": 16 * 8, "allowed_token_bits": 4 + 16}
    # ... and once back to the fill value, a further non-user in the slot sends nothing.
    sent = run_step(batch, so_of(new=[(new("F", [5, 6], [16]), 2)], finished={"E"}))
    assert sent == {"block_tables": 0, "bad_words": 0, "allowed_token_bits": 0}
