"""Any region of a state's arrays on a new mesh, computed exactly from the arrays saved on the old one.

Nothing is replayed or summed: a sliced history is cut again (through `_tp_blocks` where its blocks changed), an
owned entry is read from its old owner's row, a shared entry is the value every saved row holds.

Examples:
  >>> import numpy as np
  >>> from zero_optax.checkpoint import _regions
  >>> saved = np.array([0., 1., 2., 3., 4., 0.])     # a block of 5 coordinates on 2 devices of 3 slots
  >>> [_regions.recut(lambda lo, hi: saved[lo:hi], 5, 2 * t, 2 * t + 2).tolist() for t in range(3)]  # 3 x 2
  [[0.0, 1.0], [2.0, 3.0], [4.0, 0.0]]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from zero_optax.checkpoint import _arrays, _tp_blocks
from zero_optax.checkpoint._record import short
from zero_optax.checkpoint._schema import SavedState
from zero_optax.checkpoint._store import Region, aligned_empty, aligned_zeros
from zero_optax.core._errors import ZeroCheckpointError
from zero_optax.layout._stored import LOCAL, MICRO_STEP_PATH, StoredViews

Read = Callable[[str, Region], np.ndarray]
"""`read(name, region)`: a region of a saved array."""


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality, so NaN clocks compare equal to themselves and -0.0 differs from 0.0."""
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def show(x: np.ndarray) -> str:
    """A short text form of a value, for error messages."""
    return str(x.item() if x.size == 1 else x.reshape(-1)[:8].tolist())


def _is_nan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def shared_values(saved: SavedState, read: Read, where: str) -> dict[int, np.ndarray]:
    """Entry index -> value of every shared entry, checked to be the same on every saved row and in the record."""
    out = {}
    for a in saved.arrays:
        if a.entry is None or saved.layout.entries[a.entry].leaf is not None:
            continue
        e = saved.layout.entries[a.entry]
        rows = read(a.name, tuple((0, d) for d in a.shape))
        for r in range(1, rows.shape[0]):
            if not same(rows[r], rows[0]):
                raise ZeroCheckpointError(
                    f"{where}: shared entry `{e.path}` of state {saved.index} differs between source rows: row 0 "
                    f"holds {show(rows[0])}, row {r} holds {show(rows[r])}; the checkpoint is inconsistent.")
        if e.path in saved.clocks:
            recorded, stored = saved.clocks[e.path], rows[0].reshape(()).item()
            if not (recorded == stored and type(recorded) is type(stored) or _is_nan(recorded) and _is_nan(stored)):
                raise ZeroCheckpointError(
                    f"{where}: the record says shared entry `{e.path}` of state {saved.index} is "
                    f"{short(recorded)}, but the arrays hold {show(rows[0])}; the checkpoint is inconsistent.")
        out[a.entry] = rows[0]
    return out


def micro_step(layout: StoredViews, shared: dict[int, np.ndarray]) -> int:
    """How far into an accumulation cycle a state was taken (its `MICRO_STEP_PATH` entry's value; else 0)."""
    for j, v in shared.items():
        if layout.entries[j].path == MICRO_STEP_PATH and np.any(v != 0):
            return int(np.max(v))
    return 0


def recut(read: Callable[[int, int], np.ndarray], size: int, start: int, stop: int,
          dtype: Any = np.float64) -> np.ndarray:
    """Elements `[start, stop)` of a zero-padded history of `size` coordinates, from `read(lo, hi)`."""
    hi = min(stop, size)
    if start >= hi:
        return aligned_zeros(stop - start, dtype)
    got = read(start, hi)
    if hi == stop:
        return got
    out = aligned_zeros(stop - start, got.dtype)
    out[:hi - start] = got
    return out


@dataclasses.dataclass
class Regions:
    """Any region of a target's stored arrays; a subclass says where histories (`_history`) and packed buffers
    (`_buffer`) come from."""

    target: StoredViews
    shared: dict[int, np.ndarray]

    def region(self, array: _arrays.StoredArray, region: Region) -> np.ndarray:
        """The values of `region` of the target's array `array`."""
        if array.local is not None:  # local accumulators at a cycle boundary are zero
            return aligned_zeros(tuple(hi - lo for lo, hi in region), array.dtype)
        if array.buffer is not None:
            return self._buffer(array, region)
        e = self.target.entries[array.entry]
        if e.leaf is None:
            (r0, r1), rest = region[0], region[1:]
            value = self.shared[array.entry][tuple(slice(lo, hi) for lo, hi in rest)]
            out = aligned_empty((r1 - r0, *value.shape), value.dtype)
            out[...] = value
            return out
        return self._history(array.entry, region[0], np.dtype(e.dtype))


