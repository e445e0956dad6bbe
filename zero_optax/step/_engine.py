"""zero1's `init` and `update` inside `shard_map`: the step's stages, top to bottom.

`Engine.update`: checks, (offload in,) accumulation's branch, `_run` (reduce, update the sliced groups and the owned
leaves, gather), (offload out). Every value that moves between devices goes through the step's `_wire.Wire`; the
coupling analysis at `init` proves the views exact.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zero_optax.core import _compat
from zero_optax.core._errors import WeightError, ZeroStructureError
from zero_optax.core._names import tree_signature
from zero_optax.layout import _planner
from zero_optax.layout._layout import Layout
from zero_optax.layout._state import ZeroState
from zero_optax.layout._stored import LOCAL
from zero_optax.step import (
    _accumulate,
    _groups,
    _master,
    _offload,
    _owned_step,
    _reduce,
    _sliced_step,
    _wire,
)


def check_layout(state, axis_name, replica_axes: tuple[str, ...] = ()) -> Layout:
    """The state's layout, after checking its type, axis, world size and replica axes against the mesh."""
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


def check_tree(tree, layout: Layout, what: str, entered: frozenset[int] = frozenset()) -> list[jax.Array]:
    """The leaves of `tree` after checking structure and shapes against the parameters of `layout` (those of
    `entered`: against a device's block of rows, `_wire.row_block`)."""
    leaves, treedef = jax.tree.flatten(tree)
    if treedef != layout.treedef:
        raise ZeroStructureError(
            f"The {what} do not have the structure of the parameters this state was initialised with.\n"
            f"  {what}: {tree_signature(tree)}\n"
            f"  parameters: {tree_signature(_groups.tree(layout, [0] * len(layout.leaves)))}")
    for i, (x, leaf) in enumerate(zip(leaves, layout.leaves)):
        if tuple(np.shape(x)) != (_wire.row_block(leaf) if i in entered else leaf.shape):
            raise ZeroStructureError(
                f"The {what} leaf `{leaf.path}` has shape {tuple(np.shape(x))}, but the parameter has shape "
                f"{leaf.shape}.")
    return leaves


def check_extra_values(extra: dict) -> None:
    """Refuses an extra argument of `update` whose leaves are not arrays or numbers (a function, say)."""
    for name, value in extra.items():
        for x in jax.tree.leaves(value):
            if not isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex)):
                kind = "a function" if callable(x) else f"a {type(x).__name__}"
                raise ZeroStructureError(
                    f"The extra argument `{name}` of update is {kind}, not an array: zero1 hands the inner update "
                    f"only arrays and numbers. It decided at init how to split the update over the devices from the "
                    f"update traced without `{name}`, so it cannot vouch for an update that uses it. Bind it into the "
                    f"transformation instead, so that init traces the update with it (and zero1 runs it exactly or "
                    f"refuses it with the reason): optax.GradientTransformationExtraArgs(inner.init, "
                    f"functools.partial(inner.update, {name}=...)).")


def _check_extra(extra: dict, axes) -> None:
    for name, value in extra.items():
        for x in jax.tree.leaves(value):
            if isinstance(x, jax.Array) and _compat.vma_enabled(axes) and set(axes) & _compat.varying_axes(x):
                raise ZeroStructureError(
                    f"The extra argument `{name}` differs between the devices of `{axes}`, but every device must "
                    f"run the inner update with the same value. Pass its global value (for a loss, "
                    f"lax.pmean(loss, {axes!r})).")


