"""zero1 bound to a mesh: `init` and `update` on global arrays, in its own `shard_map` over the mesh, eagerly or under
`jax.jit`; gradients are taken as the global mean. Under `jax.jit` on an `Auto` axis the flat leaves' updates (and
large leaves' gradients) cross the `shard_map` cut in rows over it, as GSPMD's own sharded state has them. Values the
inner transformation closes over that a `shard_map` body may not read (typed on `Explicit` axes) enter it as
arguments (`_Hoisted`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zero_optax.analysis import _inner, _programs
from zero_optax.core import _compat
from zero_optax.core._errors import WeightError, ZeroError, ZeroStructureError
from zero_optax.layout import _placement, _specs
from zero_optax.layout._config import Config
from zero_optax.layout._state import ZeroState
from zero_optax.layout._stored import spec_axes
from zero_optax.step import _engine, _wire


def _spec_of(x: Any, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, drop: tuple[str, ...] = ()) -> P:
    """The `PartitionSpec` of a global array (or tracer) over `mesh`, without the axes of `drop`; replicated when it
    carries none."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):  # (a tracer carries its sharding in its type only)
        sharding = getattr(jax.typeof(x), "sharding", None)
    if isinstance(sharding, NamedSharding) and tuple(sharding.mesh.axis_names) == tuple(mesh.axis_names):
        kept = [tuple(a for a in cut if a not in drop) for cut in spec_axes(sharding.spec)]
        spec = tuple(None if not cut else cut[0] if len(cut) == 1 else cut for cut in kept)
        while spec and spec[-1] is None:
            spec = spec[:-1]
        return P(*spec)
    return P()


def param_specs(params: Any, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, drop: tuple[str, ...] = ()) -> Any:
    """Each leaf's `PartitionSpec` over `mesh`, without the axes of `drop`."""
    return jax.tree.map(lambda x: _spec_of(x, mesh, drop), params)


def placed(tree: Any, specs: Any, mesh: jax.sharding.Mesh) -> Any:
    """`tree` resharded onto `mesh` by `specs` (a tree of `PartitionSpec`s like it)."""
    return jax.tree.map(lambda x, s: _compat.reshard(x, NamedSharding(mesh, s)), tree, specs)


def _struct(x: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    """An array or `jax.ShapeDtypeStruct` `x` as a `ShapeDtypeStruct` placed by `sharding`."""
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding,
                                weak_type=bool(getattr(x, "weak_type", False)))


def abstract_state(state: Any, specs: Any, mesh: jax.sharding.Mesh) -> Any:
    """The `jax.eval_shape` of a mesh-bound `init` (`state`, whose shardings it leaves on an abstract mesh or
    unknown) with the shardings of the arrays `init` returns: `specs` (a tree like it) on `mesh`, in the layout's
    memory (`pinned_host` with `offload=True`), each spec one entry per dimension as on those arrays. A restore
    target for Orbax."""
    kind = state.layout.memory_kind

    def one(x: jax.ShapeDtypeStruct, spec: P) -> jax.ShapeDtypeStruct:
        spec = P(*spec, *[None] * (len(x.shape) - len(spec)))
        return _struct(x, NamedSharding(mesh, spec, memory_kind=kind))
    return jax.tree.map(one, state, specs)


ENTER_BYTES = 1 << 16
"""Under `jax.jit`, a leaf of at least this many bytes takes its gradient cut in rows over the data axis (what the
state needs) where its rows divide, so that GSPMD reduce-scatters it; XLA then partitions the backward pass towards
that cut, as for GSPMD's own sharded state, which costs more than it saves on small leaves (activations dominate):
the demo's model, all below it, keeps its peak (`benchmarks/RESULTS.md`, the whole step)."""


