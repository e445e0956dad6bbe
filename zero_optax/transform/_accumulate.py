"""Gradient accumulation inside zero1: k `update` calls per optimizer step, one inner update, one all-gather.

The accumulation state is part of the inner optimizer's state: `zero1(inner, accumulate_steps=k)` runs the engine
on `accumulating(inner, k, mode)`, whose state is `AccumulateState(inner, acc, micro_step, weight_sum)`. So the
layout code sees the accumulators as it sees any history:

* `accumulate="sharded"` (ZeRO-2): `acc` is a float32 tree like the parameters. Its leaves are per-leaf histories,
  sliced 1/N for sliced leaves and packed at the owner for owned leaves, and checkpoints save, restore and reshard
  them like Adam's moments. `micro_step` and `weight_sum` are shared entries, like a step count.
* `accumulate="local"`: `acc` is empty; every device keeps its own unreduced float32 sums in `ZeroState.local`
  (full size), reduced once on the cycle's last call.

Every call reduces the micro-batch's global weight (a scalar) and branches with `lax.cond` on the cycle position,
which is the same on every device: non-final calls add the micro-batch's reduce-scattered sums (sharded) or local
gradients (local) to the accumulators and return zero updates, moving no all-gather and running no inner update;
the final call divides the accumulated sums by the cycle's total weight in float32, runs the inner update once and
all-gathers once. A cycle of total weight zero is skipped.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from zero_optax.core import _compat
from zero_optax.core._errors import WeightError, ZeroError
from zero_optax.transform import _reduce, _shared
from zero_optax.transform._layout import (
    ACCUMULATE_MODES,
    LOCAL,
    MICRO_STEP_PATH,
    SHARDED,
    WEIGHT_SUM_PATH,
)
from zero_optax.transform._state import shared_arrays


class AccumulateState(NamedTuple):
    """The state of `accumulating(inner, k, mode)`.

    Attributes:
      inner: the inner transformation's state.
      acc: sharded mode: float32 sums of the gradients of this cycle's calls so far, like the parameters; local
        mode: `()` (the sums live in `ZeroState.local`).
      micro_step: int32, the number of calls of this cycle so far (0 at a cycle boundary).
      weight_sum: float32, the global weight of this cycle's calls so far.
    """

    inner: Any
    acc: Any
    micro_step: jax.Array
    weight_sum: jax.Array


def acc_dtype(dtype) -> np.dtype:
    """Accumulators sum in float32 (float64 stays float64)."""
    return np.dtype(jnp.promote_types(dtype, jnp.float32))


def _is_masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def _map_present(fn, tree, *rest):
    """`fn(index, leaf, *rest_leaves)` on every present leaf of a masked parameter view (`optax.MaskedNode` kept)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_masked)
    others = [jax.tree.leaves(t, is_leaf=_is_masked) for t in rest]
    out = [x if _is_masked(x) else fn(i, x, *(o[i] for o in others)) for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, out)


