"""Any region of a state's arrays on a new mesh, computed exactly from the arrays saved on the old one.

Nothing is replayed or summed: a sliced history is cut again (by `Recut` where its blocks changed), an owned entry is
read from its old owner's row, a shared entry is the value every saved row holds. An axis resized from `k1` to `k2`
cuts the dimension `d` where `saved[d] * k1 == target[d] * k2` (a record does not say which it cuts): exact wherever
each resized axis cuts a dimension of its own, or is the inner axis of one it shares.

Examples:
  >>> from zero_optax.checkpoint import _regions
  >>> cut = _regions.recut(_regions.Blocks((5, 3), (("model", 2),)), _regions.Blocks((5, 6), ()), "`w`")
  >>> cut.dims, [(b, s) for b, s, _ in cut.sources(0, ((0, 5), (0, 6)))]
  ((('model', 1),), [(0, ((0, 5), (0, 3))), (1, ((0, 5), (0, 3)))])
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from zero_optax.checkpoint import _arrays
from zero_optax.checkpoint._record import short
from zero_optax.checkpoint._schema import SavedState
from zero_optax.checkpoint._store import Region, aligned_empty, aligned_zeros
from zero_optax.core._errors import ZeroCheckpointError
from zero_optax.layout._stored import LOCAL, MICRO_STEP_PATH, ParamLeaf, StoredViews, spec_axes

Box = tuple[tuple[int, int], ...]
"""A box of an array: `(start, stop)` per dimension."""
Read = Callable[[str, Region], np.ndarray]
"""`read(name, region)`: a region of a saved array."""


@dataclasses.dataclass(frozen=True)
class Blocks:
    """How a leaf is cut into blocks on one mesh: one block's `shape`, and the `(axis, size)` of every mesh axis of
    size > 1 the blocks differ along, in block-numbering order."""

    shape: tuple[int, ...]
    axes: tuple[tuple[str, int], ...]

    def index(self, b: int) -> dict[str, int]:
        """Block `b`'s position along each of its axes."""
        out = {}
        for a, k in reversed(self.axes):
            b, out[a] = divmod(b, k)
        return out

    def number(self, index: Mapping[str, int]) -> int:
        """The block at `index` (positions along this cut's axes)."""
        b = 0
        for a, k in self.axes:
            b = b * k + index.get(a, 0)
        return b


