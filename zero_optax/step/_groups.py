"""The sliced leaves inside `shard_map`, stored and updated by group (`Layout.groups`).

A group's leaves run one program, so the inner update runs once per group, on the view of its first member holding
this device's slots of all members, with one history array per kind (Adam's `mu`, `nu`) for the whole group. A view
is the parameter tree with some leaves present, every other one `optax.MaskedNode()`: a group's first member holding
the group's part, the joint view of every sliced leaf, or an owner's leaves (`Views`, computed once per layout).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zero_optax.core._errors import ZeroStructureError
from zero_optax.core._names import tree_signature
from zero_optax.layout import _fusion, _inner_state, _layout, _planner, _stored
from zero_optax.layout._layout import Group, Layout
from zero_optax.layout._state import SlicedState
from zero_optax.step import (
    _reduce,
    _varying,
    _wire,
)


def tree(layout: Layout, values: list) -> Any:
    """The parameter-shaped tree of `values`, one per leaf."""
    return jax.tree_util.tree_unflatten(layout.treedef, values)


def masked_tree(layout: Layout, values: dict[int, Any]) -> Any:
    """A parameter-shaped tree holding `values` (leaf index -> array) and `optax.MaskedNode()` elsewhere."""
    return tree(layout, _layout.masked_view([values.get(i) for i in range(len(layout.leaves))], values))


def owned_entries(layout: Layout, leaves: Iterable[int]) -> list[int]:
    """The inner entries of an owner's view of `leaves`: shared entries and histories."""
    mine = set(leaves)
    shared = set(layout.view_shared(mine))
    return [j for j in layout.inner_entries if j in shared or layout.entries[j].leaf in mine]


