"""Static dependency ("taint") analysis telling whether an update couples values.

ZeRO-1 shards optimizer state in one of two ways, and each is exact only for a
certain class of inner optimizers:

* **Coordinate slicing** runs the inner optimizer on a 1-D slice of every
  flattened parameter. That is exact only if every output coordinate depends on
  the same coordinate of the inputs, i.e. the update is *elementwise*.
  :func:`find_coordinate_coupling` refuses anything else (global norms, factored
  moments, matrix products, trust ratios, all-finite checks, ...).
* **Leaf ownership** runs the inner optimizer on a subset of whole leaves. That
  is exact only if no computation mixes values of two different parameter
  leaves. :func:`find_leaf_coupling` refuses e.g. ``clip_by_global_norm`` but
  accepts per-leaf matrix algebra such as muon, adafactor or lamb.

Both trace ``fn(*args)`` to a jaxpr on abstract values and propagate taint (a
set of integer labels per value) forward through every equation, recursing into
calls and control flow. The analysis is conservative: a tainted operand reaching
a primitive it does not know is reported as coupling.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jaxlib
import numpy as np
from jax.extend import core as jcore

Taint = frozenset[int]
_CLEAN: Taint = frozenset()

# Primitives whose every output coordinate depends only on the same coordinate
# of each operand (operands of a different size are checked separately).
_ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2",
    "atanh", "bessel_i0e", "bessel_i1e", "bitcast_convert_type", "cbrt", "ceil",
    "clamp", "clz", "complex", "conj", "convert_element_type", "copy", "copy_p",
    "cos", "cosh", "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp",
    "exp2", "expm1", "floor", "ge", "gt", "igamma", "igamma_grad_a", "igammac",
    "imag", "integer_pow", "is_finite", "le", "lgamma", "log", "log1p",
    "logistic", "lt", "max", "min", "mul", "mulhi", "ne", "neg", "nextafter",
    "not", "or", "polygamma", "population_count", "pow", "random_gamma_grad",
    "real", "reduce_precision", "regularized_incomplete_beta", "rem", "round",
    "rsqrt", "select_n", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "sign", "sin", "sinh", "sqrt", "square",
    "stop_gradient", "sub", "tan", "tanh", "xor", "zeta",
})
# Identity on each operand separately (outputs[i] is operands[i]).
_PER_OPERAND_IDENTITY = frozenset({
    "device_put", "optimization_barrier", "sharding_constraint",
    "layout_constraint", "reshard", "pvary",
})
# Reductions with an ``axes`` parameter and cumulative ops with an ``axis``.
_REDUCTIONS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
    "reduce_or", "reduce_xor", "argmax", "argmin",
})
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
# Call-like primitives: operands and results map 1:1 onto a single sub-jaxpr.
_CALLS = frozenset({
    "jit", "pjit", "closed_call", "core_call", "custom_jvp_call",
    "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint",
})
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


class _Coupled(Exception):
    """Raised internally at the first coupling equation; carries the message."""


def find_coordinate_coupling(fn: Callable[..., Any], *args: Any) -> str | None:
    """Finds a computation in ``fn`` that mixes coordinates of an input array.

    Every input array leaf with more than one element is a taint source; scalars
    (step counts, hyperparameters) are not. Elementwise primitives propagate
    taint; anything else that consumes a tainted value (a reduction over an axis
    of size > 1, a matrix product, a gather, a non-trivial transpose, a
    broadcast that changes the element count, a branch on tainted data, ...) is
    coupling.

    Args:
      fn: The function to analyse, e.g. ``lambda g, s, p: tx.update(g, s, p)``.
      *args: Pytrees of arrays or ``jax.ShapeDtypeStruct`` to trace ``fn`` on.

    Returns:
      None if ``fn`` is elementwise in all its non-scalar inputs, otherwise a
      short description of the first offending primitive and its source
      location.

    Raises:
      Exception: Whatever tracing ``fn`` raises.
    """
    closed = jax.make_jaxpr(fn)(*args)
    taints = [
        frozenset({0}) if int(np.prod(v.aval.shape, dtype=np.int64)) > 1 else _CLEAN
        for v in closed.jaxpr.invars
    ]
    return _Analysis(per_leaf=False).check(closed.jaxpr, taints)


def find_leaf_coupling(fn: Callable[..., Any], *args: Any, sources: Any) -> str | None:
    """Finds a computation in ``fn`` that mixes values of two labelled leaves.

    Args:
      fn: The function to analyse, e.g. ``lambda g, s, p: tx.update(g, s, p)``.
      *args: Pytrees of arrays or ``jax.ShapeDtypeStruct`` to trace ``fn`` on.
      sources: A pytree matching ``args`` (a tuple) whose leaves are an ``int``
        label (e.g. the index of the parameter leaf) or None (untainted). A None
        may also stand for a whole subtree of ``args``, e.g. the optimizer state.

    Returns:
      None if no equation combines values carrying two distinct labels,
      otherwise a short description of the first offending primitive and its
      source location.

    Raises:
      Exception: Whatever tracing ``fn`` raises.
      ValueError: If ``sources`` does not match the structure of ``args``.
    """
    closed = jax.make_jaxpr(fn)(*args)
    labels = _expand_sources(tuple(sources), args)
    if len(labels) != len(closed.jaxpr.invars):
        raise ValueError(
            f"sources give {len(labels)} labels but fn has "
            f"{len(closed.jaxpr.invars)} array inputs"
        )
    taints = [_CLEAN if lab is None else frozenset({int(lab)}) for lab in labels]
    return _Analysis(per_leaf=True).check(closed.jaxpr, taints)


class _Labels:
    """Opaque (non-pytree) holder of the labels one ``sources`` leaf expands to."""

    def __init__(self, labels: list[int | None]):
        self.labels = labels


# Primitives that only move or reshape values; their count differs between a scalar leaf and its 1-element slice.
_SHAPE_ONLY = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type", "copy",
                         "copy_p", "pjit", "jit", "closed_call"})


def program_signature(fn: Callable[..., Any], *args: Any) -> list[str]:
    """The primitives `fn(*args)` applies, in order and through sub-jaxprs, without shape-only ones.

    An elementwise optimizer applies the same primitives to a parameter and to a slice of it; a transformation
    whose behaviour depends on parameter shapes (a weight-decay mask computed from `ndim`, say) does not.
    """
    out: list[str] = []

    def walk(jaxpr: jcore.Jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name not in _SHAPE_ONLY:
                out.append(eqn.primitive.name)
            for sub in _subjaxprs(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return out


def _expand_sources(sources: tuple[Any, ...], args: tuple[Any, ...]) -> list[int | None]:
    """Flattens ``sources`` (a prefix of ``args``, None being a leaf) to one label per arg leaf."""
    expanded = jax.tree.map(
        lambda lab, sub: _Labels([lab] * len(jax.tree.leaves(sub))),
        sources, args, is_leaf=lambda x: x is None,
    )
    holders = jax.tree.leaves(expanded, is_leaf=lambda x: isinstance(x, _Labels))
    return [lab for h in holders for lab in h.labels]


def _subjaxprs(params: dict[str, Any]) -> list[jcore.Jaxpr]:
    """Every sub-jaxpr in an equation's params (ClosedJaxpr or Jaxpr, possibly in tuples)."""
    found: list[jcore.Jaxpr] = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jcore.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jcore.Jaxpr):
                found.append(item)
    return found


