"""The inner transformation's programs: what each JAX primitive does, as the analyses read it; the update traced
once, named per leaf (`leaf_programs`, by which the plan groups and stacks leaves), and interpreted: the rest of the
package runs and searches programs only through this module.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from zero_optax.core import _compat

ClosedJaxpr = jcore.ClosedJaxpr  # pyright: ignore[reportPrivateImportUsage]  # JAX 0.12 aliases it without export
"""A traced program (JAX 0.12 has one class for it and `Jaxpr`)."""

# Every output coordinate depends only on the same coordinate of each operand (operands of another size are
# checked separately).
ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "bessel_i0e",
    "bessel_i1e", "bitcast_convert_type", "cbrt", "ceil", "clamp", "clz", "complex", "conj", "convert_element_type",
    "copy", "copy_p", "cos", "cosh", "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor",
    "ge", "gt", "igamma", "igamma_grad_a", "igammac", "imag", "integer_pow", "is_finite", "le", "lgamma", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "mulhi", "ne", "neg", "nextafter", "not", "or", "polygamma",
    "population_count", "pow", "random_gamma_grad", "real", "reduce_precision", "regularized_incomplete_beta", "rem",
    "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sinh",
    "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor", "zeta",
})
# Identity on each operand separately (outputs[i] is operands[i]).
PER_OPERAND_IDENTITY = frozenset({
    "device_put", "optimization_barrier", "sharding_constraint", "layout_constraint", "reshard", "pvary",
})
# Reductions with an `axes` parameter, and cumulative ops with an `axis`.
REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor", "argmax",
    "argmin",
})
CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
# Not elementwise, but uniform operands give a uniform result: moving, reducing or contracting equal values.
UNIFORM_PRESERVING = REDUCTIONS | {
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "slice", "rev", "dynamic_slice",
    "dot_general", "sort", "split", "unstack", "tile", "zeros_like", "reduce",
}
# Non-scalar results may differ by position even from uniform operands (`concatenate([zeros, ones])`, `cumsum`).
POSITIONAL = CUMULATIVE | {
    "iota", "iota_2x32_shape", "concatenate", "stack", "pad", "gather", "scatter", "scatter-add", "scatter_add",
    "scatter-sub", "scatter-mul", "scatter-min", "scatter-max", "dynamic_update_slice", "conv_general_dilated",
    "reduce_window", "reduce_window_sum", "reduce_window_max", "reduce_window_min", "select_and_scatter",
    "select_and_scatter_add", "select_and_gather_add", "fft", "cholesky", "cholesky_update", "eig", "eigh", "lu",
    "lu_pivots_to_permutation", "qr", "geqrf", "geqp3", "householder_product", "ormqr", "svd", "schur", "hessenberg",
    "triangular_solve", "tridiagonal", "tridiagonal_solve", "symmetric_product", "top_k", "approx_top_k",
    "ragged_dot_general",
}
# Random primitives: those producing random numbers, and those making or transforming PRNG keys.
RANDOM_NUMBERS = frozenset({
    "random_bits", "random_gamma", "threefry2x32", "threefry4x32", "philox2x32", "philox4x32", "rng_bit_generator",
    "rng_uniform", "prng_random_bits",
})
RANDOM_KEYS = frozenset({
    "random_seed", "random_wrap", "random_unwrap", "random_split", "random_fold_in", "random_clone", "prng_seed",
})
RANDOM = RANDOM_NUMBERS | RANDOM_KEYS
# Opaque primitives the analyses never look into (even if they carry a jaxpr).
KERNELS = frozenset({
    "pallas_call", "custom_call", "ffi_call", "tpu_custom_call", "custom_partitioning", "cudnn_fusion", "custom_fusion",
})
CALLBACKS = frozenset({"pure_callback", "io_callback", "buffer_callback"})
# Effects with no results: nothing flows out of them.
SINKS = frozenset({"debug_callback", "debug_print"})
# Call-like primitives: operands and results map 1:1 onto their one sub-jaxpr.
CALLS = frozenset(_compat.CALLS) | {"remat2"}
CONTROL = frozenset({"cond", "while", "scan"})
KNOWN = ELEMENTWISE | PER_OPERAND_IDENTITY | UNIFORM_PRESERVING | POSITIONAL | RANDOM | SINKS | CALLS | CONTROL

_COLLECTIVE_KINDS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "dot_general": "sum"}


def shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


def size(atom: Any) -> int:
    return math.prod(shape(atom))


def dtype(atom: Any) -> Any:
    """The dtype of a variable or literal (JAX types `aval` as an `AbstractValue`, which has none)."""
    return atom.aval.dtype


def subjaxprs(params: dict[str, Any]) -> list[Any]:
    """Every sub-jaxpr in an equation's params (ClosedJaxpr or Jaxpr, possibly in tuples), as found."""
    return [item for value in params.values() for item in (value if isinstance(value, (tuple, list)) else (value,))
            if isinstance(item, (ClosedJaxpr, jcore.Jaxpr))]