@dataclasses.dataclass(frozen=True)
class Recut:
    """One leaf's saved blocks cut again into the target's; `dims` pairs each resized axis with the dimension it
    cuts."""

    saved: Blocks
    target: Blocks
    dims: tuple[tuple[str, int], ...]

    def sources(self, b: int, box: Box) -> list[tuple[int, Box, Box]]:
        """`(saved block, box in it, box in target block b)` for every saved block overlapping `box` of block `b`."""
        index = self.target.index(b)
        s, t = self.saved.shape, self.target.shape
        shift = [0] * len(t)
        for a, d in self.dims:
            shift[d] = index.get(a, 0) * t[d]
        frame = [(lo + o, hi + o) for (lo, hi), o in zip(box, shift)]
        spans = [range(frame[d][0] // s[d], -(-frame[d][1] // s[d])) if s[d] else range(0) for _, d in self.dims]
        kept = {a: index[a] for a, _ in self.saved.axes if a not in dict(self.dims)}
        out = []
        for at in itertools.product(*spans):
            start = [0] * len(s)
            for (_, d), i in zip(self.dims, at):
                start[d] = i * s[d]
            cut = [(max(lo, x), min(hi, x + n)) for (lo, hi), x, n in zip(frame, start, s)]
            saved_box = tuple((lo - x, hi - x) for (lo, hi), x in zip(cut, start))
            target_box = tuple((lo - o, hi - o) for (lo, hi), o in zip(cut, shift))
            out.append((self.saved.number(kept | {a: i for (a, _), i in zip(self.dims, at)}), saved_box, target_box))
        return out


def leaf_blocks(layout: StoredViews, leaf: ParamLeaf, where: str) -> Blocks:
    """The blocks of `leaf` in `layout`; a ZeRO axis it is sharded over (an expert axis) has the size its block
    count leaves over (a record lists the sizes of non-ZeRO axes only)."""
    if leaf.tp_owned:  # an owned leaf's state is its whole tensor, whatever blocks its parameter has
        return Blocks(layout.whole_shape(leaf), ())
    sizes = dict(layout.axis_sizes)
    unknown = [a for a in leaf.axes if a not in sizes]
    if len(unknown) > 1:
        raise ZeroCheckpointError(
            f"{where}: leaf `{leaf.path}` is sharded over the ZeRO axes {unknown}, whose sizes the record does not "
            "tell apart; move it with zo.load_rank_records and zo.reshard_explicit.")
    if unknown:
        sizes[unknown[0]] = leaf.blocks // math.prod(sizes[a] for a in leaf.axes if a in sizes)
    return Blocks(tuple(leaf.shape), tuple((a, sizes[a]) for a in leaf.axes if sizes[a] > 1))


def _logical(blocks: Blocks) -> str:
    """How error messages show a leaf's blocks."""
    over = ", ".join(f"{a}={k}" for a, k in blocks.axes)
    return f"{list(blocks.shape)}" + (f" per block over {over}" if over else " (whole)")


def spec_dims(spec: Sequence[Any] | None) -> dict[str, int]:
    """Axis -> the dimension it cuts, from a `PartitionSpec`."""
    return {a: d for d, axes in enumerate(spec_axes(() if spec is None else spec)) for a in axes}


def recut(saved: Blocks, target: Blocks, where: str, spec: Sequence[Any] | None = None) -> Recut:
    """The recut of one leaf from `saved` to `target` blocks, its resized axes' dimensions read off the shapes and
    `spec` (the leaf's `PartitionSpec`, where given); refuses a leaf that no dimension fits, or several do."""
    k1, k2 = dict(saved.axes), dict(target.axes)
    changed = [a for a in dict.fromkeys([*k1, *k2]) if k1.get(a, 1) != k2.get(a, 1)]
    s, t = saved.shape, target.shape
    fits = [] if len(s) != len(t) else [
        dims for dims in itertools.permutations(range(len(s)), len(changed))
        if all(s[d] * k1.get(a, 1) == t[d] * k2.get(a, 1) for a, d in zip(changed, dims))
        and all(s[d] == t[d] for d in range(len(s)) if d not in dims)]
    known = spec_dims(spec)
    fits = [dims for dims in fits if all(known.get(a, d) == d for a, d in zip(changed, dims))]
    pair = f"is {_logical(saved)} in the checkpoint but {_logical(target)} in the target"
    if not fits:
        raise ZeroCheckpointError(
            f"{where} {pair}: no logical shape fits both, so the parameter's shape "
            "changed. Resharding keeps every parameter's shape; restore into a target built from the same model, "
            "or start this parameter's optimizer state afresh (zo.scatter_state with a fresh inner state).")
    if len(fits) > 1 and math.prod(s):
        raise ZeroCheckpointError(
            f"{where} {pair}: the axes {changed} could cut dimensions "
            f"{' or '.join(str(list(f)) for f in fits)}, so which coordinate is which cannot be told from the "
            "blocks. Convert the checkpoint offline with zo.reshard(src, dst, axis_sizes=..., param_specs=...) "
            "(`--param-specs FILE.json`), giving the parameters' PartitionSpecs, then restore the result.")
    return Recut(saved, target, tuple(zip(changed, fits[0])))


def placement(old: ParamLeaf, new: ParamLeaf, saved: Blocks, where: str) -> tuple[tuple[str, ...], ...] | None:
    """The spec a recut of `old` (cut into `saved` blocks) into `new` reads: the target's placement, and the
    checkpoint's for the axes the target's leaves out (where one lacks it, the other's); refuses an axis the saved
    blocks differ along that the target places on another dimension."""
    if old.spec is None or new.spec is None:
        return new.spec if old.spec is None else old.spec
    was, now = spec_dims(old.spec), spec_dims(new.spec)
    for axis, _ in saved.axes:
        if now.get(axis, was[axis]) != was[axis]:
            raise ZeroCheckpointError(
                f"{where}: leaf `{old.path}` is cut over `{axis}` along dimension {was[axis]} in the checkpoint (spec "
                f"{show_spec(old.spec)}) but along dimension {now[axis]} in the target (spec {show_spec(new.spec)}). "
                "Resharding keeps which dimension each mesh axis cuts: lay the target's parameter out as it was "
                "trained.")
    return tuple(y + tuple(a for a in x if a not in now) for x, y in zip(old.spec, new.spec))


def show_spec(spec: Sequence[Any]) -> str:
    """How error messages show a spec (per dimension, the axes cutting it)."""
    return "(" + ", ".join("None" if not cut else repr(cut[0]) if len(cut) == 1 else repr(tuple(cut))
                           for cut in spec_axes(spec)) + ")"


def recuts(saved: StoredViews, target: StoredViews, where: str, specs: Mapping[str, Sequence[Any]] | None = None
           ) -> list[Recut | None]:
    """Per leaf, its `Recut` from `saved` to `target` (None for a leaf owned in both); `specs` by leaf path, else
    the placement the layouts record."""
    specs = specs or {}
    out: list[Recut | None] = []
    for old, new in zip(saved.leaves, target.leaves):
        if not (old.sliced or new.sliced):
            out.append(None)
            continue
        blocks = leaf_blocks(saved, old, where)
        spec = specs[old.path] if old.path in specs else placement(old, new, blocks, where)
        out.append(recut(blocks, leaf_blocks(target, new, where), f"{where}: leaf `{old.path}`", spec))
    return out


def target_blocks(saved: Blocks, sizes: Mapping[str, int], spec: Sequence[Any] | None, path: str,
                  where: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A sliced leaf's axes and block shape on a mesh of axis sizes `sizes`: the saved axes, or `spec`'s, that the
    target has; a resized axis cuts the dimension `spec` names, else the only one it divides."""
    k1 = dict(saved.axes)
    cuts = dict.fromkeys(k1) if spec is None else spec_dims(spec)
    if spec is not None and (missing := sorted(set(k1) - set(cuts))):  # (no spec: the saved cuts)
        raise ZeroCheckpointError(
            f"{where}: `param_specs` gives leaf `{path}` the spec {tuple(spec)}, but its saved blocks differ "
            f"along {missing}; give the spec the parameter was trained with.")
    axes = tuple(a for a in sizes if a in cuts and sizes[a] > 1)
    shape = list(saved.shape)
    for a in dict.fromkeys([*k1, *axes]):
        before, after = k1.get(a, 1), sizes.get(a, 1) if a in axes else 1
        if before == after:
            continue
        fit = [d for d in range(len(shape)) if (shape[d] * before) % after == 0]
        d = cuts.get(a) if cuts.get(a) is not None else fit[0] if len(fit) == 1 else None
        if d is None or d >= len(shape) or (shape[d] * before) % after:
            how = (f"it could cut dimensions {fit}: pass `param_specs` (`--param-specs FILE.json`) with its "
                   "PartitionSpec" if len(fit) > 1 else "no dimension of it divides")
            raise ZeroCheckpointError(
                f"{where}: leaf `{path}` ({_logical(saved)}) is to be cut over `{a}` of size {after} (from "
                f"{before}), but {how}; or restore the checkpoint with zo.ZeroRestore(target, reshard=True), "
                "which reads the blocks from the target.")
        shape[d] = shape[d] * before // after
    return axes, tuple(shape)


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


@dataclasses.dataclass
class Regions:
    """Any region of a target's stored arrays; a subclass says where histories (`_history`) and packed buffers
    (`_buffer`) come from."""

    target: StoredViews
    shared: dict[int, np.ndarray]

    def _history(self, j: int, span: tuple[int, int], dtype: np.dtype) -> np.ndarray:
        """The values `span` of entry `j`'s 1-D history (a sliced leaf's)."""
        raise NotImplementedError

    def _buffer(self, array: _arrays.StoredArray, region: Region) -> np.ndarray:
        """The values of `region` of the packed buffer `array`."""
        raise NotImplementedError

    def region(self, array: _arrays.StoredArray, region: Region) -> np.ndarray:
        """The values of `region` of the target's array `array`."""
        if array.local is not None:  # local accumulators at a cycle boundary are zero
            return aligned_zeros(tuple(hi - lo for lo, hi in region), array.dtype)
        if array.buffer is not None:
            return self._buffer(array, region)
        assert array.entry is not None  # (neither a buffer nor local sums: an entry)
        e = self.target.entries[array.entry]
        if e.leaf is None:
            (r0, r1), rest = region[0], region[1:]
            value = self.shared[array.entry][tuple(slice(lo, hi) for lo, hi in rest)]
            out = aligned_empty((r1 - r0, *value.shape), value.dtype)
            out[...] = value
            return out
        return self._history(array.entry, region[0], np.dtype(e.dtype))


def _refuse_stacked(*layouts: StoredViews) -> None:
    """Refuses re-cutting a sliced leaf's stacked history (`(memory, slots)` per device: L-BFGS's), whose rows a
    re-cut would have to cut one by one."""
    for layout in layouts:
        e = next((e for e in layout.entries if layout.kind(e) == "sliced" and len(e.shape) > 1), None)
        if e is not None:
            raise ZeroCheckpointError(
                f"The state's `{e.path}` is a history stacked along leading axes (shape {e.shape} on each device), "
                "which restoring into another layout cannot re-cut yet. Restore it on its own mesh, then move it "
                "with zo.gather_state and zo.scatter_state (or zo.relayout).")


class Remap(Regions):
    """The arrays of a state with layout `target` (checked by `_restore`), region by region, from the saved state."""

    def __init__(self, saved: SavedState, target: StoredViews, read: Read, shared: dict[int, np.ndarray],
                 where: str = "the checkpoint", specs: dict[str, Any] | None = None):
        super().__init__(target, shared)
        _refuse_stacked(saved.layout, target)
        self.saved, self.read = saved, read
        self.cuts = recuts(saved.layout, target, where, specs)
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
        assert i is not None  # (a history's entry)
        new, old, cut = self.target.leaves[i], self.saved.layout.leaves[i], self.cuts[i]
        assert cut is not None  # (sliced in the target)
        new_block, read = new.group * new.slots, self._saved(j)
        start, stop = span
        pieces = []
        while start < stop:
            b, lo = divmod(start, new_block)
            hi = min(new_block, lo + stop - start)
            if cut.saved == cut.target and old.sliced and lo < new.size <= hi:
                pieces.append(self._block_end(self.names[(j, None)], read(b, lo, old.group * old.slots), new.size,
                                              lo, hi))
            else:
                pieces.append(self._recut(read, cut, b, lo, hi, dtype))
            start += hi - lo
        if len(pieces) == 1:
            return pieces[0]
        out = aligned_empty(stop - span[0], dtype)
        if pieces:
            np.concatenate(pieces, out=out)
        return out

    def _saved(self, j: int) -> Callable[[int, int, int], np.ndarray]:
        """`read(block, lo, hi)` of entry `j`'s saved history: a sliced leaf's block, or an owned leaf's tensor."""
        i = self.saved.layout.entries[j].leaf
        assert i is not None  # (a leaf's entry)
        old = self.saved.layout.leaves[i]
        if old.sliced:
            name, width = self.names[(j, None)], old.group * old.slots
            return lambda b, lo, hi: self.read(name, ((b * width + lo, b * width + hi),))
        owner = old.owner
        assert owner is not None  # (an owned leaf's)
        d, at = self.saved.layout.state_packing.offsets[owner][j]
        name, row = self.names[(None, d)], (owner, owner + 1)
        return lambda b, lo, hi: self.read(name, (row, (at + lo, at + hi)))[0]

    @staticmethod
    def _block_end(name: str, got: np.ndarray, size: int, lo: int, hi: int) -> np.ndarray:
        """Elements `[lo, hi)` of a block's padded history from `got` (read to the saved block's end); refuses
        saved padding that is not zero (the record's leaf shape then misdescribes the history)."""
        tail = got[size - lo:]
        if tail.size and np.any(tail.view(np.uint8)):
            raise ZeroCheckpointError(
                f"{name}: the coordinates past the end of a block of {size} elements are not zero, so the record's "
                "shape of this leaf does not describe the stored history; the checkpoint is damaged.")
        out = aligned_zeros(hi - lo, got.dtype)
        out[:size - lo] = got[:size - lo]
        return out

    def _recut(self, read: Callable[[int, int, int], np.ndarray], cut: Recut, b: int, lo: int, hi: int,
               dtype) -> np.ndarray:
        """Elements `[lo, hi)` of target block `b`'s padded history, cut out of the saved blocks it overlaps."""
        out = aligned_zeros(hi - lo, dtype)
        shape, saved = cut.target.shape, cut.saved.shape
        top = min(hi, math.prod(shape))
        if lo >= top:
            return out
        if cut.saved == cut.target:  # the same block, sliced on one side and owned on the other
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
                assert e.leaf is not None  # (a packed entry is an owned leaf's)
                read, cut = self._saved(j), self.cuts[e.leaf]  # cut: None where owned when saved too
                out[t - r0, lo - c0:hi - c0] = (read(0, lo - off, hi - off) if cut is None
                                                else self._recut(read, cut, 0, lo - off, hi - off, d))
        return out
