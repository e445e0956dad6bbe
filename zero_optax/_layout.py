"""The static layout of a ZeRO state: which parameter leaves exist, which state belongs to which, and where it lives.

A `Layout` is hashable and travels as static pytree metadata inside the state, so `update`, `describe` and the
checkpoint code all read the same description that `init` computed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from zero_optax._errors import ZeroCouplingError

FLAT = "flat"
LEAF = "leaf"


@dataclasses.dataclass(frozen=True)
class ParamLeaf:
    """One trainable parameter leaf.

    Attributes:
      path: the leaf's key path in the parameter tree, as `jax.tree_util.keystr` writes it.
      shape: the full parameter shape.
      dtype: the parameter dtype name.
      slots: coordinates each device holds: `ceil(size / world_size)` for the flat partition, the whole
        `size` (on its owner only) for the leaf partition.
      owner: the device that updates this leaf (leaf partition), else None.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    slots: int
    owner: int | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class StateEntry:
    """One array leaf of the inner optimizer's state.

    Attributes:
      path: key path inside the inner state tree.
      leaf: index of the parameter leaf whose history this is; None for state shared by all leaves (step
        counts, schedules, injected hyperparameters), which every device keeps a copy of.
      shape: shape on one device: `(slots,)` for a flat coordinate history, the full shape for the leaf
        partition and for shared entries.
      dtype: dtype name.
    """

    path: str
    leaf: int | None
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where rank-local arrays live inside per-dtype packed buffers (leaf partition).

    Attributes:
      offsets: per rank, a mapping from item index to its (dtype, offset) in that rank's buffers.
      sizes: the buffer length per dtype, the same on every rank (the largest rank's share).
      used: per rank, the elements it really uses per dtype (the rest is padding).
    """

    offsets: tuple[dict[int, tuple[str, int]], ...]
    sizes: dict[str, int]
    used: tuple[dict[str, int], ...]


def pack_plan(groups: Sequence[Sequence[tuple[int, int, str]]]) -> Packing:
    """Lays out each rank's `(item, size, dtype)` list, in order, into per-dtype buffers of one common size."""
    offsets, used = [], []
    for items in groups:
        cursor: dict[str, int] = {}
        where = {}
        for item, size, dtype in items:
            where[item] = (dtype, cursor.get(dtype, 0))
            cursor[dtype] = cursor.get(dtype, 0) + size
        offsets.append(where)
        used.append(cursor)
    dtypes = sorted({d for u in used for d in u})
    sizes = {d: max(u.get(d, 0) for u in used) for d in dtypes}
    return Packing(tuple(offsets), sizes, tuple(used))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Read-only description of a ZeRO optimizer state; `zero_optax.describe(state)` returns it.

    Attributes:
      partition: `"flat"` (every device holds a slice of every leaf) or `"leaf"` (one owner per leaf).
      axis_name: the mesh axis the state is sharded over.
      world_size: the number of devices along that axis.
      leaves: the trainable parameter leaves, in tree-flatten order.
      entries: the inner optimizer's state leaves, in tree-flatten order of the full (unsharded) state.
      treedef: the parameter tree structure.
      state_tree: the inner optimizer's state structure (`str` of its treedef, with the state's type names), which
        tells apart optimizers whose states have the same paths (Adam and AdaBelief, say).
    """

    partition: str
    axis_name: str
    world_size: int
    leaves: tuple[ParamLeaf, ...]
    entries: tuple[StateEntry, ...]
    treedef: Any = dataclasses.field(repr=False)
    state_tree: str = dataclasses.field(default="", repr=False)

    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.partition, self.axis_name, self.world_size, self.leaves, self.entries, self.treedef,
                     self.state_tree))

    # Views that users read.
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
    def owners(self) -> tuple[int, ...] | None:
        return tuple(leaf.owner for leaf in self.leaves) if self.partition == LEAF else None

    def rank_entries(self, rank: int) -> tuple[int, ...]:
        """Indices of the entries device `rank` stores: shared entries and the histories of leaves it owns."""
        if self.partition == FLAT:
            return tuple(range(len(self.entries)))
        return tuple(i for i, e in enumerate(self.entries)
                     if e.leaf is None or self.leaves[e.leaf].owner == rank)

    @functools.cached_property
    def state_packing(self) -> Packing:
        """Leaf partition: where each rank's entries sit in its packed state buffers."""
        return pack_plan([[(i, self.entries[i].size, self.entries[i].dtype) for i in self.rank_entries(r)]
                          for r in range(self.world_size)])

    @property
    def owned_leaves_per_device(self) -> tuple[int, ...]:
        """How many leaves each device updates (every device updates a slice of every leaf when flat)."""
        if self.partition == FLAT:
            return (len(self.leaves),) * self.world_size
        return tuple(sum(leaf.owner == r for leaf in self.leaves) for r in range(self.world_size))

    @property
    def state_bytes_per_device(self) -> tuple[int, ...]:
        """Optimizer-state bytes each device needs, without padding to the largest device's share."""
        return tuple(sum(self.entries[i].nbytes for i in self.rank_entries(r)) for r in range(self.world_size))

    @property
    def stored_bytes_per_device(self) -> int:
        """Optimizer-state bytes each device actually stores (leaf partition: buffers padded to one shape)."""
        if self.partition == FLAT:
            return sum(e.nbytes for e in self.entries)
        return sum(size * np.dtype(d).itemsize for d, size in self.state_packing.sizes.items())

    def summary(self) -> str:
        """A short human-readable table of the layout."""
        lines = [f"zero1 partition={self.partition!r} axis={self.axis_name!r} world_size={self.world_size}",
                 f"{'leaf':<40} {'shape':<16} {'dtype':<9} {'slots':>10} {'owner':>5}"]
        for leaf in self.leaves:
            owner = "-" if leaf.owner is None else str(leaf.owner)
            lines.append(f"{leaf.path:<40} {leaf.shape!s:<16} {leaf.dtype:<9} {leaf.slots:>10} {owner:>5}")
        lines.append(f"state bytes per device: {list(self.state_bytes_per_device)}; "
                     f"stored per device: {self.stored_bytes_per_device}")
        return "\n".join(lines)