def call_body(eqn: Any) -> Any:
    """The sub-jaxpr of a call-like equation whose inputs and outputs are the equation's, or None."""
    name = eqn.primitive.name
    candidates = subjaxprs(eqn.params)
    if name not in CALLS and (name in KNOWN or name in KERNELS or name in CALLBACKS or len(candidates) != 1):
        return None  # (`reduce`'s reducer or a kernel's body is no call; an unknown primitive, shard_map, must fit)
    for sub in candidates:
        inner = _compat.jaxpr_parts(sub)[0]
        if len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars):
            return sub
    return None


def collective_kind(eqn: Any) -> str | None:
    """`"sum"`, `"max"` or `"min"` if `eqn` reduces whole arrays to one element (`reduce_*` over the last axis
    among others, or a `dot_general` of two operands of one shape contracting all their axes in order: `jnp.vdot`),
    else None. (A reduction of `(memory, 1)` over its first axis reduces a history stacked along it, one coordinate
    per device: no collective.)"""
    name = eqn.primitive.name
    kind = _COLLECTIVE_KINDS.get(name)
    if kind is None or not eqn.outvars or size(eqn.outvars[0]) != 1:
        return None
    if name != "dot_general" and len(shape(eqn.invars[0])) > 1 and len(shape(eqn.invars[0])) - 1 not in \
            eqn.params["axes"]:
        return None
    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = eqn.invars
        dims = tuple(range(len(shape(lhs))))
        if lb or rb or shape(lhs) != shape(rhs) or tuple(lc) != dims or tuple(rc) != dims:
            return None
    return kind


# Collective primitives (as JAX names them across versions) and the HLO collective each lowers to.
COLLECTIVES = {
    "psum": "all-reduce", "psum2": "all-reduce", "psum_invariant": "all-reduce", "pmax": "all-reduce",
    "pmin": "all-reduce", "reduce_scatter": "reduce-scatter", "all_gather": "all-gather",
    "all_gather_invariant": "all-gather", "all_to_all": "all-to-all", "ppermute": "collective-permute",
}


class Collective(NamedTuple):
    """One collective of a program: its HLO kind, the mesh axes it runs over, the bytes of its full tensor per
    device (the all-reduced buffer, the gathered result, the un-scattered operand), and how many `times` it runs."""

    kind: str
    axes: tuple[str, ...]
    nbytes: int
    times: int = 1


def _nbytes(atoms: Sequence[Any]) -> int:
    return sum(size(a) * np.dtype(a.aval.dtype).itemsize for a in atoms)


