"""The inner update with every value typed varying across the ZeRO axes, whatever it branches on.

Inside `jax.shard_map` JAX refuses a `lax.cond` whose branches return differently typed (varying or invariant)
values, and zero1 hands the inner update a mix (sliced gradients vary, an owned leaf's reduced gradient and the
hyperparameters do not): `optax.contrib.reduce_on_plateau`'s cooldown or `optax.novograd`'s first step could not
run. `run` traces the update on untyped stand-ins and evaluates that program with every operand and result cast to
varying (types only: the compiled program is the inner update's). With `slices` it follows each sliced leaf's
coordinates through the program: a full reduction of them (`_primitives.collective_kind`) reduces the slice, its
padding set to the identity, across the leaf's devices (a global norm, a trust ratio); random numbers drawn in a
leaf's shape (`optax.add_noise`) wait (`_Pending`) until they meet its slice, where each device draws the whole
leaf's numbers from the same key and keeps its own (`_whole_draw`), as the coupling analysis proved exact.
"""

from __future__ import annotations

import contextvars
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from zero_optax.analysis import _primitives, _programs
from zero_optax.core import _compat
from zero_optax.core._errors import ZeroCouplingError
from zero_optax.step import _reduce


def run(fn: Callable, args: Sequence[Any], axes, slices: Sequence[Any] | None = None) -> Any:
    """`fn(*args)`, every value typed varying across `axes` (as is, where values carry no such types). `slices`:
    per leaf of `args`, None or the `_reduce.Coordinates` of the leaf's slice it holds."""
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
    """`xs` cast to one type: varying across `axes` and every axis any of them varies across (tensor-parallel
    leaves vary across more axes than the ZeRO ones)."""
    union = frozenset(axes).union(*(_axes_of(x) for x in xs))
    return [_cast(x, union) for x in xs]


def _eval(jaxpr, consts: Sequence[Any], args: Sequence[Any], axes: frozenset,
          tags: Sequence[Any] | None = None) -> tuple[list, list]:
    """Evaluates `jaxpr`, each equation's operands cast to one varying type (`_joined`); with `tags` (per input, its
    `_reduce.Coordinates` or None), also tags the results and reduces tagged values across the devices. Returns the
    results and their tags."""
    padded = [*(tags or ()), *[None] * len(args)]
    ins = [x if t is None else _OnSlice(x, t) for x, t in zip(args, padded)]
    outs = _programs.evaluate(jaxpr, [_cast(x, axes) for x in consts], ins,
                              functools.partial(_equation, axes, tags is not None))
    return [_cast(_Pending.settle(_value(x), None), axes) for x in outs], [_tag(x) for x in outs]


class _OnSlice(NamedTuple):
    """A value holding this device's slice of a leaf, `where` its `_reduce.Coordinates`."""

    x: Any
    where: Any


def _value(x) -> Any:
    return x.x if isinstance(x, _OnSlice) else x


def _tag(x) -> Any:
    return x.where if isinstance(x, _OnSlice) else None


def _equation(axes: frozenset, tagging: bool, eqn, ins: list) -> list:
    """One equation of `_eval`: draws wait (`_Pending`) until they meet a leaf's slice, then `_tagged`."""
    raw, in_tags = [_value(x) for x in ins], [_tag(x) for x in ins]
    where = next((t for t in in_tags if t is not None), None)
    if tagging and where is None and (_draws(eqn) or any(isinstance(x, _Pending) for x in raw)):
        return _Pending.of(eqn, raw, axes)  # drawn when it meets a leaf's slice
    if where is not None and eqn.primitive.name in _compat.CALLS:  # (pending draws meet their leaf inside)
        ins = raw
    else:
        if where is not None and any(isinstance(x, _Pending) for x in raw):
            where = _one(in_tags)
        ins = _joined([_Pending.settle(x, where) for x in raw], axes)
    outs, out_tags = _tagged(eqn, ins, in_tags, axes)
    return [x if t is None else _OnSlice(x, t) for x, t in zip(outs, out_tags)]


_DRAWING: contextvars.ContextVar = contextvars.ContextVar("zero_optax_drawing", default=None)
"""The `_reduce.Coordinates` whose slice the random draws being evaluated are for (None: draw as traced)."""


class _Pending:
    """A result of an equation that draws random numbers, or computes from such, evaluated (`settle`) where it
    meets a leaf's slice, its draws then of that leaf's numbers, once per leaf (meeting none: drawn as traced)."""

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
                done[id(where)] = (where, out)
            return done[id(where)][1]
        return [cls(results, k) for k in range(len(eqn.outvars))]

    @staticmethod
    def settle(x, where) -> Any:
        return x.results(where)[x.index] if isinstance(x, _Pending) else x


def _one(tags: Sequence[Any]) -> Any:
    """The leaf whose slice waiting random numbers (`_Pending`) meet in an equation with operands `tags`."""
    found = {id(t): t for t in tags if t is not None}
    if len(found) > 1:
        raise ZeroCouplingError(
            "The inner transformation passes random numbers drawn in a leaf's shape into a branch together with "
            "several leaves' values; zero1 reproduces plain optax's numbers on slices only where they meet one "
            "leaf. Add the noise outside the branch, or outside zero1.")
    return next(iter(found.values()))


