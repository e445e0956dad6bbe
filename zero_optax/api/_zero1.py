"""`zero1`: ZeRO stage 1 as an optax transformation; its arguments are checked once, into a `Config` (`_config`)."""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zero_optax.api import _bound
from zero_optax.core import _compat
from zero_optax.core._errors import ZeroError, ZeroStructureError
from zero_optax.layout import _handle, _keys, _placement
from zero_optax.layout._config import Config
from zero_optax.layout._layout import Layout
from zero_optax.layout._specs import specs_of
from zero_optax.layout._state import ZeroState, canonical, find_states
from zero_optax.layout._stored import LEAF, PARTITIONS, SHARDED
from zero_optax.step import _accumulate, _engine, _offload, _quantize, _wire


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

    def outside(self) -> _bound.Bound | None:
        """The `Bound` that runs a mesh-bound transformation outside a `shard_map` binding its axes; None inside one
        or without a mesh."""
        return self.bound if self.bound is not None and not _compat.is_bound(self.cfg.axes) else None

    def init(self, params: optax.Params) -> ZeroState | _NoParameterTrees:
        """The state for `params`: arrays, Python floats, None leaves (skipped, as optax skips them) or, for a
        mesh-bound zero1 outside `shard_map`, `jax.ShapeDtypeStruct`s (the abstract state, `Bound.init`)."""
        if _compat.is_params_placeholder(params):
            return NO_PARAMETER_TREES
        boxed = _compat.has_variables(params)
        params = _compat.as_arrays(_compat.pure(params), "zero1's init")
        bound = self.outside()
        if bound is None:
            _refuse_structs(params, self.mesh is not None)
            return self.engine.init(params)
        state = bound.init(params)
        # (Flax's Variables in, Variables out: `nnx.Optimizer` keeps their metadata, so code that derives the
        # state's shardings from the annotations, as trainers built on Flax do, finds the layout's)
        return _compat.annotated(state, specs_of(state), bound.mesh) if boxed else state

    def update(self, grads, state, params=None, *, weight=None, **extra_args):
        return self.step(grads, state, params, weight, False, extra_args)

    def step(self, grads, state, params, weight, apply: bool, extra_args: dict):
        """`update`, or with `apply` (`zero_optax.apply_gradients`) the new parameters, and the new state."""
        _engine.check_extra_values(extra_args)
        grads, params, state = _compat.pure(grads), _compat.pure(params), _compat.pure(state)
        grads, params = _compat.as_arrays(grads, "zero1's update"), _compat.as_arrays(params, "zero1's update")
        outside = self.outside()
        if outside is None and isinstance(state, ZeroState) and (misplaced := _placement.misplaced_in_body(state)):
            raise ZeroStructureError(misplaced)
        if isinstance(state, ZeroState):  # store the shared fields that optax.tree.set replaced
            axes = state.layout.axes
            state = (canonical(state, place=lambda x: _compat.reshard(x, NamedSharding(outside.mesh, P(axes))))
                     if outside is not None else canonical(state, rows=1, place=lambda x: _compat.pvary(x, axes)))
        if outside is not None:
            return outside.update(grads, state, params, weight=weight, apply=apply, **extra_args)
        return self.engine.update(grads, state, params, weight=weight, apply=apply, **extra_args)


def _refuse_structs(params: Any, bound: bool) -> None:
    """Refuses `jax.ShapeDtypeStruct` parameters where `init` builds the state from arrays: inside `shard_map`, or
    for a zero1 bound to no mesh (`bound`: it has one)."""
    found = [path for path, x in jax.tree_util.tree_flatten_with_path(params)[0] if _compat.is_struct(x)]
    if not found:
        return
    where = f"at {jax.tree_util.keystr(found[0])}" if found[0] else "(the parameters)"
    if bound:
        problem, fix = "inside shard_map, where it builds", "Call the mesh-bound init outside shard_map, which gives"
    else:
        problem = "but zero1 bound to no mesh builds"
        fix = "Bind zero1 to a mesh (zo.zero1(..., mesh=mesh)), whose init gives"
    raise ZeroStructureError(
        f"zero1's init got a jax.ShapeDtypeStruct {where}, {problem} the state from arrays. {fix} the abstract "
        "state for it, or trace init abstractly inside a shard_map: jax.eval_shape(jax.shard_map(tx.init, "
        "mesh=mesh, in_specs=P(), out_specs=zo.state_specs(tx, params, mesh=mesh)), params).")