def _live(program: Any, live: Sequence[bool] | None) -> tuple[list[tuple[Any, list[bool]]], list[bool]]:
    """The equations of `program` that lowering keeps when only the outputs `live` are used (None: all), each with
    which of its outputs are used; and which inputs are."""
    jaxpr = _compat.jaxpr_parts(program)[0]
    used = {v for v, keep in zip(jaxpr.outvars, live or [True] * len(jaxpr.outvars))
            if keep and isinstance(v, jcore.Var)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        outs = [v in used for v in eqn.outvars]
        if not (any(outs) or any(type(e).__name__ != "NamedAxisEffect" for e in eqn.effects)):
            continue  # (a collective's axis names are no effect that keeps it)
        kept.append((eqn, outs))
        body = call_body(eqn)
        if eqn.primitive.name == "cond":  # (the branch index, then the operands some branch uses)
            ins = [True, *map(any, zip(*(_live(b, outs)[1] for b in eqn.params["branches"])))]
        else:
            ins = [True] * len(eqn.invars) if body is None else _live(body, outs)[1]
        used.update(v for v, u in zip(eqn.invars, ins) if u and isinstance(v, jcore.Var))
    return kept[::-1], [v in used for v in jaxpr.invars]


def collectives(program: Any, count: int = 1, live: Sequence[bool] | None = None) -> list[Collective]:
    """Every collective `program` runs whose result is used (as lowering keeps them; `live`: which outputs are),
    in order: a `scan` body's `length` times; of a `cond`, the branch that moves the most bytes (a call runs one)."""
    out: list[Collective] = []
    for eqn, outs in _live(program, live)[0]:
        name, params = eqn.primitive.name, eqn.params
        kind = COLLECTIVES.get(name)
        if kind is not None:
            axes = params.get("axes", params.get("axis_name"))
            atoms = eqn.outvars if kind == "all-gather" else eqn.invars
            out.append(Collective(kind, (axes,) if isinstance(axes, str) else tuple(axes), _nbytes(atoms), count))
        elif name == "cond":
            found = [collectives(b, count, outs) for b in params["branches"]]
            out += max(found, key=lambda c: sum(x.nbytes * x.times for x in c))
        elif (body := call_body(eqn)) is not None:
            out += collectives(body, count, outs)
        else:
            times = count * (params["length"] if name == "scan" else 1)
            for sub in subjaxprs(params):
                out += collectives(sub, times)
    return out


class Traced(NamedTuple):
    """A function traced once (`trace`), for several analyses of the same program."""

    closed: ClosedJaxpr
    out_shape: Any
    args: tuple[Any, ...]


def trace(fn: Callable[..., Any] | Traced, *args: Any) -> Traced:
    """`fn(*args)` traced, which every analysis accepts in place of `fn` (with no args); `fn` if already traced."""
    if isinstance(fn, Traced):
        return fn
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    return Traced(closed, out_shape, args)


def labels(traced: Traced, sources: Any, out_sources: Any) -> tuple[list[int | None], list[int | None] | None]:
    """One label per input of `traced` from `sources` (a prefix of its args, None a leaf), and per output from
    `out_sources` (a prefix of its output), or None without `out_sources`."""
    jaxpr = traced.closed.jaxpr
    ins = _expand(tuple(sources), traced.args, len(jaxpr.invars), "sources", "array inputs")
    if out_sources is None:
        return ins, None
    return ins, _expand(out_sources, traced.out_shape, len(jaxpr.outvars), "out_sources", "outputs")


def _expand(sources: Any, tree: Any, count: int, name: str, what: str) -> list[int | None]:
    """`sources` flattened to one label per leaf of `tree`, checked to be `count` labels."""
    prefix = jax.tree.structure(sources, is_leaf=lambda x: x is None)
    found = [lab for lab, sub in zip(prefix.flatten_up_to(sources), prefix.flatten_up_to(tree))
             for _ in jax.tree.leaves(sub)]
    if len(found) != count:
        raise ValueError(f"{name} give {len(found)} labels but fn has {count} {what}")
    return [None if lab is None else int(lab) for lab in found]


# Primitives that only move or reshape values; their count differs between a scalar leaf and its 1-element slice.
_SHAPE_ONLY = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type", "copy",
                         "copy_p", "pjit", "jit", "closed_call", "reshard"})
# Equation parameters that describe shapes, axes or program structure: they differ between a tensor and its slice.
_SHAPE_PARAMS = frozenset({
    "shape", "dimensions", "broadcast_dimensions", "axes", "axis", "dimension", "sizes", "new_sizes", "start_indices",
    "limit_indices", "slice_sizes", "strides", "permutation", "length", "num_consts", "num_carry", "cond_nconsts",
    "body_nconsts", "sharding", "out_sharding", "split_transpose", "_split_transpose",
})


