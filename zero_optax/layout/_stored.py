"""What a checkpoint records of a zero1 state, apart from the run-time plan: `StoredLayout`, its leaves and entries,
and the views it shares with `Layout` (`StoredViews`); also the names every layer shares."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

FLAT = "flat"
LEAF = "leaf"
AUTO = "auto"
PARTITIONS = (FLAT, LEAF, AUTO)

STATE = "state"
MASTER = "master"
SHARDED = "sharded"
"""`accumulate="sharded"`: the accumulators are inner-state histories, sharded like the state (ZeRO-2)."""
LOCAL = "local"
"""`accumulate="local"`: every device keeps full-size sums of its own gradients (`ZeroState.local`)."""
ACCUMULATE_MODES = (SHARDED, LOCAL)
ACC_PREFIX = ".acc"
"""Sharded gradient accumulators are entries whose path starts with this (`_accumulate.AccumulateState.acc`)."""
MICRO_STEP_PATH = ".micro_step"
"""The shared entry counting the calls of the accumulation cycle so far (`AccumulateState.micro_step`)."""
WEIGHT_SUM_PATH = ".weight_sum"
"""The shared entry holding the cycle's global weight so far (`AccumulateState.weight_sum`)."""
MASTER_PREFIX = "<master>"
"""Master-copy entries are named `<master>` followed by the parameter leaf's path."""


def spec_axes(spec: Iterable[Any]) -> list[tuple[str, ...]]:
    """The mesh axes cutting each dimension, from a `PartitionSpec` (or any sequence of None, an axis name, a tuple
    of axis names)."""
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]