class Bound:
    """The compiled `shard_map`s of one mesh-bound zero1, cached by layout and parameter shardings."""

    def __init__(self, zero, mesh: jax.sharding.Mesh):
        self.zero = zero
        self.mesh = mesh
        # Gradients reach a mesh-bound update already reduced: the engine takes them as the global mean.
        self.mean = _engine.Engine(dataclasses.replace(zero.cfg, reduce=None))
        self._fns: dict = {}
        self._specs: dict = {}
        self._hoisted: _Hoisted | None = None
        # Parameters sharded over these (by GSPMD, after `exit_rows`) are gathered: every device runs the whole step.
        self._zero_axes = zero.cfg.axes + zero.cfg.replica_axes

    def _hoisting(self, params) -> _Hoisted:
        """The `_Hoisted` values and engines, found once (a transformation's closure does not change)."""
        if self._hoisted is None:
            self._hoisted = _Hoisted.find(self.zero.cfg, params, (self.zero.engine, self.mean))
        return self._hoisted

    def init(self, params, full_state=None):
        """`init` on global arrays; with `full_state` (a plain optax state), that state sliced (`Engine.build`); on
        parameters of which any is a `jax.ShapeDtypeStruct`, the abstract state (`abstract_state`)."""
        specs = param_specs(params, self.mesh, self._zero_axes)
        hoisted = self._hoisting(params)
        fn, out_specs = self._init_program(params, specs, hoisted, jax.tree.structure(full_state))
        if full_state is None and any(_compat.is_struct(x) for x in jax.tree.leaves(params)):
            structs = jax.tree.map(lambda x, s: _struct(x, NamedSharding(self.mesh, s)), params, specs)
            values = [_struct(v, NamedSharding(self.mesh, P())) for v in hoisted.values]
            with _specs.declared_specs(specs):
                state = abstract_state(jax.eval_shape(fn, values, structs, None), out_specs, self.mesh)
        else:
            full_state = jax.tree.map(lambda x: _compat.reshard(jnp.asarray(x), NamedSharding(self.mesh, P())),
                                      full_state)
            with _specs.declared_specs(specs):  # (the layout reads which dimension each axis cuts: `_tp`)
                state = fn(hoisted.placed(self.mesh), placed(params, specs, self.mesh), full_state)
        self._specs[state.layout] = specs
        return state

    def _init_program(self, params, specs, hoisted: _Hoisted, full_structure) -> tuple[Any, Any]:
        """The jitted `shard_map` of `init` for parameters like `params` placed by `specs`, with a plain optax state
        structured as `full_structure` or none, and its state's `PartitionSpec`s (kept by those)."""
        shapes = tuple((np.shape(x), np.dtype(x.dtype).name) for x in jax.tree.leaves(params))
        key = ("init", jax.tree.structure(params), shapes, tuple(jax.tree.leaves(specs)), full_structure)
        if key not in self._fns:
            def init(values, params, full_state):
                with hoisted.reading(values):
                    return hoisted.engine.init(params, full_state)
            stand_in = types.SimpleNamespace(init=lambda args: init(*args, full_state=None))
            traced = _specs.traced_state(stand_in, (hoisted.values, params), (hoisted.specs, specs), self.mesh,
                                         declare=specs)
            out_specs = _specs.tree_specs(traced)
            self._fns[key] = (jax.jit(jax.shard_map(init, mesh=self.mesh, in_specs=(hoisted.specs, specs, P()),
                                                    out_specs=out_specs)), out_specs)
        return self._fns[key]

    def update(self, grads, state, params=None, *, weight=None, apply: bool = False, **extra):
        """`update` on global arrays (with `apply`, the new parameters: `Engine.update`)."""
        quantize = self.zero.cfg.quantize
        if quantize is not None and quantize.grads is not None:
            raise ZeroError(
                "Quantize(grads=\"int8\") quantizes the reduction of per-device gradients, but a mesh-bound zero1 "
                "called outside shard_map receives gradients XLA has already reduced (jax.grad of the global loss). "
                "Call update inside jax.shard_map over the mesh with per-device gradients (jax.grad with respect to "
                "zo.as_local(params, axis_name)), where zero1 reduces them itself, or drop grads= (params= works "
                "in either form).")
        if weight is not None:
            raise WeightError(
                "A mesh-bound zero1 used outside shard_map receives the global mean gradient (jax.grad of the global "
                "loss), so `weight=` has nothing to weigh. Weigh the loss instead (a token-weighted mean), or call "
                "update inside shard_map with per-device gradients.")
        if not isinstance(state, ZeroState):
            raise ZeroStructureError(
                f"zero1 update expected the ZeroState returned by this transformation's init, got "
                f"{type(state).__name__}.")
        if (misplaced := _placement.misplaced(state, self.mesh)) is not None:
            raise ZeroStructureError(misplaced)
        with_params = params is not None
        specs = self._specs.get(state.layout)
        if specs is None or with_params:
            found = param_specs(params if with_params else grads, self.mesh, self._zero_axes)
            specs = found if specs is None or any(s != P() for s in jax.tree.leaves(found)) else specs
        hoisted = self._hoisting(params if with_params else grads)
        state_specs = _specs.specs_of(state)
        layout = state.layout
        # Under a trace, the updates of the sliced leaves leave cut in rows over the ZeRO axis, so that GSPMD adds
        # each device's rows to its part of the parameters and gathers the new ones, as for its own sharded state.
        # (Not on an `Explicit` axis, where the sharding is in the updates' type: the caller's add would refuse it.)
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(grads))
        auto = all(self.mesh.axis_types[self.mesh.axis_names.index(a)] == jax.sharding.AxisType.Auto
                   for a in layout.axes)
        exits = hoisted.mean.exit_rows(layout) if traced and auto and not apply else frozenset()
        # Their gradients enter as each device's block of rows where the slots are whole rows of a large leaf: GSPMD
        # then reduce-scatters a data-parallel gradient rather than all-reducing it.
        entered = frozenset(i for i in exits if _wire.row_block(layout.leaves[i]) is not None
                            and layout.leaves[i].size * np.dtype(layout.leaves[i].dtype).itemsize >= ENTER_BYTES)
        key = ("update", layout, tuple(jax.tree.leaves(specs)), with_params, apply, jax.tree.structure(extra), exits)
        flat, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, P))

        def in_rows(leaves: frozenset[int]) -> Any:  # `specs`, with `leaves` cut over the ZeRO axis
            return jax.tree.unflatten(treedef, [P(layout.axes) if i in leaves else s for i, s in enumerate(flat)])
        rows, grad_specs = in_rows(exits), in_rows(entered)
        if key not in self._fns:
            def run(values, grads, state, params, extra):
                with hoisted.reading(values):
                    return hoisted.mean.update(grads, state, params, apply=apply, exits=exits, entered=entered,
                                               **extra)

            # One device: untyped (check_vma=False), so that no one-device collective retypes values (XLA:CPU copies).
            self._fns[key] = jax.jit(jax.shard_map(
                run, mesh=self.mesh,
                in_specs=(hoisted.specs, grad_specs, state_specs, specs if with_params else P(), P()),
                out_specs=(rows, state_specs), check_vma=self.mesh.size > 1))
        grads = placed(grads, grad_specs, self.mesh)
        params = placed(params, specs, self.mesh) if with_params else None
        extra = jax.tree.map(lambda x: _compat.reshard(x, NamedSharding(self.mesh, P())), extra)
        updates, new_state = self._fns[key](hoisted.placed(self.mesh), grads, state, params, extra)
        if exits:  # each exiting leaf's rows back in the leaf's shape (where they are not already)
            u, treedef = jax.tree.flatten(updates)
            updates = jax.tree.unflatten(treedef, [_wire.unpadded(x, layout.leaves[i]) if i in exits else x
                                                   for i, x in enumerate(u)])
        return updates, new_state


