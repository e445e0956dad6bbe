"""`init` and `update` of zero1 inside `shard_map`, for sliced and owned leaves alike.

`Engine.update` reads top to bottom as its stages: (offload: the small arrays to the device), (accumulation: the
cycle position picks the final call or a micro-step, `Engine._accumulate`), then the step itself (`Engine._run`):
reduce, update the sliced groups and the owned leaves, gather; (offload: the small arrays back to host memory).
Every value that moves between devices moves through the step's `_wire.Wire`.

A step runs the inner transformation on `optax.masked`-style views of the parameter tree:

* the *group views* (`zero_optax.step._groups`): for each group of sliced leaves that run one program, this
  device's slots of all of them as one 1-D buffer, every other leaf masked. Every device runs them; they also
  advance the shared entries (step counts).
* the *owned view* of device `r`: the leaves `r` owns, whole; everything else masked. One `lax.switch` on the
  device index runs each device's own view; its shared entries are discarded (the group views computed them).
  The members of a stack (`Layout.stacks`: one program on one shape) run as the view of one of them, under
  `jax.vmap`.

The coupling analysis at `init` proves that this is exact: no computation mixes two leaves, and the shared entries
do not depend on any leaf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from zero_optax.analysis import _coupling
from zero_optax.core import _compat
from zero_optax.core._errors import WeightError, ZeroStructureError
from zero_optax.core._names import tree_signature
from zero_optax.step import (
    _accumulate,
    _groups,
    _offload,
    _owned,
    _reduce,
    _slots,
    _tp_owned,
    _wire,
)
from zero_optax.layout import _layout, _planner
from zero_optax.layout._layout import LOCAL, MASTER, Layout
from zero_optax.layout._state import ZeroState


@dataclasses.dataclass(frozen=True, eq=False)
class _Call:
    """One `update` call's checked arguments (`Engine.update`): the state's layout, the gradient and parameter
    leaves (None without parameters), the state and the extra arguments."""

    layout: Layout
    g_leaves: list
    p_leaves: list | None
    state: ZeroState
    extra: dict


@dataclasses.dataclass(frozen=True, eq=False)
class _GroupsDone:
    """What the group views of one step leave for the rest of it (`Engine._update_groups`).

    Attributes:
      new_inner: the new `SlicedState` (its shared entries kept where the step is skipped).
      shared_old: the shared entries' old values, which the owned views read.
      values: streamed (offload): each group's results for every device, and `new_master` the new master copies;
        otherwise None (`Engine._finish` computes both from `u_parts`).
      new_master: see `values`.
      u_parts, p_parts, masks: not streamed: each group's updates, its part of the parameters, and the mask of
        its valid coordinates.
    """

    new_inner: Any
    shared_old: dict
    values: list | None = None
    new_master: Any = None
    u_parts: list | None = None
    p_parts: list | None = None
    masks: list | None = None


def _tree(layout: Layout, values: list) -> Any:
    return jax.tree_util.tree_unflatten(layout.treedef, values)


def check_layout(state, axis_name, replica_axes: tuple[str, ...] = ()) -> Layout:
    """The state's layout, after checking its type, its axis and the world size of the enclosing mesh, and its
    replica axes' sizes."""
    if not isinstance(state, ZeroState):
        raise ZeroStructureError(
            f"zero1 update expected the ZeroState returned by this transformation's init, got "
            f"{type(state).__name__}. Pass the opt_state returned by tx.init.")
    layout = state.layout
    n = _compat.axis_size(axis_name)
    if layout.axis_name != axis_name or layout.world_size != n:
        raise ZeroStructureError(
            f"This state was initialised for axis `{layout.axis_name}` with {layout.world_size} devices, but "
            f"update runs over axis `{axis_name}` with {n}. Re-initialise, restore with "
            "zo.ZeroRestore(target, reshard=True), or reshard the checkpoint with zero_optax.reshard.")
    live = _compat.axis_sizes(replica_axes)
    if layout.replica_sizes != live:
        raise ZeroStructureError(
            f"This state was initialised replicated over {dict(layout.replica_sizes) or 'no axis'}, but update runs "
            f"replicated over {dict(live) or 'no axis'} (zero1's `replica_axis` and the mesh). Re-initialise, or "
            "restore the checkpoint into a state initialised on this mesh (zo.ZeroRestore(target)): a checkpoint "
            "restores at any replica count.")
    return layout


def check_tree(tree, layout: Layout, what: str) -> list[jax.Array]:
    """The leaves of `tree` after checking structure and shapes against the parameters of `layout`."""
    leaves, treedef = jax.tree.flatten(tree)
    if treedef != layout.treedef:
        raise ZeroStructureError(
            f"The {what} do not have the structure of the parameters this state was initialised with.\n"
            f"  {what}: {tree_signature(tree)}\n"
            f"  parameters: {tree_signature(_tree(layout, [0] * len(layout.leaves)))}")
    for x, leaf in zip(leaves, layout.leaves):
        if tuple(np.shape(x)) != leaf.shape:
            raise ZeroStructureError(
                f"The {what} leaf `{leaf.path}` has shape {tuple(np.shape(x))}, but the parameter has shape "
                f"{leaf.shape}.")
    return leaves


def _full_entries(layout: Layout, full_state) -> list:
    """The leaves of a plain optax state given to `scatter_state`, after checking it is the inner state's tree."""
    full, treedef = jax.tree.flatten(full_state)
    if treedef != layout.state_treedef:
        raise ZeroStructureError(
            f"scatter_state: the inner state is structured as {tree_signature(full_state)}, but the inner "
            f"transformation's init gives {layout.state_tree}.")
    return full


def _check_extra(extra: dict, axes) -> None:
    for name, value in extra.items():
        for x in jax.tree.leaves(value):
            if isinstance(x, jax.Array) and _compat.vma_enabled(axes) and set(axes) & _compat.varying_axes(x):
                raise ZeroStructureError(
                    f"The extra argument `{name}` differs between the devices of `{axes}`, but every device must "
                    f"run the inner update with the same value. Pass its global value (for a loss, "
                    f"lax.pmean(loss, {axes!r})).")


