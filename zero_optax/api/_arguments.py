"""zero1's arguments, checked once into a `Config`: every refusal of a bad argument lives here."""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zero_optax.core._errors import ZeroError
from zero_optax.layout import _keys
from zero_optax.layout._config import Config
from zero_optax.layout._stored import LEAF, PARTITIONS
from zero_optax.step import _accumulate, _offload, _quantize

_REDUCE_CHOICES = (True, False, "psum", "psum_scatter")


def config(inner: optax.GradientTransformation, mesh: jax.sharding.Mesh | None, options: dict[str, Any]) -> Config:
    """`zero1`'s keyword arguments but `mesh` (`options`) as a `Config`, each checked (`ZeroError` naming it)."""
    o = types.SimpleNamespace(**options)
    _check_partition(o.partition, o.owners)
    if o.reduce not in _REDUCE_CHOICES or isinstance(o.reduce, int) and not isinstance(o.reduce, bool):
        raise ZeroError(f"`reduce` must be True, False, \"psum\" or \"psum_scatter\", got {o.reduce!r}.")
    axes = _data_axes(o.axis_name, mesh)
    replicas = _replica_axes(o.replica_axis, axes, mesh)
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
        _offload.check_devices(mesh.devices.flat if mesh is not None else jax.devices())
    for name, dtype in (("reduce_dtype", o.reduce_dtype), ("master_dtype", o.master_dtype)):
        if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
            raise ZeroError(f"`{name}` must be a floating dtype (for example jnp.float32), got {dtype!r}.")
    typed = optax.with_extra_args_support(inner)
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
    """`axis_name` as a tuple of distinct axis names, checked to be on `mesh` (if given)."""
    axes = _axis_names(axis_name, "axis_name", "the name of the data mesh axis")
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise ZeroError(f"`mesh` must be a jax.sharding.Mesh (jax.make_mesh), got {type(mesh).__name__}.")
    _check_on_mesh(axes, "axis_name", mesh)
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
    replicas = _axis_names(replica_axis, "replica_axis", "None, the name of a mesh axis")
    shared = [a for a in replicas if a in axes]
    if shared:
        raise ZeroError(f"`replica_axis` and `axis_name` both name {shared}: the state is sharded over `axis_name` "
                        "and replicated over `replica_axis`, so an axis can be one or the other. To shard over "
                        f"both, pass axis_name={tuple(replicas) + axes!r} and no replica_axis.")
    _check_on_mesh(replicas, "replica_axis", mesh)
    return replicas
