"""The sliced leaves inside `shard_map`, stored and updated by group (`Layout.groups`).

A group's leaves run one program, so the inner update runs once per group, on the view of its first member holding
this device's slots of all members, with one history array per kind (Adam's `mu`, `nu`) for the whole group. A view
is the parameter tree with some leaves present, every other one `optax.MaskedNode()`: a group's first member holding
the group's part, the joint view of every sliced leaf, or an owner's leaves (`Views`, computed once per layout).
Without sliced leaves the view of no leaf computes the shared entries (step counts), or one leaf's view where the
inner update cannot run on a tree whose every leaf is masked (`Views.stand_in`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax import lax

from zero_optax.analysis import _programs
from zero_optax.core._errors import ZeroError, ZeroStructureError
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


def value_shared(inner, layout: Layout, values: list) -> dict[int, jax.Array]:
    """The shared entries whose `init` reads the parameters' values (dog's distance, a norm of them), from the inner
    `init` on the whole parameters `values`, as plain optax computes them: a view's part would give another value.
    Empty (the usual case: counts and zeros) where no shared entry reads them."""
    reads = layout.reads
    if reads is None:  # (not found by the layout's analysis)
        structs = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in values]
        reads = _programs.value_dependent(jax.make_jaxpr(lambda xs: inner.init(tree(layout, xs)))(structs))
    wanted = [j for j in layout.shared_entries if reads[j]]
    if not wanted:
        return {}
    leaves = jax.tree.leaves(inner.init(tree(layout, values)))
    return {j: leaves[j].astype(layout.entries[j].dtype) for j in wanted}


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
            what = "with no leaf" if group is None else f"on the sliced leaf `{layout.leaves[group.first].path}`"
            present, order = set() if group is None else {group.first}, self.order(layout, g)
            return _fusion.view_treedef(self.cfg, layout, present, order, what), order
        return self._cached((layout, g), make)

    @staticmethod
    def order(layout: Layout, g: int | None) -> list[int]:
        """The entries group `g`'s view (of no leaf when None) stands for, in order (`group`, without its treedef)."""
        group = None if g is None else layout.groups[g]
        present = set() if group is None else {group.first}
        return sorted(layout.view_shared(present) + (() if group is None else group.histories[0]))

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
        key = (layout, phase, _signature(extra))
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

    def stand_in(self, step: Step, with_params: bool) -> int | None:
        """None where the inner update runs on the view with no leaf; else the leaf whose view computes the new
        shared entries instead (the smallest; init proved they depend on no leaf). optax's galore, for one, fails
        on a tree whose every leaf is masked."""
        layout = step.layout

        def make():
            treedef, order = self.group(layout, None)
            state = jax.tree_util.tree_unflatten(treedef, [jax.ShapeDtypeStruct(layout.entries[j].shape,
                                                                                layout.entries[j].dtype)
                                                           for j in order])
            view = masked_tree(layout, {})
            try:
                jax.eval_shape(lambda s, e: step.inner.update(view, s, view if with_params else None, **e),
                               state, step.extra)
            except ZeroError:
                raise
            except (ValueError, TypeError):  # (what JAX raises on a tree with too few leaves)
                if not layout.leaves:
                    raise
                return min(range(len(layout.leaves)), key=lambda i: (layout.leaves[i].size, i))
            return None
        return self._cached((layout, "stand_in", step.phase, with_params, _signature(step.extra)), make)


