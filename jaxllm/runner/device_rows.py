"""Per-slot rows kept on the device: the persistent batch's tables that the step reads by slot.

Owns one table of rows [R + 1, *row] (R = max_num_seqs slots): its host mirror, which is the
truth, the changes not yet sent, and its copy on the device, which each step brings up to date
by sending only those changes. Row R is the fill row: never written, it is what padding
sequences (slot R) read. The owner (the input batch) writes a row when a request joins its
slot, leaves or changes (new blocks); a request that leaves a row as it was sends nothing.
Never decides what a row holds, never sees a request, and never reads the device copy back.

    host mirror (numpy)            pending                        device copy (donated)
    set_row(slot, row)     --->    entries: flat index   --flush()-->  .at[index].set(value)
    set(slot, cols, values)        rows: slot                          .at[slot].set(row)
    set_rows(slots, rows)

Two ways to send a change, allowed per table (and chosen per row when a table allows both):
  entries  (flat index int32, value): a block id appended to a block table costs 8 bytes
  rows     (slot int32, whole row): a dense row, e.g. a 1536-word allowed-token bit set
Each upload is padded to a bucket from a small sorted list (padding entries index past the
table, padding rows name slot R + 1: both are dropped), every bucket is compiled at warm-up,
and a change larger than the largest bucket goes in several calls. Values are read from the
mirror when they are sent, so a place written twice before a flush is sent once, with its
last value. Pending changes are forgotten only once every call of a flush has been issued,
so a flush that raises is sent again whole by the next one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.runner.buckets import pad_to_bucket, power_of_two_buckets
from jaxllm.runner.step import CompiledFunctions


def entry_buckets(max_entries: int) -> tuple[int, ...]:
    """Sizes of entry uploads: powers of 4 from 16 up to max_entries (one append per slot,
    or one whole row, is what a step usually sends at most)."""
    return power_of_two_buckets(min(16, max_entries), max(max_entries, 1), base=4)


def row_buckets(num_slots: int, max_rows: int = 8) -> tuple[int, ...]:
    """Sizes of whole-row uploads: 1, 2, 4, 8 (capped by the slots): rows join a few at a
    time, and a bigger join goes in several calls rather than a bucket mostly padding."""
    return power_of_two_buckets(1, max(1, min(num_slots, max_rows)))


@dataclasses.dataclass(frozen=True)
class RowUpdate:
    """One padded upload. kind "entries": index [E] flat element indices, values [E];
    kind "rows": index [K] slots, values [K, *row]."""

    kind: str
    index: np.ndarray
    values: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.index.nbytes + self.values.nbytes


class DeviceRows:
    """One per-slot table. entry_buckets / row_buckets: the padded sizes of each kind of
    upload (an empty tuple: that kind is never sent). partition_spec: how the table is split
    over the runner's mesh (None: replicated, as every table but a few large weight tables,
    e.g. LoRA's, split like the layer they adapt)."""

    def __init__(self, num_slots: int, row_shape: Sequence[int], dtype, fill, *,
                 entry_buckets: tuple[int, ...] = (), row_buckets: tuple[int, ...] = (),
                 partition_spec: PartitionSpec | None = None):
        if not entry_buckets and not row_buckets:
            raise ValueError("DeviceRows needs entry_buckets or row_buckets (or both).")
        self.num_slots = num_slots
        self.row_shape = tuple(row_shape)
        self.row_size = math.prod(self.row_shape)
        self.dtype = np.dtype(dtype)
        self.fill = fill
        if entry_buckets and (num_slots + 1) * self.row_size >= 2**31:
            raise ValueError(f"a table of {num_slots + 1} x {self.row_size} elements is too "
                             f"large for int32 entry indices; use row_buckets only.")
        self.entry_buckets = tuple(entry_buckets)
        self.row_buckets = tuple(row_buckets)
        self.partition_spec = partition_spec
        self.host = np.full((num_slots + 1, *self.row_shape), fill, self.dtype)
        self._flat = self.host.reshape(num_slots + 1, self.row_size)  # a view
        self._entries: list[np.ndarray] = []  # flat indices written since the last flush
        self._rows: set[int] = set()  # slots whose whole row goes at the next flush
        self.device: jax.Array | None = None
        self._fns: CompiledFunctions | None = None

    # ---- host half: the owner writes rows ------------------------------------------------

    def set_row(self, slot: int, row) -> None:
        """Row `slot` := row (broadcast to the row shape); only what differs is sent."""
        row = np.broadcast_to(np.asarray(row, self.dtype), self.row_shape).reshape(-1)
        self._write(slot, np.arange(self.row_size), row)

    def set_rows(self, slots, rows) -> None:
        """Rows `slots` (distinct) := rows [k, *row_shape], compared and written in one go:
        each row that differs goes whole. For tables that send whole rows only (a dense row
        per request each step, e.g. grammar bitmasks: 64 rows in ~0.1 ms, 10x fewer than
        one `set_row` each); a table that also sends entries chooses per row (`set_row`)."""
        slots = np.asarray(slots, np.int64).reshape(-1)
        if self.entry_buckets:
            for slot, row in zip(slots, rows):
                self.set_row(int(slot), row)
            return
        if slots.size and (slots.min() < 0 or slots.max() >= self.num_slots):
            raise ValueError(f"slot must be in [0, {self.num_slots}), got {slots.tolist()}")
        if np.unique(slots).size != slots.size:
            raise ValueError(f"set_rows needs distinct slots, got {slots.tolist()}")
        rows_KC = np.asarray(rows, self.dtype).reshape(slots.size, self.row_size)
        differ_K = (self._flat[slots] != rows_KC).any(axis=1)
        self._flat[slots[differ_K]] = rows_KC[differ_K]
        self._rows.update(slots[differ_K].tolist())

    def set(self, slot: int, cols, values) -> None:
        """Elements `cols` (flat positions within the row) of row `slot` := values."""
        self._write(slot, np.asarray(cols, np.int64).reshape(-1),
                    np.asarray(values, self.dtype).reshape(-1))

    def _write(self, slot: int, cols: np.ndarray, values: np.ndarray) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be in [0, {self.num_slots}), got {slot}")
        changed = cols[self._flat[slot, cols] != values]
        if changed.size == 0:
            return
        self._flat[slot, cols] = values
        if slot in self._rows:
            return  # the whole row goes anyway
        item = self.dtype.itemsize
        if not self.entry_buckets or (self.row_buckets and changed.size * (4 + item)
                                      > 4 + self.row_size * item):
            self._rows.add(slot)
        else:
            self._entries.append(slot * self.row_size + changed)

    @property
    def has_pending(self) -> bool:
        return bool(self._rows or self._entries)

    def updates(self) -> list[RowUpdate]:
        """The pending changes as padded uploads, in the order `flush` sends them (clears
        nothing)."""
        R, C = self.num_slots, self.row_size
        out = []
        slots = np.array(sorted(self._rows), np.int32)
        for chunk in _chunks(slots, self.row_buckets[-1] if slots.size else 1):
            size = pad_to_bucket(len(chunk), self.row_buckets, "rows")
            index = np.full(size, R + 1, np.int32)
            index[:len(chunk)] = chunk
            values = np.full((size, *self.row_shape), self.fill, self.dtype)
            values[:len(chunk)] = self.host[chunk]
            out.append(RowUpdate("rows", index, values))
        if self._entries:
            flat = np.unique(np.concatenate(self._entries))
            flat = flat[~np.isin(flat // C, slots)]  # those rows go whole
            for chunk in _chunks(flat, self.entry_buckets[-1]):
                size = pad_to_bucket(len(chunk), self.entry_buckets, "entries")
                index = np.full(size, (R + 1) * C, np.int32)
                index[:len(chunk)] = chunk
                values = np.full(size, self.fill, self.dtype)
                values[:len(chunk)] = self._flat.reshape(-1)[chunk]
                out.append(RowUpdate("entries", index, values))
        return out

    # ---- device half: the runner places, flushes and reads it in the step ---------------

    def place(self, sharding) -> None:
        """(Re)build the device copy from the mirror: at start-up, and after a failed step
        consumed the device state. Anything pending is in the copy, so nothing stays
        pending. `sharding`: the runner's replicated one (None: the default device); the
        table itself is split as its partition_spec says, over that sharding's mesh."""
        table = sharding
        if sharding is not None and self.partition_spec is not None:
            table = NamedSharding(sharding.mesh, self.partition_spec)
        # A copy: on CPU the device array may alias the buffer it is given, and the
        # mirror keeps changing.
        self.device = jax.device_put(self.host.copy(), table)
        self._entries.clear()
        self._rows.clear()
        if self._fns is None:
            self._fns = CompiledFunctions(
                jax.jit(_apply, static_argnums=0, donate_argnums=1),
                lambda kind, size: self._abstract(kind, size, table, sharding))

    def _abstract(self, kind: str, size: int, table, sharding) -> tuple:
        sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa
        values = (size,) if kind == "entries" else (size, *self.row_shape)
        return (kind, jax.ShapeDtypeStruct(self.host.shape, self.dtype, sharding=table),
                sds((size,), np.int32), sds(values, self.dtype))

    def flush(self) -> int:
        """Send the pending changes to the device copy; -> the bytes sent."""
        updates = self.updates()
        for u in updates:
            self.device = self._fns.get((u.kind, len(u.index)))(self.device, u.index, u.values)
        self._entries.clear()
        self._rows.clear()
        return sum(u.nbytes for u in updates)

    def warmup(self) -> None:
        """Compile every upload bucket (a zero-width table never uploads)."""
        if self.row_size:
            for size in self.entry_buckets:
                self._fns.get(("entries", size))
            for size in self.row_buckets:
                self._fns.get(("rows", size))

    @property
    def num_compiles(self) -> int:
        return self._fns.num_compiles if self._fns is not None else 0


def _apply(kind: str, table, index, values):
    """table with the padded upload written in (donated: in place). Out-of-range indices
    (the padding) are dropped."""
    if kind == "rows":
        return table.at[index].set(values, mode="drop")
    flat = table.reshape(-1).at[index].set(values, mode="drop")
    return flat.reshape(table.shape)


def _chunks(a: np.ndarray, size: int) -> list[np.ndarray]:
    return [a[i:i + size] for i in range(0, len(a), size)]