def zero1(
    inner: optax.GradientTransformation,
    *,
    axis_name: str | Sequence[str],
    replica_axis: str | Sequence[str] | None = None,
    partition: str = "flat",
    owners: Sequence[int] | None = None,
    reduce: bool | str = True,
    reduce_dtype: jax.typing.DTypeLike | None = None,
    master_dtype: jax.typing.DTypeLike | None = None,
    mesh: jax.sharding.Mesh | None = None,
    assume_elementwise: bool = False,
    bucket_bytes: int = _wire.DEFAULT_BUCKET_BYTES,
    accumulate_steps: int = 1,
    accumulate: str = SHARDED,
    offload: bool = False,
    param_specs: Any = None,
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
        the global mean. There `init` of `jax.ShapeDtypeStruct` leaves gives the abstract state, whose leaves are
        `jax.ShapeDtypeStruct` instances with the shardings of the real one (a restore target for Orbax).
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
    arguments = types.SimpleNamespace(
        inner=inner, axis_name=axis_name, replica_axis=replica_axis, partition=partition, owners=owners,
        reduce=reduce, reduce_dtype=reduce_dtype, master_dtype=master_dtype, mesh=mesh,
        assume_elementwise=assume_elementwise, bucket_bytes=bucket_bytes, accumulate_steps=accumulate_steps,
        accumulate=accumulate, offload=offload, param_specs=param_specs, quantize=quantize)
    z = Zero1(_config(arguments), mesh)
    # (optax types the update of a GradientTransformationExtraArgs as taking no extra arguments, and the state as
    # arrays: an init may return `NO_PARAMETER_TREES`)
    tx = optax.GradientTransformationExtraArgs(z.init, z.update)  # pyright: ignore[reportArgumentType]
    _handle.record(tx.init, z)
    return tx


def apply_gradients(tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any, *,
                    weight: jax.typing.ArrayLike | None = None, **extra_args: Any) -> tuple[Any, Any]:
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
    if zero is not None and zero.cfg.accumulating is None and not zero.cfg.offload:
        return zero.step(grads, opt_state, params, weight, True, extra_args)
    kwargs = dict(extra_args) if weight is None else {**extra_args, "weight": weight}
    updates, opt_state = tx.update(grads, opt_state, params, **kwargs)
    return optax.apply_updates(params, updates), opt_state


def describe(state: Any) -> Layout:
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


def as_local(params: Any, axis_name: str | Sequence[str]) -> Any:
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


_REDUCE_CHOICES = (True, False, "psum", "psum_scatter")


def _config(o: types.SimpleNamespace) -> Config:
    """zero1's arguments (`o`) as a `Config`, each checked: every refusal of a bad argument (a `ZeroError`) is here."""
    if o.partition not in PARTITIONS:
        raise ZeroError(f"`partition` must be \"flat\", \"leaf\" or \"auto\", got {o.partition!r}.")
    if o.owners is not None and o.partition != LEAF:
        raise ZeroError("`owners` applies to partition=\"leaf\" only; the flat partition splits every leaf over all "
                        "devices and \"auto\" balances the leaves it gives an owner.")
    if o.reduce not in _REDUCE_CHOICES or isinstance(o.reduce, int) and not isinstance(o.reduce, bool):
        raise ZeroError(f"`reduce` must be True, False, \"psum\" or \"psum_scatter\", got {o.reduce!r}.")
    if o.mesh is not None and not isinstance(o.mesh, jax.sharding.Mesh):
        raise ZeroError(f"`mesh` must be a jax.sharding.Mesh (jax.make_mesh), got {type(o.mesh).__name__}.")
    axes = _axis_names(o.axis_name, "axis_name", "the name of the data mesh axis", o.mesh)
    replicas = _replica_axes(o.replica_axis, axes, o.mesh)
    if o.assume_elementwise and o.partition != "flat":
        raise ZeroError("`assume_elementwise=True` applies to partition=\"flat\": with \"leaf\" whole tensors need "
                        "no proof, and \"auto\" gives leaves the analysis cannot prove elementwise an owner.")
    if isinstance(o.bucket_bytes, bool) or not isinstance(o.bucket_bytes, (int, np.integer)) or o.bucket_bytes < 0:
        raise ZeroError(f"`bucket_bytes` must be an int >= 0, got {o.bucket_bytes!r}.")
    _accumulate.check_args(o.accumulate_steps, o.accumulate)
    _check_quantize(o.quantize, o.reduce, o.master_dtype, axes + replicas)
    if not isinstance(o.offload, (bool, np.bool_)):
        raise ZeroError(f"`offload` must be True or False, got {o.offload!r}.")
    if o.offload:
        _offload.check_devices(o.mesh.devices.flat if o.mesh is not None else jax.devices())
    for name, dtype in (("reduce_dtype", o.reduce_dtype), ("master_dtype", o.master_dtype)):
        if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
            raise ZeroError(f"`{name}` must be a floating dtype (for example jnp.float32), got {dtype!r}.")
    typed = optax.with_extra_args_support(o.inner)
    inner, typed_init = _keys.as_data(typed), typed.init
    accumulating = None
    if o.accumulate_steps > 1:
        accumulating = _accumulate.Accumulating(inner, int(o.accumulate_steps), o.accumulate)
        inner = accumulating.transformation("final")
        typed_init = _accumulate.Accumulating(typed, int(o.accumulate_steps), o.accumulate).init
    return Config(
        inner=inner,
        axis_name=o.axis_name if isinstance(o.axis_name, str) else axes,
        partition=o.partition,
        owners=None if o.owners is None else tuple(o.owners),
        reduce="default" if o.reduce is True else None if o.reduce is False else o.reduce,
        reduce_dtype=None if o.reduce_dtype is None else jnp.dtype(o.reduce_dtype),
        master_dtype=None if o.master_dtype is None else jnp.dtype(o.master_dtype),
        assume_elementwise=bool(o.assume_elementwise),
        bucket_bytes=int(o.bucket_bytes),
        accumulating=accumulating,
        offload=bool(o.offload),
        typed_init=typed_init,
        param_specs=o.param_specs,
        replica_axes=replicas,
        quantize=o.quantize,
    )


def _axis_names(value, name: str, what: str, mesh) -> tuple[str, ...]:
    """`value` (zero1's argument `name`; `what` says what a single name is) as distinct axis names of `mesh`."""
    axes = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, Sequence) else ()
    if not axes or not all(isinstance(a, str) and a for a in axes) or len(set(axes)) != len(axes):
        raise ZeroError(f"`{name}` must be {what} or a tuple of distinct axis names, got {value!r}.")
    missing = [] if mesh is None else [a for a in axes if a not in mesh.axis_names]
    if mesh is not None and missing:
        raise ZeroError(f"`mesh` has axes {mesh.axis_names}, but `{name}` names {missing}.")
    return axes