def _signature(extra: dict) -> tuple:
    """The structure, shapes and dtypes of the extra arguments of `update` (a cache key)."""
    return jax.tree.structure(extra), tuple((np.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(extra))


def run_inner(step: Step, grads, state, params, slices: list | None = None, key: Any = None) -> tuple[Any, Any]:
    """The inner update on values typed varying, `slices` per argument leaf None or its `_varying.Coordinates`; the
    program it was traced to, if it was, kept in `step.programs` at `key` (unless None)."""
    keep = None if key is None else functools.partial(step.programs.__setitem__, key)
    u, new = _varying.run(lambda g, s, p, e: step.inner.update(g, s, p, **e), (grads, state, params, step.extra),
                          step.layout.axes, slices, keep)
    return _varying.like(u, grads), _varying.like(new, state)


def order(layout: Layout) -> list[int]:
    """The sliced leaves in tree order, the order buckets are planned in."""
    return sorted(i for g in layout.groups for i in g.leaves)


def _joined(arrays: Sequence[jax.Array], wanted: Sequence[Sequence[tuple[int, int, int]]]) -> list[jax.Array]:
    """For each list of `(array, start, length)` positions in `wanted`, those pieces of `arrays` concatenated, every
    array cut once for all of them at offsets XLA cannot fold (`_wire.pieces`): at constant offsets XLA splits a
    cut of a concatenation (the parameters' parts) into one program per leaf."""
    ranges = [_stored.runs(positions) for positions in wanted]
    bounds: dict[int, list[tuple[int, int]]] = {}
    for k, lo, hi in itertools.chain.from_iterable(ranges):
        bounds.setdefault(k, []).append((lo, hi))
    cut = {k: iter(_wire.pieces(arrays[k], b)) for k, b in bounds.items()}
    return [_wire.concat([next(cut[k]) for k, _, _ in runs]) for runs in ranges]


def parts_from_rows(layout: Layout, rows: Sequence[jax.Array], buckets: Sequence[_wire.Bucket]) -> list[jax.Array]:
    """Each group's part of the buffer, cut from the buckets' rows: one slice per run of members in a bucket."""
    where = {}
    for k, b in enumerate(buckets):
        for i, off in zip(b.leaves, np.cumsum([0] + [layout.leaves[i].slots for i in b.leaves])):
            where[i] = (k, int(off))
    return _joined(rows, [[(*where[i], layout.leaves[i].slots) for i in g.leaves] for g in layout.groups])


def rows_from_parts(layout: Layout, parts: Sequence[jax.Array], buckets: Sequence[_wire.Bucket]) -> list[jax.Array]:
    """The inverse of `parts_from_rows`: every bucket's row, cut from the groups' parts."""
    where = {i: (g, off) for g, group in enumerate(layout.groups) for i, off in zip(group.leaves, group.offsets)}
    return _joined(parts, [[(*where[i], layout.leaves[i].slots) for i in b.leaves] for b in buckets])


def group_rank(layout: Layout, group: Group, ranks) -> jax.Array:
    """This device's index along `group`'s ZeRO axes."""
    return ranks[layout.zero_axes(layout.leaves[group.first])]


def own_part(layout: Layout, group: Group, values, ranks, entered: frozenset[int] = frozenset()) -> jax.Array:
    """This device's slots of `group`'s members of `values` (leaf -> array), concatenated; those of `entered` are
    their slots already (`Engine.update`)."""
    rank = group_rank(layout, group, ranks)
    return _wire.concat([values[i].reshape(-1) if i in entered else _wire.own_slice(values[i], layout.leaves[i], rank)
                         for i in group.leaves])


def own_parts(layout: Layout, values, ranks, entered: frozenset[int] = frozenset()) -> list[jax.Array]:
    """`own_part` of every group."""
    return [own_part(layout, g, values, ranks, entered) for g in layout.groups]


MASK_PIECES = 16
"""`valid` builds a mask of a group with at most this many padded members piece by piece, which XLA fuses into the
mask's readers; past it, one search over the members' offsets (a loop), which keeps the program small."""


def valid(layout: Layout, group: Group, rank: jax.Array, start=0, length: int | None = None) -> jax.Array | None:
    """Which coordinates `[start, start + length)` of this device's part of the buffer are not padding (None: all;
    `length` None: the whole part, `start` 0); built from per-member numbers, not from a constant the size of the
    buffer."""
    leaves = [layout.leaves[i] for i in group.leaves]
    padded = [k for k, leaf in enumerate(leaves) if leaf.slots * leaf.group != leaf.size]
    if not padded:
        return None
    if length is None and len(padded) <= MASK_PIECES:  # (the whole part) runs of whole members, and the padded ones
        pieces, at = [], 0
        for k in padded:
            if group.offsets[k] > at:
                pieces.append(jnp.ones((group.offsets[k] - at,), bool))
            leaf = leaves[k]
            real = jnp.clip(leaf.size - rank.astype(jnp.int32) * leaf.slots, 0, leaf.slots)
            pieces.append(lax.iota(jnp.int32, leaf.slots) < real)
            at = group.offsets[k] + leaf.slots
        if at < group.size:
            pieces.append(jnp.ones((group.size - at,), bool))
        return _wire.concat(pieces)
    slots = jnp.asarray([leaf.slots for leaf in leaves], jnp.int32)
    real = jnp.clip(jnp.asarray([leaf.size for leaf in leaves], jnp.int32) - rank.astype(jnp.int32) * slots, 0, slots)
    offsets = jnp.asarray(group.offsets, jnp.int32)
    where = start + lax.iota(jnp.int32, group.size if length is None else length)
    member = jnp.searchsorted(offsets, where, side="right") - 1
    return where - offsets[member] < real[member]


def _lead(layout: Layout, group: Group, k: int) -> tuple[int, ...]:
    """The leading axes of `group`'s history `k` where it is stacked (`(memory, *param.shape)`: L-BFGS's), else ()."""
    return tuple(layout.entries[group.histories[0][k]].shape[:-1])


def viewed(layout: Layout, group: Group, histories: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """`group`'s stored histories as its view holds them: a stacked one, stored 1-D, as `(*lead, part)`."""
    return tuple(x.reshape(*lead, -1) if (lead := _lead(layout, group, k)) else x for k, x in enumerate(histories))


def stored_histories(layout: Layout, group: Group, histories: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """The inverse of `viewed`: a stacked history stored 1-D, row by row (so a group's array keeps one run of
    its members' columns per row, as a part kept in its leaf's shape does)."""
    return tuple(x.reshape(-1) if _lead(layout, group, k) else x for k, x in enumerate(histories))


def _own_rows(x: jax.Array, leaf: _stored.ParamLeaf, rank: jax.Array, lead: tuple[int, ...]) -> jax.Array:
    """This device's slots of every row of a stacked history `x` of `leaf` (`(*lead, *leaf.shape)`)."""
    rows = x.reshape(math.prod(lead), -1)
    return jax.vmap(lambda row: _wire.own_slice(row, leaf, rank))(rows).reshape(*lead, leaf.slots)


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
      programs: the inner update's programs traced on group views so far, by `Groups.program_key`, and their
        evaluations under `jax.jit` by `("evaluate", key)` (`Groups._rerun`).
      entered: the sliced leaves whose gradients are this device's block of rows already (`Engine.update`).
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
    programs: dict = dataclasses.field(default_factory=dict)
    entered: frozenset[int] = frozenset()

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
        values = dict(zip(self.views.order(layout, g), jax.tree.leaves(state)))
        own = [] if g is None else [values[j] for j in layout.groups[g].histories[0]]
        return {j: values[j] for j in layout.shared_entries if j in values}, own

    def init(self, layout: Layout, rows: list[jax.Array], full: list | None, ranks, whole: dict | None = None
             ) -> SlicedState:
        """The groups' stored state: the inner `init` on each group's part `rows`, or an optax state's `full` cut;
        `whole`: shared values computed on the whole parameters (`value_shared`), in place of a view's."""
        shared: dict[int, Any] | None = None
        histories = []
        programs: dict = {}
        for g in self.targets(layout):
            group = None if g is None else layout.groups[g]
            if full is None:
                s, h = self._init_view(layout, g, rows, programs)
            else:
                s = {j: jnp.asarray(full[j], layout.entries[j].dtype) for j in layout.shared_entries}
                h = [] if group is None else [self._cut(layout, group, full, k, ranks)
                                              for k in range(len(group.histories[0]))]
            shared = s if shared is None else {**s, **shared}  # (the first view's, and each view's replicas)
            if group is not None:
                mask = valid(layout, group, group_rank(layout, group, ranks))
                histories.append(stored_histories(layout, group, [zero_padding(x, mask) for x in h]))
        assert shared is not None  # (there is always a target)
        return stored_state(layout, {**shared, **{j: x for j, x in (whole or {}).items() if j in shared}}, histories)

    def _init_view(self, layout: Layout, g: int | None, rows: list[jax.Array], programs: dict
                   ) -> tuple[dict[int, Any], list[Any]]:
        """The inner `init` on group `g`'s view of its part of `rows` (of no leaf when None): the shared values and
        the histories. Its program is traced once per `Group.program` and type of the part (in `programs`) and
        evaluated on the later parts of that key, whose shared values `init` does not keep (the first view's)."""
        if g is None:
            self.views.group(layout, g)  # (refuses a state whose order changes when leaves are masked)
            return self._disassemble(layout, g, self.cfg.inner.init(masked_tree(layout, {})))
        group = layout.groups[g]
        x = rows[g].reshape(group.part_shape)
        key = None if group.program is None or layout.replicas else (group.program, self.held(layout, g),
                                                                     jax.typeof(x))
        if key in programs:
            return self._disassemble(layout, g, jax.core.eval_jaxpr(programs[key].jaxpr, programs[key].consts, x))
        self.views.group(layout, g)  # (the same check, once per program traced)

        def init(x):
            return self.cfg.inner.init(masked_tree(layout, {group.first: x}))
        if key is not None:
            programs[key] = jax.make_jaxpr(init)(x)
        return self._disassemble(layout, g, init(x))

    @staticmethod
    def _cut(layout: Layout, group: Group, full: list, k: int, ranks) -> jax.Array:
        """This device's part of history `k` of `group`, from the full values of its members' entries."""
        values = {i: jnp.asarray(full[entries[k]], layout.entries[entries[k]].dtype)
                  for i, entries in zip(group.leaves, group.histories)}
        lead = _lead(layout, group, k)
        if lead:  # (a stacked history: each row cut as the leaf is)
            rank = group_rank(layout, group, ranks)
            return _wire.concat([_own_rows(values[i], layout.leaves[i], rank, lead) for i in group.leaves], axis=-1)
        return own_part(layout, group, values, ranks).reshape(group.part_shape)

    @staticmethod
    def shared_values(layout: Layout, stored: SlicedState) -> dict[int, jax.Array]:
        """The shared entries' values from storage (one copy per device)."""
        return {j: x[0] for j, x in zip(layout.shared_entries, _inner_state.items(stored.shared))}

    def run_view(self, step: Step, g: int | None, grads, params, histories: Sequence, with_params: bool
                 ) -> tuple[jax.Array | None, dict[int, Any], list[Any]]:
        """Group `g`'s inner update (on a part or a chunk): its update (None without leaf), shared values, histories;
        a program traced on another group's view of the same `program_key` is evaluated on this view's leaves."""
        layout = step.layout
        if g is None and (leaf := self.views.stand_in(step, with_params)) is not None:
            return None, self._stand_in_shared(step, leaf, with_params), []
        g_part, state, p_part = self._view_leaves(step, g, grads, params if with_params else None, histories)
        leaves = [*g_part, *state, *p_part, *jax.tree.leaves(step.extra)]
        key = self.program_key(step, g, leaves)
        if g is not None and key in step.programs:
            return self._rerun(step, g, key, leaves)
        first = [] if g is None else [layout.groups[g].first]
        g_view = masked_tree(layout, dict(zip(first, g_part)))
        old = jax.tree_util.tree_unflatten(self.views.group(layout, g)[0], state)
        p_view = masked_tree(layout, dict(zip(first, p_part))) if with_params else None
        u, new = run_inner(step, g_view, old, p_view, key=key)
        what = "leaves" if g is None else f"sliced leaves of `{layout.leaves[first[0]].path}`'s group"
        check_returned(u, new, g_view, old, what)
        new_shared, new_histories = self._disassemble(layout, g, new)
        u = jax.tree.leaves(u)
        return (u[0] if u else None), new_shared, new_histories

    def _stand_in_shared(self, step: Step, i: int, with_params: bool) -> dict[int, Any]:
        """The new shared values from leaf `i`'s view (`Views.stand_in`), its gradient, parameter and state zeros."""
        layout, shared_old = step.layout, step.shared_old
        leaf = layout.leaves[i]
        assert shared_old is not None and leaf.owner is not None  # (set by `update`; no leaf is sliced)
        entries = owned_entries(layout, [i])
        old = jax.tree_util.tree_unflatten(self.views.owned(layout, leaf.owner, [i]), [
            shared_old[j] if j in shared_old else jnp.zeros(layout.entries[j].shape, layout.entries[j].dtype)
            for j in entries])
        g_view = masked_tree(layout, {i: jnp.zeros(layout.view_shape(leaf), step.inner_dt[i])})
        p_view = masked_tree(layout, {i: jnp.zeros(layout.view_shape(leaf), self.cfg.inner_dtype(leaf.dtype))})
        u, new = run_inner(step, g_view, old, p_view if with_params else None)
        check_returned(u, new, g_view, old, f"leaf `{leaf.path}` standing in for the view with no leaf")
        values = dict(zip(entries, jax.tree.leaves(new)))
        return {j: values[j] for j in layout.shared_entries}

    def _view_leaves(self, step: Step, g: int | None, grads, params, histories: Sequence) -> tuple[list, list, list]:
        """Group `g`'s view as leaves: its part of the gradients and of the parameters (in the group's `shape`; none
        without group or parameters), and the leaves of its state, in order."""
        assert step.shared_old is not None  # (set by `update`, `stream_groups`)
        group = None if g is None else step.layout.groups[g]
        own = {} if group is None else dict(zip(group.histories[0], viewed(step.layout, group, histories)))
        state = [step.shared_old[j] if j in step.shared_old else own[j] for j in self.views.order(step.layout, g)]

        def part(x) -> list:
            return [] if group is None or x is None else [x if group.shape is None else x.reshape(group.shape)]
        return part(grads), state, part(params)

    def program_key(self, step: Step, g: int | None, leaves: list) -> tuple | None:
        """What the inner update's program on group `g`'s view of `leaves` (as `run_inner` flattens them) depends
        on: the group's `Group.program`, what its state holds (`held`), the leaves' shapes and dtypes. None: the
        group traces a program of its own."""
        if g is None or step.layout.groups[g].program is None:
            return None
        return (step.layout.groups[g].program, self.held(step.layout, g),
                tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves))

    def held(self, layout: Layout, g: int) -> tuple[tuple[str, int], ...]:
        """What group `g`'s view state holds, in order: `("history", k)`, the group's `k`-th, or `("shared", j)`."""
        histories = layout.groups[g].histories[0]
        return tuple(("history", histories.index(j)) if j in histories else ("shared", j)
                     for j in self.views.order(layout, g))

    def _rerun(self, step: Step, g: int, key: tuple | None, leaves: list
               ) -> tuple[jax.Array, dict[int, Any], list[Any]]:
        """`run_view` of group `g` on its view's `leaves` by the program traced on another group's view of the same
        `program_key`: `check_returned` found its results structured like that view's arguments, so like these. The
        program is evaluated inside one `jax.jit` per key, so that the step traces it once, not once per group (a
        call XLA inlines: the same compiled step)."""
        run = step.programs.get(("evaluate", key))
        if run is None:
            run = step.programs[("evaluate", key)] = jax.jit(
                functools.partial(_varying.evaluate, step.programs[key], axes=step.layout.axes))
        out = run(leaves)
        out = _varying.like(out, leaves[:len(out)])  # (the update and the new state, like the gradient and state)
        return out[0], *self._disassemble(step.layout, g, out[1:])

    def _run_joint(self, step: Step, grads: list, params: list | None, masks: list, stored: SlicedState
                   ) -> tuple[list, dict[int, Any], list[tuple]]:
        """The inner update on the joint view of every sliced leaf (`Layout.joint`), like `run_view` per group."""
        layout = step.layout
        assert step.shared_old is not None  # (set by `update`)
        _, order = self.views.joint(layout)
        slices = {g.first: _coordinates(layout, g, mask, step.ranks) for g, mask in zip(layout.groups, masks)}
        old = _assemble(self.views.joint(layout), step.shared_old, layout.groups,
                        [viewed(layout, g, h) for g, h in zip(layout.groups, stored.histories)])
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
        new = [stored_histories(layout, g, [zero_padding(x, mask) for x in h])
               for g, h, mask in zip(layout.groups, new, masks)]
        histories = [tuple(_reduce.skip_if_empty(step.denom.ok, x, y) for x, y in zip(h, old))
                     for h, old in zip(new, stored.histories)]
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