class Views:
    """The treedefs of the inner state on the views of one `Config`'s layouts, and the updates' dtypes (cached)."""

    def __init__(self, cfg: _planner.Config):
        self.cfg = cfg
        self._cache: dict = {}

    def _cached(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def group(self, layout: Layout, g: int | None) -> tuple[Any, list[int]]:
        """Group `g`'s view (of no leaf when None): its state treedef and the entries it stands for, in order."""
        def make():
            group = None if g is None else layout.groups[g]
            present = set() if group is None else {group.first}
            order = sorted(layout.view_shared(present) + (() if group is None else group.histories[0]))
            what = "with no leaf" if group is None else f"on the sliced leaf `{layout.leaves[group.first].path}`"
            return _fusion.view_treedef(self.cfg, layout, present, order, what), order
        return self._cached((layout, g), make)

    def joint(self, layout: Layout) -> tuple[Any, list[int]]:
        """The view of every sliced leaf (`Layout.joint`): its state treedef and the entries, in order."""
        def make():
            present = {g.first for g in layout.groups}
            order = sorted(layout.view_shared(present) + tuple(j for g in layout.groups for j in g.histories[0]))
            return _fusion.view_treedef(self.cfg, layout, present, order, "on the sliced leaves"), order
        return self._cached((layout, "joint"), make)

    def owned(self, layout: Layout, r: int, leaves: Iterable[int]):
        """The state treedef of device `r`'s view of `leaves`."""
        present = frozenset(leaves)
        return self._cached((layout, r, present), lambda: _fusion.view_treedef(
            self.cfg, layout, set(present), owned_entries(layout, present), f"on device {r}"))

    def update_dtypes(self, layout: Layout, extra: dict, phase=None) -> dict[int, str]:
        """Per leaf, the dtype of the inner update's result (of `phase`'s under accumulation), from one abstract
        trace of a view holding one member of each group and stack and every other owned leaf."""
        key = (layout, phase, jax.tree.structure(extra), tuple((np.shape(x), jnp.result_type(x))
                                                                for x in jax.tree.leaves(extra)))
        inner = self.cfg.inner if phase is None else phase.inner

        def make():
            first = {i: g.first for g in layout.groups for i in g.leaves}
            first.update((i, s[0]) for s in layout.stacks for i in s)
            present = {first.get(i, i) for i in range(len(layout.leaves))}
            structs = [jax.ShapeDtypeStruct(layout.view_shape(leaf), self.cfg.inner_dtype(leaf.dtype))
                       for leaf in layout.leaves]
            view = tree(layout, _layout.masked_view(structs, present))
            state = jax.eval_shape(inner.init, view)
            updates, _ = jax.eval_shape(lambda g, s, p, e: inner.update(g, s, p, **e), view, state, view, extra)
            got = {i: np.dtype(u.dtype).name for i, u in zip(sorted(present), jax.tree.leaves(updates))}
            return {i: got[first.get(i, i)] for i in range(len(layout.leaves))}
        return self._cached(key, make)


def run_inner(step: Step, grads, state, params, slices: list | None = None) -> tuple[Any, Any]:
    """The inner update on values typed varying, `slices` per argument leaf None or its `_varying.Coordinates`."""
    u, new = _varying.run(lambda g, s, p, e: step.inner.update(g, s, p, **e), (grads, state, params, step.extra),
                          step.layout.axes, slices)
    return _varying.like(u, grads), _varying.like(new, state)


def order(layout: Layout) -> list[int]:
    """The sliced leaves in tree order, the order buckets are planned in."""
    return sorted(i for g in layout.groups for i in g.leaves)


def _pieces(arrays: Sequence[jax.Array], positions: Sequence[tuple[int, int, int]]) -> jax.Array:
    pieces = [arrays[k] if (lo, hi) == (0, arrays[k].shape[0]) else arrays[k][lo:hi]
              for k, lo, hi in _stored.runs(positions)]
    return _wire.concat(pieces)


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


def own_part(layout: Layout, group: Group, values, ranks) -> jax.Array:
    """This device's slots of `group`'s members of `values` (leaf -> array), concatenated."""
    rank = group_rank(layout, group, ranks)
    return _wire.concat([_wire.own_slice(values[i], layout.leaves[i], rank) for i in group.leaves])


def own_parts(layout: Layout, values, ranks) -> list[jax.Array]:
    """`own_part` of every group."""
    return [own_part(layout, g, values, ranks) for g in layout.groups]


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


def _coordinates(layout: Layout, group: Group, mask, ranks) -> _varying.Coordinates:
    """What the joint view's value of `group`'s (only) leaf holds: which of its coordinates, on which axes."""
    leaf = layout.leaves[group.first]
    return _varying.Coordinates(mask, layout.zero_axes(leaf) if leaf.group > 1 else (), leaf,
                               group_rank(layout, group, ranks))


def _view(layout: Layout, groups: Sequence[Group], parts: Sequence[jax.Array]) -> Any:
    """The masked tree holding each group's part (in the group's `shape`) at its first member."""
    return masked_tree(layout, {g.first: x if g.shape is None else x.reshape(g.shape)
                                       for g, x in zip(groups, parts)})


def _assemble(view: tuple[Any, list[int]], shared: dict[int, Any], groups: Sequence[Group], histories) -> Any:
    """The inner state of a view (its treedef and entries) from the shared values and its groups' histories."""
    treedef, order = view
    own = {j: x for g, h in zip(groups, histories) for j, x in zip(g.histories[0], h)}
    return jax.tree_util.tree_unflatten(treedef, [shared[j] if j in shared else own[j] for j in order])


def stored_state(layout: Layout, shared: dict[int, Any], histories) -> SlicedState:
    """The stored `SlicedState` of the shared entries' values and the groups' histories."""
    return SlicedState(_inner_state.tree(layout, [shared[j][None] for j in layout.shared_entries]), tuple(histories))


@dataclasses.dataclass(frozen=True, eq=False)
class Groups:
    """`init` and `update` of the groups of one `Config`'s layouts."""

    cfg: _planner.Config
    views: Views

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
                values = {} if g is None or group is None else {group.first: rows[g].reshape(group.part_shape)}
                s, h = self._disassemble(layout, g, self.cfg.inner.init(masked_tree(layout, values)))
            else:
                s = {j: jnp.asarray(full[j], layout.entries[j].dtype) for j in layout.shared_entries}
                h = [] if group is None else [self._cut(layout, group, full, k, ranks)
                                              for k in range(len(group.histories[0]))]
            shared = s if shared is None else {**s, **shared}  # (the first view's, and each view's replicas)
            if group is not None:
                mask = valid(layout, group, group_rank(layout, group, ranks))
                histories.append(tuple(zero_padding(x, mask) for x in h))
        assert shared is not None  # (there is always a target)
        return stored_state(layout, shared, histories)

    @staticmethod
    def _cut(layout: Layout, group: Group, full: list, k: int, ranks) -> jax.Array:
        """This device's part of history `k` of `group`, from the full values of its members' entries."""
        values = {i: jnp.asarray(full[entries[k]], layout.entries[entries[k]].dtype)
                  for i, entries in zip(group.leaves, group.histories)}
        return own_part(layout, group, values, ranks).reshape(group.part_shape)

    @staticmethod
    def shared_values(layout: Layout, stored: SlicedState) -> dict[int, jax.Array]:
        """The shared entries' values from storage (one copy per device)."""
        return {j: x[0] for j, x in zip(layout.shared_entries, _inner_state.items(stored.shared))}

    def run_view(self, step: Step, g: int | None, grads, params, histories: Sequence, with_params: bool
                 ) -> tuple[jax.Array | None, dict[int, Any], list[Any]]:
        """Group `g`'s inner update (on a part or a chunk): its update (None without leaf), shared values, histories."""
        layout = step.layout
        assert step.shared_old is not None  # (set by `update`, `stream_groups`)
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
        assert step.shared_old is not None  # (set by `update`)
        _, order = self.views.joint(layout)
        slices = {g.first: _coordinates(layout, g, mask, step.ranks) for g, mask in zip(layout.groups, masks)}
        old = _assemble(self.views.joint(layout), step.shared_old, layout.groups, stored.histories)
        g_view = _view(layout, layout.groups, grads)
        p_view = None if params is None else _view(layout, layout.groups, params)
        firsts = sorted(slices)
        tags = [slices[i] for i in firsts]
        tags += [None if e.leaf is None else slices[e.leaf] for e in (layout.entries[j] for j in order)]
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
        return updates, stored_state(layout, shared_new, histories), shared_old


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