def slot_count(size: int, group: int) -> int:
    """The coordinates each of `group` devices holds of a sliced leaf of `size` elements: `ceil(size / group)`."""
    return -(-size // group)


def known_sizes(sizes: dict[str, int], leaf: ParamLeaf) -> dict[str, int] | None:
    """`sizes` with that of the one axis of `leaf` it lacks (a ZeRO axis, which a record does not size) read off the
    leaf's block count; None where it lacks several."""
    unknown = [a for a in leaf.axes if a not in sizes]
    if len(unknown) > 1:
        return None
    if unknown:
        sizes = dict(sizes, **{unknown[0]: leaf.blocks // math.prod(sizes[a] for a in leaf.axes if a in sizes)})
    return sizes


def whole_shape(shape: tuple[int, ...], dims: tuple[tuple[str, ...], ...], sizes: dict[str, int]
                ) -> tuple[int, ...]:
    """A parameter's whole shape from its block's `shape`, the axes cutting each dimension and their `sizes`."""
    if not dims:
        return tuple(shape)
    return tuple(n * math.prod(sizes[a] for a in cut) for n, cut in zip(shape, dims))


@dataclasses.dataclass(frozen=True)
class ParamLeaf:
    """One trainable parameter leaf.

    Attributes:
      shape: the parameter's shape on one device (inside `shard_map`: its local block).
      slots: sliced: coordinates each device of the group holds, `ceil(size / group)`; owned: `size`.
      owner: owned: the device index (along the ZeRO axes) that updates this leaf; sliced: None.
      axes: mesh axes the parameter is sharded over (tensor or expert parallel); its blocks differ along them.
      group: the number of devices one block's coordinates are split over (the ZeRO axes not in `axes`).
      dims: a tensor-parallel owned leaf's mesh axes cutting each dimension; empty for every other leaf.
      spec: the leaf's placement, the mesh axes cutting each dimension of the parameter (its `PartitionSpec`,
        naming exactly `axes`); None where the run did not know it (a leaf sharded over other mesh axes inside
        a `shard_map` without `param_specs`, or a checkpoint of record format 2).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    slots: int
    owner: int | None = None
    axes: tuple[str, ...] = ()
    blocks: int = 1
    group: int = 1
    dims: tuple[tuple[str, ...], ...] = ()
    # (Not compared: a layout is the same whether or not its run was told the specs, so that `zo.state_specs`,
    # which is, gives the out_specs of a `shard_map` whose init is not.)
    spec: tuple[tuple[str, ...], ...] | None = dataclasses.field(default=None, compare=False)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def tp_owned(self) -> bool:
        """Whether this is an owned leaf whose blocks its owner gathers over tensor-parallel axes (`dims`)."""
        return bool(self.dims)

    @property
    def sliced(self) -> bool:
        return self.owner is None


@dataclasses.dataclass(frozen=True)
class StateEntry:
    """One array the state stores: a leaf of the inner optimizer's state, or a master copy of a parameter.

    Attributes:
      path: key path inside the full inner state tree (`MASTER_PREFIX` + the parameter's path for master copies).
      leaf: index of the parameter leaf whose history this is; None for state shared by all leaves (step counts).
      shape: shape on one device: `(slots,)` for a sliced leaf's history, else the full shape.
      key_impl: a typed PRNG key's implementation (`"threefry2x32"`), stored as its key data; else None.
    """

    path: str
    leaf: int | None
    shape: tuple[int, ...]
    dtype: str
    role: str = STATE
    key_impl: str | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where rank-local arrays live inside per-dtype packed buffers: per rank, item -> `(dtype, offset)`; and the
    buffer length per dtype, the same on every rank."""

    offsets: tuple[dict[int, tuple[str, int]], ...]
    sizes: dict[str, int]


def runs(pieces: Sequence[tuple[Any, int, int]]) -> list[tuple[Any, int, int]]:
    """`(array, start, length)` pieces as `(array, start, stop)` ranges, merging a piece that continues the last.

    Examples:
      >>> runs([(0, 0, 4), (0, 4, 3), (1, 0, 2), (0, 9, 1)])
      [(0, 0, 7), (1, 0, 2), (0, 9, 10)]
    """
    out: list[tuple[Any, int, int]] = []
    for k, start, length in pieces:
        if out and out[-1][0] == k and out[-1][2] == start:
            out[-1] = (k, out[-1][1], start + length)
        else:
            out.append((k, start, start + length))
    return out


def pack_plan(groups: Sequence[Sequence[tuple[int, int, str]]]) -> Packing:
    """Lays out each rank's `(item, size, dtype)` list, in order, into per-dtype buffers of one common size."""
    offsets, sizes = [], {}
    for items in groups:
        cursor: dict[str, int] = {}
        offsets.append({})
        for item, size, dtype in items:
            offsets[-1][item] = (dtype, cursor.get(dtype, 0))
            cursor[dtype] = cursor.get(dtype, 0) + size
        for dtype, used in cursor.items():
            sizes[dtype] = max(sizes.get(dtype, 0), used)
    return Packing(tuple(offsets), dict(sorted(sizes.items())))


class StoredViews:
    """The views `StoredLayout` and `Layout` share, from the fields that describe a stored state."""

    # (the fields of both that the views read)
    axis_name: str | tuple[str, ...]
    world_size: int
    leaves: tuple[ParamLeaf, ...]
    entries: tuple[StateEntry, ...]
    state_tree: str
    partition: str
    master_dtype: str | None
    axis_sizes: tuple[tuple[str, int], ...]
    accumulate: str | None
    accumulate_steps: int
    replica_sizes: tuple[tuple[str, int], ...]

    @property
    def axes(self) -> tuple[str, ...]:
        return (self.axis_name,) if isinstance(self.axis_name, str) else tuple(self.axis_name)

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The mesh axes the state is replicated over (`replica_sizes`' names); empty without replicas."""
        return tuple(a for a, _ in self.replica_sizes)

    @property
    def replica_count(self) -> int:
        """How many replicas hold the state: the product of `replica_sizes`."""
        return math.prod(s for _, s in self.replica_sizes)

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(leaf.path for leaf in self.leaves)

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(leaf.shape for leaf in self.leaves)

    @property
    def slots(self) -> tuple[int, ...]:
        return tuple(leaf.slots for leaf in self.leaves)

    @property
    def owners(self) -> tuple[int | None, ...] | None:
        """One owner per leaf (None for sliced leaves); None altogether when every leaf is sliced."""
        if all(leaf.sliced for leaf in self.leaves):
            return None
        return tuple(leaf.owner for leaf in self.leaves)

    @property
    def sharding(self) -> tuple[str, ...]:
        """Per leaf, how its state is sharded: `"sliced"` or `"owned"` (what `partition="auto"` decided)."""
        return tuple("sliced" if leaf.sliced else "owned" for leaf in self.leaves)

    @functools.cached_property
    def inner_entries(self) -> tuple[int, ...]:
        """Indices of the inner optimizer's entries (not master copies), in full-state order."""
        return tuple(i for i, e in enumerate(self.entries) if e.role == STATE)

    def whole_shape(self, leaf: ParamLeaf) -> tuple[int, ...]:
        """The parameter's whole (global) shape (`ParamLeaf.dims`); its block's shape without `dims`."""
        return whole_shape(leaf.shape, leaf.dims, dict(self.axis_sizes))

    def view_shape(self, leaf: ParamLeaf) -> tuple[int, ...]:
        """The shape the inner transformation sees `leaf` in: its slots (sliced), its whole shape (owned)."""
        return (leaf.slots,) if leaf.sliced else self.whole_shape(leaf)

    def zero_axes(self, leaf: ParamLeaf) -> tuple[str, ...]:
        """The ZeRO axes one block of `leaf` is sharded over (`axis_name` minus the leaf's own axes)."""
        return tuple(a for a in self.axes if a not in leaf.axes)

    def history_axes(self, leaf: ParamLeaf) -> tuple[str, ...]:
        """The mesh axes a sliced leaf's 1-D history is sharded over: its own axes (block-major), then its ZeRO axes."""
        return tuple(leaf.axes) + self.zero_axes(leaf)

    def local_axes(self, leaf: ParamLeaf) -> tuple[str, ...]:
        """The mesh axes `accumulate="local"`'s per-device sums of `leaf` are stacked over."""
        return self.replica_axes + self.history_axes(leaf)

    @functools.cached_property
    def unpacked_entries(self) -> tuple[int, ...]:
        """The inner entries stored as arrays of their own (shared and sliced): `ZeroState._inner`'s."""
        return tuple(j for j in self.inner_entries if self.kind(self.entries[j]) != "owned")

    @functools.cached_property
    def shared_entries(self) -> tuple[int, ...]:
        """The shared inner entries (step counts, ...), in order: `ZeroState._inner.shared`."""
        return tuple(j for j in self.inner_entries if self.entries[j].leaf is None)

    def kind(self, entry: StateEntry) -> str:
        """`"shared"`, `"sliced"` or `"owned"`: how `entry` is stored."""
        if entry.leaf is None:
            return "shared"
        return "sliced" if self.leaves[entry.leaf].sliced else "owned"

    @functools.cached_property
    def _owned_by_rank(self) -> tuple[tuple[int, ...], ...]:
        per_rank: list[list[int]] = [[] for _ in range(self.world_size)]
        for i, e in enumerate(self.entries):
            owner = None if e.leaf is None else self.leaves[e.leaf].owner
            if owner is not None:  # (an owned leaf's entry)
                per_rank[owner].append(i)
        return tuple(tuple(r) for r in per_rank)

    def rank_entries(self, rank: int) -> tuple[int, ...]:
        """Indices of the owned entries device `rank` packs."""
        return self._owned_by_rank[rank]

    @functools.cached_property
    def state_packing(self) -> Packing:
        """Where each rank's owned entries sit in its packed state buffers."""
        return pack_plan([[(i, self.entries[i].size, self.entries[i].dtype) for i in owned]
                          for owned in self._owned_by_rank])


@dataclasses.dataclass(frozen=True)
class StoredLayout(StoredViews):
    """What a checkpoint records of a zero1 state, none of the run-time plan; its fields are as `Layout`'s, except
    that `axis_sizes` knows only the axes of `axis_name` and the leaves' `axes`."""

    partition: str
    axis_name: str | tuple[str, ...]
    world_size: int
    leaves: tuple[ParamLeaf, ...]
    entries: tuple[StateEntry, ...]
    state_tree: str
    master_dtype: str | None
    axis_sizes: tuple[tuple[str, int], ...]
    accumulate: str | None = None
    accumulate_steps: int = 1
    replica_sizes: tuple[tuple[str, int], ...] = ()
