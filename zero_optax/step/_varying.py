"""The inner update with every value typed varying across the ZeRO axes, whatever it branches on.

Inside `jax.shard_map` (`check_vma=True`) JAX types each value as varying across the mesh axes or invariant, and
refuses a `lax.cond` / `lax.switch` whose branches return differently typed values, or a loop whose carry changes
type. zero1 hands the inner update a mix: sliced gradients and stored histories differ between devices, while an
owned leaf's reduced gradient, the extra arguments and injected hyperparameters are the same on all. Typed as
they come, an optax transformation that returns a constant in one branch and a value derived from its state in
the other (`optax.contrib.reduce_on_plateau`'s cooldown), or its gradient in one branch and its state in the
other (`optax.novograd`'s first step), cannot run.

`run` therefore traces the inner update once on untyped (invariant) stand-ins, where every branch agrees, and
evaluates the traced program on the real inputs with every operand and result cast to varying: each primitive
then sees operands of one type, and each branch, loop body and called function (whose own programs are evaluated
the same way) returns varying values. The casts are types only; the compiled program is the inner update's.

With `slices` (issue 29), `run` also knows which inputs hold this device's coordinate slice of a sliced leaf
(`_reduce.Coordinates`) and follows them through the program: a result of the size of such an operand holds the
same coordinates (the coupling analysis proved the update elementwise in them, but for full reductions outside
control flow). A full reduction of such a value (`_coupling.collective_kind`: a sum, max or min of all its
elements, or `jnp.vdot`) reduces the slice with its padding set to the reduction's identity and then reduces
across the leaf's devices (`_reduce.across_slices`), so every device gets what the update computes on the whole
leaf: a global norm, a trust ratio.

Random numbers drawn in a leaf's shape (`optax.add_noise`: a key per leaf, split from one key over every leaf,
`jax.random.normal(key, leaf.shape)`) are drawn in the shape of its slice on stand-ins. Their values wait
(`_Pending`) until they meet the slice of a leaf: each device then draws the whole leaf's numbers from the same
key and keeps its own slots (`_whole_draw`), which are the numbers plain optax adds to those coordinates. The
coupling analysis proved that they meet only there, elementwise, outside control flow (`_Origin.aligned`).
"""

from __future__ import annotations

import contextvars
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core

from zero_optax.analysis import _coupling
from zero_optax.core import _compat
from zero_optax.core._errors import ZeroCouplingError
from zero_optax.step import _reduce


def run(fn: Callable, args: Sequence[Any], axes, slices: Sequence[Any] | None = None) -> Any:
    """`fn(*args)`, every value typed varying across `axes` (as is, where values carry no such types).

    `slices`, if given, has one entry per leaf of `args` (in `jax.tree.leaves` order): None, or the
    `_reduce.Coordinates` of a leaf's slice it holds; full reductions of those then run across the devices.
    """
    vma = _compat.vma_enabled(axes)
    if not vma and slices is None:
        return fn(*args)
    axes = frozenset(_compat.as_tuple(axes)) if vma else frozenset()
    flat, tree = jax.tree.flatten(args)
    stand_ins = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in flat]
    closed, out_shape = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)), return_shape=True)(*stand_ins)
    out, _ = _eval(closed.jaxpr, closed.consts, [_cast(x, axes) for x in flat], axes,
                   None if slices is None else list(slices))
    return jax.tree.unflatten(jax.tree.structure(out_shape), out)


def like(tree: Any, reference: Any) -> Any:
    """`tree` with each leaf typed varying across at least the axes of the same leaf of `reference` (`tree` as
    it is where the two are structured differently: the caller refuses that)."""
    leaves, treedef = jax.tree.flatten(tree)
    ref, ref_def = jax.tree.flatten(reference)
    if treedef != ref_def:
        return tree
    return jax.tree.unflatten(treedef, [_cast(x, _axes_of(r)) for x, r in zip(leaves, ref)])