def _scan_counts(eqn: Any) -> tuple[int, int]:
    """How many of a scan's operands are constants and carries (JAX <= 0.10 names them; 0.11 groups them)."""
    params = eqn.params
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    # JAX >= 0.11: `ft_in` is a flat tree grouping the operands into (consts, carry, xs).
    consts, carry, _ = params["ft_in"].update(list(range(len(eqn.invars)))).unpack()
    return len(list(consts)), len(list(carry))


def _open(jaxpr: Any) -> jcore.Jaxpr:
    """The Jaxpr of a ClosedJaxpr (its consts are never tainted)."""
    return jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr


def _call_body(eqn: Any) -> jcore.Jaxpr | None:
    """The sub-jaxpr of a call-like equation whose invars/outvars match the equation's."""
    if eqn.primitive.name in _CALLS:
        candidates = [_open(eqn.params[k]) for k in _CALL_PARAMS if k in eqn.params]
    elif eqn.primitive.name in ("cond", "while", "scan"):
        return None
    else:  # Unknown higher-order primitive (shard_map, composite, ...): accept only an exact fit.
        candidates = _subjaxprs(eqn.params)
        if len(candidates) != 1:
            return None
    for sub in candidates:
        if len(sub.invars) == len(eqn.invars) and len(sub.outvars) == len(eqn.outvars):
            return sub
    return None


