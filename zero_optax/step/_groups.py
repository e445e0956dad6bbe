"""The sliced leaves inside `shard_map`, stored and updated by group (`Layout.groups`).

A group's leaves run one program, so the inner update runs once per group, on the view of its first member holding
this device's slots of all members, with one history array per kind (Adam's `mu`, `nu`) for the whole group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zero_optax.core._errors import ZeroStructureError
from zero_optax.core._names import tree_signature
from zero_optax.layout import _inner_state, _planner, _stored
from zero_optax.step import (
    _reduce,
    _slots,
    _varying,
    _views,
    _wire,
)
from zero_optax.layout._layout import Group, Layout
from zero_optax.layout._state import SlicedState


def run_inner(step: Step, grads, state, params, slices: list | None = None) -> tuple[Any, Any]:
    """The inner update on values typed varying, `slices` per argument leaf None or its `_reduce.Coordinates`."""
    u, new = _varying.run(lambda g, s, p, e: step.inner.update(g, s, p, **e), (grads, state, params, step.extra),
                          step.layout.axes, slices)
    return _varying.like(u, grads), _varying.like(new, state)


def order(layout: Layout) -> list[int]:
    """The sliced leaves in tree order, the order buckets are planned in."""
    return sorted(i for g in layout.groups for i in g.leaves)


def _pieces(arrays: Sequence[jax.Array], positions: Sequence[tuple[int, int, int]]) -> jax.Array:
    pieces = [arrays[k] if (lo, hi) == (0, arrays[k].shape[0]) else arrays[k][lo:hi]
              for k, lo, hi in _stored.runs(positions)]
    return _slots.concat(pieces)


def parts_from_rows(layout: Layout, rows: Sequence[jax.Array], buckets: Sequence[_wire.Bucket]) -> list[jax.Array]:
    """Each group's part of the buffer, cut from the buckets' rows: one slice per run of members in a bucket."""
    where = {}
    for k, b in enumerate(buckets):
        for i, off in zip(b.leaves, np.cumsum([0] + [layout.leaves[i].slots for i in b.leaves])):
            where[i] = (k, int(off))
    return [_pieces(rows, [(*where[i], layout.leaves[i].slots) for i in g.leaves]) for g in layout.groups]


def rows_from_parts(layout: Layout, parts: Sequence[jax.Array], buckets: Sequence[_wire.Bucket]) -> list[jax.Array]:
    """The inverse of `parts_from_rows`: every bucket's row, cut from the groups' parts."""
    where = {i: (g, off) for g, group in enumerate(layout.groups) for i, off in zip(group.leaves, group.offsets)}
    return [_pieces(parts, [(*where[i], layout.leaves[i].slots) for i in b.leaves]) for b in buckets]


def group_rank(layout: Layout, group: Group, ranks) -> jax.Array:
    """This device's index along `group`'s ZeRO axes."""
    return ranks[layout.zero_axes(layout.leaves[group.first])]


def valid(layout: Layout, group: Group, rank: jax.Array, start=0, length: int | None = None) -> jax.Array | None:
    """Which coordinates `[start, start + length)` of this device's part of the buffer are not padding (None: all);
    built from per-member numbers, not from a constant the size of the buffer."""
    leaves = [layout.leaves[i] for i in group.leaves]
    if all(leaf.slots * leaf.group == leaf.size for leaf in leaves):
        return None
    slots = jnp.asarray([leaf.slots for leaf in leaves], jnp.int32)
    real = jnp.clip(jnp.asarray([leaf.size for leaf in leaves], jnp.int32) - rank.astype(jnp.int32) * slots, 0, slots)
    offsets = jnp.asarray(group.offsets, jnp.int32)
    where = start + lax.iota(jnp.int32, group.size if length is None else length)
    member = jnp.searchsorted(offsets, where, side="right") - 1
    return where - offsets[member] < real[member]


def zero_padding(x: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Keeps the padded coordinates of a history at zero (some optimizers add eps to them)."""
    return x if mask is None else jnp.where(mask, x, jnp.zeros_like(x))


