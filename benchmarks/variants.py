"""The optimizer-step variants being compared, each built for a given ``tx``, mesh and params.

Every variant exposes the same calling convention so the harness can treat them uniformly:

* ``init(params) -> state``, jitted; ``params`` replicated (``P()``) on the mesh.
* ``step(params, grads, state) -> (params, state)``, jitted, donating ``params`` and ``state``.
  ``grads`` has a leading device axis of size N sharded ``P("data")``: device i holds its own
  full-size *local* (not yet reduced) gradient, as after its backward pass. We feed explicit
  per-device gradients instead of calling ``jax.grad`` inside ``shard_map`` because in JAX 0.10
  (``check_vma=True``) the gradient w.r.t. a replicated parameter there comes back already
  psum'd, which would hide the data-parallel reduction we want to measure.

Variants:

1. ``replicated``: plain data parallelism; ``pmean`` of the gradient (one all-reduce), then every
   device runs the full optimizer on replicated params and state, inside ``shard_map``. ``optax_jit``: the
   same under plain ``jax.jit`` (the mean gradient, no ``shard_map``): on one device, plain optax.
2. ``gspmd``: MaxText-style; ``jax.jit`` with params replicated and every optimizer-state leaf
   sharded over "data" on its first dimension divisible by N, leaving GSPMD to partition the update.
3. ``zero1_flat_psum`` / ``zero1_flat_scatter`` / ``zero1_leaf`` / ``zero1_auto``: ``zero_optax.zero1``
   under ``jax.shard_map`` (``partition="flat"`` with an all-reduce or the default reduce-scatter in buckets,
   ``zero1_flat_per_leaf`` the same with one reduce-scatter and one all-gather per leaf, ``"leaf"``, ``"auto"``).
4. ``zero1_flat_bound``: ``zero_optax.zero1(tx, axis_name="data", mesh=mesh)`` under plain ``jax.jit``, fed the
   global mean gradient (the mesh-bound form; it runs its own ``shard_map``).
5. ``FLAX_VARIANTS`` (``benchmarks.step_time --flax`` only): the same mesh-bound zero1 with one all-gather per leaf
   (``bucket_bytes=0``), stepped by Flax's classes: ``nnx_optimizer`` (``nnx.Optimizer.update``: ``tx.update`` +
   ``optax.apply_updates``) against ``nnx_zero_optimizer`` (``zero_optax.ZeroOptimizer``), ``train_state``
   (``TrainState.apply_gradients``) against ``zero_train_state`` (``zero_optax.ZeroTrainState``), each under
   ``jax.jit`` with the NNX model built from the parameters inside the step (NNX objects are pytrees) and the
   optimizer object, or the ``TrainState`` without its parameters, as the state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests._models import muon_recipe

AXIS = "data"

Step = Callable[[Any, Any, Any], tuple[Any, Any]]


class VariantUnavailable(Exception):
    """The variant cannot be built in this environment (e.g. ``zero_optax.zero1`` missing)."""


@dataclass(frozen=True)
class Built:
    """A variant instantiated for one optimizer, mesh and parameter pytree."""

    init: Callable[[Any], Any]
    step: Step
    param_sharding: NamedSharding
    grad_sharding: NamedSharding
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Variant:
    """A named recipe ``build(tx, mesh, params) -> Built``; ``zero1`` marks the variants under test."""

    name: str
    build: Callable[[optax.GradientTransformation, Mesh, Any], Built]
    zero1: bool = False


def make_mesh(n: int, devices: list[Any] | None = None) -> Mesh:
    """1-D "data" mesh over the first ``n`` devices, with *Auto* axis type.

    Auto matters for the gspmd variant: ``jax.make_mesh`` defaults to Explicit axes in JAX 0.10,
    under which ``jit`` type-checks shardings (sharding-in-types) and e.g. Muon's ``x @ x.T`` on a
    state leaf sharded along the contracted dim is a ``ShardingTypeError`` instead of being left
    to the GSPMD partitioner as MaxText does.
    """
    devs = (devices if devices is not None else jax.devices())[:n]
    if len(devs) < n:
        raise ValueError(f"need {n} devices, have {len(devs)}")
    return Mesh(np.array(devs), (AXIS,), axis_types=(AxisType.Auto,))


def optimizers() -> dict[str, optax.GradientTransformation]:
    """The inner optimizers benchmarked: AdamW, Muon (optax.contrib) and the Muon recipe."""
    return {
        "adamw": optax.adamw(3e-4, weight_decay=0.1),
        "muon": optax.contrib.muon(2e-2),
        "muon_recipe": muon_recipe(),
    }


def _local(grads: Any) -> Any:
    """Inside shard_map: drop the size-1 leading device axis of this device's gradient block."""
    return jax.tree_util.tree_map(lambda g: g[0], grads)