# No mesh: the context where values typed on any mesh may be read (to find and read what the inner one closes over).
_NO_MESH = jax.sharding.AbstractMesh((), ())


def _must_enter(x: Any) -> bool:
    """Whether a closed-over value must enter the `shard_map` as an argument: an array typed on an `Explicit` axis."""
    if not isinstance(x, jax.Array):
        return False
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    return mesh is not None and not mesh.empty and jax.sharding.AxisType.Explicit in tuple(mesh.axis_types)


def _stand_in(x: Any) -> jax.ShapeDtypeStruct:
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=bool(getattr(aval, "weak_type", False)))


def _trace(fn, args: tuple):
    """`fn(*args)` traced on stand-ins of `args` with no context mesh: the closed jaxpr, output shapes, flat args."""
    flat, tree = jax.tree.flatten(args)
    with jax.sharding.use_abstract_mesh(_NO_MESH):
        closed, out_shape = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)), return_shape=True)(
            *[_stand_in(x) for x in flat])
    return closed, out_shape, flat


# Primitives that only move or retype a value between devices: per device, the identity.
_PLACEMENTS = frozenset({"reshard", "sharding_constraint", "mesh_cast"})


def _per_device(eqn):
    """`eqn` as a `shard_map` body runs it: a placement dropped (None; the body's manual mesh refuses it)."""
    return None if eqn.primitive.name in _PLACEMENTS and len(eqn.invars) == len(eqn.outvars) == 1 else eqn