def signature(jaxpr: jcore.Jaxpr, known: dict[Any, str], out: list[str]) -> None:
    """Appends to `out` one entry per equation of `jaxpr` (sub-jaxprs included, shape-only ones left out), such as
    `mul(_,0.9)` (`known`: scalar values by var), equal on a leaf and its slice for an elementwise update. Integer
    arithmetic on known scalars (an index normalised against a dimension: `select_n(lt(0,0),0,add(0,5))`) is
    folded into the value it computes, which the equations reading it show (or an entry, where `jaxpr` returns
    it)."""
    folded = set()
    for eqn in jaxpr.eqns:
        values = [_scalar_repr(v.val) if isinstance(v, jcore.Literal) else known.get(v) for v in eqn.invars]
        name = eqn.primitive.name
        value = _folded(eqn, values)
        if value is not None:
            known[eqn.outvars[0]] = value
            folded.add(eqn.outvars[0])
            continue
        if name not in _SHAPE_ONLY:
            out.append(_signature_entry(eqn, _indices_that_matter(eqn, values)))
        elif name not in CALLS and values and values[0] is not None:
            known[eqn.outvars[0]] = values[0]  # a moved or broadcast known scalar has the same value
        _bodies(eqn, values, out)
    out.extend(f"={known[v]}" for v in jaxpr.outvars if isinstance(v, jcore.Var) and v in folded)


_FOLDABLE: dict[str, Callable[..., Any]] = {
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal,
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "neg": np.negative, "max": np.maximum, "min": np.minimum,
    "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor, "not": np.invert,
    "select_n": lambda which, *cases: cases[int(which)], "clamp": lambda lo, x, hi: np.minimum(np.maximum(x, lo), hi),
}
"""Integer and boolean arithmetic `signature` computes on known scalars (as XLA does, wrapping on overflow)."""


def _folded(eqn: Any, values: Sequence[str | None]) -> str | None:
    """The value of `eqn`, integer or boolean arithmetic on the known scalars `values` only, or None."""
    fn = _FOLDABLE.get(eqn.primitive.name)
    known = [x for x in values if x is not None]
    atoms = [*eqn.invars, *eqn.outvars]
    if fn is None or not known or len(known) != len(values) or len(eqn.outvars) != 1 or \
            not all(size(v) == 1 and np.dtype(dtype(v)).kind in "biu" for v in atoms):
        return None
    try:
        ins = [np.asarray(x == "True" if np.dtype(dtype(v)).kind == "b" else int(x), dtype(v))
               for x, v in zip(known, eqn.invars)]
        with np.errstate(all="ignore"):
            return _scalar_repr(np.asarray(fn(*ins)).astype(dtype(eqn.outvars[0])))
    except (TypeError, ValueError, OverflowError):
        return None


def _indices_that_matter(eqn: Any, operands: Sequence[Any]) -> list[Any]:
    """`operands` of `eqn` without the start indices of a `dynamic_slice` (`dynamic_update_slice`) along dimensions
    it takes (writes) whole, which XLA clamps to 0 whatever they are: `x[i]` of a history `(memory, *shape)` indexes
    the memory axis alone, on the parameter as on its slice `(memory, slots)`."""
    name = eqn.primitive.name
    if name == "dynamic_slice":
        whole, first = tuple(eqn.params["slice_sizes"]), 1
    elif name == "dynamic_update_slice":
        whole, first = shape(eqn.invars[1]), 2
    else:
        return list(operands)
    dims = shape(eqn.invars[0])
    if len(operands) < first + len(dims):
        return list(operands)
    kept = [x for d, x in enumerate(operands[first:first + len(dims)]) if whole[d] != dims[d]]
    return [*operands[:first], *kept, *operands[first + len(dims):]]


def _bodies(eqn: Any, values: Sequence[str | None], out: list[str]) -> None:
    """`signature` of `eqn`'s sub-jaxprs; a call's body knows the scalar operands `values` of the call."""
    body = call_body(eqn)
    for sub in subjaxprs(eqn.params):
        jaxpr, inner = _compat.jaxpr_parts(sub)[0], known_consts(sub)
        if sub is body:
            inner.update((v, x) for v, x in zip(jaxpr.invars, values) if x is not None)
        signature(jaxpr, inner, out)