def _mean_step(tx: optax.GradientTransformation) -> Step:
    """Outside shard_map: the step on the mean over the stacked per-device gradients (what ``jax.grad`` of a global
    loss gives under ``jax.jit``), then ``tx``'s update and ``optax.apply_updates``."""
    def step(params: Any, grads: Any, state: Any) -> tuple[Any, Any]:
        g = jax.tree_util.tree_map(lambda x: x.mean(axis=0), grads)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state
    return step


def _shardings(mesh: Mesh) -> tuple[NamedSharding, NamedSharding]:
    return NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))


# ----------------------------------------------------------------------------- 1. replicated


def build_replicated(tx: optax.GradientTransformation, mesh: Mesh, params: Any) -> Built:
    """Plain data parallelism: all-reduce (pmean) the gradient, full optimizer on every device."""
    rep, dat = _shardings(mesh)

    def step(params: Any, grads: Any, state: Any) -> tuple[Any, Any]:
        g = jax.lax.pmean(_local(grads), AXIS)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    sm = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AXIS), P()), out_specs=(P(), P()))
    return Built(
        init=jax.jit(tx.init, out_shardings=rep),
        step=jax.jit(sm, donate_argnums=(0, 2)),
        param_sharding=rep,
        grad_sharding=dat,
    )


def build_optax_jit(tx: optax.GradientTransformation, mesh: Mesh, params: Any) -> Built:
    """Plain optax under ``jax.jit``, no ``shard_map``: the mean gradient, the state replicated. On one device
    this is the program a user without zero1 runs (the reference of the one-device step targets)."""
    rep, dat = _shardings(mesh)

    step = _mean_step(tx)

    return Built(
        init=jax.jit(tx.init, out_shardings=rep),
        step=jax.jit(step, in_shardings=(rep, dat, rep), out_shardings=(rep, rep), donate_argnums=(0, 2)),
        param_sharding=rep,
        grad_sharding=dat,
    )


# ----------------------------------------------------------------------------- 2. gspmd


def first_divisible_spec(shape: tuple[int, ...], n: int) -> P:
    """``P`` sharding the first dimension divisible by ``n`` over "data"; ``P()`` if none (or scalar)."""
    for i, d in enumerate(shape):
        if d % n == 0 and d >= n:
            return P(*([None] * i), AXIS)
    return P()


def gspmd_state_specs(tx: optax.GradientTransformation, params: Any, n: int) -> Any:
    """Pytree (matching ``tx.init(params)``) of the ``PartitionSpec`` the gspmd variant uses."""
    abstract = jax.eval_shape(tx.init, params)
    return jax.tree_util.tree_map(lambda x: first_divisible_spec(x.shape, n), abstract)


