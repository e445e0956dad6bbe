"""The inner update with every value typed varying across the ZeRO axes, whatever it branches on.

Inside `shard_map` JAX refuses a `lax.cond` whose branches return differently typed values, and zero1 hands the
inner update a mix: `run` evaluates its program with every operand cast to varying. With `slices` it follows each
sliced leaf's coordinates: a full reduction of them reduces across the leaf's devices (a global norm), and random
numbers drawn in a leaf's shape wait (`_Pending`) until they meet its slice, then draw the whole leaf's numbers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax import lax

from zero_optax.analysis import _programs
from zero_optax.core import _compat
from zero_optax.core._errors import ZeroCouplingError
from zero_optax.layout._stored import ParamLeaf
from zero_optax.step import _wire


def run(fn: Callable, args: Sequence[Any], axes, slices: Sequence[Any] | None = None,
        traced: Callable | None = None) -> Any:
    """`fn(*args)`, every value typed varying across `axes`; `slices`: per leaf of `args`, its coordinates or None;
    `traced(program)` receives the program `fn` was traced to, when it was (for `evaluate`)."""
    vma = _compat.vma_enabled(axes)
    if not vma and slices is None:
        return fn(*args)
    axes = frozenset(_compat.as_tuple(axes)) if vma else frozenset()
    flat, tree = jax.tree.flatten(args)
    stand_ins = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in flat]
    closed, out_shape = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)), return_shape=True)(*stand_ins)
    if traced is not None:
        traced(closed)
    out, _ = _eval(closed.jaxpr, closed.consts, [_cast(x, axes) for x in flat], axes, slices)
    return jax.tree.unflatten(jax.tree.structure(out_shape), out)


def evaluate(closed: _programs.ClosedJaxpr, flat: Sequence[Any], axes) -> list:
    """The results, flat, of a program `run` traced (and gave `traced`), on leaves `flat` of the shapes and dtypes
    it was traced on, computed as `run` computes them."""
    axes = frozenset(_compat.as_tuple(axes)) if _compat.vma_enabled(axes) else frozenset()
    return _eval(closed.jaxpr, closed.consts, [_cast(x, axes) for x in flat], axes)[0]


def like(tree: Any, reference: Any) -> Any:
    """`tree` with each leaf typed varying across at least the axes of the same leaf of `reference`."""
    if jax.tree.structure(tree) != jax.tree.structure(reference):
        return tree
    return jax.tree.map(lambda x, r: _cast(x, _axes_of(r)), tree, reference)


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
    """`xs` cast to one type: varying across `axes` and every axis any of them varies across."""
    union = frozenset(axes).union(*(_axes_of(x) for x in xs))
    return [_cast(x, union) for x in xs]


def _eval(jaxpr, consts: Sequence[Any], args: Sequence[Any], axes: frozenset,
          tags: Sequence[Any] | None = None, drawing=None) -> tuple[list, list]:
    """`jaxpr`'s results and tags, operands cast alike; `tags`: per input or None; `drawing`: as `_apply`'s `where`."""
    padded = [*(tags or ()), *[None] * len(args)]
    ins = [x if t is None else _OnSlice(x, t) for x, t in zip(args, padded)]
    outs = _programs.evaluate(jaxpr, [_cast(x, axes) for x in consts], ins,
                              functools.partial(_equation, axes, tags is not None, drawing))
    return [_cast(_Pending.settle(_value(x), None), axes) for x in outs], [_tag(x) for x in outs]


class Coordinates(NamedTuple):
    """This device's slots of the sliced `leaf` from `rank * leaf.slots` on, `valid` where not padding (None: all)."""

    valid: jax.Array | None
    axes: tuple[str, ...]
    leaf: ParamLeaf
    rank: Any