class Engine:
    """zero1's `init` and `update` for one `Config`, inside `shard_map` over its axes."""

    def __init__(self, cfg: _planner.Config):
        self.cfg = cfg
        self.wire = _wire.Wire.of(cfg)
        self.views = _groups.Views(cfg)
        self.masters = _master.of(cfg)
        self.sliced = _sliced_step.SlicedStep(cfg, self.wire, _groups.Groups(cfg, self.views), self.masters)
        self.owned = _owned_step.OwnedStep(cfg, self.wire, self.views, self.masters)
        self._fresh_states: collections.OrderedDict = collections.OrderedDict()  # (`_fresh`)

    @staticmethod
    def _ranks(layout: Layout) -> dict:
        groups = {layout.zero_axes(leaf) for leaf in layout.leaves} | {layout.axes}
        return {axes: _compat.axis_index(axes) for axes in groups}

    def init(self, params, full_state=None) -> ZeroState:
        """The state for `params`: fresh from the inner `init`, or sliced from a plain optax `full_state`."""
        cfg = self.cfg
        layout = _planner.build_layout(cfg, params)
        full = None
        if full_state is not None:
            full, treedef = jax.tree.flatten(full_state)
            if treedef != layout.state_treedef:
                raise ZeroStructureError(
                    f"scatter_state: the inner state is structured as {tree_signature(full_state)}, but the inner "
                    f"transformation's init gives {layout.state_tree}.")
        if full is None and not cfg.offload and _compat.manual_axes():
            return self._fresh(layout)(params)
        state = self._state(layout, params, full)
        return _offload.move(state, jax.memory.Space.Host, cfg.bucket_bytes) if cfg.offload else state

    def _fresh(self, layout: Layout) -> Callable[[Any], ZeroState]:
        """The fresh state of `layout` as one nested `jax.jit`, kept per layout: the trace that `state_specs` makes
        is then the one `init` evaluates, not made again. Kept by the layout's `id` (equal layouts may differ in
        what they record); the entry holds the layout, so no other object has that `id` while it is kept."""
        return _planner.remembered(id(layout), lambda: (layout, jax.jit(functools.partial(
            self._state, layout, full=None))), self._fresh_states)[1]

    def _state(self, layout: Layout, params, full: list | None) -> ZeroState:
        """The state of `layout` for `params`: fresh from the inner `init`, or sliced from the leaves `full` of a
        plain optax state."""
        cfg = self.cfg
        values = [x.astype(cfg.inner_dtype(x.dtype)) for x in jax.tree.leaves(params)]
        ranks = self._ranks(layout)
        rows = _groups.own_parts(layout, values, ranks)
        whole = _groups.value_shared(cfg.inner, layout, values) if full is None else None
        inner_state = self.sliced.groups.init(layout, rows, full, ranks, whole)
        buffers = self.owned.build(layout, values, full, ranks[layout.axes], whole)
        master = self.masters.init(rows, layout)
        local = (_accumulate.init_local(layout, params, layout.replica_axes + layout.axes)
                 if layout.accumulate == LOCAL else None)
        return ZeroState(inner_state, buffers, master, layout, local)

    def update(self, grads, state, params=None, *, weight=None, apply: bool = False,
               exits: frozenset[int] = frozenset(), entered: frozenset[int] = frozenset(), **extra):
        """One `update` call; with `apply` (`zo.apply_gradients`), the new parameters instead of the updates; the
        updates of the leaves of `exits` (`exit_rows`) as this device's slots, not gathered (its block of rows where
        they are whole rows: `_wire.row_block`); the gradients of `entered` (of `exits`, global means) given as
        this device's block of rows."""
        cfg = self.cfg
        layout, g_leaves, p_leaves = self._check_step(grads, state, params, weight, extra, entered)
        if cfg.offload:  # the stored state stays in host memory and streams through the device
            state = _offload.move_small(state, jax.memory.Space.Device, cfg.bucket_bytes)
        if cfg.accumulating is None:
            denom = _reduce.denominator(weight, *_reduce.reduction(layout))
            step = dataclasses.replace(self._step(layout, g_leaves, p_leaves, denom, extra), entered=entered)
            updates, new_state = self._run(step, g_leaves, state, apply, exits)
        else:
            updates, new_state = self._accumulate(layout, g_leaves, p_leaves, state, extra, weight)
        if cfg.offload:
            new_state = _offload.move_small(new_state, jax.memory.Space.Host, cfg.bucket_bytes)
        return updates, new_state

    def exit_rows(self, layout: Layout) -> frozenset[int]:
        """The leaves whose updates can leave a mesh-bound `update` cut in rows over the ZeRO axis, as a data-parallel
        state's updates do under GSPMD (each device adds its rows, the new parameters are gathered): the sliced
        leaves sharded over that one axis only, in a step with no master copies, offload, accumulation,
        replica axes or quantized gather, whose updates are what the inner update returned. A leaf fused with
        others into one group (`FUSE_BYTES`) is gathered with them: its rows, cut from the group's part at its own
        offset, would be one more program for XLA to compile per leaf, for a few kilobytes."""
        cfg = self.cfg
        if (cfg.offload or cfg.accumulating is not None or cfg.master_dtype is not None or layout.replica_axes
                or (cfg.quantize is not None and cfg.quantize.params is not None) or len(layout.axes) != 1
                or layout.world_size == 1):
            return frozenset()
        alone = {g.first for g in layout.groups if len(g.leaves) == 1}
        return frozenset(i for i, leaf in enumerate(layout.leaves) if leaf.sliced and not leaf.axes and i in alone)

    def _run(self, step: _groups.Step, g_leaves: list, state: ZeroState, apply: bool = False,
             exits: frozenset[int] = frozenset()):
        """Reduce, update the sliced groups and the owned leaves, gather (a micro-step gathers nothing: None)."""
        layout = step.layout
        owned = [i for i, leaf in enumerate(layout.leaves) if not leaf.sliced]
        g_parts = self.sliced.reduce(step, g_leaves)
        done = self.sliced.update(step, g_parts, state)
        new_buffers, u_owned = dict(state.buffers), {}
        if owned:
            step = dataclasses.replace(step, shared_old=done.shared_old)
            new_buffers, u_owned = self.owned.update(step, owned, g_leaves, state)
        if not step.stepping:
            return None, ZeroState(done.new_inner, new_buffers, state.master, layout, state.local)
        return self.sliced.gather(step, done, state, new_buffers, u_owned, apply, exits)

    def _accumulate(self, layout: Layout, g_leaves: list, p_leaves: list | None, state: ZeroState, extra: dict,
                    weight):
        """An accumulating call: `lax.cond` on the cycle position runs the final call or a micro-step (zero updates)."""
        cfg, acc = self.cfg, self.cfg.accumulating
        w = _accumulate.call_weight(cfg.reduce is not None, weight, layout)
        extra = {**extra, "accumulate_weight": w}
        final, micro = _accumulate.phases(acc, g_leaves, cfg.inner_dtype)
        local = acc.mode == LOCAL
        dtypes = self.masters.update_dtypes(self.views, layout, extra, final)

        def last(operands):
            g_leaves, state, p_leaves = operands
            if local:
                g_leaves, state = _accumulate.take_local(g_leaves, state)
            step = self._step(layout, g_leaves, p_leaves, final.denom, extra, final)
            return self._run(step, g_leaves, state)

        def middle(operands):
            g_leaves, state, p_leaves = operands
            # typed like the final call's updates: varying over the leaf's own (tensor- or expert-parallel) axes
            zeros = _groups.tree(layout, [_compat.pvary(jnp.zeros(g.shape, dtypes[i]), layout.leaves[i].axes)
                                         for i, g in enumerate(g_leaves)])
            if local:
                return zeros, _accumulate.add_local(layout, state, g_leaves, w)
            _, new = self._run(self._step(layout, g_leaves, p_leaves, micro.denom, extra, micro), g_leaves, state)
            return zeros, new

        position = self.wire.agree(_accumulate.position(layout, state))  # typed invariant for the branch
        return lax.cond(position + 1 >= acc.steps, last, middle, (g_leaves, state, p_leaves))

    def _step(self, layout: Layout, g_leaves: list, p_leaves: list | None, denom: _reduce.Denominator, extra: dict,
              phase: _accumulate.Phase | None = None) -> _groups.Step:
        """The step's `_groups.Step` (under accumulation, `phase`'s)."""
        cfg = self.cfg
        inner_dt = ({i: np.dtype(cfg.inner_dtype(g.dtype)).name for i, g in enumerate(g_leaves)} if phase is None
                    else phase.grad_dtypes)
        sum_dt = {i: self.wire.sum_dtype(g.dtype) for i, g in enumerate(g_leaves)}
        return _groups.Step(layout, cfg.inner if phase is None else phase.inner, extra, denom, inner_dt, sum_dt,
                            self._ranks(layout), phase is None or phase.step, cfg.offload, p_leaves, phase=phase)

    def _check_step(self, grads, state, params, weight, extra, entered: frozenset[int] = frozenset()
                    ) -> tuple[Layout, list, list | None]:
        """The layout and the leaves of `grads` and `params`, every argument of `update` checked."""
        cfg = self.cfg
        layout = check_layout(state, cfg.axis_name, cfg.replica_axes)
        g_leaves = check_tree(grads, layout, "gradients", entered)
        p_leaves = None if params is None else check_tree(params, layout, "parameters")
        self.masters.check(p_leaves)
        reducing = cfg.reduce is not None
        if cfg.accumulate != LOCAL:
            whole = [i for i in range(len(g_leaves)) if i not in entered]  # (a block of rows varies, by design)
            _reduce.check_semantics([g_leaves[i] for i in whole], [layout.paths[i] for i in whole],
                                    [layout.zero_axes(layout.leaves[i]) for i in whole], reducing,
                                    replicas=layout.replica_axes)
        if weight is not None and not reducing:
            raise WeightError(
                "`weight=` weighs each device's gradient (a loss sum) in the reduction, but with reduce=False the "
                "gradients are already the global mean. Pass weight to zo.reduce_gradients instead, or use "
                "reduce=True.")
        _check_extra(extra, layout.replica_axes + layout.axes)
        return layout, g_leaves, p_leaves
