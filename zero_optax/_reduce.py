"""Gradient reduction across the data axis: mean, or weighted by each device's sample or token count.

Inside `jax.shard_map` with `check_vma=True` (the default), `jax.grad` of a loss with respect to replicated
parameters already returns the *sum* of the devices' gradients (an invariant value): autodiff inserts the psum.
Gradients typed as varying are per-device and get summed here; invariant ones are taken as already summed, so
nothing is counted twice. To let zero1 reduce-scatter instead of autodiff's all-reduce, differentiate with
respect to `zero_optax.as_local(params, axis_name)`.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from zero_optax import _compat
from zero_optax._errors import ZeroError


class WeightError(ZeroError):
    """A sample/token weight is negative or not a scalar."""


def _raise_negative(negative):
    if negative:
        raise WeightError(
            "zero1: a device passed a negative `weight`. `weight` is this device's sample or token count "
            "(its gradient being a loss sum) and must be >= 0.")


def global_weight(weight, axis_name: str) -> jax.Array:
    """`psum(weight)` in float32, after checking that every device's weight is a non-negative scalar."""
    if isinstance(weight, (numbers.Number, np.ndarray)):
        if np.ndim(weight) != 0:
            raise WeightError(f"`weight` must be a scalar (this device's sample count), got shape {np.shape(weight)}.")
        if weight < 0:
            raise WeightError(f"`weight` must be >= 0 (this device's sample or token count), got {weight}.")
    elif jnp.ndim(weight) != 0:
        raise WeightError(f"`weight` must be a scalar (this device's sample count), got shape {jnp.shape(weight)}.")
    w = jnp.asarray(weight, jnp.float32)
    if not isinstance(weight, (numbers.Number, np.ndarray)):
        # A traced weight is checked on the devices; only a negative one calls back to the host, which raises
        # (the step then fails with this message inside a JaxRuntimeError).
        negative = lax.psum((w < 0).astype(jnp.int32), axis_name) > 0
        lax.cond(negative, lambda: jax.debug.callback(_raise_negative, negative), lambda: None)
    return lax.psum(w, axis_name)


class Denominator(NamedTuple):
    """What the summed gradient is divided by, and whether the step may move anything."""

    value: jax.Array | int  # world size, or the global weight (1 where it is zero)
    ok: jax.Array | None    # None without weights; else psum(weight) > 0


def denominator(weight, axis_name: str, world_size: int) -> Denominator:
    if weight is None:
        return Denominator(world_size, None)
    total = global_weight(weight, axis_name)
    ok = total > 0
    return Denominator(jnp.where(ok, total, 1.0), ok)


def _sum(g: jax.Array, axis_name: str) -> jax.Array:
    if _compat.is_varying(g, axis_name) or not _compat.vma_enabled(axis_name):
        return lax.psum(g, axis_name)
    return g  # already summed by autodiff (invariant)


def mean_gradients(grads: Any, axis_name: str, denom: Denominator, reduce_dtype=None) -> Any:
    """All-reduces `grads` and divides by `denom`, computing in `reduce_dtype` if given; keeps each leaf's dtype."""
    def one(g):
        wide = g.astype(reduce_dtype) if reduce_dtype is not None else g
        return (_sum(wide, axis_name) / jnp.asarray(denom.value, wide.dtype)).astype(g.dtype)
    return jax.tree.map(one, grads)


def scatter_mean(flat: jax.Array, axis_name: str, denom: Denominator, reduce_dtype=None) -> jax.Array:
    """Reduce-scatters a padded 1-D (or `[N, k]`) buffer: this device gets its block of the global mean."""
    wide = flat.astype(reduce_dtype) if reduce_dtype is not None else flat
    n = _compat.axis_size(axis_name)
    if _compat.is_varying(wide, axis_name) or not _compat.vma_enabled(axis_name):
        part = lax.psum_scatter(wide, axis_name, scatter_dimension=0, tiled=True)
    else:  # already summed by autodiff: just take this device's block
        block = wide.shape[0] // n
        part = lax.dynamic_slice_in_dim(wide, lax.axis_index(axis_name) * block, block, axis=0)
    return (part / jnp.asarray(denom.value, part.dtype)).astype(flat.dtype)


def skip_if_empty(ok: jax.Array | None, new: Any, old: Any) -> Any:
    """Selects `old` wherever the global weight was zero (`ok` False); `new` otherwise."""
    if ok is None:
        return new
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


class ReduceGradientsState(NamedTuple):
    """`reduce_gradients` keeps no state."""


def reduce_gradients(axis_name: str, *, reduce_dtype=None) -> optax.GradientTransformationExtraArgs:
    """Reduces each device's local gradients to their global mean, or weighted mean, across `axis_name`.

    Use it before global operations that must see the full reduced gradient, followed by
    `zero1(..., reduce=False)`. Runs inside `jax.shard_map`; its state is empty.

    Without `weight` the result is the mean over devices. With `weight` (this device's sample or token count,
    its gradient being a loss *sum*) it is `psum(grads) / psum(weight)`; where the global weight is zero the
    result is zero.

    Args:
      axis_name: the data-parallel mesh axis.
      reduce_dtype: if given (for example `jnp.float32`), reduce bf16/f16 gradients in this dtype; the result
        keeps each gradient's dtype.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose `update` accepts `weight=`.

    Examples:
      >>> import jax, optax, zero_optax as zo
      >>> tx = optax.chain(zo.reduce_gradients("data"), optax.clip_by_global_norm(1.0),
      ...                  zo.zero1(optax.adamw(1e-3), axis_name="data", reduce=False))
    """
    reduce_dtype = None if reduce_dtype is None else jnp.dtype(reduce_dtype)

    def init_fn(params):
        del params
        return ReduceGradientsState()

    def update_fn(updates, state, params=None, *, weight=None, **extra_args):
        del params, extra_args
        n = _compat.axis_size(axis_name, "reduce_gradients")
        denom = denominator(weight, axis_name, n)
        reduced = mean_gradients(updates, axis_name, denom, reduce_dtype)
        if denom.ok is not None:
            reduced = skip_if_empty(denom.ok, reduced, jax.tree.map(jnp.zeros_like, reduced))
        return reduced, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