def abstract(tree):
    """`tree` with every array replaced by a `jax.ShapeDtypeStruct` of its shape and dtype."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _paths(tree) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def discover_entries(init_fn, treedef, leaf_structs: Sequence[jax.ShapeDtypeStruct]
                     ) -> tuple[tuple[StateEntry, ...], str]:
    """Finds which inner-state leaves belong to which parameter leaf, from `init_fn` on partial trees.

    Returns the entries in the full state's flatten order and the full state's tree structure as a string.

    The inner optimizer is initialised (abstractly) on the whole tree, on a tree with every leaf replaced by
    `optax.MaskedNode()`, and on trees holding one leaf each. State present without any leaf is shared; state
    that appears with leaf `i` alone is leaf `i`'s history. This is the same mechanism `optax.masked` relies on,
    so it works for any transformation that composes with `optax.masked`.
    """
    n = len(leaf_structs)
    masked = [optax.MaskedNode()] * n

    def shape_of(leaves):
        try:
            return jax.eval_shape(init_fn, jax.tree_util.tree_unflatten(treedef, leaves))
        except Exception as e:
            raise ZeroCouplingError(
                "zero1 could not tell which optimizer state belongs to which parameter: the inner "
                "transformation's init failed on a tree whose other leaves are optax.MaskedNode() "
                f"(the way optax.masked calls it): {type(e).__name__}: {e}") from e

    full_state = shape_of(list(leaf_structs))
    full = _paths(full_state)
    shared = {p for p, _ in _paths(shape_of(masked))}
    owner_of: dict[str, int] = {}
    for i in range(n):
        view = list(masked)
        view[i] = leaf_structs[i]
        for path, _ in _paths(shape_of(view)):
            if path in shared:
                continue
            if path in owner_of:
                raise ZeroCouplingError(
                    f"The inner optimizer's state `{path}` appears for two parameter leaves ({owner_of[path]} and "
                    f"{i}); zero1 can only shard state that belongs to one leaf or to none.")
            owner_of[path] = i
    entries = []
    for path, x in full:
        if path not in shared and path not in owner_of:
            raise ZeroCouplingError(
                f"The inner optimizer's state `{path}` depends on several parameter leaves at once; zero1 can only "
                "shard state that belongs to one leaf or to none.")
        entries.append(StateEntry(path, owner_of.get(path), tuple(x.shape), np.dtype(x.dtype).name))
    return tuple(entries), str(jax.tree.structure(full_state))


def param_leaves(params, world_size: int, partition: str, owners: Sequence[int] | None = None):
    """The `(treedef, leaves)` of a parameter tree for the given partition."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = []
    for i, (path, x) in enumerate(flat):
        shape = tuple(np.shape(x))
        size = math.prod(shape)
        if partition == FLAT:
            slots, owner = -(-size // world_size), None
        else:
            slots, owner = size, owners[i]
        leaves.append(ParamLeaf(jax.tree_util.keystr(path), shape, np.dtype(x.dtype).name, slots, owner))
    return treedef, tuple(leaves)