def leaf_programs(fn: Callable[..., Any] | Traced, *args: Any, sources: Any, out_sources: Any,
                  names: dict[str, str] | None = None, collective: bool = False) -> dict[int | None, tuple[str, ...]]:
    """Label (or None: the unlabelled outputs) -> the program `fn` runs on that leaf, for every label no equation
    mixes with another (`sources`, `out_sources`: as for `_coupling.analyze_leaves`). Operands are named by where
    they come from (shared values by what computes them, in `names`, shared across traces); with `collective`, a
    full reduction of one leaf is its program's but its result carries no label."""
    program = trace(fn, *args)
    walker = _LeafPrograms(program.closed, {} if names is None else names, collective)
    in_labels, out_labels = labels(program, sources, out_sources)
    assert out_labels is not None  # as `out_sources` is given
    return walker.run(in_labels, out_labels)


class _LeafPrograms:
    """The walk of `leaf_programs`: per variable its label and its name, per label its program."""

    def __init__(self, closed: ClosedJaxpr, names: dict[str, str], collective: bool = False):
        self.closed = closed
        self.names = names
        self.collective = collective
        self.label_of: dict[Any, int] = {}
        self.name: dict[Any, str] = dict.fromkeys(closed.jaxpr.constvars, "c?")
        self.name.update((v, f"k{x}") for v, x in known_consts(closed).items())
        self.programs: dict[int | None, list[str]] = {None: []}
        self.counts: dict[int, int] = {}
        self.mixed: set[int] = set()

    def run(self, in_labels: list[int | None], out_labels: list[int | None]) -> dict[int | None, tuple[str, ...]]:
        jaxpr = self.closed.jaxpr
        unlabelled = 0
        for var, lab in zip(jaxpr.invars, in_labels):
            if lab is None:
                self.name[var] = f"in{unlabelled}:{dtype(var)}"
                unlabelled += 1
            else:
                self._own(var, lab)
                self.programs.setdefault(lab, []).append(f"in:{dtype(var)}")
        self._walk(jaxpr.eqns)
        for var, lab in zip(jaxpr.outvars, out_labels):
            if lab is not None and not isinstance(var, jcore.Literal) and self.label_of.get(var, lab) != lab:
                self.mixed.add(lab)
            self.programs.setdefault(lab, []).append(f"out:{self._ref(var)}:{dtype(var)}")
        return {lab: tuple(prog) for lab, prog in self.programs.items() if lab not in self.mixed}

    def _own(self, var: Any, lab: int) -> None:
        self.label_of[var] = lab
        self.name[var] = f"x{self.counts.get(lab, 0)}"
        self.counts[lab] = self.counts.get(lab, 0) + 1

    def _ref(self, v: Any) -> str:
        return f"k{_scalar_repr(v.val)}" if isinstance(v, jcore.Literal) else self.name.get(v, "?")

    def _alias(self, dst: Any, src: Any) -> None:
        self.name[dst] = self._ref(src)
        if not isinstance(src, jcore.Literal) and src in self.label_of:
            self.label_of[dst] = self.label_of[src]
        else:
            self.label_of.pop(dst, None)

    def _walk(self, eqns: Sequence[Any]) -> None:
        for eqn in eqns:
            body = call_body(eqn) if eqn.primitive.name in CALLS else None
            if body is not None:
                self._inline(eqn, body)
                continue
            labs = {self.label_of[v] for v in eqn.invars if not isinstance(v, jcore.Literal) and v in self.label_of}
            if len(labs) > 1:
                self.mixed.update(labs)
                for out in eqn.outvars:
                    self.label_of[out], self.name[out] = min(labs), "?"
            elif eqn.primitive.name in _SHAPE_ONLY and eqn.primitive.name not in CALLS and len(eqn.invars) == 1:
                for out in eqn.outvars:  # a moved value is the same value
                    self._alias(out, eqn.invars[0])
            else:
                self._equation(eqn, labs.pop() if labs else None)

    def _inline(self, eqn: Any, body: Any) -> None:
        """A call (a jit over a whole tree): its equations, as if written in place."""
        sub = _compat.jaxpr_parts(body)[0]
        self.name.update((v, "c?") for v in sub.constvars)
        self.name.update((v, f"k{x}") for v, x in known_consts(body).items())
        for inner, outer in zip(sub.invars, eqn.invars):
            self._alias(inner, outer)
        self._walk(sub.eqns)
        for outer, inner in zip(eqn.outvars, sub.outvars):
            self._alias(outer, inner)

    def _equation(self, eqn: Any, lab: int | None) -> None:
        refs = [self._ref(v) for v in eqn.invars]
        values = [r[1:] if r.startswith("k") else None for r in refs]  # known scalars by value
        value = _folded(eqn, values)
        if value is not None:  # (shared: integer arithmetic on known scalars, named by its value as `signature`)
            self.label_of.pop(eqn.outvars[0], None)
            self.name[eqn.outvars[0]] = f"k{value}"
            return
        body: list[str] = []
        _bodies(eqn, values, body)
        entry = (f"{_signature_entry(eqn, [None] * len(refs))}({','.join(_indices_that_matter(eqn, refs))})"
                 + (f"{{{';'.join(body)}}}" if body else ""))
        if lab is None:  # shared: named by what computes it
            for i, out in enumerate(eqn.outvars):
                self.label_of.pop(out, None)
                self.name[out] = self.names.setdefault(f"{entry}#{i}", f"s{len(self.names)}")
            return
        self.programs[lab].append(entry)
        if self.collective and collective_kind(eqn) is not None:  # the same scalar on every device
            for out in eqn.outvars:
                self.label_of.pop(out, None)
                self.name[out] = f"r{lab}.{self.counts.get(lab, 0)}"
                self.counts[lab] = self.counts.get(lab, 0) + 1
            return
        for out in eqn.outvars:
            self._own(out, lab)