def stepped(u: jax.Array, master: jax.Array | None, mask: jax.Array | None, ok, p_dtype) -> tuple:
    """`(None, updates)`, or the new master copies and their rounding to `p_dtype` (a skipped step leaves them)."""
    if master is None:
        return None, _reduce.skip_if_empty(ok, u, jnp.zeros_like(u))
    new = _reduce.skip_if_empty(ok, zero_padding((master + u).astype(master.dtype), mask), master)
    return new, new.astype(p_dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """What every stage of one `update` call reads alike.

    Attributes:
      inner: the transformation that runs (under accumulation, the final step's or a micro-step's).
      denom: the reduction's denominator; `denom.ok` is None, or whether the step's global weight is nonzero.
      inner_dt, sum_dt: leaf -> the dtype name the inner update sees its gradient in, and the one it is summed in.
      ranks: this device's index along each tuple of axes a group of leaves is sharded over.
      stepping: False for a micro-batch that only accumulates.
      streamed: the stored arrays stream through the device from host memory (offload).
      p_leaves: the parameter leaves (None without), as the reading code holds them (in a branch, its operand).
      shared_old: the shared entries' old values, once the group views have read them.
      phase: under accumulation, the side of the call that runs (`_accumulate.Phase`).
    """

    layout: Layout
    inner: Any
    extra: dict
    denom: Any
    inner_dt: dict
    sum_dt: dict
    ranks: dict
    stepping: bool = True
    streamed: bool = False
    p_leaves: list | None = None
    shared_old: dict | None = None
    phase: Any = None

    @property
    def rank(self):
        """This device's index along the ZeRO axes."""
        return self.ranks[self.layout.axes]


def _coordinates(layout: Layout, group: Group, mask, ranks) -> _reduce.Coordinates:
    """What the joint view's value of `group`'s (only) leaf holds: which of its coordinates, on which axes."""
    leaf = layout.leaves[group.first]
    return _reduce.Coordinates(mask, layout.zero_axes(leaf) if leaf.group > 1 else (),
                               leaf.shape if leaf.blocks == 1 else None, group_rank(layout, group, ranks), leaf.slots,
                               leaf.group)


def _view(layout: Layout, groups: Sequence[Group], parts: Sequence[jax.Array]) -> Any:
    """The masked tree holding each group's part (in the group's `shape`) at its first member."""
    return _views.masked_tree(layout, {g.first: x if g.shape is None else x.reshape(g.shape)
                                       for g, x in zip(groups, parts)})


def _assemble(view: tuple[Any, list[int]], shared: dict[int, Any], groups: Sequence[Group], histories) -> Any:
    """The inner state of a view (its treedef and entries) from the shared values and its groups' histories."""
    treedef, order = view
    own = {j: x for g, h in zip(groups, histories) for j, x in zip(g.histories[0], h)}
    return jax.tree_util.tree_unflatten(treedef, [shared[j] if j in shared else own[j] for j in order])


def _stored_state(layout: Layout, shared: dict[int, Any], histories) -> SlicedState:
    """The stored `SlicedState` of the shared entries' values and the groups' histories."""
    return SlicedState(_inner_state.tree(layout, [shared[j][None] for j in layout.shared_entries]), tuple(histories))


@dataclasses.dataclass(frozen=True, eq=False)
class Groups:
    """`init` and `update` of the groups of one `Config`'s layouts."""

    cfg: _planner.Config
    views: _views.Views

    def targets(self, layout: Layout) -> list[int | None]:
        return list(range(len(layout.groups))) or [None]

    def _disassemble(self, layout: Layout, g: int | None, state: Any) -> tuple[dict[int, Any], list[Any]]:
        _, order = self.views.group(layout, g)
        values = dict(zip(order, jax.tree.leaves(state)))
        own = [] if g is None else [values[j] for j in layout.groups[g].histories[0]]
        return {j: values[j] for j in layout.shared_entries if j in values}, own

    def init(self, layout: Layout, rows: list[jax.Array], full: list | None, ranks) -> SlicedState:
        """The groups' stored state: the inner `init` on each group's part `rows`, or an optax state's `full` cut."""
        shared: dict[int, Any] | None = None
        histories = []
        for g in self.targets(layout):
            group = None if g is None else layout.groups[g]
            if full is None:
                values = {} if group is None else {group.first: rows[g].reshape(group.part_shape)}
                s, h = self._disassemble(layout, g, self.cfg.inner.init(_views.masked_tree(layout, values)))
            else:
                s = {j: jnp.asarray(full[j], layout.entries[j].dtype) for j in layout.shared_entries}
                h = [] if group is None else [self._cut(layout, group, full, k, ranks)
                                              for k in range(len(group.histories[0]))]
            shared = s if shared is None else {**s, **shared}  # (the first view's, and each view's replicas)
            if group is not None:
                mask = valid(layout, group, group_rank(layout, group, ranks))
                histories.append(tuple(zero_padding(x, mask) for x in h))
        return _stored_state(layout, shared, histories)

    @staticmethod
    def _cut(layout: Layout, group: Group, full: list, k: int, ranks) -> jax.Array:
        """This device's part of history `k` of `group`, from the full values of its members' entries."""
        values = {i: jnp.asarray(full[entries[k]], layout.entries[entries[k]].dtype)
                  for i, entries in zip(group.leaves, group.histories)}
        return _slots.own_rows(values, layout, group.leaves, group_rank(layout, group, ranks)).reshape(group.part_shape)

    @staticmethod
    def shared_values(layout: Layout, stored: SlicedState) -> dict[int, jax.Array]:
        """The shared entries' values from storage (one copy per device)."""
        return {j: x[0] for j, x in zip(layout.shared_entries, _inner_state.items(stored.shared))}

    def run_view(self, step: Step, g: int | None, grads, params, histories: Sequence, with_params: bool
                 ) -> tuple[jax.Array | None, dict[int, Any], list[Any]]:
        """Group `g`'s inner update (on a part or a chunk): its update (None without leaf), shared values, histories."""
        layout = step.layout
        groups = [] if g is None else [layout.groups[g]]
        g_view = _view(layout, groups, [grads])
        old = _assemble(self.views.group(layout, g), step.shared_old, groups, [histories])
        u, new = run_inner(step, g_view, old, _view(layout, groups, [params]) if with_params else None)
        what = "leaves" if g is None else f"sliced leaves of `{layout.leaves[groups[0].first].path}`'s group"
        check_returned(u, new, g_view, old, what)
        new_shared, new_histories = self._disassemble(layout, g, new)
        u = jax.tree.leaves(u)
        return (u[0] if u else None), new_shared, new_histories

    def _run_joint(self, step: Step, grads: list, params: list | None, masks: list, stored: SlicedState
                   ) -> tuple[list, dict[int, Any], list[tuple]]:
        """The inner update on the joint view of every sliced leaf (`Layout.joint`), like `run_view` per group."""
        layout = step.layout
        _, order = self.views.joint(layout)
        slices = {g.first: _coordinates(layout, g, mask, step.ranks) for g, mask in zip(layout.groups, masks)}
        old = _assemble(self.views.joint(layout), step.shared_old, layout.groups, stored.histories)
        g_view = _view(layout, layout.groups, grads)
        p_view = None if params is None else _view(layout, layout.groups, params)
        firsts = sorted(slices)
        tags = [slices[i] for i in firsts]
        tags += [None if layout.entries[j].leaf is None else slices[layout.entries[j].leaf] for j in order]
        tags += ([] if p_view is None else [slices[i] for i in firsts]) + [None] * len(jax.tree.leaves(step.extra))
        u, new = run_inner(step, g_view, old, p_view, tags)
        check_returned(u, new, g_view, old, "sliced leaves")
        values = dict(zip(order, jax.tree.leaves(new)))
        updates = dict(zip(firsts, jax.tree.leaves(u)))
        return ([updates[g.first] for g in layout.groups], {j: values[j] for j in layout.shared_entries},
                [tuple(values[j] for j in g.histories[0]) for g in layout.groups])

    def update(self, step: Step, grads: list[jax.Array | None], params: list[jax.Array | None] | None,
               stored: SlicedState, masks: list) -> tuple[list, SlicedState, dict]:
        """Each group's updates, the new stored state (the old where the step is skipped) and the old shared values."""
        layout = step.layout
        shared_old = self.shared_values(layout, stored)
        step = dataclasses.replace(step, shared_old=shared_old)
        if layout.joint:
            updates, shared_new, new = self._run_joint(step, grads, params, masks, stored)
        else:
            runs = [self.run_view(step, g, grads[t], None if params is None else params[t],
                                  () if g is None else stored.histories[g], params is not None)
                    for t, g in enumerate(self.targets(layout))]
            updates, shared_new, new = [u for u, _, _ in runs], runs[0][1], [h for _, _, h in runs]
        histories = [tuple(_reduce.skip_if_empty(step.denom.ok, zero_padding(x, mask), y) for x, y in zip(h, old))
                     for h, old, mask in zip(new, stored.histories, masks)]
        return updates, _stored_state(layout, shared_new, histories), shared_old


def check_returned(updates, new_state, g_tree, old_state, what: str) -> None:
    """Refuses an inner update whose results are not structured like its inputs."""
    if jax.tree.structure(updates) != jax.tree.structure(g_tree):
        raise ZeroStructureError(
            f"The inner update returned updates structured as {tree_signature(updates)} for the {what}, but the "
            f"gradients it was given are {tree_signature(g_tree)}.")
    if jax.tree.structure(new_state) != jax.tree.structure(old_state):
        raise ZeroStructureError(
            f"The inner update returned a state structured as {tree_signature(new_state)} for the {what}, but "
            f"its state was {tree_signature(old_state)}: zero1 stores the state in the layout init found.")
