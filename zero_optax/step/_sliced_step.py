"""The sliced leaves' part of a step: reduce-scatter in buckets, update each group's slots, all-gather in buckets.

Every device runs the group views (`_groups`) on its own coordinates; they also advance the shared entries (step
counts). The gather stage assembles the step's result: the updates, or with `apply` the new parameters.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from zero_optax.core._errors import ZeroStructureError
from zero_optax.layout._config import Config
from zero_optax.layout._layout import Layout
from zero_optax.layout._state import ZeroState
from zero_optax.step import (
    _groups,
    _master,
    _offload,
    _reduce,
    _wire,
)


@dataclasses.dataclass(frozen=True, eq=False)
class GroupsDone:
    """What the group views leave for the rest of the step.

    Attributes:
      new_inner: the new `SlicedState`.
      shared_old: the shared entries' old values, which the owned views read.
      values, new_master: streamed (offload): each group's results and the new master copies; otherwise None.
      u_parts, p_parts, masks: not streamed: each group's updates, parameters and valid-coordinate mask.
    """

    new_inner: Any
    shared_old: dict
    values: list | None = None
    new_master: Any = None
    u_parts: list | None = None
    p_parts: list | None = None
    masks: list | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class SlicedStep:
    """The stages of the sliced leaves for one `Config`: `reduce`, `update`, `gather`."""

    cfg: Config
    wire: _wire.Wire
    groups: _groups.Groups
    masters: _master.NoMasters

    def reduce(self, step: _groups.Step, g_leaves: list) -> list:
        """Each group's part of the reduced gradient on this device, in the inner's dtype (`[None]` without groups)."""
        layout, inner_dt, ranks = step.layout, step.inner_dt, step.ranks
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
        if self.cfg.reduce is None:  # already the global mean
            return _groups.own_parts(layout, {i: grads[i].astype(inner_dt[i]) for i in sliced}, ranks, step.entered)
        buckets = self.wire.plan(layout, sliced, [step.sum_dt[i] for i in sliced])
        if self.cfg.reduce == "psum":
            rows = self.wire.all_reduce_slices(grads, layout, buckets, ranks)
        else:
            rows = self.wire.reduce_scatter(grads, layout, buckets)
        joined = _groups.parts_from_rows(layout, rows, buckets)
        return [_reduce.divide(x, step.denom, inner_dt[g.first]) for g, x in zip(layout.groups, joined)]

    def update(self, step: _groups.Step, g_parts: list, state: ZeroState) -> GroupsDone:
        """The inner update on each group's part `g_parts` of the reduced gradient (streamed with `step.streamed`)."""
        layout, ranks, p_leaves = step.layout, step.ranks, step.p_leaves
        if step.streamed and layout.groups:
            params_parts = self._params(layout, p_leaves, None, ranks)
            p_dtypes = [None if p_leaves is None else np.dtype(p_leaves[g.first].dtype) for g in layout.groups]
            values, new_inner, new_master, shared_old = _offload.stream_groups(self.groups, step, g_parts,
                                                                               params_parts, state, p_dtypes)
            done = GroupsDone(new_inner, shared_old, values, new_master)
        else:
            masks = [_groups.valid(layout, g, _groups.group_rank(layout, g, ranks)) for g in layout.groups]
            p_parts = self._params(layout, p_leaves, state, ranks)
            u_parts, new_inner, shared_old = self.groups.update(step, g_parts, p_parts, state._inner, masks)
            done = GroupsDone(new_inner, shared_old, u_parts=u_parts, p_parts=p_parts, masks=masks)
        new_inner = done.new_inner._replace(shared=_reduce.skip_if_empty(step.denom.ok, done.new_inner.shared,
                                                                         state._inner.shared))
        return dataclasses.replace(done, new_inner=new_inner)

    def gather(self, step: _groups.Step, done: GroupsDone, state: ZeroState, new_buffers: dict, u_owned: dict,
               apply: bool, exits: frozenset[int] = frozenset()):
        """The step's result on every device (the updates, with `apply` the new parameters) and the new state; the
        leaves of `exits` (`Engine.exit_rows`) keep this device's slots, not gathered (`_gather_values`)."""
        layout, p_leaves, ok = step.layout, step.p_leaves, step.denom.ok
        values, new_master = done.values, done.new_master
        if done.u_parts is not None and layout.groups:
            assert done.masks is not None  # (set with `u_parts`)
            p_dtypes = [None if p_leaves is None else p_leaves[g.first].dtype for g in layout.groups]
            values, new_master = self.masters.group_results(done.u_parts, state, done.masks, ok, p_dtypes)
            values = self.masters.before_gather(values, done.p_parts, apply)
        elif done.u_parts is not None:
            values, new_master = [], state.master
        assert values is not None  # (streamed: `done.values`)
        result = self.masters.after_gather(self._gather_values(layout, values, exits), u_owned, p_leaves, ok, apply)
        new_state = ZeroState(done.new_inner, new_buffers, new_master, layout, state.local)
        return _groups.tree(layout, [result[i] for i in range(len(layout.leaves))]), new_state

    def _params(self, layout: Layout, p_leaves: list | None, state: ZeroState | None, ranks) -> list | None:
        """The parameters each group's view sees (`_master`; `state` None: streamed), or None without parameters."""
        if p_leaves is None:
            return None
        if not layout.groups:
            return [None]
        return self.masters.group_params(state, lambda: _groups.own_parts(layout, p_leaves, ranks))

    def _gather_values(self, layout: Layout, values: list, exits: frozenset[int]) -> dict[int, jax.Array]:
        """Every sliced leaf's full value, all-gathered in buckets planned in tree order from the groups' parts;
        those of `exits`, this device's slots (its block of rows where they are whole rows), each behind an
        optimization barrier (so that XLA fuses none of the update into what the caller computes from it, which keeps
        the caller's results bit for bit, and frees each once read)."""
        if not layout.groups:
            return {}
        values = [x.reshape(-1) for x in values]  # a part kept in its leaf's shape (`Group.shape`) gathers 1-D
        # (in the leaf's shape where they are its block of rows: the caller's GSPMD reads the leaf cut over its first
        # dimension, with nothing to reshape)
        own = {i: x[off:off + layout.leaves[i].slots].reshape(_wire.row_block(layout.leaves[i]) or (-1,))
               for g, x in zip(layout.groups, values) for i, off in zip(g.leaves, g.offsets) if i in exits}
        order = [i for i in _groups.order(layout) if i not in exits]
        dtypes = {i: np.dtype(x.dtype).name for g, x in zip(layout.groups, values) for i in g.leaves}
        buckets = self.wire.plan(layout, order, [dtypes[i] for i in order])
        gathered = self.wire.gather(_groups.rows_from_parts(layout, values, buckets), layout, buckets)
        return {**gathered, **{i: jax.lax.optimization_barrier(x) for i, x in own.items()}}