class Accumulating:
    """`accumulating(inner, k, mode)`: the transformation the engine runs for `zero1(..., accumulate_steps=k)`.

    `update` is the final call of a cycle (its gradient is the last micro-batch's sum, `accumulate_weight` that
    micro-batch's global weight): the analyses at `init` see exactly the step that runs the inner update. `add` is a
    non-final call. `cast` (leaf index -> dtype name) is the dtype the inner update sees each mean gradient in; it is
    set by `update` below for the call being traced, and the gradient's own dtype is used when unset.
    """

    def __init__(self, inner: optax.GradientTransformationExtraArgs, steps: int, mode: str):
        self.inner = inner
        self.steps = steps
        self.mode = mode
        self.cast: dict[int, str] | None = None

    def init(self, params) -> AccumulateState:
        acc = (jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), acc_dtype(p.dtype)), params)
               if self.mode == SHARDED else ())
        return AccumulateState(self.inner.init(params), acc, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))

    def _sums(self, grads, state: AccumulateState):
        if self.mode != SHARDED:
            return _map_present(lambda i, g: g.astype(acc_dtype(g.dtype)), grads)
        return _map_present(lambda i, g, a: a + g.astype(a.dtype), grads, state.acc)

    def update(self, grads, state: AccumulateState, params=None, *, accumulate_weight, **extra):
        total = state.weight_sum + accumulate_weight
        ok = total > 0
        denom = jnp.where(ok, total, 1.0)

        def mean(i, s):
            dt = s.dtype if self.cast is None else self.cast[i]
            return (s / denom.astype(s.dtype)).astype(dt)
        mean_grads = _map_present(mean, self._sums(grads, state))
        updates, new_inner = self.inner.update(mean_grads, state.inner, params, **extra)
        new_inner = _reduce.skip_if_empty(ok, new_inner, state.inner)
        updates = _reduce.skip_if_empty(ok, updates, jax.tree.map(jnp.zeros_like, updates))
        acc = jax.tree.map(jnp.zeros_like, state.acc)
        return updates, AccumulateState(new_inner, acc, jnp.zeros_like(state.micro_step),
                                        jnp.zeros_like(state.weight_sum))

    def add(self, grads, state: AccumulateState, params=None, *, accumulate_weight, **extra):
        del params, extra
        acc = self._sums(grads, state) if self.mode == SHARDED else state.acc
        return grads, AccumulateState(state.inner, acc, state.micro_step + 1, state.weight_sum + accumulate_weight)

    def transformation(self, which: str) -> optax.GradientTransformationExtraArgs:
        return optax.GradientTransformationExtraArgs(self.init, self.update if which == "final" else self.add)


@dataclasses.dataclass(frozen=True)
class Hooks:
    """How the engine runs one accumulating call (`zero_optax.transform._engine.Engine.update`).

    Attributes:
      inner: the transformation to run in place of the configured one (`Accumulating.update` or `.add`).
      step: whether this call is an optimizer step: it moves the master copies and all-gathers the updates.
        Otherwise the updates are zeros and nothing is gathered.
      grad_dtypes: leaf index -> the dtype the reduced gradient sums are handed over in (float32).
      checked: whether the gradients' varying/invariant types are checked against the reduction.
    """

    inner: optax.GradientTransformationExtraArgs
    step: bool
    grad_dtypes: dict[int, str]
    checked: bool = True

    denom = _reduce.Denominator(1, None)
    """Sums: the division by the cycle's weight happens in `Accumulating.update`."""


def check_args(accumulate_steps, accumulate) -> None:
    if isinstance(accumulate_steps, bool) or not isinstance(accumulate_steps, (int, np.integer)) or \
            accumulate_steps < 1:
        raise ZeroError(f"`accumulate_steps` must be an int >= 1 (the number of update calls, one per "
                        f"micro-batch, per optimizer step), got {accumulate_steps!r}.")
    if accumulate not in ACCUMULATE_MODES:
        raise ZeroError(f"`accumulate` must be \"sharded\" (accumulators sharded like the state, ZeRO-2) or "
                        f"\"local\" (each device keeps full-size local sums), got {accumulate!r}.")


def _shared_entry(layout, path: str) -> int | None:
    if layout.accumulate is None:
        return None
    return next(j for j, e in enumerate(layout.entries) if e.leaf is None and e.path == path)


def micro_step_entry(layout) -> int | None:
    """The index of the shared cycle-position entry, or None without accumulation."""
    return _shared_entry(layout, MICRO_STEP_PATH)


def weight_sum_entry(layout) -> int | None:
    """The index of the shared entry holding the cycle's weight so far, or None without accumulation."""
    return _shared_entry(layout, WEIGHT_SUM_PATH)


