"""The persistent batch's per-slot device rows (runner/device_rows.py), exactly: which
uploads a change makes, and that the device copy equals the host mirror after them.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.runner.device_rows import DeviceRows, entry_buckets, row_buckets

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
