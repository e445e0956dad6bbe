"""Master copies (`zero1(..., master_dtype=)`) as one strategy the stages call, chosen once per `Config`.

`MasterCopies` keeps each device's slots (owners: their leaves) of the parameters in `master_dtype`, runs the inner
update on them and sends them rounded to the parameter dtype; the updates then move each parameter onto its rounded
master. `NoMasters` sends the updates. Every difference between the two lives here.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zero_optax.core._errors import ZeroStructureError
from zero_optax.layout._layout import Layout
from zero_optax.layout._stored import MASTER
from zero_optax.step import _groups, _packed, _reduce


def stored_masters(layout: Layout, entries: list[int], stored: _packed.Row | dict) -> dict:
    """Leaf -> its master copy among an owner's `stored` entries (empty without master copies)."""
    return {layout.entries[j].leaf: stored[j] for j in entries if layout.entries[j].role == MASTER and j in stored}


class NoMasters:
    """Without master copies: the inner update runs on the parameters; devices receive its updates."""

    gathers_tp_params = True  # owners of tensor-parallel leaves need the parameters' blocks gathered

    def init(self, rows: list, layout: Layout) -> tuple | None:
        """The sliced leaves' master copies a new state stores: none."""
        return None

    def check(self, p_leaves: list | None) -> None:
        """Refuses a call without the parameters where they are needed."""

    def update_dtypes(self, views, layout: Layout, extra: dict, phase=None) -> dict[int, str]:
        """Per leaf, the dtype of the updates `update` returns."""
        return views.update_dtypes(layout, extra, phase)

    def sent_dtypes(self, views, step: _groups.Step, owned: list[int]) -> dict[int, str]:
        """Per owned leaf, the dtype its owner sends every device."""
        return {i: d for i, d in views.update_dtypes(step.layout, step.extra, step.phase).items() if i in owned}

    def group_params(self, state, slices: Callable[[], list]) -> list | None:
        """The parameters each group's view sees: this device's slices (`state` None: a streamed group's chunks)."""
        return slices()

    def group_results(self, u_parts: list, state, masks: list, ok, p_dtypes: list) -> tuple[list, tuple | None]:
        """What every device receives of each group (the updates, zero where the step is skipped)."""
        return [_groups.stepped(u, None, None, ok, None)[1] for u in u_parts], state.master

    def before_gather(self, values: list, p_parts: list | None, apply: bool) -> list:
        """With `apply`, each device adds its part of the updates to its part of the parameters."""
        if not apply:
            return values
        assert p_parts is not None  # (applying: the parameters are given)
        return [None if v is None else optax.apply_updates(p.reshape(v.shape), v) for p, v in zip(p_parts, values)]

    def after_gather(self, gathered: dict, owned: dict, p_leaves: list | None, ok, apply: bool) -> dict:
        """The result per leaf from the gathered and owned values: the updates, or with `apply` the parameters."""
        owned = _reduce.skip_if_empty(ok, owned, jax.tree.map(jnp.zeros_like, owned))  # zero where skipped
        if apply:
            assert p_leaves is not None  # (applying: the parameters are given)
            return {**gathered, **{i: optax.apply_updates(p_leaves[i], u) for i, u in owned.items()}}
        return {**gathered, **owned}

    def owner_params(self, masters: dict, p_leaves: list, mine: list[int]) -> dict:
        """The parameters an owner's view sees."""
        return {i: p_leaves[i] for i in mine}

    def owner_results(self, layout: Layout, entries: list[int], stored: _packed.Row | dict, u: dict, values: dict,
                      step) -> dict:
        """What an owner sends for its leaves (its updates); `values` its new stored entries."""
        return u


class MasterCopies(NoMasters):
    """Master copies in `dtype`: the inner update runs on them; devices receive them rounded."""

    gathers_tp_params = False

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)

    def init(self, rows: list, layout: Layout) -> tuple | None:
        return tuple(x.reshape(g.part_shape) for x, g in zip(rows, layout.groups))

    def check(self, p_leaves: list | None) -> None:
        if p_leaves is None:
            raise ZeroStructureError(
                "zero1(master_dtype=...) needs the parameters: call tx.update(grads, opt_state, params), so that "
                "the returned updates move them onto the master copy.")

    def update_dtypes(self, views, layout: Layout, extra: dict, phase=None) -> dict[int, str]:
        return dict.fromkeys(range(len(layout.leaves)), self.dtype.name)

    def sent_dtypes(self, views, step: _groups.Step, owned: list[int]) -> dict[int, str]:
        p_leaves = step.p_leaves
        assert p_leaves is not None  # (`check` refused a call without them)
        return {i: np.dtype(p_leaves[i].dtype).name for i in owned}

    def group_params(self, state, slices: Callable[[], list]) -> list | None:
        return None if state is None else list(state.master)  # (streamed chunks read them from host memory)

    def group_results(self, u_parts: list, state, masks: list, ok, p_dtypes: list) -> tuple[list, tuple]:
        results = [_groups.stepped(u, m, mask, ok, dt)
                   for u, m, mask, dt in zip(u_parts, state.master, masks, p_dtypes)]
        return [v for _, v in results], tuple(m for m, _ in results)

    def before_gather(self, values: list, p_parts: list | None, apply: bool) -> list:
        return values

    def after_gather(self, gathered: dict, owned: dict, p_leaves: list | None, ok, apply: bool) -> dict:
        assert p_leaves is not None  # (`check` refused a call without them)
        rounded = {**gathered, **owned}  # (the owned leaves' owners send their rounded masters too)
        if apply:
            return {i: _reduce.skip_if_empty(ok, t, p_leaves[i]) for i, t in rounded.items()}
        updates = {i: t.astype(self.dtype) - p_leaves[i].astype(self.dtype) for i, t in rounded.items()}
        return _reduce.skip_if_empty(ok, updates, jax.tree.map(jnp.zeros_like, updates))

    def owner_params(self, masters: dict, p_leaves: list, mine: list[int]) -> dict:
        return masters

    def owner_results(self, layout: Layout, entries: list[int], stored: _packed.Row | dict, u: dict, values: dict,
                      step) -> dict:
        masters = stored_masters(layout, entries, stored)
        if not step.stepping:  # a micro-batch that only accumulates: the master copies stay as they are
            values.update({j: stored[j] for j in entries if layout.entries[j].role == MASTER and j in stored})
            return u
        u, out = _packed.unstacked(u), {}
        for j in entries:
            if layout.entries[j].role == MASTER:
                i = layout.entries[j].leaf
                values[j] = (masters[i] + u[i]).astype(masters[i].dtype)
                out[i] = values[j].astype(step.p_leaves[i].dtype)
        return out


def of(cfg) -> NoMasters:
    """The master-copy strategy of `cfg`."""
    return NoMasters() if cfg.master_dtype is None else MasterCopies(cfg.master_dtype)