def _check_quantize(quantize, reduce, master_dtype, axes: tuple[str, ...]) -> None:
    """Refuses a `quantize` that is no `zo.Quantize` or does not fit the other arguments."""
    if quantize is None:
        return
    if not isinstance(quantize, _quantize.Quantize):
        raise ZeroError(f"`quantize` must be None or zo.Quantize(...), got {type(quantize).__name__}.")
    if quantize.axes is not None:
        unknown = [a for a in quantize.axes if a not in axes]
        if unknown:
            raise ZeroError(f"Quantize(axes=...) names {unknown}, but zero1 communicates over {axes} "
                            "(`axis_name` and `replica_axis`).")
    if quantize.params is not None and master_dtype is None:
        raise ZeroError(
            "Quantize(params=\"int8\") sends the new parameters as int8 blocks, so each device's parameters become "
            "the block-wise rounding of an exact master copy; it needs one: zero1(..., master_dtype=jnp.float32). "
            "Without it the rounding error would accumulate step after step.")
    if quantize.grads is not None and reduce is not True and reduce != "psum_scatter":
        raise ZeroError(
            f"Quantize(grads=\"int8\") quantizes the reduce-scatter zero1 reduces gradients with, but "
            f"reduce={reduce!r} "
            "reduces none (False: the gradients are already the mean) or all-reduces them (\"psum\"). Use "
            "reduce=True, or drop grads=.")


def _replica_axes(replica_axis, axes: tuple[str, ...], mesh) -> tuple[str, ...]:
    """`replica_axis` as a tuple of distinct axis names (empty for None), disjoint from `axes`, on `mesh`."""
    if replica_axis is None:
        return ()
    replicas = _axis_names(replica_axis, "replica_axis", "None, the name of a mesh axis", mesh)
    shared = [a for a in replicas if a in axes]
    if shared:
        raise ZeroError(f"`replica_axis` and `axis_name` both name {shared}: the state is sharded over `axis_name` "
                        "and replicated over `replica_axis`, so an axis can be one or the other. To shard over "
                        f"both, pass axis_name={tuple(replicas) + axes!r} and no replica_axis.")
    return replicas
