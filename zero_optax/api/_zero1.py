"""`zero1`: ZeRO stage 1 as an optax transformation."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zero_optax.core import _compat
from zero_optax.core._errors import ZeroError
from zero_optax.step import _engine, _quantize, _wire
from zero_optax.layout import _handle
from zero_optax.layout._config import Config
from zero_optax.api import _arguments, _bound
from zero_optax.layout._layout import Layout
from zero_optax.layout._stored import SHARDED
from zero_optax.layout._state import ZeroState, canonical, find_states

class _NoParameterTrees:
    """What `init` returns for `optax.tree_map_params`'s placeholder parameters: a zero1 state holds no tree shaped
    like the parameters, so `tree_map_params` hands it whole to `transform_non_params`."""

    def __repr__(self) -> str:
        return "<zero1: no parameter-shaped trees>"


NO_PARAMETER_TREES = _NoParameterTrees()


class Zero1:
    """The object behind a zero1 transformation (`tx.init`, `tx.update` are its bound methods; `_handle` finds it)."""

    def __init__(self, cfg: Config, mesh: jax.sharding.Mesh | None):
        self.cfg = cfg
        self.engine = _engine.Engine(cfg)
        self.mesh = mesh
        self.bound = None if mesh is None else _bound.Bound(self, mesh)

    def outside(self) -> bool:
        """Whether a mesh-bound transformation runs outside a `shard_map` binding its axes."""
        return self.bound is not None and not _compat.is_bound(self.cfg.axes)

    def init(self, params) -> ZeroState:
        if _compat.is_params_placeholder(params):
            return NO_PARAMETER_TREES
        params = _compat.pure(params)
        return self.bound.init(params) if self.outside() else self.engine.init(params)

    def update(self, grads, state, params=None, *, weight=None, **extra_args):
        return self._step(grads, state, params, weight, False, extra_args)

    @property
    def gathers_parameters(self) -> bool:
        """Whether `apply_gradients` can gather new parameters (not under accumulation or offload)."""
        return self.cfg.accumulating is None and not self.cfg.offload

    def apply_gradients(self, grads, state, params, *, weight=None, **extra_args):
        """`zero_optax.apply_gradients` for this transformation: new parameters and state."""
        return self._step(grads, state, params, weight, True, extra_args)

    def _step(self, grads, state, params, weight, apply: bool, extra_args: dict):
        grads, params, state = _compat.pure(grads), _compat.pure(params), _compat.pure(state)
        outside = self.outside()
        if isinstance(state, ZeroState):  # store the shared fields that optax.tree.set replaced
            axes = state.layout.axes
            state = (canonical(state, place=lambda x: _compat.reshard(x, NamedSharding(self.mesh, P(axes))))
                     if outside else canonical(state, rows=1, place=lambda x: _compat.pvary(x, axes)))
        if outside:
            return self.bound.update(grads, state, params, weight=weight, apply=apply, **extra_args)
        return self.engine.update(grads, state, params, weight=weight, apply=apply, **extra_args)


def zero1(
    inner: optax.GradientTransformation,
    *,
    axis_name: str | Sequence[str],
    replica_axis: str | Sequence[str] | None = None,
    partition: str = "flat",
    owners: Sequence[int] | None = None,
    reduce: bool | str = True,
    reduce_dtype=None,
    master_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    assume_elementwise: bool = False,
    bucket_bytes: int = _wire.DEFAULT_BUCKET_BYTES,
    accumulate_steps: int = 1,
    accumulate: str = SHARDED,
    offload: bool = False,
    param_specs=None,
    quantize: _quantize.Quantize | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Shards the state of `inner` across the devices of `axis_name`, ZeRO stage 1 style.

    `init` and `update` run inside `jax.shard_map` over `axis_name` (or, with `mesh=`, anywhere). `update` reduces
    each device's local gradients, updates only the state this device owns and all-gathers the result, so every
    device receives the replicated updates `inner` would compute on one device from the reduced gradient.
    `zero_optax.state_specs` gives the state's `PartitionSpec`s (`P(axis_name)` on a 1-D mesh).

    Inside `shard_map`, per-device gradients are typed varying (differentiate with respect to
    `zero_optax.as_local(params, axis_name)`); invariant gradients are refused by a reducing `reduce` and taken as
    the global mean with `reduce=False`. `update(grads, state, params=None, *, weight=None, **extra_args)`: the
    reduced gradient is the mean over devices, or with `weight` (this device's sample or token count, its gradient
    a loss sum) `psum(grads) / psum(weight)` in float32; a step of global weight zero is skipped. Extra arguments
    (`value=` of `optax.contrib.reduce_on_plateau`) must be the same on every device.

    Args:
      inner: the optax transformation to shard.
      axis_name: the data-parallel mesh axis, or a tuple of axes the state is sharded over jointly. Parameters
        sharded over other axes (tensor or expert parallel) keep those shardings.
      replica_axis: data-parallel axes (disjoint from `axis_name`) the state is replicated over (multi-slice or
        multi-node): gradients are reduce-scattered over `axis_name`, each shard all-reduced over `replica_axis`,
        the result gathered over `axis_name` only. The mean is over every device of both. Default: none.
      partition: `"flat"` (default: every device owns `ceil(count / N)` coordinates of every leaf; for elementwise
        optimizers), `"leaf"` (every leaf has one owner that updates it whole: Muon, Adafactor, LAMB, Shampoo) or
        `"auto"` (per leaf, from the inner transformation: elementwise leaves sliced, the others owned).
      owners: `"leaf"` only: one device index per leaf in tree-flatten order; None balances the state bytes.
      reduce: `True`: the default collective (a reduce-scatter, or for owned leaves an all-reduce where padding
        would move more bytes); `"psum"` or `"psum_scatter"` to choose; `False`: the gradients already are the
        global mean (after `zero_optax.reduce_gradients` and a global operation, say).
      reduce_dtype: sum the gradients in this dtype (for example `jnp.float32` for bf16 gradients).
      master_dtype: keep a sharded master copy of the parameters in this dtype: the inner optimizer runs on it,
        devices gather the new parameters in their own dtype, and the updates move `params` onto the rounded
        master copy. `update` then needs `params`.
      mesh: bind the transformation to this mesh, so that `init` and `update` also work outside `shard_map` on
        global arrays, eagerly or under `jax.jit` (Flax's `nnx.Optimizer`, `TrainState`); the gradients are then
        the global mean.
      assume_elementwise: skip the proof that the inner update is elementwise (`"flat"`), for custom kernels the
        analysis cannot see into; a wrong answer is then your responsibility.
      bucket_bytes: sliced leaves travel in buckets of at least this many bytes; `0` sends every leaf alone.
      accumulate_steps: accumulate gradients over this many `update` calls per optimizer step, like
        `optax.MultiSteps`: the last call of a cycle runs the inner update once on the (weighted) mean; the others
        return zero updates.
      accumulate: `"sharded"` (default, ZeRO-2: float32 accumulators sharded like the state) or `"local"` (each
        device sums its own gradients at full size; one reduction per optimizer step).
      offload: keep every stored array in each device's `pinned_host` memory (ZeRO-Offload); `update` streams it
        through the device in chunks of at most `bucket_bytes`.
      param_specs: the parameters' `PartitionSpec`s (your `shard_map`'s in_specs), needed only inside your own
        `shard_map` when an owned leaf is sharded over a tensor-parallel axis.
      quantize: `zo.Quantize(...)`: send the parameter all-gather (needs `master_dtype`) and the gradient
        reduce-scatters as int8 blocks (ZeRO++). Default None: every collective exact.

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
    cfg = _arguments.config(inner, mesh, dict(
        axis_name=axis_name, replica_axis=replica_axis, partition=partition, owners=owners, reduce=reduce,
        reduce_dtype=reduce_dtype, master_dtype=master_dtype, assume_elementwise=assume_elementwise,
        bucket_bytes=bucket_bytes, accumulate_steps=accumulate_steps, accumulate=accumulate, offload=offload,
        param_specs=param_specs, quantize=quantize))
    z = Zero1(cfg, mesh)
    tx = optax.GradientTransformationExtraArgs(z.init, z.update)
    _handle.record(tx.init, z)
    return tx


def apply_gradients(tx: optax.GradientTransformation, grads, opt_state, params, *, weight=None, **extra_args):
    """One optimizer step: the new parameters and state, what `tx.update` followed by `optax.apply_updates` gives.

    For a zero1 transformation, each device adds the updates of the coordinates it owns to its own slice of the
    parameters, and the devices all-gather the *new parameters* instead of the updates (as ZeRO does): the same
    values without a full-size `optax.apply_updates` pass. Under `accumulate_steps > 1` or `offload=True`, and for
    any other transformation (a chain holding a zero1, plain optax), it runs `tx.update` and `optax.apply_updates`.

    Args:
      tx: a transformation, typically `zo.zero1(...)`.
      grads: the gradients, as for `tx.update`.
      opt_state: `tx`'s state.
      params: the parameters (required).
      weight: as for zero1's `update` (this device's sample or token count); not passed when None.
      **extra_args: passed to `tx.update` (`value=` for `optax.contrib.reduce_on_plateau`).

    Returns:
      `(new_params, new_opt_state)`.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, zero_optax as zo
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = zo.zero1(optax.sgd(0.5), axis_name="data", mesh=mesh)
      >>> params = {"w": jnp.ones(3)}
      >>> params, state = zo.apply_gradients(tx, {"w": jnp.ones(3)}, tx.init(params), params)
      >>> params["w"].tolist()
      [0.5, 0.5, 0.5]
    """
    if params is None:
        raise ZeroError("zo.apply_gradients needs the parameters: it returns the new ones.")
    zero = _handle.find(tx)
    if zero is not None and zero.gathers_parameters:
        return zero.apply_gradients(grads, opt_state, params, weight=weight, **extra_args)
    kwargs = dict(extra_args) if weight is None else {**extra_args, "weight": weight}
    updates, opt_state = tx.update(grads, opt_state, params, **kwargs)
    return optax.apply_updates(params, updates), opt_state


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


def as_local(params, axis_name: str | Sequence[str]):
    """Marks replicated parameters as per-device inside `shard_map`, so `jax.grad` returns local gradients.

    Inside `jax.shard_map` (with `check_vma=True`, the default), autodiff already all-reduces the gradient with
    respect to a replicated parameter. Differentiating with respect to `as_local(params)` instead leaves each device
    its own gradient, which zero1 then reduce-scatters, moving half the bytes.

    Examples:
      >>> # inside the shard_map'ed step:
      >>> # grads = jax.grad(loss_fn)(zo.as_local(params, "data"), batch)
      >>> # updates, opt_state = tx.update(grads, opt_state, params)
    """
    _compat.axis_size(axis_name, "as_local")
    return _compat.pvary(params, axis_name)
