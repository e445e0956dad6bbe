"""The static layout of a zero1 state, hashable pytree metadata: its leaves, how each is sharded, where its state
lives (a *sliced* leaf's across its ZeRO group, an *owned* leaf's whole on its owner, *shared* entries everywhere)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Container, Sequence
from typing import Any

import numpy as np
import optax

from zero_optax.layout._stored import (
    ACC_PREFIX,
    LOCAL,
    MASTER,
    SHARDED,
    STATE,
    ParamLeaf,
    StateEntry,
    StoredViews,
)


@dataclasses.dataclass(frozen=True)
class Group:
    """Sliced leaves whose inner update is one program, stored and updated as one buffer: each device's part is
    the concatenation of its slots of every member, updated once on a view of the first member.

    Attributes:
      histories: per member, its inner-state entries; the `k`-th of every member is stored in history array `k`.
      masters: per member, its master-copy entry (empty without `master_dtype`).
      size: the length of a device's part, the sum of the members' slots.
      shape: None, or a lone 2+-D leaf's own shape (XLA updates a donated buffer in place only in its own shape).
      program: a number naming the programs the members' inner update and `init` run, equal for the groups whose
        members run the same (None: programs of their own); such groups trace them once per shape of their views.
    """

    leaves: tuple[int, ...]
    histories: tuple[tuple[int, ...], ...]
    masters: tuple[int, ...]
    offsets: tuple[int, ...]
    size: int
    shape: tuple[int, ...] | None = None
    # (Not compared: a hint for tracing, which gives the same programs without it; two states of one optimizer,
    # one behind optax.inject_hyperparams, are alike.)
    program: int | None = dataclasses.field(default=None, compare=False)

    @property
    def first(self) -> int:
        """The member whose view runs the group's update."""
        return self.leaves[0]

    @property
    def part_shape(self) -> tuple[int, ...]:
        """The shape of a device's part of the group's stored arrays: `shape`, or `(size,)`."""
        return (self.size,) if self.shape is None else self.shape