def _identity(kind: str, dtype) -> jax.Array:
    """The value that leaves a `kind` reduction unchanged, in `dtype`."""
    dtype = np.dtype(dtype)
    if kind == "sum" or dtype == np.bool_:
        return jnp.asarray(kind == "min" and dtype == np.bool_, dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.asarray(-np.inf if kind == "max" else np.inf, dtype)
    info = jnp.iinfo(dtype)
    return jnp.asarray(info.min if kind == "max" else info.max, dtype)


def without_padding(x: jax.Array, where: Coordinates, kind: str) -> jax.Array:
    """`x` (a value on `where`'s coordinates) with its padding set to the identity of a `kind` reduction."""
    if where.valid is None:
        return x
    valid = where.valid.reshape(x.shape) if where.valid.size == x.size else where.valid  # (stacked: every row)
    return jnp.where(valid, x, _identity(kind, x.dtype))


class _OnSlice(NamedTuple):
    """A value holding this device's slice of a leaf, `where` its `Coordinates`."""

    x: Any
    where: Any


def _value(x) -> Any:
    return x.x if isinstance(x, _OnSlice) else x


def _tag(x) -> Any:
    return x.where if isinstance(x, _OnSlice) else None


def _equation(axes: frozenset, tagging: bool, drawing, eqn, ins: list) -> list:
    """One equation of `_eval`: draws wait (`_Pending`) until they meet a leaf's slice, then `_tagged`."""
    raw, in_tags = [_value(x) for x in ins], [_tag(x) for x in ins]
    where = next((t for t in in_tags if t is not None), None)
    if where is None:
        if tagging and (_draws(eqn) or any(isinstance(x, _Pending) for x in raw)):
            return _Pending.of(eqn, raw, axes)  # drawn when it meets a leaf's slice
        return _apply(eqn, _joined([_Pending.settle(x, None) for x in raw], axes), axes, drawing)
    if eqn.primitive.name in _compat.CALLS:  # (pending draws meet their leaf inside)
        ins = raw
    else:
        if any(isinstance(x, _Pending) for x in raw):
            where = _one(in_tags)
        ins = _joined([_Pending.settle(x, where) for x in raw], axes)
    outs, out_tags = _tagged(eqn, ins, in_tags, axes)
    return [x if t is None else _OnSlice(x, t) for x, t in zip(outs, out_tags)]


class _Pending:
    """A result computed from random draws, evaluated (`settle`) once per leaf's slice it meets, of its numbers."""

    __slots__ = ("index", "results")

    def __init__(self, results: Callable[[Any], list], index: int):
        self.results, self.index = results, index

    @classmethod
    def of(cls, eqn, raw: list, axes: frozenset) -> list[_Pending]:
        done: dict = {}

        def results(where) -> list:
            if id(where) not in done:
                ins = _joined([cls.settle(x, where) for x in raw], axes)
                done[id(where)] = (where, _apply(eqn, ins, axes, where))
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


def _draws(eqn) -> bool:
    """Whether `eqn` draws random numbers (`random_bits`), itself or in a program it calls."""
    subs = _programs.subjaxprs(eqn.params)
    return eqn.primitive.name == "random_bits" or any(_program_draws(_compat.jaxpr_parts(sub)[0]) for sub in subs)


@functools.lru_cache(maxsize=256)
def _program_draws(jaxpr) -> bool:
    return _programs.any_equation(jaxpr, _draws)


def _whole_draw(eqn, key, where: Coordinates) -> jax.Array:
    """This device's slots of the whole leaf's `random_bits` of `key`, as plain optax draws them."""
    if where.leaf.blocks != 1:
        raise ZeroCouplingError(
            "The inner transformation adds random numbers to a parameter sharded over a tensor-parallel mesh axis; "
            "zero1 reproduces plain optax's numbers only for leaves whole on every device's block. Keep such "
            "parameters replicated over the tensor-parallel axes, or add the noise outside zero1.")
    whole = _programs.bind(eqn, [key], {**eqn.params, "shape": where.leaf.shape})[0]
    return _wire.own_slice(whole, where.leaf, where.rank).reshape(eqn.params["shape"])


def _tagged(eqn, ins: list, in_tags: list, axes: frozenset) -> tuple[list, list]:
    """One equation's results and their tags (a result holds the coordinates of a tagged operand of its size)."""
    if eqn.primitive.name in _compat.CALLS or eqn.primitive.name == "cond":
        return _programs_tagged(eqn, ins, in_tags, axes)
    if eqn.primitive.name == "scan":
        return _scan_tagged(eqn, ins, in_tags, axes)
    kind = _programs.collective_kind(eqn)
    if kind is not None:
        where = next(t for t in in_tags if t is not None)
        ins = [without_padding(x, where, kind) for x in ins]  # (a dot's operands both: 0 * inf is nan)
        return [_wire.Wire(where.axes).joint(_programs.bind(eqn, ins)[0], kind)], [None]  # over the leaf's devices
    out = _apply(eqn, ins, axes)
    tagged = [(jnp.shape(x), t) for x, t in zip(ins, in_tags) if t is not None]
    return out, [_result_tag(v.aval.shape, tagged) for v in eqn.outvars]


def _result_tag(shape: tuple[int, ...], tagged: Sequence[tuple[tuple[int, ...], Any]]) -> Any:
    """The tag of a result of `shape` from its tagged operands (`(shape, tag)`): that of one of its size, else of
    one whose last axis, like the result's, holds the leaf's slots (a row of a stacked history, `_stacked`)."""
    size = math.prod(shape)
    found = next((t for s, t in tagged if math.prod(s) == size), None)
    if found is None and shape:
        found = next((t for s, t in tagged if s and s[-1] == shape[-1] == t.leaf.slots), None)
    return found


def _scan_tagged(eqn, ins: list, in_tags: list, axes: frozenset) -> tuple[list, list]:
    """A `lax.scan` on slices (every device runs its iterations), its body evaluated with the tags of its
    constants and carry: a carry that holds a leaf's slots after some iteration holds them from the first (found
    by tracing the loop again, which the dead first trace leaves to XLA to drop)."""
    nc, nk = _compat.scan_counts(eqn)
    if any(t is not None for t in in_tags[nc + nk:]):
        raise ZeroCouplingError("The inner transformation scans over a sliced leaf's coordinates; zero1 runs a "
                                "`lax.scan` on slices only over values that are not parameter data.")
    carry = list(in_tags[nc:nc + nk])
    while True:
        found: list = []

        def run(program, args: list, carry=carry, found=found) -> list:
            outs, tags = _eval(*_compat.jaxpr_parts(program), args, axes,
                               [*in_tags[:nc], *carry, *[None] * (len(args) - nc - nk)])
            found.append(tags[:nk])
            return outs
        outs = _programs.retraced(eqn, ins, run, carry=lambda c: _joined(c, _axes_of(ins[0]) if ins else axes))
        assert outs is not None  # (a scan)
        new = [t if t is not None else o for t, o in zip(carry, found[-1])]
        if all(a is b for a, b in zip(new, carry)):
            return outs, [*carry, *[None] * (len(eqn.outvars) - nk)]
        carry = new


def _programs_tagged(eqn, ins: list, in_tags: list, axes: frozenset) -> tuple[list, list]:
    """A call or `lax.cond` on slices (the analysis proved every device takes the same branch), each program
    evaluated with the tags; a result keeps a tag they all agree on."""
    found: dict[int, list] = {}  # per program, its results' tags
    tags = in_tags[1:] if eqn.primitive.name == "cond" else in_tags  # (not the branch index)

    def run(program, args: list) -> list:
        outs, found[id(program)] = _eval(*_compat.jaxpr_parts(program), args, axes, tags)
        return outs
    outs = _programs.retraced(eqn, ins, run, _agreeing)
    assert outs is not None  # (a call or a cond)
    tags = list(found.values())
    return outs, [t if all(f[i] is t for f in tags) else None for i, t in enumerate(tags[0])]


def _agreeing(fns: Sequence[Callable], ins: Sequence[Any]) -> list[Callable]:
    """`fns` (the branches of a `lax.switch`) with each output cast to the union of its types over the branches."""
    outs = [jax.make_jaxpr(f)(*ins).out_avals for f in fns]
    types = [frozenset().union(*(_axes_of(o[k]) for o in outs)) for k in range(len(outs[0]))]
    return [lambda *xs, f=f: [_cast(x, t) for x, t in zip(f(*xs), types)] for f in fns]


def _apply(eqn, ins: list, axes: frozenset, where=None) -> list:
    """One equation's results (random draws for the slice `where` describes), its sub-programs run by `_eval`."""
    def run(program, args: list) -> list:
        return _eval(*_compat.jaxpr_parts(program), args, axes, None, where)[0]
    outs = _programs.retraced(eqn, ins, run, _agreeing, lambda carry: _joined(carry, _axes_of(ins[0]) if ins else axes))
    if outs is not None:
        return outs
    p = eqn.params
    if eqn.primitive.name == "random_bits" and where is not None and math.prod(p["shape"]) == where.leaf.slots \
            and not ins[0].shape:
        return [_whole_draw(eqn, ins[0], where)]
    return _programs.bind(eqn, ins)
