"""zero1 bound to a mesh: `init` and `update` on global arrays, eagerly or under `jax.jit` (and so in Flax).

Outside `shard_map`, a mesh-bound zero1 runs its own `shard_map` over the mesh. Parameters keep their
`NamedSharding`s (replicated over the data axes; any other axis is tensor or expert parallelism), the state comes
back sharded over the data axes (`zero_optax.state_specs`), and updates come back with the parameters' shardings.
Gradients are the global mean, as `jax.grad` of a global loss under `jax.jit` gives them: XLA reduces them before
zero1 sees them.

Values the inner transformation closes over enter that `shard_map` as arguments where they must (`_Hoisted`): JAX
refuses a `shard_map` body that reads a value typed on a mesh with `Explicit` axes from outside (NotImplementedError:
"Closing over inputs to shard_map where the input is sharded on `Explicit` axes is not implemented"), and
`optax.inject_hyperparams(factory)` builds the transformation around exactly such values: the hyperparameters,
traced (under `jax.jit`) or concrete, which `jax.set_mesh` types on the mesh (issue 29).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend import core as jex_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zero_optax.core import _compat
from zero_optax.analysis import _inner
from zero_optax.core._errors import WeightError, ZeroError, ZeroStructureError
from zero_optax.step import _engine
from zero_optax.layout import _planner, _specs
from zero_optax.layout._state import ZeroState


def _spec_of(x: Any, mesh: jax.sharding.Mesh) -> P:
    """The `PartitionSpec` of a global array (or tracer) over `mesh`; replicated when it carries none."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):  # (tracers of older JAX releases carry no sharding)
        sharding = getattr(jax.typeof(x), "sharding", None)
    if isinstance(sharding, NamedSharding) and tuple(sharding.mesh.axis_names) == tuple(mesh.axis_names):
        spec = tuple(sharding.spec)
        while spec and spec[-1] is None:
            spec = spec[:-1]
        return P(*spec)
    return P()


def param_specs(params: Any, mesh: jax.sharding.Mesh) -> Any:
    return jax.tree.map(lambda x: _spec_of(x, mesh), params)


def placed(tree: Any, specs: Any, mesh: jax.sharding.Mesh) -> Any:
    """`tree` resharded onto `mesh` by `specs` (a tree of `PartitionSpec`s like it)."""
    return jax.tree.map(lambda x, s: _compat.reshard(x, NamedSharding(mesh, s)), tree, specs)


def _key(tree: Any, specs: Any) -> tuple:
    return (jax.tree.structure(tree), tuple((np.shape(x), np.dtype(x.dtype).name) for x in jax.tree.leaves(tree)),
            tuple(jax.tree.leaves(specs)))