class Engine:
    """zero1's `init`, `update` and `scatter` for one `Config`, inside `shard_map` over its axes."""

    def __init__(self, cfg: _planner.Config):
        self.cfg = cfg
        self.groups = _groups.Groups(cfg)
        self.wire = _wire.Wire.of(cfg)
        self._views: dict = {}
        self._udtypes: dict = {}

    # ------------------------------------------------------------------ views and bookkeeping

    @staticmethod
    def _owned_entries(layout: Layout, r: int, leaves: Sequence[int] | None = None) -> list[int]:
        """The inner entries of device `r`'s owned view of `leaves` (all it owns by default): the shared entries and
        those leaves' histories, in order."""
        mine = {i for i, leaf in enumerate(layout.leaves) if leaf.owner == r} if leaves is None else set(leaves)
        shared = set(layout.view_shared(mine))
        return [j for j in layout.inner_entries if j in shared or layout.entries[j].leaf in mine]

    def _view(self, layout: Layout, r: int, leaves: Sequence[int] | None = None):
        """The inner state treedef of device `r`'s owned view of `leaves` (all it owns by default; cached)."""
        present = frozenset(i for i, leaf in enumerate(layout.leaves) if leaf.owner == r) if leaves is None \
            else frozenset(leaves)
        key = (layout, r, present)
        if key not in self._views:
            self._views[key] = _planner.view_treedef(self.cfg, layout, set(present),
                                                  self._owned_entries(layout, r, present), f"on device {r}")
        return self._views[key]

    @staticmethod
    def _ranks(layout: Layout) -> dict:
        groups = {layout.zero_axes(leaf) for leaf in layout.leaves} | {layout.axes}
        return {axes: _compat.axis_index(axes) for axes in groups}

    def _update_dtypes(self, layout: Layout, extra: dict, phase: _accumulate.Phase | None = None) -> dict[int, str]:
        """The dtype of the update of the inner transformation (of `phase`'s with accumulation) for each leaf
        (cached). One abstract trace of a view of one leaf per group and per stack, whose members run one program
        on one dtype, and every other owned leaf."""
        key = (layout, phase, jax.tree.structure(extra), tuple((np.shape(x), jnp.result_type(x))
                                                                for x in jax.tree.leaves(extra)))
        inner = self.cfg.inner if phase is None else phase.inner
        if key not in self._udtypes:
            dt = self.cfg.inner_dtype
            first = {i: g.first for g in layout.groups for i in g.leaves}
            first.update((i, s[0]) for s in layout.stacks for i in s)
            present = {first.get(i, i) for i in range(len(layout.leaves))}
            structs = [jax.ShapeDtypeStruct(layout.view_shape(leaf), dt(leaf.dtype)) for leaf in layout.leaves]
            view = _tree(layout, _layout.masked_view(structs, present))
            state = jax.eval_shape(inner.init, view)
            updates, _ = jax.eval_shape(lambda g, s, p, e: inner.update(g, s, p, **e), view, state, view, extra)
            got = {i: np.dtype(u.dtype).name for i, u in zip(sorted(present), jax.tree.leaves(updates))}
            self._udtypes[key] = {i: got[first.get(i, i)] for i in range(len(layout.leaves))}
        return self._udtypes[key]

    # ------------------------------------------------------------------ init

    def init(self, params) -> ZeroState:
        return self.build(params, None)

    def build(self, params, full_state) -> ZeroState:
        """The state for `params`: fresh from the inner `init`, or sliced from a plain optax `full_state`."""
        cfg = self.cfg
        layout = _planner.build_layout(cfg, params)
        values = [x.astype(cfg.inner_dtype(x.dtype)) for x in jax.tree.leaves(params)]
        ranks = self._ranks(layout)
        rank = ranks[layout.axes]
        rows = [_slots.own_rows(values, layout, g.leaves, ranks[layout.zero_axes(layout.leaves[g.first])])
                for g in layout.groups]
        full = None if full_state is None else _full_entries(layout, full_state)
        inner_state = self.groups.init(layout, rows, full, ranks)
        whole = [_tp_owned.gather_whole(self.wire, layout, leaf, x) if leaf.tp_owned else x
                 for leaf, x in zip(layout.leaves, values)]
        buffers = self._build_owned(layout, whole, full, rank)
        master = None
        if cfg.master_dtype is not None:
            master = tuple(x.reshape(g.part_shape) for x, g in zip(rows, layout.groups))
        local = None
        if layout.accumulate == LOCAL:
            local = _accumulate.init_local(layout, params, layout.replica_axes + layout.axes)
        state = ZeroState(inner_state, buffers, master, layout, local)
        return _offload.to_host(state, cfg.bucket_bytes) if cfg.offload else state

    def _build_owned(self, layout: Layout, values: list, full: list | None, rank) -> dict[str, jax.Array]:
        """The packed buffers of the owned leaves: row `r` holds the state (and master copies) of the leaves device
        `r` owns, from the inner `init` on them or from a plain optax state (`full`). Empty when no leaf is owned."""
        cfg = self.cfg
        packing = layout.state_packing
        if not packing.sizes:
            return {}

        def branch(r):
            def run(values, full):
                owned = {i for i, leaf in enumerate(layout.leaves) if leaf.owner == r}
                if full is None:
                    b_entries = self._owned_entries(layout, r)
                    self._view(layout, r)  # checks the entry order this device packs
                    state = cfg.inner.init(_tree(layout, _layout.masked_view(values, owned)))
                    got = dict(zip(b_entries, jax.tree.leaves(state)))
                else:
                    got = {j: full[j] for j in layout.rank_entries(r) if layout.entries[j].role != MASTER}
                for j in layout.rank_entries(r):
                    if layout.entries[j].role == MASTER:
                        got[j] = values[layout.entries[j].leaf]
                items = {j: got[j] for j in layout.rank_entries(r)}
                return _compat.pvary(_owned.pack(items, packing.offsets[r], packing.sizes), layout.axes)
            return run

        buffers = _owned.switch(rank, [branch(r) for r in range(layout.world_size)], values, full)
        return {d: b[None] for d, b in buffers.items()}

    # ------------------------------------------------------------------ update

    def update(self, grads, state, params=None, *, weight=None, apply: bool = False, **extra):
        """One `update` call, its stages top to bottom: with `offload` the state's small arrays come to the device;
        with accumulation the cycle position picks the final call or a micro-step (`_accumulate`); the step
        (`_run`: reduce, update the sliced groups and the owned leaves, gather); with `offload` the small arrays
        go back to host memory.

        With `apply` (`zero_optax.apply_gradients`, which passes it only without accumulation or offload) it
        returns the new parameters instead of the updates: each device adds its own coordinates' updates to its
        slice of the parameters before the all-gather."""
        cfg = self.cfg
        layout, g_leaves, p_leaves = self._check_step(grads, state, params, weight, extra, cfg.accumulate != LOCAL)
        if cfg.offload:  # the stored state stays in host memory and streams through the device
            state = _offload.small_to_device(state, cfg.bucket_bytes)
        if cfg.accumulating is None:
            denom = _reduce.denominator(weight, *_reduce.reduction(layout))
            step = self._step(layout, g_leaves, p_leaves, denom, extra)
            updates, new_state = self._run(step, g_leaves, state, apply)
        else:
            updates, new_state = self._accumulate(_Call(layout, g_leaves, p_leaves, state, extra), weight)
        if cfg.offload:
            new_state = _offload.small_to_host(new_state, cfg.bucket_bytes)
        return updates, new_state

    def _run(self, step: _groups.Step, g_leaves: list, state: ZeroState, apply: bool = False):
        """The step's stages: reduce the sliced leaves' gradients, update the sliced groups (with `step.streamed`
        their arrays stream through the device chunk by chunk), reduce the owned leaves' gradients to their
        owners and update them (`_update_owned`), gather. A micro-step that only accumulates gathers nothing and
        returns no updates (None)."""
        layout = step.layout
        owned = [i for i, leaf in enumerate(layout.leaves) if not leaf.sliced]
        g_parts = self._reduce_groups(step, g_leaves)     # reduce: the sliced leaves' gradients, in buckets
        done = self._update_groups(step, g_parts, state)  # update the groups: every device, its own coordinates
        new_buffers, u_owned = dict(state.buffers), {}
        if owned:  # update the owned leaves: reduced to their owners, one switch branch per device
            step = dataclasses.replace(step, shared_old=done.shared_old)
            new_buffers, u_owned = self._update_owned(step, owned, g_leaves, state)
        if not step.stepping:  # a micro-batch that only accumulates: nothing moves, nothing is gathered
            return None, ZeroState(done.new_inner, new_buffers, state.master, layout, state.local)
        return self._finish(step, done, state, new_buffers, u_owned, apply)  # gather: updates or new parameters

    def _accumulate(self, call: _Call, weight):
        """An accumulating call: the cycle position, the same on every device, picks with `lax.cond` the final
        call (`_run` on the cycle's sums, then the step) or a micro-step (`_run` adding to the sharded
        accumulators, or with `accumulate="local"` no collective at all), which returns zero updates."""
        cfg, layout = self.cfg, call.layout
        acc = cfg.accumulating
        w = _accumulate.call_weight(cfg.reduce is not None, weight, layout)
        extra = {**call.extra, "accumulate_weight": w}
        final, micro = _accumulate.phases(acc, call.g_leaves, cfg.inner_dtype)
        local = acc.mode == LOCAL
        dtypes = ({i: np.dtype(cfg.master_dtype).name for i in range(len(layout.leaves))}
                  if cfg.master_dtype is not None else self._update_dtypes(layout, extra, final))

        def last(operands):
            g_leaves, state, p_leaves = operands
            if local:
                g_leaves = _accumulate.with_local(g_leaves, state)
            step = self._step(layout, g_leaves, p_leaves, final.denom, extra, final)
            updates, new = self._run(step, g_leaves, state)
            return updates, (_accumulate.cleared(new) if local else new)

        def middle(operands):
            g_leaves, state, p_leaves = operands
            # typed like the final call's updates: varying over the leaf's own (tensor- or expert-parallel) axes
            zeros = _tree(layout, [_compat.pvary(jnp.zeros(g.shape, dtypes[i]), layout.leaves[i].axes)
                                   for i, g in enumerate(g_leaves)])
            if local:
                return zeros, _accumulate.add_local(layout, state, g_leaves, w)
            _, new = self._run(self._step(layout, g_leaves, p_leaves, micro.denom, extra, micro), g_leaves, state)
            return zeros, new

        position = self.wire.agree(_accumulate.position(layout, call.state))  # typed invariant for the branch
        return lax.cond(position + 1 >= acc.steps, last, middle, (call.g_leaves, call.state, call.p_leaves))

    def _step(self, layout: Layout, g_leaves: list, p_leaves: list | None, denom: _reduce.Denominator, extra: dict,
              phase: _accumulate.Phase | None = None) -> _groups.Step:
        """The step's `_groups.Step`: the transformation that runs and the dtypes (from `phase` for an
        accumulating call), the denominator, this device's ranks."""
        cfg = self.cfg
        inner_dt = ({i: np.dtype(cfg.inner_dtype(g.dtype)).name for i, g in enumerate(g_leaves)} if phase is None
                    else phase.grad_dtypes)
        sum_dt = {i: self.wire.sum_dtype(g.dtype) for i, g in enumerate(g_leaves)}
        return _groups.Step(layout, cfg.inner if phase is None else phase.inner, extra, denom, inner_dt, sum_dt,
                            self._ranks(layout), phase is None or phase.step, cfg.offload, p_leaves, phase=phase)

    def _update_groups(self, step: _groups.Step, g_parts: list, state: ZeroState) -> _GroupsDone:
        """The group views: the inner update on each group's part of the reduced gradient, `g_parts` (streamed
        through the device chunk by chunk with `step.streamed`)."""
        cfg, layout, ranks, p_leaves = self.cfg, step.layout, step.ranks, step.p_leaves
        ok = step.denom.ok
        if step.streamed and layout.groups:
            params_parts = None if p_leaves is None or cfg.master_dtype is not None else \
                self._sliced_params(layout, p_leaves, state, ranks)
            p_dtypes = [None if p_leaves is None else np.dtype(p_leaves[g.first].dtype) for g in layout.groups]
            values, new_inner, new_master, shared_old = self.groups.update_streamed(step, g_parts, params_parts, state,
                                                                                     p_dtypes)
            done = _GroupsDone(new_inner, shared_old, values, new_master)
        else:
            masks = [_groups.valid(layout, g, ranks[layout.zero_axes(layout.leaves[g.first])]) for g in layout.groups]
            p_parts = self._sliced_params(layout, p_leaves, state, ranks)
            u_parts, new_inner, shared_old = self.groups.update(step, g_parts, p_parts, state.inner_state, masks)
            done = _GroupsDone(new_inner, shared_old, u_parts=u_parts, p_parts=p_parts, masks=masks)
        new_inner = done.new_inner._replace(shared=_reduce.skip_if_empty(ok, done.new_inner.shared,
                                                                         state.inner_state.shared))
        return dataclasses.replace(done, new_inner=new_inner)

    def _finish(self, step: _groups.Step, done: _GroupsDone, state: ZeroState, new_buffers: dict, u_owned: dict,
                apply: bool):
        """The step's result: the updates (or with `apply` the new parameters), gathered to every device, and the
        new state."""
        cfg, layout, p_leaves, ok = self.cfg, step.layout, step.p_leaves, step.denom.ok
        values, new_master = done.values, done.new_master
        if done.u_parts is not None:
            values, new_master = self._group_results(layout, done.u_parts, p_leaves, state, ok, done.masks)
            if apply and cfg.master_dtype is None:  # each device adds its part of the updates to its parameters
                values = [None if v is None else optax.apply_updates(p.reshape(v.shape), v)
                          for p, v in zip(done.p_parts, values)]
        updates = self._gather_values(layout, values)
        new_state = ZeroState(done.new_inner, new_buffers, new_master, layout, state.local)
        if apply:
            if cfg.master_dtype is None:
                new_params = {**updates, **{i: optax.apply_updates(p_leaves[i], u) for i, u in u_owned.items()}}
            else:  # the gathered, rounded master copies (of the owned leaves too: their owners send those)
                new_params = {i: _reduce.skip_if_empty(ok, t, p_leaves[i]) for i, t in {**updates, **u_owned}.items()}
            return _tree(layout, [new_params[i] for i in range(len(layout.leaves))]), new_state
        updates.update(u_owned)
        if cfg.master_dtype is not None:  # every device moves its parameters onto the gathered, rounded master copy
            md = cfg.master_dtype
            updates = {i: t.astype(md) - p_leaves[i].astype(md) for i, t in updates.items()}
            if ok is not None:
                updates = {i: jnp.where(ok, u, jnp.zeros_like(u)) for i, u in updates.items()}
        return _tree(layout, [updates[i] for i in range(len(layout.leaves))]), new_state

    def _check_step(self, grads, state, params, weight, extra, semantics: bool = True
                    ) -> tuple[Layout, list, list | None]:
        """The state's layout and the leaves of `grads` and `params`, after checking every argument of `update`
        (with `semantics`, also whether the gradients are per-device as the reduction expects)."""
        cfg = self.cfg
        layout = check_layout(state, cfg.axis_name, cfg.replica_axes)
        g_leaves = check_tree(grads, layout, "gradients")
        p_leaves = None if params is None else check_tree(params, layout, "parameters")
        if cfg.master_dtype is not None and p_leaves is None:
            raise ZeroStructureError(
                "zero1(master_dtype=...) needs the parameters: call tx.update(grads, opt_state, params), so that "
                "the returned updates move them onto the master copy.")
        reducing = cfg.reduce is not None
        if semantics:
            _reduce.check_semantics(g_leaves, layout.paths, [layout.zero_axes(leaf) for leaf in layout.leaves],
                                    reducing, replicas=layout.replica_axes)
        if weight is not None and not reducing:
            raise WeightError(
                "`weight=` weighs each device's gradient (a loss sum) in the reduction, but with reduce=False the "
                "gradients are already the global mean. Pass weight to zo.reduce_gradients instead, or use "
                "reduce=True.")
        _check_extra(extra, layout.replica_axes + layout.axes)
        return layout, g_leaves, p_leaves

    def _sliced_params(self, layout: Layout, p_leaves: list | None, state: ZeroState, ranks) -> list | None:
        """The parameters each group's view sees (this device's part of the buffer): the master copies with
        `master_dtype`, this device's slices of `params` otherwise, or None without parameters."""
        if p_leaves is None:
            return None
        if not layout.groups:
            return [None]
        if self.cfg.master_dtype is not None:
            return list(state.master)
        return [_slots.own_rows(p_leaves, layout, g.leaves, ranks[layout.zero_axes(layout.leaves[g.first])])
                for g in layout.groups]

    def _group_results(self, layout: Layout, u_parts: list, p_leaves: list | None, state: ZeroState, ok,
                       masks: list) -> tuple[list, Any]:
        """What every device receives of each group (`_groups.stepped`: the updates, or with `master_dtype` the new
        master copies rounded to the parameter dtype), and the new master copies."""
        if not layout.groups:
            return [], state.master
        masters = state.master if self.cfg.master_dtype is not None else [None] * len(layout.groups)
        results = [_groups.stepped(u, m, mask, ok, None if p_leaves is None else p_leaves[g.first].dtype)
                   for u, m, mask, g in zip(u_parts, masters, masks, layout.groups)]
        new_master = state.master if self.cfg.master_dtype is None else tuple(m for m, _ in results)
        return [v for _, v in results], new_master

    def _gather_values(self, layout: Layout, values: list) -> dict[int, jax.Array]:
        """Every sliced leaf's full value, all-gathered in buckets from each group's part of the buffer. Buckets are
        planned in tree order; a run of one group's members in a bucket is one slice of the group's buffer."""
        wire = self.wire
        updates: dict[int, jax.Array] = {}
        if not layout.groups:
            return updates
        values = [x.reshape(-1) for x in values]  # a part kept in its leaf's shape (`Group.shape`) gathers 1-D
        order = _groups.order(layout)
        dtypes = {i: np.dtype(x.dtype).name for g, x in zip(layout.groups, values) for i in g.leaves}
        buckets = wire.plan(layout, order, [dtypes[i] for i in order])
        if _by_rows(layout, buckets):
            updates.update(wire.gather_rows(_groups.rows_from_parts(layout, values, buckets), layout, buckets))
        else:
            per_leaf = {}
            for g, x in zip(layout.groups, values):
                per_leaf.update(_groups.split(g, x, layout))
            updates.update(wire.gather(per_leaf, layout, buckets))
        return updates

    def _reduce_groups(self, step: _groups.Step, g_leaves: list) -> list:
        """Each group's part of the reduced gradient on this device (its members' slots, concatenated), in the
        inner's dtype; `[None]` without sliced leaves (the view of no leaf). The reduction goes in buckets over
        all sliced leaves."""
        cfg, layout, denom, inner_dt, sum_dt, ranks = (self.cfg, step.layout, step.denom, step.inner_dt, step.sum_dt,
                                                       step.ranks)
        if not layout.groups:
            return [None]
        for g in layout.groups:
            if len({inner_dt[i] for i in g.leaves}) > 1:
                raise ZeroStructureError(
                    f"The gradients of the sliced leaves {[layout.leaves[i].path for i in g.leaves]} have "
                    f"different dtypes ({sorted({inner_dt[i] for i in g.leaves})}), but their parameters have one "
                    "dtype and one optimizer program: pass their gradients in one dtype.")
        sliced = _groups.order(layout)
        grads = {i: g_leaves[i] for i in sliced}
        if cfg.reduce is None:  # already the global mean
            return [_slots.own_rows({i: grads[i].astype(inner_dt[i]) for i in g.leaves}, layout, g.leaves,
                                     ranks[layout.zero_axes(layout.leaves[g.first])]) for g in layout.groups]
        buckets = self.wire.plan(layout, sliced, [sum_dt[i] for i in sliced])
        if cfg.reduce == "psum":
            parts = self.wire.all_reduce_slices(grads, layout, buckets, ranks)
            parts = {i: _reduce.divide(x, denom, inner_dt[i]) for i, x in parts.items()}
            return [_groups.joined(g, parts) for g in layout.groups]
        if _by_rows(layout, buckets):
            joined = _groups.parts_from_rows(layout, self.wire.reduce_scatter_rows(grads, layout, buckets), buckets)
        else:
            parts = self.wire.reduce_scatter(grads, layout, buckets)
            joined = [_groups.joined(g, parts) for g in layout.groups]
        return [_reduce.divide(x, denom, inner_dt[g.first]) for g, x in zip(layout.groups, joined)]

    def _update_owned(self, step: _groups.Step, owned: list[int], g_leaves: list, state: ZeroState) -> tuple[dict, dict]:
        """The inner update on every device's owned view, in one `lax.switch` on the device index.

        Gradients reach the owners (`_owned_gradients`; the blocks of leaves sharded over tensor-parallel axes
        are then gathered whole, `_tp_inputs`), each device updates the state packed in its row of the buffers
        (with `streamed`, buffers in host memory, bucket by bucket: `_owned_streamed`; `_owned_branch`), and the
        owned leaves' updates (or new master values, rounded) return to every device by an all-gather of one
        packing (of another for tensor-parallel leaves, whose blocks differ along their axes). Returns the new
        buffers and those updates.
        """
        layout, denom, stepping, streamed = step.layout, step.denom, step.stepping, step.streamed
        n = layout.world_size
        master = self.cfg.master_dtype is not None
        mode, plan_g, grad_input = self._owned_gradients(step, [i for i in owned if not layout.leaves[i].tp_owned],
                                                         g_leaves)
        tp, tp_rows = self._tp_inputs(step, [i for i in owned if layout.leaves[i].tp_owned], mode, g_leaves)
        u_dtypes = ({i: np.dtype(step.p_leaves[i].dtype).name for i in owned} if master else
                    {i: d for i, d in self._update_dtypes(layout, step.extra, step.phase).items() if i in owned})
        plans = _OwnedPlans(mode, plan_g, *(_owned.leaf_plan(layout, {i: d for i, d in u_dtypes.items()
                                                                      if layout.leaves[i].tp_owned == t})
                                            for t in (False, True)), tp)
        old_buffers = {d: b[0] for d, b in state.buffers.items()}
        branches = [self._owned_branch(step, plans, [i for i in owned if layout.leaves[i].owner == r], r)
                    for r in range(n)]
        out = _owned.switch(step.rank, branches, grad_input, old_buffers, step.p_leaves, tp_rows)
        if not stepping:
            return {d: b[None] for d, b in out.items()}, {}
        new, u_out, t_out = out
        if not streamed:  # (streamed, each bucket keeps its old state where the step is skipped)
            new = _reduce.skip_if_empty(denom.ok, new, old_buffers)
        new_buffers = {d: b[None] for d, b in new.items()}
        u = _gather_owned(self.wire, layout, u_out, plans.u)
        if n > 1:
            u.update(_gather_owned(self.wire, layout, t_out, plans.tp_u))
        if not master:
            u = _reduce.skip_if_empty(denom.ok, u, jax.tree.map(jnp.zeros_like, u))
        return new_buffers, u

    def _owned_branch(self, step: _groups.Step, plans: _OwnedPlans, mine: list[int], r: int):
        """Device `r`'s branch of `_update_owned`'s switch: the owned view's update of the leaves `mine` it owns.
        Returns the new buffers, and when stepping the updates packed by `plans.u` and `plans.tp_u` (on one
        device: per leaf)."""
        layout, n = step.layout, step.layout.world_size
        packing = layout.state_packing
        shapes = {i: layout.leaves[i].shape for i in plans.g.offsets[r]}

        def run(grad_input, buffers, p_leaves, tp_rows):
            here = dataclasses.replace(step, p_leaves=p_leaves)  # (the branch's operand)
            if plans.mode == "psum_scatter":
                g = _owned.Row(grad_input, plans.g.offsets[r], shapes,
                               lambda x, i: _reduce.divide(x, step.denom, step.inner_dt[i]))
            else:
                g = {i: grad_input[i] for i in mine if i in grad_input}
            g, here = _tp_whole(here, plans, r, mine, g, tp_rows)
            if step.streamed:
                new_buffers, u = self._owned_streamed(here, r, mine, g, buffers)
            else:
                stored = _owned.Row(buffers, packing.offsets[r],
                                    {j: layout.entries[j].shape for j in layout.rank_entries(r)})
                values, u = self._owned_view_update(here, r, mine, g, stored)
                new_buffers = _owned.pack(values, packing.offsets[r], packing.sizes, base=buffers if n > 1 else None)
            if not step.stepping:
                return _compat.pvary(new_buffers, layout.axes) if n > 1 else new_buffers
            u = {k: _tp_owned.own_block(layout.leaves[k], x) if isinstance(k, int) and layout.leaves[k].tp_owned else x
                 for k, x in u.items()}  # (each device keeps its block of a tensor-parallel leaf's result)
            if n == 1:
                return new_buffers, _owned.unstacked(u), {}
            tp_u = {i: x for i, x in u.items() if isinstance(i, int) and layout.leaves[i].tp_owned}
            u_buffers = _owned.pack({k: x for k, x in u.items() if k not in tp_u}, plans.u.offsets[r], plans.u.sizes)
            t_buffers = _owned.pack(tp_u, plans.tp_u.offsets[r], plans.tp_u.sizes)
            return (*_compat.pvary((new_buffers, u_buffers), layout.axes),
                    _compat.pvary(t_buffers, layout.axes + _tp_owned.tp_axes(layout, range(len(layout.leaves)))))
        return run

    def _tp_inputs(self, step: _groups.Step, tp: list[int], mode: str | None, g_leaves: list
                   ) -> tuple[_TpGathered | None, tuple]:
        """The owned leaves `tp` sharded over tensor-parallel axes (`ParamLeaf.dims`): their gradients reduced by
        `mode` (in buffers of their own: they vary along those axes), each device's row of them (and, without
        master copies, of their parameters' blocks), gathered over those axes (`_tp_owned.gather`). Returns the static
        part and the arrays, for the switch's operands; `(None, ())` without such leaves."""
        layout = step.layout
        if not tp:
            return None, ()
        _, plan, reduced = self._owned_gradients(step, tp, g_leaves, mode)
        if mode != "psum_scatter":  # (every device holds the reduced blocks of every leaf: its row of them)
            plan = _owned.leaf_plan(layout, {i: np.dtype(reduced[i].dtype).name for i in tp})
            reduced = _tp_owned.own_row(layout, reduced, plan, step.rank)
        grads = _tp_owned.gather(self.wire, layout, reduced, plan, tp)
        params = None
        if step.p_leaves is not None and self.cfg.master_dtype is None and step.stepping:
            plan_p = _owned.leaf_plan(layout, {i: np.dtype(step.p_leaves[i].dtype).name for i in tp})
            params = _tp_owned.gather(self.wire, layout, _tp_owned.own_row(layout, {i: step.p_leaves[i] for i in tp}, plan_p, step.rank),
                                plan_p, tp)
        static = _TpGathered(dataclasses.replace(grads, rows=None),
                             None if params is None else dataclasses.replace(params, rows=None))
        return static, (grads.rows, None if params is None else params.rows)

    def _owned_streamed(self, step: _groups.Step, r: int, mine: list[int], g: dict[int, jax.Array], buffers
                        ) -> tuple[dict, dict]:
        """Inside device `r`'s branch, its packed `buffers` in host memory: the owned view's update bucket by bucket
        of its leaves (`_owned.stream_buckets`). A bucket's stored entries come to the device (one move per
        contiguous range of a buffer), are updated and go back into the host buffers before the next bucket is
        read from them, so the device holds one bucket's state at a time. Returns the new buffers and the
        updates (or rounded new master values) of `mine`."""
        layout = step.layout
        offsets = layout.state_packing.offsets[r]
        u_all: dict[int, jax.Array] = {}
        for bucket in _owned.stream_buckets(layout, r, mine, self.cfg.bucket_bytes):
            entries = [j for j in layout.rank_entries(r) if layout.entries[j].leaf in bucket and
                       (step.stepping or layout.entries[j].role != MASTER)]  # a micro-step leaves the masters alone
            ranges = _owned.spans(offsets, {j: layout.entries[j].size for j in entries})
            pieces = [_offload.fetch(buffers[d], lo, hi - lo) for d, lo, hi in ranges]
            stored = _owned.read(pieces, ranges, offsets, {j: layout.entries[j].shape for j in entries})
            values, u = self._owned_view_update(step, r, bucket, {i: g[i] for i in bucket}, stored)
            values = _reduce.skip_if_empty(step.denom.ok, _owned.unstacked(values), stored)
            buffers = dict(buffers)
            for (d, lo, _), x in zip(ranges, _owned.write(values, ranges, offsets)):
                buffers[d] = _offload.store(buffers[d], x, lo)
            buffers = lax.optimization_barrier(buffers)  # the next bucket is read after this one is written
            u_all.update(_owned.unstacked(u))
        return buffers, u_all

    def _owned_view_update(self, step: _groups.Step, r: int, mine: list[int], g: dict[int, jax.Array],
                           stored: dict[int, jax.Array]) -> tuple[dict, dict]:
        """Inside device `r`'s branch: the inner update of its owned view of the leaves `mine` (all it owns, or a
        bucket of them), with gradients `g`.

        The old state is `stored` (entry -> array: the histories and master copies of `mine`, or more; without
        `stepping` the master copies may be left out) and the shared entries' old values. The leaves of a stack
        (`Layout.stacks`) run as one vectorised view (`_stack_update`), the others as one masked view. Returns the
        new values of `mine`'s stored entries (master copies included) and what every device must receive for
        `mine`: the updates, or with `master_dtype` the new master values rounded to the parameter dtype. A stack's
        values are keyed by its members' entries (or leaves), stacked (`_owned.Key`).
        """
        layout, p_leaves, shared_old, stepping = step.layout, step.p_leaves, step.shared_old, step.stepping
        master = self.cfg.master_dtype is not None
        present = set(mine)
        entries = [j for j in layout.rank_entries(r) if layout.entries[j].leaf in present]
        masters = {layout.entries[j].leaf: stored[j] for j in entries
                   if layout.entries[j].role == MASTER and j in stored}
        if p_leaves is None or not stepping:  # (a micro-step only accumulates: it reads no parameters)
            p = None
        else:
            p = masters if master else {i: p_leaves[i] for i in mine}
        stacks = [s for s in ([i for i in stack if i in present] for stack in layout.stacks) if len(s) > 1]
        stacked = {i for s in stacks for i in s}
        rest = [i for i in mine if i not in stacked]
        u: dict[_owned.Key, jax.Array] = {}
        values: dict[_owned.Key, jax.Array] = {}
        for stack in stacks:
            u_stack, v_stack = self._stack_update(step, r, stack, g, stored, p)
            if u_stack is None:  # an update `jax.vmap` cannot run (a host callback without a `vmap_method`): its
                rest += stack    # members run in the masked view, one program each
                continue
            u.update(u_stack)
            values.update(v_stack)
        rest.sort()
        if rest or not stacks:
            b_entries = self._owned_entries(layout, r, rest)
            old = jax.tree_util.tree_unflatten(self._view(layout, r, rest), [shared_old[j] if j in shared_old
                                                                              else stored[j] for j in b_entries])
            g_view = _groups.masked_tree(layout, {i: g[i] for i in rest})
            p_view = None if p is None else _groups.masked_tree(layout, {i: p[i] for i in rest})
            u_view, new = _groups.run_inner(step, g_view, old, p_view)
            _groups.check_returned(u_view, new, g_view, old, f"leaves device {r} owns")
            u.update(zip(rest, jax.tree.leaves(u_view)))
            values.update((j, v) for j, v in zip(b_entries, jax.tree.leaves(new)) if j not in shared_old)
        if master and stepping:
            u = _step_masters(layout, entries, masters, _owned.unstacked(u), values, p_leaves)
        elif master:  # a micro-batch that only accumulates: the master copies stay as they are
            values.update({j: stored[j] for j in entries if layout.entries[j].role == MASTER and j in stored})
        return values, u

    def _stack_update(self, step: _groups.Step, r: int, stack: list[int], g, stored, p: dict[int, jax.Array] | None
                      ) -> tuple[dict | None, dict | None]:
        """Inside device `r`'s branch: the inner update of the view of `stack[0]` alone, vectorised over the
        members of `stack` (their gradients, parameters and histories stacked; the shared entries the same for
        all). The members run one program on one shape (`Layout.stacks`), so member `k` gets what its own view
        would. Returns the members' updates, keyed by `tuple(stack)`, and their new histories, keyed by the
        members' entries, stacked; or `(None, None)` where the first member's view holds an operation `jax.vmap`
        refuses (`_vectorisable`), read from its program before anything is vectorised."""
        layout, shared_old = step.layout, step.shared_old
        first = stack[0]
        treedef = self._view(layout, r, [first])
        views = [self._owned_entries(layout, r, [i]) for i in stack]
        own = [k for k, j in enumerate(views[0]) if j not in shared_old]

        def run(g1, histories, p1):
            it = iter(histories)
            old = jax.tree_util.tree_unflatten(treedef, [shared_old[j] if j in shared_old else next(it)
                                                         for j in views[0]])
            g_view = _groups.masked_tree(layout, {first: g1})
            u, new = _groups.run_inner(step, g_view, old, None if p1 is None else _groups.masked_tree(
                layout, {first: p1}))
            _groups.check_returned(u, new, g_view, old, f"leaves device {r} owns")
            new = jax.tree.leaves(new)
            return jax.tree.leaves(u)[0], [new[k] for k in own]

        keys = [tuple(view[k] for view in views) for k in own]
        args = (_owned.stacked(g, stack), [_owned.stacked(stored, key) for key in keys],
                None if p is None else jnp.stack([p[i] for i in stack]))
        if not _vectorisable(jax.make_jaxpr(run)(*jax.tree.map(_member_type, args)).jaxpr):
            return None, None
        u, new = jax.vmap(run)(*args)
        return {tuple(stack): u}, dict(zip(keys, new))

    def _owned_gradients(self, step: _groups.Step, owned: list[int], g_leaves: list, mode: str | None = "choose"
                         ) -> tuple[str, Any, dict]:
        """How the owned leaves' gradients reach their owners, and the switch operand that carries them.

        `"psum_scatter"`: owner-packed rows, reduce-scattered (each owner receives its row, still to be divided);
        `"psum"`: every owned leaf all-reduced and divided; otherwise (the gradients already are the global mean)
        the leaves as they are. The mode is chosen (`_owned.choose_reduce`) unless given. Returns the mode, the
        gradients' packing and the operand.
        """
        cfg = self.cfg
        layout, denom, inner_dt, sum_dt = step.layout, step.denom, step.inner_dt, step.sum_dt
        n = layout.world_size
        plan_g = _owned.leaf_plan(layout, {i: sum_dt[i] for i in owned})
        nbytes = sum(g_leaves[i].size * np.dtype(sum_dt[i]).itemsize for i in owned)
        if mode == "choose":
            mode = _owned.choose_reduce("auto" if cfg.reduce == "default" else cfg.reduce, plan_g, nbytes, n,
                                        self.wire.packs_owned_gradients)
        if mode == "psum_scatter":
            rows = _owned.scatter_rows({i: g_leaves[i].astype(sum_dt[i]) for i in owned}, plan_g, n)
            grad_input = self.wire.scatter_packed(rows)
        elif mode == "psum":
            grad_input = {i: _reduce.divide(self.wire.all_reduce(g_leaves[i].astype(sum_dt[i])), denom, inner_dt[i])
                          for i in owned}
        else:
            grad_input = {i: g_leaves[i].astype(inner_dt[i]) for i in owned}
        return mode, plan_g, grad_input


