"""A sliced leaf's blocks on one mesh, cut again for another: tensor-parallel and expert axes of any size.

A record holds a block's shape and its axes' sizes, not which dimension each axis cuts: an axis resized from `k1`
to `k2` cuts the dimension `d` where `saved[d] * k1 == target[d] * k2`, every other dimension keeping its size.
Exact wherever each resized axis cuts a dimension of its own (or is the inner axis of one it shares).

Examples:
  >>> from zero_optax.checkpoint import _tp_blocks
  >>> cut = _tp_blocks.recut(_tp_blocks.Blocks((5, 3), (("model", 2),)), _tp_blocks.Blocks((5, 6), ()), "`w`")
  >>> cut.dims, [(b, s) for b, s, _ in cut.sources(0, ((0, 5), (0, 6)))]
  ((('model', 1),), [(0, ((0, 5), (0, 3))), (1, ((0, 5), (0, 3)))])
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from zero_optax.core._errors import ZeroCheckpointError
from zero_optax.layout._stored import ParamLeaf, StoredViews

Box = tuple[tuple[int, int], ...]
"""A box of an array: `(start, stop)` per dimension."""


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

    @property
    def identity(self) -> bool:
        """Whether every target block is the saved block of the same number."""
        return self.saved == self.target

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


def spec_entries(spec: Sequence[Any]) -> list[tuple[str, ...]]:
    """The axes cutting each dimension, from a `PartitionSpec` (or any sequence of None, axis, tuple of axes)."""
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]


def spec_dims(spec: Sequence[Any] | None) -> dict[str, int]:
    """Axis -> the dimension it cuts, from a `PartitionSpec`."""
    return {a: d for d, axes in enumerate(spec_entries(() if spec is None else spec)) for a in axes}


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


def recuts(saved: StoredViews, target: StoredViews, where: str, specs: Mapping[str, Sequence[Any]] | None = None
           ) -> list[Recut | None]:
    """Per leaf, its `Recut` from `saved` to `target` (None for a leaf owned in both); `specs` by leaf path."""
    return [recut(leaf_blocks(saved, old, where), leaf_blocks(target, new, where), f"{where}: leaf `{old.path}`",
                  (specs or {}).get(old.path)) if old.sliced or new.sliced else None
            for old, new in zip(saved.leaves, target.leaves)]


def target_blocks(saved: Blocks, sizes: Mapping[str, int], spec: Sequence[Any] | None, path: str,
                  where: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A sliced leaf's axes and block shape on a mesh of axis sizes `sizes`: the saved axes, or `spec`'s, that the
    target has; a resized axis cuts the dimension `spec` names, else the only one it divides."""
    k1 = dict(saved.axes)
    cuts = dict.fromkeys(k1) if spec is None else spec_dims(spec)
    if missing := sorted(set(k1) - set(cuts)):
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
