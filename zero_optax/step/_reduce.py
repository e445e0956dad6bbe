"""Gradient reduction across the ZeRO axes: mean, or weighted by each device's sample or token count.

An invariant gradient may be the sum over devices or already the global mean, so zero1 never guesses: reducing
modes take varying (per-device) gradients only, `reduce=False` takes invariant ones as the global mean.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from zero_optax.core import _compat
from zero_optax.core._errors import WeightError, ZeroGradientError
from zero_optax.core._names import leaf_paths
from zero_optax.step import _wire

INVARIANT_HELP = """\
{what} got gradients that are the same on every device of `{axis}` (typed invariant), for example `{path}`.
Such gradients are either the sum over devices (jax.grad of a local loss with respect to replicated parameters)
or already the global mean (jax.grad of a lax.pmean'd loss, lax.pmean, zo.reduce_gradients), and zero1 cannot
tell which. Either
  * differentiate with respect to per-device parameters, so that zero1 reduces each device's own gradient (the
    cheapest path: one reduce-scatter):
        grads = jax.grad(loss_fn)(zo.as_local(params, {local!r}), batch)
  * or, if they already are the global mean, pass reduce=False."""

VARYING_HELP = """\
zero1(reduce=False) takes gradients that are already reduced (the global mean, the same on every device), but
`{path}` differs between the devices of `{axis}` (typed varying). Reduce it first (zo.reduce_gradients({axis!r})
or lax.pmean), or let zero1 reduce it with reduce=True."""


def _raise_negative(negative):
    if negative:
        raise WeightError(
            "zero1: a device passed a negative `weight`. `weight` is this device's sample or token count "
            "(its gradient being a loss sum) and must be >= 0.")


def global_weight(weight, axes) -> jax.Array:
    """`psum(weight)` in float32, after checking that every device's weight is a non-negative scalar."""
    concrete = isinstance(weight, (numbers.Number, np.ndarray))
    if np.ndim(weight) != 0:
        raise WeightError(f"`weight` must be a scalar (this device's sample count), got shape {np.shape(weight)}.")
    if concrete and weight < 0:  # pyright: ignore[reportOperatorIssue]  # (typeshed's Number has no order)
        raise WeightError(f"`weight` must be >= 0 (this device's sample or token count), got {weight}.")
    w = jnp.asarray(weight, jnp.float32)
    wire = _wire.Wire(_compat.as_tuple(axes))
    if not concrete:  # checked on the devices: only a negative weight calls back to the host, which raises
        negative = wire.all_reduce((w < 0).astype(jnp.int32)) > 0
        lax.cond(negative, lambda: jax.debug.callback(_raise_negative, negative), lambda: None)
    return wire.all_reduce(w)


def reduction(layout) -> tuple[tuple[str, ...], int]:
    """The axes a zero1 state's gradients and weights are summed over (replica, then ZeRO axes), and their size."""
    return layout.replica_axes + layout.axes, layout.world_size * layout.replica_count


class Denominator(NamedTuple):
    """What the summed gradient is divided by, and whether the step may move anything."""

    value: jax.Array | int  # world size, or the global weight (1 where it is zero)
    ok: jax.Array | None    # None without weights; else psum(weight) > 0


def denominator(weight, axes, world_size: int) -> Denominator:
    """The world size without `weight`, else the global weight and whether it is positive."""
    if weight is None:
        return Denominator(world_size, None)
    total = global_weight(weight, axes)
    ok = total > 0
    return Denominator(jnp.where(ok, total, 1.0), ok)


def divide(total: jax.Array, denom: Denominator, dtype) -> jax.Array:
    """`total / denom` computed in at least float32 (a token count may exceed float16's 65504), cast to `dtype`."""
    if isinstance(denom.value, int) and denom.value == 1:
        return total.astype(dtype)
    wide = jnp.promote_types(total.dtype, jnp.float32)
    return (total.astype(wide) / jnp.asarray(denom.value, wide)).astype(dtype)


def check_semantics(leaves: Sequence[jax.Array], paths: Sequence[str], zero_axes: Sequence[Sequence[str]],
                    reducing: bool, what: str = "zero1(reduce=True)", replicas: Sequence[str] = ()) -> None:
    """Refuses gradients not varying across their ZeRO and `replicas` axes (reducing) or not invariant (not
    reducing); with `check_vma=False` values carry no such type and are taken as the mode says."""
    replicas = tuple(replicas)
    for g, path, axes in zip(leaves, paths, zero_axes):
        axes = replicas + tuple(axes)
        if not axes or not _compat.vma_enabled(axes):
            continue
        varying = _compat.varying_axes(g)
        if reducing and not set(axes) <= varying:
            axis = next(a for a in axes if a not in varying)
            local = axes if replicas else axis
            raise ZeroGradientError(INVARIANT_HELP.format(what=what, axis=axis, path=path, local=local))
        if not reducing and set(axes) & varying:
            axis = next(a for a in axes if a in varying)
            raise ZeroGradientError(VARYING_HELP.format(axis=axis, path=path))


def skip_if_empty(ok: jax.Array | None, new: Any, old: Any) -> Any:
    """Selects `old` wherever the global weight was zero (`ok` False); `new` otherwise."""
    if ok is None:
        return new
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


class ReduceGradientsState(NamedTuple):
    """`reduce_gradients` keeps no state."""


def reduce_gradients(axis_name: str | Sequence[str], *, reduce_dtype: jax.typing.DTypeLike | None = None
                     ) -> optax.GradientTransformationExtraArgs:
    """Reduces each device's local gradients to their global mean, or weighted mean, across `axis_name`.

    Use it before global operations that must see the full reduced gradient, followed by `zero1(...,
    reduce=False)`; inside `jax.shard_map`. With `weight` (this device's sample or token count, its gradient a loss
    *sum*) the result is `psum(grads) / psum(weight)` (in at least float32), zero where the global weight is zero.

    Args:
      axis_name: the data-parallel mesh axis, or a tuple of axes.
      reduce_dtype: if given (for example `jnp.float32`), sum bf16/f16 gradients in this dtype; the result
        keeps each gradient's dtype.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose `update` accepts `weight=`.

    Raises:
      ZeroGradientError: from `update`, for gradients already the same on every device (a sum, or a mean?).
      WeightError: from `update`, for a `weight` that is no scalar or is negative.

    Examples:
      >>> import jax, optax, zero_optax as zo
      >>> tx = optax.chain(zo.reduce_gradients("data"), optax.clip_by_global_norm(1.0),
      ...                  zo.zero1(optax.adamw(1e-3), axis_name="data", reduce=False))
    """
    reduce_dtype = None if reduce_dtype is None else jnp.dtype(reduce_dtype)
    axes = _compat.as_tuple(axis_name)

    def init_fn(params):
        del params
        return ReduceGradientsState()

    def update_fn(updates, state, params=None, *, weight=None, **extra_args):
        del params, extra_args
        n = _compat.axis_size(axes, "reduce_gradients")
        leaves = jax.tree.leaves(updates)
        check_semantics(leaves, leaf_paths(updates), [axes] * len(leaves), reducing=True, what="zo.reduce_gradients")
        denom = denominator(weight, axes, n)
        wire = _wire.Wire(axes)
        reduced = jax.tree.map(lambda g: divide(wire.all_reduce(g if reduce_dtype is None else g.astype(reduce_dtype)),
                                                denom, g.dtype), updates)
        if denom.ok is not None:
            reduced = skip_if_empty(denom.ok, reduced, jax.tree.map(jnp.zeros_like, reduced))
        return reduced, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