@dataclasses.dataclass(frozen=True)
class _TpGathered:
    """The static part (`rows` None) of `_tp_owned.gather`'s results for the tensor-parallel owned leaves: of their
    gradients, and of their parameters (None with master copies, or without parameters)."""

    grads: _tp_owned.Gathered
    params: _tp_owned.Gathered | None


@dataclasses.dataclass(frozen=True)
class _OwnedPlans:
    """How `_update_owned` moves the owned leaves' values: the gradient collective's `mode` and packing `g`, the
    packings of the updates (`u`) and of the tensor-parallel leaves' updates (`tp_u`), and `tp` (`_TpGathered`,
    None without tensor-parallel owned leaves)."""

    mode: str | None
    g: Any
    u: Any
    tp_u: Any
    tp: _TpGathered | None


def _tp_whole(step: _groups.Step, plans: _OwnedPlans, r: int, mine: list[int], g, tp_rows: tuple):
    """Inside device `r`'s branch: `g` (its gradients: a `Row` or a dict) and `step` (its parameters) with the whole
    tensors of the tensor-parallel leaves among `mine`, assembled from the gathered rows `tp_rows`."""
    layout = step.layout
    whole = [i for i in mine if layout.leaves[i].tp_owned]
    if not whole:
        return g, step
    grads = dataclasses.replace(plans.tp.grads, rows=tp_rows[0])
    g_whole = {i: grads.whole(layout, r, i) for i in whole}
    if plans.mode == "psum_scatter":
        g_whole = {i: _reduce.divide(x, step.denom, step.inner_dt[i]) for i, x in g_whole.items()}
    g = g.overlaid(g_whole) if isinstance(g, _owned.Row) else {**g, **g_whole}
    if plans.tp.params is not None:
        params = dataclasses.replace(plans.tp.params, rows=tp_rows[1])
        p_leaves = list(step.p_leaves)
        for i in whole:
            p_leaves[i] = params.whole(layout, r, i)
        step = dataclasses.replace(step, p_leaves=p_leaves)
    return g, step