def _shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


def _size(atom: Any) -> int:
    return int(np.prod(_shape(atom), dtype=np.int64))


_JAX_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (jax, jaxlib)
    if getattr(m, "__file__", None)
)
_STDLIB = sysconfig.get_paths().get("stdlib", "\0") + os.sep


def _is_internal(filename: str) -> bool:
    if filename.startswith(_JAX_DIRS) or filename == __file__:
        return True
    return filename.startswith(_STDLIB) and "-packages" not in filename


def _short_path(filename: str) -> str:
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in filename:
            return filename.rsplit(marker, 1)[1]
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith("..") else rel


def _user_frames(eqn: Any) -> list[str]:
    """Formatted source frames of ``eqn`` outside jax internals, innermost first."""
    try:
        from jax._src import source_info_util  # pylint: disable=g-import-not-at-top

        codes, lastis = eqn.source_info.traceback.raw_frames()
        frames = [
            source_info_util.raw_frame_to_frame(code, lasti)
            for code, lasti in zip(codes, lastis)
            if not _is_internal(code.co_filename)
        ]
        return [f"{_short_path(f.file_name)}:{f.start_line} ({f.function_name})" for f in frames]
    except Exception:  # pylint: disable=broad-except
        return []


def _describe(eqns: Sequence[Any], reason: str) -> str:
    """Names the primitive of ``eqns[-1]`` and where it came from.

    ``eqns`` is the chain of enclosing call/control-flow equations ending with
    the offending one; equations traced inside a ``jax.jit`` carry only jax
    frames, so the location falls back to the innermost enclosing equation that
    has user frames. Besides the innermost user frame, the innermost frame of an
    ``update`` function (e.g. ``clip_by_global_norm.<locals>.update_fn``) is
    named when it differs, since that identifies the offending transformation.
    """
    frames = next((f for f in map(_user_frames, reversed(eqns)) if f), [])
    where = ""
    if frames:
        where = f" at {frames[0]}"
        update = next((f for f in frames if "update" in f.rsplit("(", 1)[-1]), frames[0])
        if update != frames[0]:
            where += f" in {update}"
    return f"`{eqns[-1].primitive.name}`{where}: {reason}"


def _coordinate_violation(eqn: Any, taints: Sequence[Taint]) -> str | None:
    """Why a first-order equation with a tainted operand mixes coordinates, or None."""
    name = eqn.primitive.name
    tainted = [v for v, t in zip(eqn.invars, taints) if t]
    out_size = _size(eqn.outvars[0]) if eqn.outvars else 0
    if name in _ELEMENTWISE:
        if any(_size(v) != out_size for v in tainted):
            return "broadcasts a parameter-derived value to a different number of elements"
        return None
    params = eqn.params
    operand = eqn.invars[0]
    shape = _shape(operand)
    if name == "squeeze" or (name == "reshape" and params.get("dimensions") is None):
        return None  # Row-major reshapes keep element order.
    if name == "broadcast_in_dim":
        if tainted == [operand] and _size(operand) == out_size:
            return None  # Only unit dimensions added.
        return "broadcasts a parameter-derived value to a different number of elements"
    if name == "transpose":
        moved = [p for p in params["permutation"] if shape[p] != 1]
        return None if moved == sorted(moved) else "transposes a parameter-shaped value"
    if name in _REDUCTIONS:
        sizes = [shape[a] for a in params["axes"]]
        if all(s == 1 for s in sizes):
            return None
        return f"reduces a parameter-derived value over axes of sizes {sizes}"
    if name in _CUMULATIVE:
        size = shape[params["axis"]]
        return None if size == 1 else f"accumulates a parameter-derived value along an axis of size {size}"
    return "is not elementwise in a parameter-derived operand"