@dataclasses.dataclass(frozen=True)
class Layout(StoredViews):
    """Read-only description of a zero1 state; `zero_optax.describe(state)` returns it.

    Attributes:
      partition: `"flat"`, `"leaf"` or `"auto"`, as given to `zero1` (each leaf says how it is sharded).
      axis_name: the mesh axis (or tuple of axes) the state is sharded over; `world_size`: its device count.
      replica_sizes: `(name, size)` of the axes the state is replicated over (`replica_axis`).
      leaves: the trainable parameter leaves (`ParamLeaf`), in tree-flatten order.
      entries: the inner state's leaves in the full state's flatten order, then the master copies (`StateEntry`).
      treedef: the parameter tree structure; `state_tree`, `state_treedef`: the inner state's, as text and treedef.
      master_dtype: the master copies' dtype name, or None.
      axis_sizes: `(name, size)` of every mesh axis named by `axis_name` or by a leaf's `axes`.
      accumulate: None, `"sharded"` or `"local"`; `accumulate_steps`: update calls per optimizer step.
      memory_kind: `"device"`, or `"pinned_host"` with `offload=True` (not part of a checkpoint).
      groups: the sliced leaves grouped by the program their update runs (`Group`): how they are stored.
      stacks: owned leaves each device updates together under `jax.vmap` (one program, shape and owner).
      joint: whether the sliced leaves' update runs in one view of them all (it reduces or draws across leaves).
      replicas: `(entry, leaf)` for a sliced leaf's entry that is no history (novograd's per-leaf norm), stored as
        shared state.
      programs: per owned leaf, the programs its inner update and init run (with its shape and dtype), where one
        may run for another leaf of the same programs: devices owning alike share one branch; empty where unknown.
      reads: per inner entry, whether the inner `init` computes it from the parameters' values (not only from
        their shapes), from the analysis's trace of that `init`; None where unknown.
    """

    partition: str
    axis_name: str | tuple[str, ...]
    world_size: int
    leaves: tuple[ParamLeaf, ...]
    entries: tuple[StateEntry, ...]
    treedef: Any = dataclasses.field(repr=False)
    state_tree: str = dataclasses.field(default="", repr=False)
    state_treedef: Any = dataclasses.field(default=None, repr=False)
    master_dtype: str | None = None
    axis_sizes: tuple[tuple[str, int], ...] = ()
    accumulate: str | None = None
    accumulate_steps: int = 1
    memory_kind: str = dataclasses.field(default="device", compare=False)
    groups: tuple[Group, ...] = ()
    stacks: tuple[tuple[int, ...], ...] = ()
    joint: bool = False
    replicas: tuple[tuple[int, int], ...] = ()
    replica_sizes: tuple[tuple[str, int], ...] = ()
    programs: tuple[Any, ...] = dataclasses.field(default=(), compare=False, repr=False)
    reads: tuple[bool, ...] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:  # (cached: jit hashes the layout, static metadata, at every call)
        return hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.compare))

    def view_shared(self, present: Container[int]) -> tuple[int, ...]:
        """The shared entries of a view holding the leaves `present`: all but the `replicas` of absent leaves."""
        absent = {j for j, i in self.replicas if i not in present}
        return tuple(j for j in self.shared_entries if j not in absent)

    @functools.cached_property
    def stored_at(self) -> dict[int, tuple[int, int, int]]:
        """Sliced entry -> `(group, k, offset)`: where it starts in history `k` of `group` (-1: its master copy)."""
        out = {}
        for g, group in enumerate(self.groups):
            for m, off in enumerate(group.offsets):
                for k, j in enumerate(group.histories[m]):
                    out[j] = (g, k, off)
                if group.masters:
                    out[group.masters[m]] = (g, -1, off)
        return out

    @property
    def owned_leaves_per_device(self) -> tuple[int, ...]:
        """How many leaves each device updates (every device updates a slice of every sliced leaf)."""
        sliced = sum(leaf.sliced for leaf in self.leaves)
        return tuple(sliced + sum(leaf.owner == r for leaf in self.leaves) for r in range(self.world_size))

    def _bytes_per_device(self, kind: str) -> tuple[int, ...]:
        """Per device, the bytes of its entries of `kind`: `"state"`, `"master"` or `"acc"` (sharded accumulators)."""
        def kind_of(e: StateEntry) -> str:
            acc = self.accumulate == SHARDED and e.leaf is not None and e.path.startswith(ACC_PREFIX)
            return "acc" if acc else e.role

        def held(e: StateEntry, rank: int) -> bool:
            return e.leaf is None or self.leaves[e.leaf].sliced or self.leaves[e.leaf].owner == rank
        return tuple(sum(e.nbytes for e in self.entries if kind_of(e) == kind and held(e, r))
                     for r in range(self.world_size))

    @property
    def state_bytes_per_device(self) -> tuple[int, ...]:
        """Bytes each device needs for the inner optimizer's state, without padding to the largest share."""
        return self._bytes_per_device(STATE)

    @property
    def master_bytes_per_device(self) -> tuple[int, ...]:
        """Bytes each device needs for master copies (zero without `master_dtype`)."""
        return self._bytes_per_device(MASTER)

    @property
    def accumulator_bytes_per_device(self) -> tuple[int, ...]:
        """Bytes each device needs for gradient accumulators: its share of the float32 sums, or full-size local."""
        if self.accumulate == LOCAL:
            total = sum(leaf.size * np.dtype(np.promote_types(leaf.dtype, np.float32)).itemsize
                        for leaf in self.leaves)
            return (total,) * self.world_size
        return self._bytes_per_device("acc")

    @property
    def stored_bytes_per_device(self) -> int:
        """Bytes each device actually stores, master copies included (owned entries padded to one shape)."""
        unpacked = sum(e.nbytes for e in self.entries if e.leaf is None or self.leaves[e.leaf].sliced)
        packed = sum(size * np.dtype(d).itemsize for d, size in self.state_packing.sizes.items())
        return unpacked + packed

    def summary(self) -> str:
        """A short human-readable table of the layout."""
        lines = [f"zero1 partition={self.partition!r} axis={self.axis_name!r} world_size={self.world_size}"
                 + (f" replicated over {dict(self.replica_sizes)}" if self.replica_sizes else "")
                 + (f" master_dtype={self.master_dtype}" if self.master_dtype else "")
                 + f" state in {self.memory_kind} memory",
                 f"{'leaf':<40} {'shape':<16} {'dtype':<9} {'sharding':<8} {'slots':>10} {'owner':>5}"]
        for leaf in self.leaves:
            owner = "-" if leaf.owner is None else str(leaf.owner)
            how = "sliced" if leaf.sliced else "owned"
            lines.append(f"{leaf.path:<40} {leaf.shape!s:<16} {leaf.dtype:<9} {how:<8} {leaf.slots:>10} {owner:>5}")
        lines.append(f"state bytes per device: {list(self.state_bytes_per_device)}; "
                     + (f"master bytes per device: {list(self.master_bytes_per_device)}; " if self.master_dtype
                        else "")
                     + f"stored per device: {self.stored_bytes_per_device}"
                     + (f"; {len(self.groups)} groups of sliced leaves (largest "
                        f"{max(len(g.leaves) for g in self.groups)} leaves)" if self.groups else "")
                     + (f"; accumulate={self.accumulate!r} steps={self.accumulate_steps} accumulator bytes per "
                        f"device: {list(self.accumulator_bytes_per_device)}" if self.accumulate else ""))
        return "\n".join(lines)


def masked_view(values: Sequence[Any], present) -> list[Any]:
    """`values` with every item whose index is not in `present` replaced by `optax.MaskedNode()`."""
    return [v if i in present else optax.MaskedNode() for i, v in enumerate(values)]