def _vectorisable(jaxpr) -> bool:
    """Whether `jax.vmap` can run the program `jaxpr` (sub-programs included): it refuses a `pure_callback` that
    names no `vmap_method` and an ordered `io_callback` (JAX's batching rules for them raise)."""
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        if name == "pure_callback" and params.get("vmap_method") is None:
            return False
        if name == "io_callback" and params.get("ordered", False):
            return False
        if not all(_vectorisable(_compat.jaxpr_parts(sub)[0]) for sub in _coupling.subjaxprs(params)):
            return False
    return True


def _member_type(x: jax.Array):
    """The type (shape, dtype, varying axes) of one member of the stacked `x`."""
    aval = jax.typeof(x)
    return aval.update(shape=aval.shape[1:])


def _by_rows(layout: Layout, buckets) -> bool:
    """Whether the groups' buffers go to and from the collectives as whole bucket rows: on groups of more than one
    device (on one device there is no collective to feed, and a row would only copy the leaves)."""
    return all(b.axes and layout.leaves[b.leaves[0]].group > 1 for b in buckets)


def _step_masters(layout: Layout, entries, masters: dict[int, jax.Array], u: dict[int, jax.Array], values: dict,
                  p_leaves: list) -> dict[int, jax.Array]:
    """Inside an owner's branch: adds its updates `u` to its master copies (written into `values`, to be packed)
    and returns the new master values rounded to the parameter dtype, which every device then receives."""
    for j in entries:
        if layout.entries[j].role == MASTER:
            i = layout.entries[j].leaf
            values[j] = (masters[i] + u[i]).astype(masters[i].dtype)
    return {i: values[j].astype(p_leaves[i].dtype) for j in entries
            if layout.entries[j].role == MASTER for i in [layout.entries[j].leaf]}


def _gather_owned(wire: _wire.Wire, layout: Layout, u_out: dict[str, jax.Array], plan_u) -> dict[int, jax.Array]:
    """The owners' results, packed by `plan_u` (or, on one device, per leaf), on every device, per leaf."""
    if layout.world_size == 1:  # a psum of one device only retypes the value as replicated, which untyped
        # values (`check_vma=False`) need not be
        return {i: wire.invariant(x) for i, x in u_out.items()} if _compat.vma_enabled(layout.axes) else u_out
    return _owned.gathered_leaves(wire.gather_packed(u_out), plan_u, layout)