def build_gspmd(tx: optax.GradientTransformation, mesh: Mesh, params: Any) -> Built:
    """MaxText-style: jit with replicated params and state leaves sharded on a divisible dim.

    The data-parallel reduction is modeled honestly as part of the jitted program: the gradient
    arrives as the stacked per-device local gradients (leading axis sharded over "data") and the
    step takes their mean over that axis. That is exactly what GSPMD sees when a data-parallel
    ``jax.grad`` is jitted with a batch-sharded input (a partial sum per device), and it is free to
    lower it as an all-reduce or, since the optimizer state only needs its own slice, as a
    reduce-scatter followed by an all-gather of the updated params.
    """
    rep, dat = _shardings(mesh)
    n = mesh.shape[AXIS]
    specs = gspmd_state_specs(tx, params, n)
    state_sh = jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
    )

    step = _mean_step(tx)

    leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return Built(
        init=jax.jit(tx.init, out_shardings=state_sh),
        step=jax.jit(
            step,
            in_shardings=(rep, dat, state_sh),
            out_shardings=(rep, state_sh),
            donate_argnums=(0, 2),
        ),
        param_sharding=rep,
        grad_sharding=dat,
        notes={"state_specs": specs, "sharded_leaves": sum(s != P() for s in leaves), "leaves": len(leaves)},
    )


# ----------------------------------------------------------------------------- 3. zero1


def _zero1_builder(**zero1_kwargs: Any) -> Callable[[optax.GradientTransformation, Mesh, Any], Built]:
    """Builder for ``zo.zero1(tx, axis_name="data", **zero1_kwargs)`` under ``jax.shard_map``."""

    def build(tx: optax.GradientTransformation, mesh: Mesh, params: Any) -> Built:
        try:
            import zero_optax as zo

            ztx = zo.zero1(tx, axis_name=AXIS, **zero1_kwargs)
        except (ImportError, AttributeError) as e:
            raise VariantUnavailable(f"{type(e).__name__}: {e}") from e
        rep, dat = _shardings(mesh)

        def step(params: Any, grads: Any, state: Any) -> tuple[Any, Any]:
            updates, state = ztx.update(_local(grads), state, params)
            return optax.apply_updates(params, updates), state

        init = jax.shard_map(ztx.init, mesh=mesh, in_specs=P(), out_specs=P(AXIS))
        sm = jax.shard_map(
            step, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)), out_specs=(P(), P(AXIS))
        )
        return Built(
            init=jax.jit(init),
            step=jax.jit(sm, donate_argnums=(0, 2)),
            param_sharding=rep,
            grad_sharding=dat,
            notes={"zero1_kwargs": zero1_kwargs},
        )

    return build


def _bound_builder(apply: bool, **zero1_kwargs: Any) -> Callable[[optax.GradientTransformation, Mesh, Any], Built]:
    """Builder for ``zo.zero1(tx, axis_name="data", mesh=mesh, **zero1_kwargs)`` under plain ``jax.jit``: the
    global mean gradient (as ``jax.grad`` of a global loss gives it) goes to a mesh-bound zero1, which runs its own
    ``shard_map``; then ``optax.apply_updates``, or with ``apply`` the one call ``zo.apply_gradients``."""

    def build(tx: optax.GradientTransformation, mesh: Mesh, params: Any) -> Built:
        try:
            import zero_optax as zo

            ztx = zo.zero1(tx, axis_name=AXIS, mesh=mesh, **zero1_kwargs)
            apply_gradients = zo.apply_gradients if apply else None
        except (ImportError, AttributeError, TypeError) as e:
            raise VariantUnavailable(f"{type(e).__name__}: {e}") from e
        rep, dat = _shardings(mesh)
        step = _mean_step(ztx)
        if apply:
            def step(params: Any, grads: Any, state: Any) -> tuple[Any, Any]:
                g = jax.tree_util.tree_map(lambda x: x.mean(axis=0), grads)
                return apply_gradients(ztx, g, state, params)

        return Built(init=ztx.init, step=jax.jit(step, donate_argnums=(0, 2)), param_sharding=rep,
                     grad_sharding=dat, notes={"zero1_kwargs": {"mesh": "bound", **zero1_kwargs}, "apply": apply})

    return build


build_zero1_bound = _bound_builder(False)


