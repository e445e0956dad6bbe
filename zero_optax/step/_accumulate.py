"""Gradient accumulation inside zero1: k `update` calls per optimizer step, one inner update, one all-gather.

A wrapper around the inner transformation (`Accumulating`, like `optax.MultiSteps`), so its accumulators are
inner-state histories the layout shards like any other (`"sharded"`, ZeRO-2); `"local"` keeps full-size per-device
sums in `ZeroState.local` instead. A cycle of total weight zero is skipped.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zero_optax.core import _compat
from zero_optax.core._errors import ZeroError
from zero_optax.layout import _inner_state
from zero_optax.layout._state import shared_arrays
from zero_optax.layout._stored import ACCUMULATE_MODES, MICRO_STEP_PATH, SHARDED, WEIGHT_SUM_PATH
from zero_optax.step import _reduce


class AccumulateState(NamedTuple):
    """The state of `Accumulating`."""

    inner: Any
    acc: Any  # sharded: float32 sums of this cycle's gradients, like the parameters; local: `()` (`ZeroState.local`)
    micro_step: jax.Array  # int32: the calls of this cycle so far (0 at a cycle boundary)
    weight_sum: jax.Array  # float32: the global weight of this cycle's calls so far


def acc_dtype(dtype) -> np.dtype:
    """Accumulators sum in float32 (float64 stays float64)."""
    return np.dtype(jnp.promote_types(dtype, jnp.float32))


def _is_masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def _map_present(fn, tree):
    """`fn(index, leaf)` on every present leaf of a masked parameter view (`optax.MaskedNode` kept)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_masked)
    return jax.tree.unflatten(treedef, [x if _is_masked(x) else fn(i, x) for i, x in enumerate(leaves)])


@dataclasses.dataclass(frozen=True, eq=False)
class Accumulating:
    """The inner transformation wrapped for `accumulate_steps=k`: a cycle's `"final"` call, or an `"add"`."""

    inner: optax.GradientTransformationExtraArgs
    steps: int
    mode: str

    def init(self, params) -> AccumulateState:
        acc = (jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), acc_dtype(p.dtype)), params)
               if self.mode == SHARDED else ())
        return AccumulateState(self.inner.init(params), acc, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32))

    def _sums(self, grads, state: AccumulateState):
        if self.mode != SHARDED:
            return jax.tree.map(lambda g: g.astype(acc_dtype(g.dtype)), grads)
        return jax.tree.map(lambda g, a: a + g.astype(a.dtype), grads, state.acc)

    def update(self, grads, state: AccumulateState, params=None, *, accumulate_weight, cast=None, **extra):
        total = state.weight_sum + accumulate_weight
        ok = total > 0
        denom = jnp.where(ok, total, 1.0)

        def mean(i, s):
            return (s / denom.astype(s.dtype)).astype(s.dtype if cast is None else cast[i])
        mean_grads = _map_present(mean, self._sums(grads, state))
        updates, new_inner = self.inner.update(mean_grads, state.inner, params, **extra)
        new_inner = _reduce.skip_if_empty(ok, new_inner, state.inner)
        updates = _reduce.skip_if_empty(ok, updates, jax.tree.map(jnp.zeros_like, updates))
        return updates, AccumulateState(new_inner, *jax.tree.map(jnp.zeros_like, state[1:]))  # a new cycle

    def add(self, grads, state: AccumulateState, params=None, *, accumulate_weight, **extra):
        acc = self._sums(grads, state) if self.mode == SHARDED else state.acc
        return grads, AccumulateState(state.inner, acc, state.micro_step + 1, state.weight_sum + accumulate_weight)

    def transformation(self, which: str, cast: tuple[str, ...] | None = None) -> optax.GradientTransformationExtraArgs:
        # (optax types the update of a GradientTransformationExtraArgs as taking no extra arguments)
        if which != "final":
            return optax.GradientTransformationExtraArgs(self.init, self.add)  # pyright: ignore[reportArgumentType]
        update = self.update if cast is None else functools.partial(self.update, cast=cast)
        return optax.GradientTransformationExtraArgs(self.init, update)  # pyright: ignore[reportArgumentType]