class _Analysis:
    """Forward taint propagation over a jaxpr in coordinate or leaf mode."""

    def __init__(self, per_leaf: bool):
        self.per_leaf = per_leaf
        self._stack: list[Any] = []  # Enclosing equations, for source locations.

    def _coupled(self, eqn: Any, reason: str) -> _Coupled:
        return _Coupled(_describe([*self._stack, eqn], reason))

    def check(self, jaxpr: jcore.Jaxpr, taints: Sequence[Taint]) -> str | None:
        try:
            self.run(jaxpr, taints)
        except _Coupled as e:
            return str(e)
        return None

    def run(self, jaxpr: jcore.Jaxpr, taints: Sequence[Taint]) -> list[Taint]:
        """Propagates input taints through ``jaxpr``; raises ``_Coupled`` on coupling."""
        env: dict[Any, Taint] = dict(zip(jaxpr.invars, taints))

        def read(atom: Any) -> Taint:
            return _CLEAN if isinstance(atom, jcore.Literal) else env.get(atom, _CLEAN)

        for eqn in jaxpr.eqns:
            outs = self._equation(eqn, [read(v) for v in eqn.invars])
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def _equation(self, eqn: Any, taints: list[Taint]) -> list[Taint]:
        """The result taints of one equation; raises ``_Coupled`` if it couples."""
        n_out = len(eqn.outvars)
        if not any(taints):
            return [_CLEAN] * n_out
        name = eqn.primitive.name
        if name == "cond":
            return self._cond(eqn, taints)
        if name == "while":
            return self._while(eqn, taints)
        if name == "scan":
            return self._scan(eqn, taints)
        body = _call_body(eqn)
        if body is not None:
            return self._nested(eqn, body, taints)
        if name in _PER_OPERAND_IDENTITY and len(taints) == n_out:
            return list(taints)
        union = frozenset().union(*taints)
        if self.per_leaf:
            if len(union) > 1:
                raise self._coupled(eqn, f"mixes parameter leaves {sorted(union)}")
        else:
            reason = _coordinate_violation(eqn, taints)
            if reason is not None:
                raise self._coupled(eqn, reason)
        return [union] * n_out

    def _nested(self, eqn: Any, jaxpr: jcore.Jaxpr, taints: Sequence[Taint]) -> list[Taint]:
        """Runs a sub-jaxpr of ``eqn`` with ``eqn`` on the location stack."""
        self._stack.append(eqn)
        try:
            return self.run(jaxpr, taints)
        finally:
            self._stack.pop()

    def _control(self, eqn: Any, pred: Taint, outs: list[Taint], what: str) -> list[Taint]:
        """Adds the taint of a branch/loop predicate to every result (control dependence)."""
        if not pred:
            return outs
        if not self.per_leaf:
            raise self._coupled(eqn, f"{what} depends on parameter-derived data")
        outs = [t | pred for t in outs]
        mixed = next((t for t in outs if len(t) > 1), None)
        if mixed is not None:
            raise self._coupled(
                eqn, f"{what} depends on a leaf and selects values of parameter leaves {sorted(mixed)}")
        return outs

    def _cond(self, eqn: Any, taints: list[Taint]) -> list[Taint]:
        """All branches on the operands; the index (first operand) is a control dependence."""
        index, ops = taints[0], taints[1:]
        outs = [_CLEAN] * len(eqn.outvars)
        for branch in eqn.params["branches"]:
            outs = [a | b for a, b in zip(outs, self._nested(eqn, _open(branch), ops))]
        return self._control(eqn, index, outs, "branch predicate")

    def _while(self, eqn: Any, taints: list[Taint]) -> list[Taint]:
        """Iterates the carry taint to a fixed point; the loop predicate is a control dependence."""
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, carry = taints[:nc], taints[nc:nc + nb], taints[nc + nb:]
        while True:
            pred = self._nested(eqn, _open(p["cond_jaxpr"]), cond_consts + carry)[0]
            body_out = self._nested(eqn, _open(p["body_jaxpr"]), body_consts + carry)
            new = self._control(eqn, pred, [a | b for a, b in zip(carry, body_out)], "loop condition")
            if new == carry:
                return carry
            carry = new

    def _scan(self, eqn: Any, taints: list[Taint]) -> list[Taint]:
        """Iterates the carry taint to a fixed point over ``consts + carry + xs``."""
        p = eqn.params
        nc, nk = _scan_counts(eqn)
        consts, carry, xs = taints[:nc], taints[nc:nc + nk], taints[nc + nk:]
        if any(xs) and not self.per_leaf:
            raise self._coupled(
                eqn, "iterates over a parameter-derived array (mixes coordinates along the scanned axis)")
        while True:
            outs = self._nested(eqn, _open(p["jaxpr"]), consts + carry + xs)
            new = [a | b for a, b in zip(carry, outs[:nk])]
            if new == carry:
                break
            carry = new
        ys = outs[nk:]
        if any(ys) and not self.per_leaf:
            raise self._coupled(eqn, "stacks a parameter-derived value along a new axis")
        return carry + ys