def _axes_of(x) -> frozenset:
    """The axes a value, or an abstract value, is typed varying across."""
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def _cast(x, axes: frozenset):
    """`x` typed varying across `axes` (and whatever it already varies across)."""
    x = jnp.asarray(x)
    missing = tuple(sorted(axes - _axes_of(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _joined(xs: Sequence[Any], axes: frozenset) -> list:
    """`xs` cast to one type: varying across `axes` and every axis any of them varies across. Tensor-parallel
    leaves vary across more axes than the ZeRO ones, and an operation must see its operands typed alike."""
    union = frozenset(axes).union(*(_axes_of(x) for x in xs))
    return [_cast(x, union) for x in xs]


def _eval(jaxpr, consts: Sequence[Any], args: Sequence[Any], axes: frozenset,
          tags: Sequence[Any] | None = None) -> tuple[list, list]:
    """Evaluates `jaxpr`, each equation's operands cast to one varying type (`_joined`); with `tags` (an input's
    `_reduce.Coordinates` or None), also the results' tags, and full reductions of tagged values across the
    devices (see the module docstring). Returns the results and their tags."""
    env: dict = {}
    tag: dict = {}

    def read(v):
        return jnp.asarray(v.val, v.aval.dtype) if isinstance(v, jex_core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, [_cast(x, axes) for x in consts]))
    env.update(zip(jaxpr.invars, args))
    tag.update((v, t) for v, t in zip(jaxpr.invars, tags or ()) if t is not None)
    for eqn in jaxpr.eqns:
        raw = [read(v) for v in eqn.invars]
        in_tags = [None if isinstance(v, jex_core.Literal) else tag.get(v) for v in eqn.invars]
        where = next((t for t in in_tags if t is not None), None)
        if tags is not None and where is None and (_draws(eqn) or any(isinstance(x, _Pending) for x in raw)):
            env.update(zip(eqn.outvars, _Pending.of(eqn, raw, axes)))  # drawn when it meets a leaf's slice
            continue
        if where is not None and eqn.primitive.name in _compat.CALLS:  # (pending draws meet their leaf inside)
            ins = raw
        else:
            if where is not None and any(isinstance(x, _Pending) for x in raw):
                where = _one(in_tags)
            ins = _joined([_Pending.settle(x, where) for x in raw], axes)
        outs, out_tags = _tagged(eqn, ins, in_tags, axes)
        outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
        tag.update((v, t) for v, t in zip(eqn.outvars, out_tags) if t is not None)
    return ([_cast(_Pending.settle(read(v), None), axes) for v in jaxpr.outvars],
            [None if isinstance(v, jex_core.Literal) else tag.get(v) for v in jaxpr.outvars])


_DRAWING: contextvars.ContextVar = contextvars.ContextVar("zero_optax_drawing", default=None)
"""The `_reduce.Coordinates` whose slice the random draws being evaluated are for (None: draw as traced)."""


class _Pending:
    """One result of an equation that draws random numbers, or computes from such, not evaluated yet: it is
    evaluated (`settle`) where it meets the slice of a leaf, its draws then of that leaf's numbers, once per leaf
    (a draw meeting no leaf is drawn as traced)."""

    __slots__ = ("index", "results")

    def __init__(self, results: Callable[[Any], list], index: int):
        self.results, self.index = results, index

    @classmethod
    def of(cls, eqn, raw: list, axes: frozenset) -> list[_Pending]:
        done: dict = {}

        def results(where) -> list:
            if id(where) not in done:
                ins = _joined([cls.settle(x, where) for x in raw], axes)
                token = _DRAWING.set(where)
                try:
                    out = _apply(eqn, ins, axes)
                finally:
                    _DRAWING.reset(token)
                done[id(where)] = (where, out if eqn.primitive.multiple_results else [out])
            return done[id(where)][1]
        return [cls(results, k) for k in range(len(eqn.outvars))]

    @staticmethod
    def settle(x, where) -> Any:
        return x.results(where)[x.index] if isinstance(x, _Pending) else x


def _one(tags: Sequence[Any]) -> Any:
    """The leaf whose slice random numbers that wait (`_Pending`) meet in an equation with operands `tags`."""
    found = {id(t): t for t in tags if t is not None}
    if len(found) > 1:
        raise ZeroCouplingError(
            "The inner transformation passes random numbers drawn in a leaf's shape into a branch together with "
            "several leaves' values; zero1 reproduces plain optax's numbers on slices only where they meet one "
            "leaf. Add the noise outside the branch, or outside zero1.")
    return next(iter(found.values()))


def _draws(eqn) -> bool:
    """Whether `eqn` draws random numbers (`random_bits`), itself or in a program it calls."""
    if eqn.primitive.name == "random_bits":
        return True
    return any(_program_draws(_compat.jaxpr_parts(sub)[0]) for sub in _coupling.subjaxprs(eqn.params))


@functools.lru_cache(maxsize=256)
def _program_draws(jaxpr) -> bool:
    return any(_draws(e) for e in jaxpr.eqns)


def _whole_draw(eqn, key, where) -> jax.Array:
    """`random_bits` of `key` in the shape of a slice of the leaf `where` describes: the whole leaf's bits, as plain
    optax draws them, flattened, padded as the leaf's slots are, and this device's slots of them."""
    p = eqn.params
    if where.shape is None:
        raise ZeroCouplingError(
            "The inner transformation adds random numbers to a parameter sharded over a tensor-parallel mesh axis; "
            "zero1 reproduces plain optax's numbers only for leaves whole on every device's block. Keep such "
            "parameters replicated over the tensor-parallel axes, or add the noise outside zero1.")
    whole = eqn.primitive.bind(key, **eqn.primitive.get_bind_params({**p, "shape": tuple(where.shape)}))
    flat = jnp.pad(whole.reshape(-1), (0, where.slots * where.group - whole.size))
    return lax.dynamic_slice_in_dim(flat, where.rank * where.slots, where.slots).reshape(p["shape"])


def _tagged(eqn, ins: list, in_tags: list, axes: frozenset) -> tuple[Any, list]:
    """One equation and its results' tags: a call evaluates its program with the tags, a full reduction of a
    tagged value reduces across the devices, and any other result holds the coordinates of an operand of its
    size."""
    if not any(t is not None for t in in_tags):
        return _apply(eqn, ins, axes), [None] * len(eqn.outvars)
    name = eqn.primitive.name
    if name in _compat.CALLS:
        jaxpr, consts = _compat.jaxpr_parts(eqn.params[_compat.CALLS[name]])
        return _eval(jaxpr, consts, ins, axes, in_tags)
    if name == "cond":
        return _cond(eqn, ins, in_tags, axes)
    kind = _coupling.collective_kind(eqn)
    if kind is not None:
        where = next(t for t in in_tags if t is not None)
        ins = [_reduce.without_padding(x, where, kind) for x in ins]  # (a dot's operands both: 0 * inf is nan)
        local = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
        return _reduce.across_slices(local, where, kind), [None]
    out = _apply(eqn, ins, axes)
    sized = [(jnp.size(x), t) for x, t in zip(ins, in_tags) if t is not None]
    return out, [next((t for n, t in sized if n == v.aval.size), None) for v in eqn.outvars]


def _cond(eqn, ins: list, in_tags: list, axes: frozenset) -> tuple[list, list]:
    """A `lax.cond` / `lax.switch` whose operands hold slices: each branch evaluated with the operands' tags (its
    full reductions run across the devices, which all take the branch: the analysis proved the predicate the
    same on every device). A result holds the coordinates its tag says where every branch agrees."""
    found: dict[int, list] = {}

    def branch(k, closed):
        jaxpr, consts = _compat.jaxpr_parts(closed)

        def run(*xs):
            outs, found[k] = _eval(jaxpr, consts, xs, axes, in_tags[1:])
            return outs
        return run
    fns = _agreeing([branch(k, b) for k, b in enumerate(eqn.params["branches"])], ins[1:])
    outs = lax.switch(ins[0], fns, *ins[1:])
    tags = [t if all(found[k][i] is t for k in found) else None for i, t in enumerate(found[0])]
    return outs, tags


def _closed(closed, axes: frozenset) -> Callable:
    """A function evaluating a closed jaxpr (or an open one without constants) the same way."""
    jaxpr, consts = _compat.jaxpr_parts(closed)
    return lambda *xs: _eval(jaxpr, consts, xs, axes)[0]


def _agreeing(fns: Sequence[Callable], ins: Sequence[Any]) -> list[Callable]:
    """`fns` (the branches of a `lax.switch`) with each output cast to the union of its types over the branches,
    so that every branch returns the same types."""
    outs = [jax.make_jaxpr(f)(*ins).out_avals for f in fns]
    types = [frozenset().union(*(_axes_of(o[k]) for o in outs)) for k in range(len(outs[0]))]
    return [lambda *xs, f=f: [_cast(x, t) for x, t in zip(f(*xs), types)] for f in fns]


def _apply(eqn, ins: list, axes: frozenset):
    name = eqn.primitive.name
    p = eqn.params
    if name in _compat.CALLS:
        return _closed(p[_compat.CALLS[name]], axes)(*ins)
    if name == "cond":
        branches = _agreeing([_closed(b, axes) for b in p["branches"]], ins[1:])
        return lax.switch(ins[0], branches, *ins[1:])
    if name == "while":  # (the operands are cast alike, so the carry keeps its type)
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond, body = _closed(p["cond_jaxpr"], axes), _closed(p["body_jaxpr"], axes)
        cc, bc, init = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
        return lax.while_loop(lambda c: cond(*cc, *c)[0], lambda c: _joined(body(*bc, *c), _axes_of(ins[0])),
                              init)
    if name == "scan":
        return _scan(eqn, ins, axes)
    where = _DRAWING.get()
    if name == "random_bits" and where is not None and math.prod(p["shape"]) == where.slots and not ins[0].shape:
        return _whole_draw(eqn, ins[0], where)
    return eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(p))


def _scan(eqn, ins: list, axes: frozenset) -> list:
    p = eqn.params
    body = _closed(p["jaxpr"], axes)
    nc, nk = _compat.scan_counts(eqn)
    consts, init, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
    union = _axes_of(ins[0]) if ins else axes  # (the operands are cast alike, so the carry keeps its type)

    def step(carry, x):
        out = body(*consts, *carry, *x)
        return _joined(out[:nk], union), out[nk:]

    carry, ys = lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]