@dataclasses.dataclass(frozen=True)
class Phase:
    """One side of an accumulating call; equal phases run the same program."""

    inner: optax.GradientTransformationExtraArgs = dataclasses.field(compare=False)
    step: bool  # an optimizer step: moves the master copies, gathers the updates
    grad_dtypes: dict[int, str] = dataclasses.field(compare=False)  # leaf -> the dtype its gradient sums are in
    cast: tuple[str, ...] = ()  # the final side: per leaf, the dtype the inner update sees its mean gradient in

    denom = _reduce.Denominator(1, None)  # sums: `Accumulating.update` divides by the cycle's weight


def phases(acc: Accumulating, g_leaves: list, inner_dtype) -> tuple[Phase, Phase]:
    """The final and the micro-step phase of a call with gradients `g_leaves` (`inner_dtype`: `Config`'s)."""
    sums = {i: acc_dtype(g.dtype).name for i, g in enumerate(g_leaves)}
    cast = tuple(np.dtype(inner_dtype(g.dtype)).name for g in g_leaves)
    return Phase(acc.transformation("final", cast), True, sums, cast), Phase(acc.transformation("add"), False, sums)


def check_args(accumulate_steps, accumulate) -> None:
    if isinstance(accumulate_steps, bool) or not isinstance(accumulate_steps, (int, np.integer)) or \
            accumulate_steps < 1:
        raise ZeroError(f"`accumulate_steps` must be an int >= 1 (the number of update calls, one per "
                        f"micro-batch, per optimizer step), got {accumulate_steps!r}.")
    if accumulate not in ACCUMULATE_MODES:
        raise ZeroError(f"`accumulate` must be \"sharded\" (accumulators sharded like the state, ZeRO-2) or "
                        f"\"local\" (each device keeps full-size local sums), got {accumulate!r}.")


def _shared_entry(layout, path: str) -> int:
    """The index of the shared entry at `path` (`MICRO_STEP_PATH` or `WEIGHT_SUM_PATH`)."""
    return next(j for j, e in enumerate(layout.entries) if e.leaf is None and e.path == path)


def position(layout, state) -> jax.Array:
    """This device's copy of the cycle position: the number of calls of this cycle so far."""
    return shared_arrays(state)[_shared_entry(layout, MICRO_STEP_PATH)][0]


def call_weight(reducing: bool, weight, layout) -> jax.Array:
    """The global weight of one call, in float32: its share of the cycle's mean."""
    if not reducing:
        return jnp.ones((), jnp.float32)  # each call's gradient is already a mean
    axes, devices = _reduce.reduction(layout)
    if weight is None:
        return jnp.asarray(devices, jnp.float32)  # each device's gradient is a mean over its batch
    return _reduce.global_weight(weight, axes)


def take_local(g_leaves: list, state) -> tuple[list, Any]:
    """The final call of `accumulate="local"`: the gradients plus this device's sums (float32), and `state` with
    the sums back at zero."""
    sums = [a[0] + g.astype(a.dtype) for g, a in zip(g_leaves, jax.tree.leaves(state.local))]
    return sums, dataclasses.replace(state, local=jax.tree.map(jnp.zeros_like, state.local))


def add_local(layout, state, g_leaves: list, w: jax.Array):
    """A micro-step of `accumulate="local"`: the gradients added to this device's sums, no collective."""
    step, total = _shared_entry(layout, MICRO_STEP_PATH), _shared_entry(layout, WEIGHT_SUM_PATH)
    inner = state._inner._replace(shared=_inner_state.tree(layout, [
        x + 1 if j == step else x + w.astype(x.dtype) if j == total else x
        for j, x in shared_arrays(state).items()]))
    sums = [(a[0] + g.astype(a.dtype))[None] for g, a in zip(g_leaves, jax.tree.leaves(state.local))]
    local = jax.tree.unflatten(jax.tree.structure(state.local), sums)
    return dataclasses.replace(state, _inner=inner, local=local)


def init_local(layout, params, axes):
    """The zero local accumulators of `params` (per device `[1, *shape]`), typed varying over `axes`."""
    return _compat.pvary(jax.tree.map(lambda p: jnp.zeros((1, *jnp.shape(p)), acc_dtype(p.dtype)), params), axes)
