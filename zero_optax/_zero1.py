"""`zero1`: ZeRO stage 1 as an optax transformation."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from zero_optax import _compat
from zero_optax._errors import ZeroError
from zero_optax._flat import flat_zero1
from zero_optax._layout import FLAT, LEAF, Layout
from zero_optax._leaf import leaf_zero1
from zero_optax._state import ZeroFlatState, ZeroLeafState

# Chosen by benchmarks/run.py (see benchmarks/RESULTS.md): reduce-scatter moves half the gradient traffic of an
# all-reduce and was no slower on any mesh we measured.
DEFAULT_REDUCE = "psum_scatter"
_REDUCE_CHOICES = (True, False, "psum", "psum_scatter")


def zero1(
    inner: optax.GradientTransformation,
    *,
    axis_name: str,
    partition: str = FLAT,
    owners: Sequence[int] | None = None,
    reduce: bool | str = True,
    reduce_dtype=None,
) -> optax.GradientTransformationExtraArgs:
    """Shards the state of `inner` across the devices of `axis_name`, ZeRO stage 1 style.

    `init` and `update` run inside `jax.shard_map` over `axis_name`. `update` reduces each device's local
    gradients, updates only the state this device owns, and all-gathers the updates, so every device receives
    the same replicated updates (`P()`) that `inner` would compute on one device from the reduced gradient.
    Every leaf of the state is sharded along its leading axis, so `P(axis_name)` is the spec of the whole state.

    Partitions:
      * `"flat"`: every device owns `ceil(count / N)` consecutive coordinates of every flattened leaf. Exact
        for elementwise optimizers (Adam, AdamW, Lion, SGD, RMSProp, Adagrad, AdaBelief, schedules,
        `inject_hyperparams`, `MultiSteps`); transformations that couple coordinates are refused.
      * `"leaf"`: every leaf has one owner that keeps its state and updates it as a whole tensor (Muon,
        Adafactor, LAMB, Shampoo). Per-device state is at least the largest leaf's state.

    `update(grads, state, params=None, *, weight=None, **extra_args)`: without `weight` the reduced gradient is
    the mean over devices; with `weight` (this device's sample or token count, its gradient being a loss sum)
    it is `psum(grads) / psum(weight)`. A step whose global weight is zero is skipped: the updates are zero and
    the state, step counts included, is returned unchanged. Gradients that `jax.grad` already summed across the
    axis (invariant values, which is what differentiating with respect to replicated parameters inside
    `shard_map` gives) are not summed again; see `zero_optax.as_local` to get per-device gradients instead.

    Args:
      inner: the optax transformation to shard.
      axis_name: the data-parallel mesh axis.
      partition: `"flat"` (default) or `"leaf"`.
      owners: leaf partition only: one device index per leaf in tree-flatten order; None balances the
        optimizer-state bytes (`zero_optax.balanced_owners`).
      reduce: `True` reduces the gradients with the default collective: a reduce-scatter (`"psum_scatter"`)
        for the flat partition; for the leaf partition a reduce-scatter of owner-packed buffers unless padding to
        the largest owner's share would move more bytes than an all-reduce. `"psum"` all-reduces, `"psum_scatter"`
        reduce-scatters; `False` takes gradients that are already reduced and replicated, for
        example by `zero_optax.reduce_gradients` followed by a global operation.
      reduce_dtype: reduce bf16/f16 gradients in this dtype (for example `jnp.float32`); the inner optimizer
        still sees each gradient in its own dtype.

    Returns:
      An `optax.GradientTransformationExtraArgs`.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, zero_optax as zo
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = zo.zero1(optax.adam(1e-2), axis_name="data")
      >>> params = {"w": jnp.ones((3, 2))}
      >>> state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))(params)
      >>> zo.describe(state).slots
      (6,)
    """
    if partition not in (FLAT, LEAF):
        raise ZeroError(f"`partition` must be \"flat\" or \"leaf\", got {partition!r}.")
    if owners is not None and partition != LEAF:
        raise ZeroError("`owners` applies to partition=\"leaf\" only; the flat partition splits every leaf over all "
                        "devices.")
    if reduce not in _REDUCE_CHOICES or isinstance(reduce, int) and not isinstance(reduce, bool):
        raise ZeroError(f"`reduce` must be True, False, \"psum\" or \"psum_scatter\", got {reduce!r}.")
    if not isinstance(axis_name, str) or not axis_name:
        raise ZeroError(f"`axis_name` must be the name of the data mesh axis, got {axis_name!r}.")
    mode = (DEFAULT_REDUCE if partition == FLAT else "auto") if reduce is True else (None if reduce is False else reduce)
    dtype = None if reduce_dtype is None else jnp.dtype(reduce_dtype)
    inner = optax.with_extra_args_support(inner)
    if partition == FLAT:
        return flat_zero1(inner, axis_name, mode, dtype)
    return leaf_zero1(inner, axis_name, owners, mode, dtype)


def describe(state) -> Layout:
    """The read-only layout of a zero1 state: world size, axis, partition, leaves, slots, owners, bytes.

    Works on concrete states, on `jax.eval_shape` results, and on a zero1 state nested in a larger optax state
    (the first one found).

    Examples:
      >>> import jax, jax.numpy as jnp, optax, zero_optax as zo
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = zo.zero1(optax.adam(1e-2), axis_name="data", partition="leaf")
      >>> state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))({"w": jnp.ones(3)})
      >>> zo.describe(state).owners
      (0,)
    """
    found = find_states(state)
    if not found:
        raise ZeroError(f"describe expects a state returned by a zero1 transformation's init, got "
                        f"{type(state).__name__} with no zero1 state inside.")
    return found[0].layout


def find_states(tree) -> list[ZeroFlatState | ZeroLeafState]:
    """Every zero1 state inside `tree`, in tree order."""
    is_zero = lambda x: isinstance(x, (ZeroFlatState, ZeroLeafState))
    return [x for x in jax.tree.leaves(tree, is_leaf=is_zero) if is_zero(x)]


def as_local(params, axis_name: str):
    """Marks replicated parameters as per-device inside `shard_map`, so `jax.grad` returns local gradients.

    Inside `jax.shard_map` (with `check_vma=True`, the default), the gradient with respect to a replicated
    parameter is already summed over the axis by autodiff, an all-reduce that costs 2x the gradient bytes on the
    wire. Differentiating with respect to `as_local(params)` instead leaves each device its own gradient, which
    zero1 then reduce-scatters (1x), so a ZeRO-1 step moves no more bytes than plain data parallelism.

    Examples:
      >>> # inside the shard_map'ed step:
      >>> # grads = jax.grad(loss_fn)(zo.as_local(params, "data"), batch)
    """
    _compat.axis_size(axis_name, "as_local")
    return _compat.pvary(params, axis_name)