VARIANTS: tuple[Variant, ...] = (
    Variant("replicated", build_replicated),
    Variant("optax_jit", build_optax_jit),
    Variant("gspmd", build_gspmd),
    Variant("zero1_flat_psum", _zero1_builder(partition="flat", reduce="psum"), zero1=True),
    Variant("zero1_flat_scatter", _zero1_builder(partition="flat", reduce="psum_scatter"), zero1=True),
    Variant("zero1_flat_per_leaf", _zero1_builder(partition="flat", bucket_bytes=0), zero1=True),
    Variant("zero1_leaf", _zero1_builder(partition="leaf"), zero1=True),
    Variant("zero1_auto", _zero1_builder(partition="auto"), zero1=True),
    Variant("zero1_flat_bound", build_zero1_bound, zero1=True),
    Variant("zero1_flat_apply", _bound_builder(True), zero1=True),
    Variant("zero1_flat_apply_per_leaf", _bound_builder(True, bucket_bytes=0), zero1=True),
)


# ----------------------------------------------------------------------------- 5. Flax


def _flax_builder(kind: str, fast: bool) -> Callable[[optax.GradientTransformation, Mesh, Any], Built]:
    """Builder for mesh-bound zero1 (``bucket_bytes=0``) stepped by ``nnx.Optimizer`` / ``zero_optax.ZeroOptimizer``
    (``kind="nnx"``) or ``TrainState`` / ``zero_optax.ZeroTrainState`` (``kind="train_state"``), under ``jax.jit``.

    The harness's parameters stay a dict: the NNX step wraps them in a module (one ``nnx.Param`` per leaf) inside
    the jitted step, and the state is the optimizer object (which holds no model since Flax 0.11); the TrainState
    step puts them into the state's ``params`` and returns the state without them, so nothing is donated twice.
    """

    def build(tx: optax.GradientTransformation, mesh: Mesh, params: Any) -> Built:
        try:
            from flax import nnx
            from flax.training import train_state

            import zero_optax as zo

            ztx = zo.zero1(tx, axis_name=AXIS, mesh=mesh, bucket_bytes=0)
            optimizer_cls = zo.ZeroOptimizer if fast else nnx.Optimizer
            state_cls = zo.ZeroTrainState if fast else train_state.TrainState
        except (ImportError, AttributeError, TypeError) as e:
            raise VariantUnavailable(f"{type(e).__name__}: {e}") from e
        rep, dat = _shardings(mesh)

        def mean(grads: Any) -> Any:
            return jax.tree_util.tree_map(lambda x: x.mean(axis=0), grads)

        if kind == "nnx":
            class Model(nnx.Module):
                def __init__(self, tree: Any):
                    self.params = nnx.data(jax.tree_util.tree_map(nnx.Param, tree))

            def values(model: Any) -> Any:
                return jax.tree_util.tree_map(lambda v: v[...], model.params,
                                              is_leaf=lambda x: isinstance(x, nnx.Variable))

            def init(p: Any) -> Any:
                return optimizer_cls(Model(p), ztx, wrt=nnx.Param)

            def step(p: Any, grads: Any, optimizer: Any) -> tuple[Any, Any]:
                model = Model(p)
                optimizer.update(model, nnx.state(Model(mean(grads))))
                return values(model), optimizer
        else:
            def init(p: Any) -> Any:
                return state_cls.create(apply_fn=None, params=p, tx=ztx).replace(params=None)

            def step(p: Any, grads: Any, state: Any) -> tuple[Any, Any]:
                state = state.replace(params=p).apply_gradients(grads=mean(grads))
                return state.params, state.replace(params=None)

        return Built(init=init, step=jax.jit(step, donate_argnums=(0, 2)), param_sharding=rep, grad_sharding=dat,
                     notes={"zero1_kwargs": {"mesh": "bound", "bucket_bytes": 0}, "flax": kind, "apply": fast})

    return build


FLAX_VARIANTS: tuple[Variant, ...] = (
    Variant("nnx_optimizer", _flax_builder("nnx", fast=False), zero1=True),
    Variant("nnx_zero_optimizer", _flax_builder("nnx", fast=True), zero1=True),
    Variant("train_state", _flax_builder("train_state", fast=False), zero1=True),
    Variant("zero_train_state", _flax_builder("train_state", fast=True), zero1=True),
)