def _is_draw(eqn) -> bool:
    return eqn.primitive.name == "random_bits"


def _draws(eqn) -> bool:
    """Whether `eqn` draws random numbers (`random_bits`), itself or in a program it calls."""
    subs = _primitives.subjaxprs(eqn.params)
    return _is_draw(eqn) or any(_program_draws(_compat.jaxpr_parts(sub)[0]) for sub in subs)


@functools.lru_cache(maxsize=256)
def _program_draws(jaxpr) -> bool:
    return _programs.any_equation(jaxpr, _is_draw)


def _whole_draw(eqn, key, where) -> jax.Array:
    """`random_bits` of `key` in the shape of a slice of the leaf `where` describes: the whole leaf's bits, as plain
    optax draws them, flattened, padded as the leaf's slots are, and this device's slots of them."""
    p = eqn.params
    if where.shape is None:
        raise ZeroCouplingError(
            "The inner transformation adds random numbers to a parameter sharded over a tensor-parallel mesh axis; "
            "zero1 reproduces plain optax's numbers only for leaves whole on every device's block. Keep such "
            "parameters replicated over the tensor-parallel axes, or add the noise outside zero1.")
    whole = _programs.bind(eqn, [key], {**p, "shape": tuple(where.shape)})[0]
    flat = jnp.pad(whole.reshape(-1), (0, where.slots * where.group - whole.size))
    return lax.dynamic_slice_in_dim(flat, where.rank * where.slots, where.slots).reshape(p["shape"])


def _tagged(eqn, ins: list, in_tags: list, axes: frozenset) -> tuple[list, list]:
    """One equation and its results' tags: a call evaluates its program with the tags, a full reduction of a tagged
    value reduces across the devices, any other result holds the coordinates of an operand of its size."""
    if not any(t is not None for t in in_tags):
        return _apply(eqn, ins, axes), [None] * len(eqn.outvars)
    name = eqn.primitive.name
    if name in _compat.CALLS:
        jaxpr, consts = _compat.jaxpr_parts(eqn.params[_compat.CALLS[name]])
        return _eval(jaxpr, consts, ins, axes, in_tags)
    if name == "cond":
        return _cond(eqn, ins, in_tags, axes)
    kind = _primitives.collective_kind(eqn)
    if kind is not None:
        where = next(t for t in in_tags if t is not None)
        ins = [_reduce.without_padding(x, where, kind) for x in ins]  # (a dot's operands both: 0 * inf is nan)
        return [_reduce.across_slices(_programs.bind(eqn, ins)[0], where, kind)], [None]
    out = _apply(eqn, ins, axes)
    sized = [(jnp.size(x), t) for x, t in zip(ins, in_tags) if t is not None]
    return out, [next((t for n, t in sized if n == v.aval.size), None) for v in eqn.outvars]


def _cond(eqn, ins: list, in_tags: list, axes: frozenset) -> tuple[list, list]:
    """A `lax.cond` whose operands hold slices: each branch evaluated with their tags (its full reductions run
    across the devices, which all take the branch: the analysis proved the predicate the same on every device). A
    result holds the coordinates its tag says where every branch agrees."""
    found: dict[int, list] = {}  # per branch, its results' tags

    def run(program, args: list) -> list:
        outs, found[id(program)] = _eval(*_compat.jaxpr_parts(program), args, axes, in_tags[1:])
        return outs
    outs = _programs.retraced(eqn, ins, run, _agreeing)
    tags = list(found.values())
    return outs, [t if all(f[i] is t for f in tags) else None for i, t in enumerate(tags[0])]


def _run(program, args: list, axes: frozenset) -> list:
    return _eval(*_compat.jaxpr_parts(program), args, axes)[0]


def _agreeing(fns: Sequence[Callable], ins: Sequence[Any]) -> list[Callable]:
    """`fns` (the branches of a `lax.switch`) with each output cast to the union of its types over the branches."""
    outs = [jax.make_jaxpr(f)(*ins).out_avals for f in fns]
    types = [frozenset().union(*(_axes_of(o[k]) for o in outs)) for k in range(len(outs[0]))]
    return [lambda *xs, f=f: [_cast(x, t) for x, t in zip(f(*xs), types)] for f in fns]


def _apply(eqn, ins: list, axes: frozenset) -> list:
    """One equation's results; the programs it calls, branches on or loops over evaluated by `_eval` (the operands
    are cast alike, so a loop's carry keeps its type)."""
    outs = _programs.retraced(eqn, ins, functools.partial(_run, axes=axes), _agreeing,
                              lambda carry: _joined(carry, _axes_of(ins[0]) if ins else axes))
    if outs is not None:
        return outs
    where = _DRAWING.get()
    p = eqn.params
    if eqn.primitive.name == "random_bits" and where is not None and math.prod(p["shape"]) == where.slots \
            and not ins[0].shape:
        return [_whole_draw(eqn, ins[0], where)]
    return _programs.bind(eqn, ins)