class Bound:
    """The compiled `shard_map`s of one mesh-bound zero1, cached by layout and parameter shardings."""

    def __init__(self, zero, mesh: jax.sharding.Mesh):
        self.zero = zero
        self.mesh = mesh
        # Gradients reach a mesh-bound update already reduced: the engine takes them as the global mean.
        self.mean = _engine.Engine(dataclasses.replace(zero.cfg, reduce=None))
        self._fns: dict = {}
        self._specs: dict = {}
        self._hoisted: _Hoisted | None = None  # found at the first call (`_hoisting`)

    def _hoisting(self, params, extra: dict | None) -> _Hoisted:
        """The values the inner transformation closes over that must enter the `shard_map` as arguments, and the
        engines that read them from there (found once: a transformation's closure does not change)."""
        if self._hoisted is None:
            self._hoisted = _Hoisted.find(self.zero.cfg, params, extra)
        return self._hoisted

    def init(self, params):
        specs = param_specs(params, self.mesh)
        hoisted = self._hoisting(params, None)
        key = ("init", _key(params, specs))
        if key not in self._fns:
            if hoisted.values:
                def init(values, params):
                    with hoisted.reading(values):
                        return hoisted.engine.init(params)
            else:
                def init(values, params):
                    del values
                    return self.zero.engine.init(params)
            traced = _specs.traced_state(_Tx(lambda args: init(*args)), (hoisted.values, params),
                                         (hoisted.specs, specs), self.mesh, declare=specs)
            self._fns[key] = jax.jit(jax.shard_map(init, mesh=self.mesh, in_specs=(hoisted.specs, specs),
                                                   out_specs=_specs.tree_specs(traced)))
        with _specs.declared_specs(specs):  # (the layout reads which dimension each axis cuts: `_tp`)
            state = self._fns[key](hoisted.placed(self.mesh), placed(params, specs, self.mesh))
        self._specs[state.layout] = specs
        return state

    @property
    def zero_init(self):
        """A stand-in transformation whose `init` is the unbound engine's (for tracing the state's layout)."""
        return _Tx(self.zero.engine.init)

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
        layout = state.layout
        specs = self._specs.get(layout)
        if specs is None or params is not None:
            found = param_specs(params if params is not None else grads, self.mesh)
            specs = found if specs is None or any(s != P() for s in jax.tree.leaves(found)) else specs
        hoisted = self._hoisting(params if params is not None else grads, extra)
        state_specs = _specs.specs_of(state)
        extra_specs = jax.tree.map(lambda _: P(), extra)
        with_params = params is not None
        key = ("update", layout, tuple(jax.tree.leaves(specs)), with_params, apply, jax.tree.structure(extra))
        if key not in self._fns:
            if hoisted.values:
                def run(values, grads, state, params, extra):
                    with hoisted.reading(values):
                        return hoisted.mean.update(grads, state, params, apply=apply, **extra)
            else:
                def run(values, grads, state, params, extra):
                    del values
                    return self.mean.update(grads, state, params, apply=apply, **extra)

            # On a one-device mesh nothing varies: untyped (check_vma=False), the step needs no collective at all,
            # where typed values would have to be retyped replicated by one-device collectives (copies on XLA:CPU).
            self._fns[key] = jax.jit(jax.shard_map(
                run, mesh=self.mesh,
                in_specs=(hoisted.specs, specs, state_specs, specs if with_params else P(), extra_specs),
                out_specs=(specs, state_specs), check_vma=self.mesh.size > 1))
        grads = placed(grads, specs, self.mesh)
        params = placed(params, specs, self.mesh) if with_params else None
        extra = jax.tree.map(lambda x: _compat.reshard(x, NamedSharding(self.mesh, P())), extra)
        return self._fns[key](hoisted.placed(self.mesh), grads, state, params, extra)


# The context the inner transformation is traced in to find (and to read) what it closes over: no mesh, so that
# a value typed on any mesh may be read (inside a `shard_map` body the context mesh is manual, where JAX refuses
# values typed on a mesh with `Explicit` axes).
_NO_MESH = jax.sharding.AbstractMesh((), ())


def _must_enter(x: Any) -> bool:
    """Whether a value the inner transformation closes over must enter the `shard_map` as an argument: an array
    or tracer typed on a mesh with an `Explicit` axis (JAX closes a body over any other: untyped ones as they are,
    those on `Auto` meshes resharded replicated)."""
    if not isinstance(x, jax.Array):
        return False
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    return mesh is not None and not mesh.empty and jax.sharding.AxisType.Explicit in tuple(mesh.axis_types)


def _may_reach_typed(root: Any, limit: int = 20_000) -> bool:
    """Whether a value that `_must_enter` may be reachable from `root` (the inner transformation): through
    containers, functions' closures and defaults, partials, bound methods and objects' attributes
    (`_inner.reachable`). True also when the search stops after `limit` objects.

    A cheap test (a walk over Python objects, no trace) that spares the common case, hyperparameters given as
    numbers, the two traces of `_Hoisted.find`: only where it finds such a value do they run, and they decide
    which values are hoisted. A value it cannot reach (a module global, say) is not hoisted: JAX then refuses the
    `shard_map` as it did before.
    """
    for count, x in enumerate(_inner.reachable(root), 1):
        if count > limit or _must_enter(x):
            return True
    return False