def _signature_entry(eqn: Any, values: Sequence[str | None]) -> str:
    """`name[param=value,...](operand,...)` for `signature`."""
    params = [f"{k}={_param_repr(v)}" for k, v in sorted(eqn.params.items())
              if k not in _SHAPE_PARAMS and _param_repr(v) is not None]
    entry = eqn.primitive.name + (f"[{','.join(params)}]" if params else "")
    if any(x is not None for x in values):
        entry += "(" + ",".join("_" if x is None else x for x in values) + ")"
    return entry


def _param_repr(value: Any) -> str | None:
    """A stable string for a scalar-like equation parameter, or None for anything else."""
    if isinstance(value, (bool, int, float, complex, str, np.generic, enum.Enum)):
        return repr(value)
    if isinstance(value, np.dtype):
        return str(value)
    return None


def _scalar_repr(value: Any) -> str | None:
    """`repr` of a one-element array's value, or None if it has more elements (or none)."""
    try:
        array = np.asarray(value)
    except (TypeError, RuntimeError):  # a PRNG key array or a tracer; an array deleted or not on this host
        return None
    return repr(array.reshape(()).item()) if array.size == 1 else None


def known_consts(program: Any) -> dict[Any, str]:
    """The scalar constants of a program, by constvar."""
    jaxpr, consts = _compat.jaxpr_parts(program)
    found = ((v, _scalar_repr(c)) for v, c in zip(jaxpr.constvars, consts))
    return {v: x for v, x in found if x is not None}


def bind(eqn: Any, ins: Sequence[Any], params: dict[str, Any] | None = None) -> list:
    """`eqn`'s primitive bound to `ins` (with `params` in place of its own, if given): its results, as a list."""
    out = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params if params is None else params))
    return list(out) if eqn.primitive.multiple_results else [out]