def _local(value: Any) -> Any:
    """A parameter as a `shard_map` body runs it: a sharding on a mesh, which the body refuses, replaced by None."""
    return None if isinstance(value, NamedSharding) and not value.mesh.empty else value


def _evaluate(program, args: list, consts=None) -> list:
    """`program` on `args` (and `consts`, if given) in the current trace, its sub-programs retraced. Operands are
    typed varying over the same axes first, as tracing would type them (a hoisted value meets sliced parameters)."""
    jaxpr, own = _compat.jaxpr_parts(program)

    def rule(eqn, ins: list) -> list:
        typed = [_compat.varying_axes(x) for x in ins]
        axes = frozenset().union(*typed)
        ins = [x if t == axes else _compat.pvary(x, tuple(sorted(axes))) for x, t in zip(ins, typed)]
        outs = _programs.retraced(eqn, ins, _evaluate)
        return _programs.bind(eqn, ins) if outs is None else outs
    return _programs.evaluate(jaxpr, own if consts is None else consts, args, rule)


class _Hoisted:
    """The closed-over values a `shard_map` body may not read (`_must_enter`), and engines whose inner transformation
    reads them from the body's arguments (`reading`) instead. Values no object walk reaches are not hoisted."""

    def __init__(self, cfg: Config, values: list, engines: tuple):
        self.values = values
        self.specs = [P() for _ in values]
        self._index = {id(v): i for i, v in enumerate(values)}
        self._reading: list | None = None
        if not values:  # the plain engines, which read nothing
            self.engine, self.mean = engines
            return
        if cfg.accumulating is None:
            cfg = dataclasses.replace(cfg, inner=self._wrap(cfg.inner))
        else:  # the accumulating transformation calls its own inner one: wrap that
            accumulating = dataclasses.replace(cfg.accumulating, inner=self._wrap(cfg.accumulating.inner))
            cfg = dataclasses.replace(cfg, inner=accumulating.transformation("final"), accumulating=accumulating)
        self.engine = _engine.Engine(cfg)
        self.mean = _engine.Engine(dataclasses.replace(cfg, reduce=None))

    @classmethod
    def find(cls, cfg: Config, params, engines: tuple) -> _Hoisted:
        """The values among the constants of the inner `init` and `update`; `engines` (plain, mean) where none."""
        inner = cfg.inner if cfg.accumulating is None else cfg.accumulating.inner
        if not _inner.may_reach(inner, _must_enter):  # (spares the common case, numbers, the two traces)
            return cls(cfg, [], engines)
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), cfg.inner_dtype(x.dtype)), params)
        closed_init, state, _ = _trace(inner.init, (params,))
        with jax.sharding.use_abstract_mesh(_NO_MESH):  # (the update's extra arguments found as the analyses find them)
            closed_update = _inner.trace_update(inner, params, state, params)[0].closed
        values = {id(c): c for c in (*closed_init.consts, *closed_update.consts) if _must_enter(c)}
        return cls(cfg, list(values.values()), engines)

    def placed(self, mesh: jax.sharding.Mesh) -> list:
        """The values, replicated over `mesh`."""
        return [_compat.reshard(v, NamedSharding(mesh, P())) for v in self.values]

    @contextlib.contextmanager
    def reading(self, values: list):
        """The wrapped inner transformation reads the hoisted values as `values` (a body's arguments)."""
        previous, self._reading = self._reading, list(values)
        try:
            yield
        finally:
            self._reading = previous

    def _wrap(self, inner) -> optax.GradientTransformationExtraArgs:
        return optax.GradientTransformationExtraArgs(
            lambda params: self._call(inner.init, (params,)),
            lambda updates, state, params=None, **extra: self._call(_inner.update_fn(inner),
                                                                    (updates, state, params, extra)))

    def _call(self, fn, args: tuple):
        if self._reading is None:
            raise RuntimeError("zero1 (mesh-bound): the inner transformation was called outside its shard_map.")
        closed, out_shape, flat = _trace(fn, args)
        closed = _programs.rewrite(closed, _per_device, _local)
        consts = [self._reading[self._index[id(c)]] if id(c) in self._index else c
                  for c in _compat.jaxpr_parts(closed)[1]]
        out = _evaluate(closed, flat, consts)
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)