def _stand_in(x: Any) -> jax.ShapeDtypeStruct:
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=bool(getattr(aval, "weak_type", False)))


def _trace(fn, args: tuple):
    """`fn(*args)` traced on stand-ins of `args`, with no context mesh: (the closed jaxpr, the output's shape
    tree, the flat leaves of `args`)."""
    flat, tree = jax.tree.flatten(args)
    with jax.sharding.use_abstract_mesh(_NO_MESH):
        closed, out_shape = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)), return_shape=True)(
            *[_stand_in(x) for x in flat])
    return closed, out_shape, flat


# Primitives that only move or retype a value between devices: per device, where a body's values are local, the
# identity.
_PLACEMENTS = frozenset({"reshard", "sharding_constraint", "mesh_cast"})


def _per_device(value: Any) -> Any:
    """A program (or an equation's parameter) made to run per device, as a `shard_map` body runs it: every sharding
    on a mesh replaced by None (the primitive's default) and every placement (`_PLACEMENTS`) by its operand,
    recursively into the programs it calls.

    Traced where the hoisted values can be read, the inner transformation's program types what it derives from them
    on their mesh, and some primitives record that type (`broadcast_in_dim`'s `sharding`, as `jnp.where` broadcasts
    a hyperparameter); a function jitted inside it may also bring a program traced earlier in a `shard_map` body
    (JAX's cache keys it by its arguments' types, not by the context mesh), resharding onto that body's mesh.
    Evaluated in the body, whose context mesh is manual, both would be refused; per device, values derived from
    replicated hyperparameters are replicated, which is what the defaults give.
    """
    if isinstance(value, NamedSharding):
        return value if value.mesh.empty else None
    if isinstance(value, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
        wrapped = getattr(value, "jaxpr", value)
        if wrapped is not value:  # a ClosedJaxpr around a Jaxpr (JAX 0.10, 0.11; JAX 0.12 has one class for both)
            return value.replace(jaxpr=_per_device(wrapped))
        forwarded: dict = {}

        def read(v):
            return forwarded.get(v, v) if isinstance(v, jex_core.Var) else v
        eqns = []
        for eqn in value.eqns:
            invars = [read(v) for v in eqn.invars]
            if eqn.primitive.name in _PLACEMENTS and len(invars) == len(eqn.outvars) == 1:
                forwarded[eqn.outvars[0]] = invars[0]
                continue
            eqns.append(eqn.replace(invars=invars, params={k: _per_device(v) for k, v in eqn.params.items()}))
        return value.replace(eqns=eqns, outvars=[read(v) for v in value.outvars])
    if type(value) is tuple:
        return tuple(_per_device(v) for v in value)
    return value


def _evaluate(program, args: list, consts=None) -> list:
    """Evaluates `program` on `args` (with `consts` in place of its own constants, if given) in the current trace,
    tracing again each program it calls, branches on or loops over, so that every value is typed where it is
    computed: as tracing the inner transformation there would type it."""
    jaxpr, own = _compat.jaxpr_parts(program)
    env = dict(zip(jaxpr.constvars, own if consts is None else consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return jnp.asarray(v.val, v.aval.dtype) if isinstance(v, jex_core.Literal) else env[v]
    for eqn in jaxpr.eqns:
        outs = _equation(eqn, [read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs]))
    return [read(v) for v in jaxpr.outvars]


def _equation(eqn, ins: list):
    name, p = eqn.primitive.name, eqn.params
    if name in _compat.CALLS:
        return _evaluate(p[_compat.CALLS[name]], ins)
    if name == "cond":
        return lax.switch(ins[0], [functools.partial(_branch, b) for b in p["branches"]], *ins[1:])
    if name == "while":
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cc, bc, init = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
        return lax.while_loop(lambda c: _evaluate(p["cond_jaxpr"], [*cc, *c])[0],
                              lambda c: _evaluate(p["body_jaxpr"], [*bc, *c]), init)
    if name == "scan":
        nc, nk = _compat.scan_counts(eqn)
        consts, init, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]

        def step(carry, x):
            out = _evaluate(p["jaxpr"], [*consts, *carry, *x])
            return out[:nk], out[nk:]
        carry, ys = lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
        return [*carry, *ys]
    return eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(p))