def update(engine, grads, state, params, weight, extra):
    """One accumulating `update` call of `engine` (inside `shard_map`)."""
    cfg = engine.cfg
    acc: Accumulating = cfg.accumulating
    layout, g_leaves = engine.checked(state, grads)
    w = _call_weight(cfg.reduce is not None, weight, layout)
    acc.cast = {i: np.dtype(cfg.inner_dtype(g.dtype)).name for i, g in enumerate(g_leaves)}
    sums = {i: acc_dtype(g.dtype).name for i, g in enumerate(g_leaves)}
    shared = shared_arrays(state)
    position = shared[micro_step_entry(layout)][0]
    position = engine.wire.agree(position)  # the same on every device; typed invariant for the branch
    final = position + 1 >= acc.steps
    local = acc.mode == LOCAL

    def last(operands):
        grads, state, params = operands
        if local:
            grads = _tree_add(grads, state.local)
        hooks = Hooks(acc.transformation("final"), True, sums, checked=not local)
        updates, new = engine.update(grads, state, params, hooks=hooks, accumulate_weight=w, **extra)
        if local:
            new = dataclasses.replace(new, local=jax.tree.map(jnp.zeros_like, state.local))
        return updates, new

    def middle(operands):
        grads, state, params = operands
        dtypes = ({i: np.dtype(cfg.master_dtype).name for i in range(len(layout.leaves))}
                  if cfg.master_dtype is not None else
                  engine._update_dtypes(layout, {**extra, "accumulate_weight": w}))  # pylint: disable=protected-access
        # typed like the final call's updates: varying over the leaf's own (tensor- or expert-parallel) axes
        zeros = jax.tree.map(lambda g, i: _compat.pvary(jnp.zeros(g.shape, dtypes[i]), layout.leaves[i].axes),
                             grads, _indices(layout))
        if local:
            step, total = micro_step_entry(layout), weight_sum_entry(layout)
            inner = state.inner_state
            inner = inner._replace(shared=_shared.tree(layout, [
                x + 1 if j == step else x + w.astype(x.dtype) if j == total else x
                for j, x in shared_arrays(state).items()]))
            new_local = _tree_add(grads, state.local, keep_lead=True)
            return zeros, dataclasses.replace(state, inner_state=inner, local=new_local)
        hooks = Hooks(acc.transformation("add"), False, sums)
        _, new = engine.update(grads, state, params, hooks=hooks, accumulate_weight=w, **extra)
        return zeros, new

    try:
        if acc.steps == 1:
            return last((grads, state, params))
        return lax.cond(final, last, middle, (grads, state, params))
    finally:
        acc.cast = None


def _call_weight(reducing: bool, weight, layout) -> jax.Array:
    """The global weight of one call, in float32: its share of the cycle's mean."""
    if weight is not None and not reducing:
        raise WeightError(
            "`weight=` weighs each device's gradient (a loss sum) in the reduction, but with reduce=False the "
            "gradients are already the global mean. Pass weight to zo.reduce_gradients instead, or use "
            "reduce=True.")
    if not reducing:
        return jnp.ones((), jnp.float32)                    # each call's gradient is already a mean
    if weight is None:
        return jnp.asarray(layout.world_size, jnp.float32)  # each device's gradient is a mean over its batch
    return _reduce.global_weight(weight, layout.axes)


def _indices(layout):
    return jax.tree_util.tree_unflatten(layout.treedef, list(range(len(layout.leaves))))


def _tree_add(grads, local, keep_lead: bool = False):
    """`grads + local` in the accumulators' dtype; `local` holds `[1, *shape]` per-device blocks."""
    def one(g, a):
        s = a[0] + g.astype(a.dtype)
        return s[None] if keep_lead else s
    return jax.tree.map(one, grads, local)


def init_local(layout, params, axes):
    """The zero local accumulators of `params` (per device `[1, *shape]`), typed varying over `axes`."""
    zeros = jax.tree.map(lambda p: jnp.zeros((1, *jnp.shape(p)), acc_dtype(p.dtype)), params)
    return _compat.pvary(zeros, axes) if _compat.vma_enabled(axes) else zeros