class Remap(Regions):
    """The arrays of a state with layout `target` (checked by `_restore`), region by region, from the saved state."""

    def __init__(self, saved: SavedState, target: StoredViews, read: Read, shared: dict[int, np.ndarray],
                 where: str = "the checkpoint", specs: dict[str, Any] | None = None):
        super().__init__(target, shared)
        self.saved, self.read = saved, read
        self.cuts = _tp_blocks.recuts(saved.layout, target, where, specs)
        self.names = {(a.entry, a.buffer): a.name for a in saved.arrays}
        if target.accumulate == LOCAL and (step := micro_step(saved.layout, shared)):
            raise ZeroCheckpointError(
                f"This checkpoint was taken {step} micro-batches into an accumulation cycle of "
                "zero1(accumulate=\"local\"), whose per-device gradient sums cannot be re-cut for another "
                f"layout (world size {saved.layout.world_size} -> {target.world_size}). Restore it on its own "
                "mesh, or checkpoint at a cycle boundary (after the k-th update call of a cycle), or use "
                "accumulate=\"sharded\", whose accumulators reshard.")

    def _history(self, j: int, span: tuple[int, int], dtype: np.dtype) -> np.ndarray:
        i = self.target.entries[j].leaf  # the same leaf index in the saved layout (`_restore`)
        new, old, cut = self.target.leaves[i], self.saved.layout.leaves[i], self.cuts[i]
        new_block = new.group * new.slots
        start, stop = span
        pieces = []
        while start < stop:
            b, lo = divmod(start, new_block)
            hi = min(new_block, lo + stop - start)
            if cut.identity and old.sliced:
                old_block = old.group * old.slots
                pieces.append(self._block(self.names[(j, None)], b * old_block, old_block, new.size, lo, hi, dtype))
            else:
                pieces.append(self._recut(self._saved(j), cut, b, lo, hi, dtype))
            start += hi - lo
        if len(pieces) == 1:
            return pieces[0]
        out = aligned_empty(stop - span[0], dtype)
        if pieces:
            np.concatenate(pieces, out=out)
        return out

    def _saved(self, j: int) -> Callable[[int, int, int], np.ndarray]:
        """`read(block, lo, hi)` of entry `j`'s saved history: a sliced leaf's block, or an owned leaf's tensor."""
        old = self.saved.layout.leaves[self.saved.layout.entries[j].leaf]
        if old.sliced:
            name, width = self.names[(j, None)], old.group * old.slots
            return lambda b, lo, hi: self.read(name, ((b * width + lo, b * width + hi),))
        d, at = self.saved.layout.state_packing.offsets[old.owner][j]
        name, row = self.names[(None, d)], (old.owner, old.owner + 1)
        return lambda b, lo, hi: self.read(name, (row, (at + lo, at + hi)))[0]

    def _block(self, name: str, base: int, old_block: int, size: int, lo: int, hi: int, dtype) -> np.ndarray:
        """Elements `[lo, hi)` of one block's new padded history; refuses saved padding that is not zero (the
        record's leaf shape then misdescribes the history)."""
        if hi < size or lo >= size:
            return recut(lambda a, c: self.read(name, ((base + a, base + c),)), size, lo, hi, dtype)
        got = self.read(name, ((base + lo, base + old_block),))
        tail = got[size - lo:]
        if tail.size and np.any(tail.view(np.uint8)):
            raise ZeroCheckpointError(
                f"{name}: the coordinates past the end of a block of {size} elements are not zero, so the record's "
                "shape of this leaf does not describe the stored history; the checkpoint is damaged.")
        out = aligned_zeros(hi - lo, got.dtype)
        out[:size - lo] = got[:size - lo]
        return out

    def _recut(self, read: Callable[[int, int, int], np.ndarray], cut: _tp_blocks.Recut, b: int, lo: int, hi: int,
               dtype) -> np.ndarray:
        """Elements `[lo, hi)` of target block `b`'s padded history, cut out of the saved blocks it overlaps."""
        out = aligned_zeros(hi - lo, dtype)
        shape, saved = cut.target.shape, cut.saved.shape
        top = min(hi, math.prod(shape))
        if lo >= top:
            return out
        if cut.identity:  # the same block, sliced on one side and owned on the other
            out[:top - lo] = read(b, lo, top)
            return out
        row, saved_row = math.prod(shape[1:]), math.prod(saved[1:])
        r0, r1 = lo // row, -(-top // row)
        rows = np.zeros((r1 - r0, *shape[1:]), dtype)
        for source, (s_rows, *s_rest), (t_rows, *t_rest) in cut.sources(b, ((r0, r1), *((0, d) for d in shape[1:]))):
            got = read(source, s_rows[0] * saved_row, s_rows[1] * saved_row)
            got = got.reshape((s_rows[1] - s_rows[0], *saved[1:]))[(slice(None), *(slice(*x) for x in s_rest))]
            rows[(slice(t_rows[0] - r0, t_rows[1] - r0), *(slice(*x) for x in t_rest))] = got
        out[:top - lo] = rows.reshape(-1)[lo - r0 * row:top - r0 * row]
        return out

    def _buffer(self, array: _arrays.StoredArray, region: Region) -> np.ndarray:
        d = array.buffer
        (r0, r1), (c0, c1) = region
        out = aligned_zeros((r1 - r0, c1 - c0), d)
        for t in range(r0, r1):
            for j, (dj, off) in self.target.state_packing.offsets[t].items():
                e = self.target.entries[j]
                lo, hi = max(off, c0), min(off + e.size, c1)
                if dj != d or lo >= hi:
                    continue
                read, cut = self._saved(j), self.cuts[e.leaf]  # cut: None where owned when saved too
                out[t - r0, lo - c0:hi - c0] = (read(0, lo - off, hi - off) if cut is None
                                                else self._recut(read, cut, 0, lo - off, hi - off, d))
        return out