def _branch(program, *xs) -> list:
    return _evaluate(program, list(xs))


class _Hoisted:
    """The values an inner transformation closes over that a `shard_map` body may not read (`_must_enter`), and
    engines whose inner transformation reads them from the body's arguments instead.

    `find` traces the inner `init` and `update` once on the global parameters' shapes and collects the constants
    of those programs that `_must_enter`: the values `optax.inject_hyperparams` injects, for instance. Where there
    are any, every call of the wrapped inner transformation (`init`, `update`, and the analyses of them) traces
    the real one with no context mesh, where those values can be read, and evaluates the traced program with each
    of them replaced by the body's argument that carries it (`reading`), retracing branches, loops and called
    functions on the body's values (`_evaluate`). The program is the inner transformation's; only where its
    closed-over values come from changes.
    """

    def __init__(self, cfg: _planner.Config, values: list):
        self.values = values
        self.specs = [P() for _ in values]
        self._index = {id(v): i for i, v in enumerate(values)}
        self._reading: list | None = None
        if not values:
            return
        if cfg.accumulating is None:
            cfg = dataclasses.replace(cfg, inner=self._wrap(cfg.inner))
        else:  # the accumulating transformation calls its own inner one: wrap that
            accumulating = dataclasses.replace(cfg.accumulating, inner=self._wrap(cfg.accumulating.inner))
            cfg = dataclasses.replace(cfg, inner=accumulating.transformation("final"), accumulating=accumulating)
        self.engine = _engine.Engine(cfg)
        self.mean = _engine.Engine(dataclasses.replace(cfg, reduce=None))

    @classmethod
    def find(cls, cfg: _planner.Config, params, extra: dict | None) -> _Hoisted:
        inner = cfg.inner if cfg.accumulating is None else cfg.accumulating.inner
        if not _may_reach_typed(inner):
            return cls(cfg, [])
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), cfg.inner_dtype(x.dtype)), params)
        closed_init, state, _ = _trace(inner.init, (params,))
        if extra is None:  # (at init: the update's extra arguments are found as the analyses find them)
            with jax.sharding.use_abstract_mesh(_NO_MESH):
                closed_update = _planner.trace_update(inner, params, state, params)[0].closed
        else:
            closed_update = _trace(lambda g, s, p, e: inner.update(g, s, p, **e), (params, state, params, extra))[0]
        values, seen = [], set()
        for c in (*closed_init.consts, *closed_update.consts):
            if _must_enter(c) and id(c) not in seen:
                seen.add(id(c))
                values.append(c)
        return cls(cfg, values)

    def placed(self, mesh: jax.sharding.Mesh) -> list:
        """The values, replicated over `mesh` (the arguments the `shard_map` takes them as)."""
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
            lambda updates, state, params=None, **extra: self._call(
                lambda u, s, p, e: inner.update(u, s, p, **e), (updates, state, params, extra)))

    def _call(self, fn, args: tuple):
        if self._reading is None:
            raise RuntimeError("zero1 (mesh-bound): the inner transformation was called outside its shard_map.")
        closed, out_shape, flat = _trace(fn, args)
        closed = _per_device(closed)
        consts = [self._reading[self._index[id(c)]] if id(c) in self._index else c
                  for c in _compat.jaxpr_parts(closed)[1]]
        out = _evaluate(closed, flat, consts)
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)


@dataclasses.dataclass(frozen=True)
class _Tx:
    init: Any