def evaluate(jaxpr: jcore.Jaxpr, consts: Sequence[Any], args: Sequence[Any],
             rule: Callable[[Any, list], list | None] | None = None, literal: Callable | None = None) -> list:
    """Runs `jaxpr` on `consts` and `args` in the current trace; `rule(eqn, ins)` gives an equation's results, or
    None to bind it as it is. `literal(atom)` reads a literal, by default as an array (an analysis reads facts)."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        if isinstance(v, jcore.Literal):
            return jnp.asarray(v.val, dtype(v)) if literal is None else literal(v)
        return env[v]
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = None if rule is None else rule(eqn, ins)
        env.update(zip(eqn.outvars, bind(eqn, ins) if outs is None else outs))
    return [read(v) for v in jaxpr.outvars]


def retraced(eqn: Any, ins: list[Any], run: Callable[[Any, list], list],
             branches: Callable | None = None, carry: Callable[[list], list] | None = None) -> list | None:
    """The results of a call, branch or loop whose programs `run(program, args)` runs again in the current trace,
    or None for any other equation. `branches(fns, operands)` may adapt the branches, `carry(values)` a loop's."""
    name, p = eqn.primitive.name, eqn.params
    carry = carry or (lambda values: values)
    if name in _compat.CALLS:
        return run(p[_compat.CALLS[name]], list(ins))
    if name == "cond":
        fns = [lambda *xs, b=b: run(b, list(xs)) for b in p["branches"]]
        return lax.switch(ins[0], fns if branches is None else branches(fns, ins[1:]), *ins[1:])
    if name == "while":
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cc, bc, init = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
        return lax.while_loop(lambda c: run(p["cond_jaxpr"], [*cc, *c])[0],
                              lambda c: carry(run(p["body_jaxpr"], [*bc, *c])), init)
    if name == "scan":
        nc, nk = _compat.scan_counts(eqn)
        consts, init, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]

        def step(c, x):
            out = run(p["jaxpr"], [*consts, *c, *x])
            return carry(out[:nk]), out[nk:]
        c, ys = lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
        return [*c, *ys]
    return None


def value_dependent(program: Any) -> list[bool]:
    """For each output of `program`, whether it may depend on the values of its inputs, not only on their shapes
    and dtypes (an equation holding sub-programs: each output on any operand)."""
    jaxpr = _compat.jaxpr_parts(program)[0]
    reads = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, jcore.Literal) and v in reads for v in eqn.invars):
            reads.update(eqn.outvars)
    return [not isinstance(v, jcore.Literal) and v in reads for v in jaxpr.outvars]


def any_equation(program: Any, predicate: Callable[[Any], bool]) -> bool:
    """Whether `predicate` holds for an equation of `program` or of a program it holds (in any equation's params)."""
    for eqn in _compat.jaxpr_parts(program)[0].eqns:
        if predicate(eqn) or any(any_equation(sub, predicate) for sub in subjaxprs(eqn.params)):
            return True
    return False


def rewrite(program: Any, rule: Callable[[Any], Any], param: Callable[[Any], Any] | None = None) -> Any:
    """`program` with `rule(eqn)` (an equation, or None to drop one of one operand, forwarding it) in place of each
    equation, whose operands, sub-programs and other parameters (`param(value)`, if given) are rewritten first."""
    wrapped = getattr(program, "jaxpr", program)
    if wrapped is not program:  # a ClosedJaxpr around a Jaxpr (JAX 0.10, 0.11; JAX 0.12 has one class for both)
        return program.replace(jaxpr=rewrite(wrapped, rule, param))
    forwarded: dict = {}

    def read(v):
        return forwarded.get(v, v) if isinstance(v, jcore.Var) else v
    eqns = []
    for eqn in program.eqns:
        eqn = eqn.replace(invars=[read(v) for v in eqn.invars],
                          params={k: _rewritten(v, rule, param) for k, v in eqn.params.items()})
        new = rule(eqn)
        if new is None:
            forwarded[eqn.outvars[0]] = eqn.invars[0]
        else:
            eqns.append(new)
    return program.replace(eqns=eqns, outvars=[read(v) for v in program.outvars])


def _rewritten(value: Any, rule: Callable[[Any], Any], param: Callable[[Any], Any] | None) -> Any:
    if isinstance(value, (ClosedJaxpr, jcore.Jaxpr)):
        return rewrite(value, rule, param)
    if type(value) is tuple:
        return tuple(_rewritten(v, rule, param) for v in value)
    return value if param is None else param(value)


def vectorisable(program: Any) -> bool:
    """Whether `jax.vmap` can run `program` (it refuses a `pure_callback` without `vmap_method`, an ordered
    `io_callback`)."""
    return not any_equation(program, _unbatchable)


def _unbatchable(eqn: Any) -> bool:
    name, params = eqn.primitive.name, eqn.params
    return ((name == "pure_callback" and params.get("vmap_method") is None)
            or (name == "io_callback" and params.get("ordered", False)))
