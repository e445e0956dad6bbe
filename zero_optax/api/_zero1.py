"""`zero1`: ZeRO stage 1 as an optax transformation."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zero_optax.core import _compat
from zero_optax.core._errors import ZeroError
from zero_optax.step import (
    _accumulate,
    _engine,
    _offload,
    _quantize,
    _wire,
)
from zero_optax.layout import _handle, _keys, _planner
from zero_optax.api import _bound
from zero_optax.layout._layout import LEAF, PARTITIONS, SHARDED, Layout
from zero_optax.layout._state import ZeroState, canonical, find_states

_REDUCE_CHOICES = (True, False, "psum", "psum_scatter")


class _NoParameterTrees:
    """What `init` returns for `optax.tree_map_params`'s placeholder parameters: a zero1 state holds no tree
    shaped like the parameters (their state is stored sliced and packed; its inner state's per-parameter fields
    are `Sharded` markers without values), so `tree_map_params` maps its function over nothing and hands the
    state whole to `transform_non_params`, if given. `zo.state_specs` gives a zero1 state's shardings."""

    def __repr__(self) -> str:
        return "<zero1: no parameter-shaped trees>"


NO_PARAMETER_TREES = _NoParameterTrees()


class Zero1:
    """The object behind a zero1 transformation: `tx.init` and `tx.update` are its bound methods.

    Functions that need zero1's own view of a transformation (`zero_optax.scatter_state`, `zero_optax.state_specs`)
    find it with `zero1_of(tx, ...)` (or `find_zero1(tx)`), which `zero1` records it for.
    """

    def __init__(self, cfg: _planner.Config, mesh: jax.sharding.Mesh | None):
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
        """Whether `apply_gradients` can gather new parameters: not under accumulation or offload, whose steps
        gather the updates (`zero_optax.apply_gradients` then applies them)."""
        return self.cfg.accumulating is None and not self.cfg.offload

    def apply_gradients(self, grads, state, params, *, weight=None, **extra_args):
        """`zero_optax.apply_gradients` for this transformation (`gathers_parameters`): new parameters and state."""
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

    `init` and `update` run inside `jax.shard_map` over `axis_name` (or, with `mesh=`, anywhere: see below).
    `update` reduces each device's local gradients, updates only the state this device owns, and all-gathers the
    result, so every device receives the same replicated updates (`P()`) that `inner` would compute on one device
    from the reduced gradient. On a 1-D mesh every leaf of the state is sharded along its leading axis, so
    `P(axis_name)` is the spec of the whole state; on any mesh `zero_optax.state_specs` gives the specs.

    Partitions:
      * `"flat"`: every device owns `ceil(count / N)` consecutive coordinates of every flattened leaf. Exact
        for elementwise optimizers (Adam, AdamW, Lion, SGD, RMSProp, Adagrad, AdaBelief, schedules,
        `inject_hyperparams`, `MultiSteps`); transformations that couple coordinates are refused.
      * `"leaf"`: every leaf has one owner that keeps its state and updates it as a whole tensor (Muon,
        Adafactor, LAMB, Shampoo). Per-device state is at least the largest leaf's state.
      * `"auto"`: per leaf, from the inner transformation itself: leaves it updates elementwise are sliced, the
        others get one owner (Muon's matrices owned, the embedding and vectors of its AdamW branch sliced).

    Gradients. Inside `shard_map`, zero1 tells per-device gradients (typed varying: differentiate with respect to
    `zero_optax.as_local(params, axis_name)`) from gradients that are the same on every device (typed
    invariant), and never guesses what an invariant gradient means (a sum, or already the mean): with a reducing
    `reduce` it refuses them, with `reduce=False` it takes them as the global mean. `update(grads, state,
    params=None, *, weight=None, **extra_args)`: without `weight` the reduced gradient is the mean over devices;
    with `weight` (this device's sample or token count, its gradient being a loss sum) it is
    `psum(grads) / psum(weight)`, divided in float32. A step whose global weight is zero is skipped: the updates
    are zero and the state, step counts included, is returned unchanged. Extra arguments (`value=` for
    `optax.contrib.reduce_on_plateau`) must be the same on every device.

    Args:
      inner: the optax transformation to shard.
      axis_name: the data-parallel mesh axis, or a tuple of axes (`("replica", "data")`) the state is sharded
        over jointly. Parameters sharded over other mesh axes (tensor or expert parallel) keep those shardings;
        each device's block is sharded over the data axes.
      replica_axis: data-parallel mesh axes (a name or a tuple, disjoint from `axis_name`) the state is
        *replicated* over (multi-slice and multi-node training: `axis_name` inside a slice or node, the fast
        network; `replica_axis` across them, the slow one). Inside `shard_map` gradients are per-device over
        both (`zo.as_local(params, ("replica", "data"))`): each step reduce-scatters them over `axis_name`,
        all-reduces only this device's shard over `replica_axis` (1/N of the bytes), updates the shard (the same
        on every replica) and all-gathers over `axis_name` only. The mean (or with `weight=` the weighted mean)
        is over every device of both. Default None: no replicas.
      partition: `"flat"` (default), `"leaf"` or `"auto"`.
      owners: leaf partition only: one device index per leaf in tree-flatten order; None balances the
        optimizer-state bytes (`zero_optax.balanced_owners`).
      reduce: `True` reduces per-device gradients with the default collective: a reduce-scatter for sliced
        leaves; for owned leaves a reduce-scatter of owner-packed buffers unless padding to the largest owner's
        share would move more bytes than an all-reduce. `"psum"` all-reduces, `"psum_scatter"` reduce-scatters;
        `False` takes gradients that already are the global mean, for example from `zero_optax.reduce_gradients`
        followed by a global operation.
      reduce_dtype: sum the gradients in this dtype (for example `jnp.float32` for bf16 gradients); without
        `master_dtype` the inner optimizer still sees each gradient in its own dtype.
      master_dtype: keep a sharded master copy of the parameters in this dtype (for example `jnp.float32` for
        bf16 parameters). Gradients are then reduced in `master_dtype` (unless `reduce_dtype` says otherwise),
        the inner optimizer runs on the master values, devices all-gather the new parameters in the parameter
        dtype, and the updates move `params` onto the master copy rounded to their dtype. `update` then needs
        `params`.
      mesh: bind the transformation to this mesh, so that `init` and `update` also work outside `shard_map`, on
        global arrays, eagerly or under `jax.jit` (Flax's `nnx.Optimizer` and `TrainState`). There the gradients
        are the global mean, as `jax.grad` of a global loss gives them. Inside a `shard_map` that binds
        `axis_name` it behaves like the unbound form.
      assume_elementwise: skip the proof that the inner update is elementwise (sliced leaves). For custom kernels
        the analysis cannot see into; a wrong answer is then your responsibility.
      bucket_bytes: sliced leaves travel in buckets of at least this many bytes (one reduce-scatter and one
        all-gather per bucket), a leaf of at least this many bytes alone (on the CPU, every leaf of at least
        64 KiB: `zero_optax.step._wire.ALONE_BYTES`); `0` sends every leaf on its own.
      accumulate_steps: accumulate gradients over this many `update` calls (one per micro-batch) per optimizer
        step, like `optax.MultiSteps`: the k-th call of a cycle runs the inner update once on the mean over every
        (device, micro-batch) pair (with `weight=`: the sum of the loss-sum gradients over the sum of the weights,
        in float32); the other calls return zero updates. A cycle whose total weight is zero is skipped.
      accumulate: `"sharded"` (default, ZeRO-2 style): each micro-batch is reduce-scattered into float32
        accumulators sharded like the state (1/N per device; owned leaves' at their owner), and only the final
        call runs the inner update and all-gathers. `"local"`: each device sums its own gradients at full size
        and the final call reduces once, the least wire (2x the parameter bytes per optimizer step) for more
        memory. Checkpoints of local accumulators restore at another world size only at a cycle boundary.

      offload: keep every array the state stores (histories, owned buffers, master copies, accumulators) in
        each device's `pinned_host` memory (ZeRO-Offload); `init` and restores place it there. `update` streams
        it through the device: the sliced leaves' state in chunks of at most `bucket_bytes`, each device's owned
        leaves in buckets of at most `bucket_bytes` of state (or one leaf, if its state is larger), each brought
        to the device, updated and returned before the next, so the device never holds the whole shard. Refused
        where the devices have no `pinned_host` memory.
      param_specs: the parameters' `PartitionSpec`s (a tree like the parameters, or a prefix of it: the in_specs
        of your `shard_map`). Needed only inside your own `shard_map` where a leaf that gets an owner (`"leaf"`,
        or a matrix `"auto"` owns) is sharded over a tensor-parallel axis: its owner gathers the blocks and
        updates the whole tensor, and the spec says which dimension each axis cuts. The mesh-bound form and
        `zo.state_specs` read them from the parameters themselves.
      quantize: `zo.Quantize(params="int8", grads="int8", block_size=256, axes=None)` sends the all-gather of
        new parameters (`params`, requires `master_dtype`) and the gradients' reduce-scatters (`grads`, inside
        `shard_map` only) as int8 blocks with one float32 scale each, about a quarter of the float32 bytes
        (ZeRO++); `axes` limits it to some mesh axes (`replica_axis`, say). The state holds no quantized copy, so
        checkpoints are unchanged. Default None: every collective exact.
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
    _check_partition(partition, owners)
    if reduce not in _REDUCE_CHOICES or isinstance(reduce, int) and not isinstance(reduce, bool):
        raise ZeroError(f"`reduce` must be True, False, \"psum\" or \"psum_scatter\", got {reduce!r}.")
    axes = _data_axes(axis_name, mesh)
    replicas = _replica_axes(replica_axis, axes, mesh)
    if assume_elementwise and partition != "flat":
        raise ZeroError("`assume_elementwise=True` applies to partition=\"flat\": with \"leaf\" whole tensors need "
                        "no proof, and \"auto\" gives leaves the analysis cannot prove elementwise an owner.")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes < 0:
        raise ZeroError(f"`bucket_bytes` must be an int >= 0, got {bucket_bytes!r}.")
    _accumulate.check_args(accumulate_steps, accumulate)
    _check_quantize(quantize, reduce, master_dtype, axes + replicas)
    if not isinstance(offload, (bool, np.bool_)):
        raise ZeroError(f"`offload` must be True or False, got {offload!r}.")
    if offload:
        _offload.check_devices(mesh.devices.flat if mesh is not None else jax.devices())
    for name, dtype in (("reduce_dtype", reduce_dtype), ("master_dtype", master_dtype)):
        if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
            raise ZeroError(f"`{name}` must be a floating dtype (for example jnp.float32), got {dtype!r}.")
    typed = optax.with_extra_args_support(inner)
    inner, typed_init = _keys.as_data(typed), typed.init
    accumulating = None
    if accumulate_steps > 1:
        accumulating = _accumulate.Accumulating(inner, int(accumulate_steps), accumulate)
        inner = accumulating.transformation("final")
        typed_init = _accumulate.Accumulating(typed, int(accumulate_steps), accumulate).init
    cfg = _planner.Config(
        inner=inner,
        axis_name=axis_name if isinstance(axis_name, str) else axes,
        partition=partition,
        owners=None if owners is None else tuple(owners),
        reduce="default" if reduce is True else None if reduce is False else reduce,
        reduce_dtype=None if reduce_dtype is None else jnp.dtype(reduce_dtype),
        master_dtype=None if master_dtype is None else jnp.dtype(master_dtype),
        assume_elementwise=bool(assume_elementwise),
        bucket_bytes=int(bucket_bytes),
        accumulating=accumulating,
        offload=bool(offload),
        typed_init=typed_init,
        param_specs=param_specs,
        replica_axes=replicas,
        quantize=quantize,
    )
    z = Zero1(cfg, mesh)
    tx = optax.GradientTransformationExtraArgs(z.init, z.update)
    _handle.record(tx.init, z)
    return tx


def find_zero1(tx) -> Zero1 | None:
    """The `Zero1` behind `tx` if `zero1` returned `tx` (not a chain that holds one), else None."""
    return _handle.find(tx)


def zero1_of(tx, what: str) -> Zero1:
    """The `Zero1` behind `tx`; `NotZero1Error` (naming the caller, `what`) for any other transformation."""
    return _handle.zero1_of(tx, what)


def apply_gradients(tx: optax.GradientTransformation, grads, opt_state, params, *, weight=None, **extra_args):
    """One optimizer step: the new parameters and state, what `tx.update` followed by `optax.apply_updates` gives.

    For a zero1 transformation (`tx = zo.zero1(...)`, unbound inside `shard_map` or mesh-bound anywhere), each
    device adds the updates of the coordinates it owns to its own slice of the parameters, and the devices
    all-gather the *new parameters* instead of the updates (as ZeRO and DeepSpeed do), which saves the separate
    full-size pass that `optax.apply_updates` makes over the gathered updates. The values are the same: the same
    additions, on other devices. Under `accumulate_steps > 1` or `offload=True`, and for any other transformation
    (a chain holding a zero1, plain optax), it runs `tx.update` and `optax.apply_updates`.

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
    zero = find_zero1(tx)
    if zero is not None and zero.gathers_parameters:
        return zero.apply_gradients(grads, opt_state, params, weight=weight, **extra_args)
    kwargs = dict(extra_args) if weight is None else {**extra_args, "weight": weight}
    updates, opt_state = tx.update(grads, opt_state, params, **kwargs)
    return optax.apply_updates(params, updates), opt_state


def _check_partition(partition, owners) -> None:
    """Refuses an unknown `partition`, and `owners` for a partition that chooses its own."""
    if partition not in PARTITIONS:
        raise ZeroError(f"`partition` must be \"flat\", \"leaf\" or \"auto\", got {partition!r}.")
    if owners is not None and partition != LEAF:
        raise ZeroError("`owners` applies to partition=\"leaf\" only; the flat partition splits every leaf over all "
                        "devices and \"auto\" balances the leaves it gives an owner.")


def _axis_names(value, name: str, what: str) -> tuple[str, ...]:
    """`value` (zero1's argument `name`) as a tuple of distinct axis names; `what` says what a single name is."""
    axes = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, Sequence) else ()
    if not axes or not all(isinstance(a, str) and a for a in axes) or len(set(axes)) != len(axes):
        raise ZeroError(f"`{name}` must be {what} or a tuple of distinct axis names, got {value!r}.")
    return axes


def _check_on_mesh(axes: tuple[str, ...], name: str, mesh) -> None:
    """Refuses axes (zero1's argument `name`) that `mesh` (if given) does not have."""
    missing = [] if mesh is None else [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ZeroError(f"`mesh` has axes {mesh.axis_names}, but `{name}` names {missing}.")


def _data_axes(axis_name, mesh) -> tuple[str, ...]:
    """`axis_name` as a tuple of distinct axis names, after checking that `mesh` (if given) is a mesh with them
    all."""
    axes = _axis_names(axis_name, "axis_name", "the name of the data mesh axis")
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise ZeroError(f"`mesh` must be a jax.sharding.Mesh (jax.make_mesh), got {type(mesh).__name__}.")
    _check_on_mesh(axes, "axis_name", mesh)
    return axes


def _check_quantize(quantize, reduce, master_dtype, axes: tuple[str, ...]) -> None:
    """Refuses a `quantize` that is no `zo.Quantize`, names axes zero1 does not communicate over, quantizes
    parameters without master copies, or gradients that zero1 does not reduce by reduce-scatters."""
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
    """`replica_axis` as a tuple of distinct axis names (empty for None), disjoint from the ZeRO `axes` and on
    `mesh` (if given)."""
    if replica_axis is None:
        return ()
    replicas = _axis_names(replica_axis, "replica_axis", "None, the name of a mesh axis")
    shared = [a for a in replicas if a in axes]
    if shared:
        raise ZeroError(f"`replica_axis` and `axis_name` both name {shared}: the state is sharded over `axis_name` "
                        "and replicated over `replica_axis`, so an axis can be one or the other. To shard over "
                        f"both, pass axis_name={tuple(replicas) + axes!r} and no replica_axis.")
    _check_on_mesh(replicas, "replica_axis", mesh)
    return replicas


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

    Inside `jax.shard_map` (with `check_vma=True`, the default), the gradient with respect to a replicated
    parameter is already summed over the axis by autodiff, an all-reduce that costs 2x the gradient bytes on the
    wire, and the result no longer says whether it is a sum or a mean. Differentiating with respect to
    `as_local(params)` instead leaves each device its own gradient, which zero1 then reduce-scatters (1x), so a
    ZeRO-1 step moves no more bytes than plain data parallelism.

    Examples:
      >>> # inside the shard_map'ed step:
      >>> # grads = jax.grad(loss_fn)(zo.as_local(params, "data"), batch)
      >>> # updates, opt_state = tx.update(grads, opt_state, params)
    """
    _compat.axis_size(axis_name, "as_local")
    return _compat.pvary(params, axis_name)
