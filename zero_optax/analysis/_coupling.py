"""Static analyses of an update's jaxpr: whether it couples values ("taint"), and what program it runs.

Two jobs. The first, below, proves what a partition may do. The second reads *programs*: what an update computes,
as text equal for two leaves (or one leaf in two traces) exactly when the same program runs on them, whatever
their shapes (:func:`leaf_programs`, which zero1's plan uses to group sliced leaves and stack owned ones, and to
refuse an update that runs something else on slices than on the parameters; :func:`program_signature`, the same
for a whole function, used by the tests only).

ZeRO-1 shards optimizer state in one of two ways, and each is exact only for a
certain class of inner optimizers:

* **Coordinate slicing** runs the inner optimizer on a 1-D slice of every
  flattened parameter. That is exact only if every output coordinate depends on
  the same coordinate of the inputs, i.e. the update is *elementwise*.
  :func:`find_coordinate_coupling` refuses anything else (global norms, factored
  moments, matrix products, trust ratios, all-finite checks, position masks,
  ...).
* **Leaf ownership** runs the inner optimizer on a subset of whole leaves. That
  is exact only if no computation mixes values of two different parameter
  leaves. :func:`find_leaf_coupling` refuses e.g. ``clip_by_global_norm`` but
  accepts per-leaf matrix algebra such as muon, adafactor or lamb (the plan uses
  :func:`analyze_leaves`; :func:`find_leaf_coupling` is its plain form, kept for
  the tests of the analysis).
* :func:`analyze_leaves` does both at once for ``partition="auto"``: it refuses
  leaf mixing and reports which leaves have their coordinates mixed (and so
  need whole tensors).

All trace ``fn(*args)`` to a jaxpr on abstract values and propagate a
:class:`_Fact` per value forward through every equation, recursing into calls
and control flow. A fact records which parameter leaves the value depends on
(``labels``), which of those it depends on coordinate by coordinate
(``coords``), whether it derives from a random primitive and whether, although
not parameter-derived, its value may differ from one array position to another
(an ``iota``, a constant vector, the result of an opaque kernel, ...): on a
coordinate slice such a value would be paired with the wrong coordinates.

The analysis is conservative: random numbers reaching parameter data or an
output are refused in every mode, and a primitive it does not know is treated
as opaque (it mixes coordinates of what it consumes, and its results depend on
positions).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jaxlib
import numpy as np
from jax.extend import core as jcore

from zero_optax.core import _compat
from zero_optax.core._errors import ZeroCouplingError

Taint = frozenset[int]
_NONE: Taint = frozenset()

# Primitives whose every output coordinate depends only on the same coordinate
# of each operand (operands of a different size are checked separately).
_ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan",
    "atan2", "atanh", "bessel_i0e", "bessel_i1e", "bitcast_convert_type",
    "cbrt", "ceil", "clamp", "clz", "complex", "conj", "convert_element_type",
    "copy", "copy_p", "cos", "cosh", "digamma", "div", "eq", "erf", "erf_inv",
    "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "igamma",
    "igamma_grad_a", "igammac", "imag", "integer_pow", "is_finite", "le",
    "lgamma", "log", "log1p", "logistic", "lt", "max", "min", "mul", "mulhi",
    "ne", "neg", "nextafter", "not", "or", "polygamma", "population_count",
    "pow", "random_gamma_grad", "real", "reduce_precision",
    "regularized_incomplete_beta", "rem", "round", "rsqrt", "select_n",
    "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign",
    "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh",
    "xor", "zeta",
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
# Known primitives that are not elementwise but give a position-independent
# (uniform) result when every operand is uniform: moving, reducing or
# contracting equal values gives equal values.
_UNIFORM_PRESERVING = _REDUCTIONS | {
    "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
    "slice", "rev", "dynamic_slice", "dot_general", "sort", "split", "unstack",
    "tile", "zeros_like", "reduce",
}
# Known primitives whose non-scalar results may differ from one position to
# another even when every operand is uniform (``concatenate([zeros, ones])``,
# ``zeros.at[3].set(1)``, ``cumsum(ones)``, linear algebra, ...).
_POSITIONAL = _CUMULATIVE | {
    "iota", "iota_2x32_shape", "concatenate", "stack", "pad", "gather", "scatter",
    "scatter-add", "scatter_add", "scatter-sub", "scatter-mul", "scatter-min",
    "scatter-max", "dynamic_update_slice", "conv_general_dilated",
    "reduce_window", "reduce_window_sum", "reduce_window_max",
    "reduce_window_min", "select_and_scatter", "select_and_scatter_add",
    "select_and_gather_add", "fft", "cholesky", "cholesky_update", "eig",
    "eigh", "lu", "lu_pivots_to_permutation", "qr", "geqrf", "geqp3",
    "householder_product", "ormqr", "svd", "schur", "hessenberg",
    "triangular_solve", "tridiagonal", "tridiagonal_solve",
    "symmetric_product", "top_k", "approx_top_k", "ragged_dot_general",
}
# Random primitives: those producing random numbers, and those making or
# transforming PRNG keys (which may be carried in shared state).
_RANDOM_NUMBERS = frozenset({
    "random_bits", "random_gamma", "threefry2x32", "threefry4x32",
    "philox2x32", "philox4x32", "rng_bit_generator", "rng_uniform",
    "prng_random_bits",
})
_RANDOM_KEYS = frozenset({
    "random_seed", "random_wrap", "random_unwrap", "random_split",
    "random_fold_in", "random_clone", "prng_seed",
})
_RANDOM = _RANDOM_NUMBERS | _RANDOM_KEYS
# Opaque primitives the analysis never looks into (even if they carry a jaxpr).
_KERNELS = frozenset({
    "pallas_call", "custom_call", "ffi_call", "tpu_custom_call",
    "custom_partitioning", "cudnn_fusion", "custom_fusion",
})
_CALLBACKS = frozenset({"pure_callback", "io_callback", "buffer_callback"})
# Effects with no results: nothing flows out of them.
_SINKS = frozenset({"debug_callback", "debug_print"})
# Call-like primitives: operands and results map 1:1 onto a single sub-jaxpr.
_CALLS = frozenset({
    "jit", "pjit", "closed_call", "core_call", "custom_jvp_call",
    "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint",
})
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_CONTROL = frozenset({"cond", "while", "scan"})
_KNOWN = (_ELEMENTWISE | _PER_OPERAND_IDENTITY | _UNIFORM_PRESERVING | _POSITIONAL | _RANDOM | _SINKS
          | _CALLS | _CONTROL)


CouplingError = ZeroCouplingError
"""Raised where an update mixes parameter leaves or draws random numbers into parameter data (the message names
the primitive and its source line; zero1 adds what to do)."""


@dataclasses.dataclass(frozen=True)
class LeafAnalysis:
    """What :func:`analyze_leaves` found.

    Attributes:
      coupled: Labels of the leaves whose coordinates the update mixes; those
        leaves need whole tensors (leaf partition), the others can be sliced.
      reasons: For each coupled label, a description (primitive, source
        location, reason) of the first equation that mixes its coordinates.
      output_taints: For each flattened output of ``fn``, the labels of the
        leaves it depends on.
      reductions: With ``collective``, the labels of the leaves whose
        coordinates a full reduction sums (or maxes, mins) into a scalar: on
        slices of the leaf that is a local reduction and a collective.
      crossing: None, or where a scalar reduced from one leaf first meets
        another leaf's values or reductions (a global norm): the leaves'
        reductions must then all run on every device.
      output_reductions: For each flattened output, the labels of the leaves
        whose reductions it depends on.
      draws: With ``collective``, the labels of the leaves whose values meet
        random numbers drawn in their shape (``optax.add_noise``): on slices
        each device draws the whole leaf's numbers and keeps its slice.
      output_coords: For each flattened output, the labels of the leaves it
        depends on coordinate by coordinate.
    """

    coupled: frozenset[int]
    reasons: Mapping[int, str]
    output_taints: tuple[frozenset[int], ...]
    reductions: frozenset[int] = frozenset()
    crossing: str | None = None
    output_reductions: tuple[frozenset[int], ...] = ()
    draws: frozenset[int] = frozenset()
    output_coords: tuple[frozenset[int], ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class _Origin:
    """Where a random or position-dependent value was made.

    Attributes:
      what: What the value is, as a phrase (``"draws random numbers"``).
      eqns: The enclosing equations ending with the one that made the value,
        or empty for a function input or constant.
      number: For a random value, whether it holds random numbers rather than
        a PRNG key.
      aligned: For random numbers, whether they are still the draw's array
        position by position (only elementwise operations since
        ``random_bits``): meeting a leaf's values elementwise, each pairs
        with the coordinate plain optax pairs it with, which a device holding
        a slice reproduces by drawing the whole leaf and keeping its slice.
    """

    what: str
    eqns: tuple[Any, ...] = ()
    number: bool = False
    aligned: bool = False


class _Fact(NamedTuple):
    """What the analysis knows about one value."""

    labels: Taint = _NONE  # Parameter leaves the value depends on.
    coords: Taint = _NONE  # Leaves (of more than one element) it depends on coordinate by coordinate.
    random: _Origin | None = None  # Set if it derives from a random primitive.
    positional: _Origin | None = None  # Set if, not being parameter-derived, it may vary by position.
    reduced: Taint = _NONE  # Leaves whose full (collective) reductions the value depends on.
    control: bool = False  # Set if it passed through control flow (its coordinates are no longer reduced exactly).


_CLEAN = _Fact()
_CONSTANT = _Origin("a non-scalar constant (an array the function closes over)")
_LITERAL = _Origin("a non-scalar literal")
_SHARED = _Origin("non-scalar shared state (an input without a parameter label, e.g. a vector hyperparameter)")


class Traced(NamedTuple):
    """A function traced once (`trace`), for several analyses of the same program."""

    closed: jcore.ClosedJaxpr
    out_shape: Any
    args: tuple[Any, ...]


def trace(fn: Callable[..., Any], *args: Any) -> Traced:
    """Traces `fn(*args)` to a jaxpr that every function of this module accepts in place of `fn` (with no args)."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    return Traced(closed, out_shape, args)


def _traced(fn: Callable[..., Any] | Traced, args: tuple[Any, ...]) -> Traced:
    return fn if isinstance(fn, Traced) else trace(fn, *args)


def find_coordinate_coupling(fn: Callable[..., Any], *args: Any, collective: bool = False) -> str | None:
    """Finds a computation in ``fn`` that mixes coordinates of an input array.

    Every input array leaf with more than one element is a taint source; scalars
    (step counts, hyperparameters) are not. Elementwise primitives propagate
    taint; anything else that consumes a tainted value (a reduction over an axis
    of size > 1, a matrix product, a gather, a non-trivial transpose, a
    broadcast that changes the element count, a branch on tainted data, an
    opaque kernel, ...) is coupling, and so is combining a tainted value with a
    position-dependent one (``iota``, a non-scalar constant). Random numbers
    reaching tainted data or an output are refused too: devices holding slices
    would not draw what optax draws on one device.

    Args:
      fn: The function to analyse, e.g. ``lambda g, s, p: tx.update(g, s, p)``.
      *args: Pytrees of arrays or ``jax.ShapeDtypeStruct`` to trace ``fn`` on.
      collective: Accept full reductions (:func:`collective_kind`) of
        coordinate-wise values outside control flow: on slices they are a
        local reduction followed by a collective over the devices.

    Returns:
      None if ``fn`` is elementwise in all its non-scalar inputs, otherwise a
      short description of the first offending primitive and its source
      location.

    Raises:
      Exception: Whatever tracing ``fn`` raises.
    """
    closed, _, args = _traced(fn, args)
    try:
        _Analysis(strict=True, collective=collective).check(closed, _coordinate_facts(closed), None)
    except CouplingError as e:
        return str(e)
    return None


def _coordinate_facts(closed: jcore.ClosedJaxpr, untainted: frozenset[int] = frozenset(),
                      scalar_leaves: frozenset[int] = frozenset()) -> list[_Fact]:
    """One label for every non-scalar input but the `untainted` ones (a PRNG key's data), and for the
    `scalar_leaves` (one-element parameter data, which random numbers may meet as they meet other leaves)."""
    tainted, scalar = _Fact(frozenset({0}), frozenset({0})), _Fact(frozenset({0}))
    return [tainted if _size(v) > 1 and k not in untainted else scalar if k in scalar_leaves else _CLEAN
            for k, v in enumerate(closed.jaxpr.invars)]


class Slices(NamedTuple):
    """What an update elementwise but for full reductions and random draws in a leaf's shape needs on slices.

    Attributes:
      joint: whether it has any: it then needs every leaf's slice at once (collectives over the slices, one
        key split over all leaves).
      coordinate_outputs: per flattened output, whether it depends on inputs coordinate by coordinate (an
        output that does not, such as novograd's per-leaf norm, is the same on every device holding a slice).
    """

    joint: bool
    coordinate_outputs: tuple[bool, ...]


def on_slices(fn: Callable[..., Any], *args: Any, untainted: frozenset[int] = frozenset(),
              scalar_leaves: frozenset[int] = frozenset()) -> Slices:
    """What ``fn`` needs on coordinate slices (:class:`Slices`); raises :class:`CouplingError`, naming the
    operation, where :func:`find_coordinate_coupling` with ``collective=True`` finds one. ``untainted`` and
    ``scalar_leaves`` are positions among the flattened inputs: non-scalar inputs that are no parameter data (a
    PRNG key's data), and one-element inputs that are (:func:`_coordinate_facts`)."""
    closed, _, args = _traced(fn, args)
    analysis = _Analysis(strict=True, collective=True)
    outs = analysis.check(closed, _coordinate_facts(closed, untainted, scalar_leaves), None)
    return Slices(bool(analysis.reduced or analysis.draws), tuple(bool(f.coords) for f in outs))


def find_leaf_coupling(fn: Callable[..., Any], *args: Any, sources: Any, out_sources: Any = None) -> str | None:
    """Finds a computation in ``fn`` that mixes values of two labelled leaves.

    Used by the tests of the analysis (``tests/test_coupling.py``); zero1's plan calls :func:`analyze_leaves`,
    which answers this and more in one pass.

    Args:
      fn: The function to analyse, e.g. ``lambda g, s, p: tx.update(g, s, p)``.
      *args: Pytrees of arrays or ``jax.ShapeDtypeStruct`` to trace ``fn`` on.
      sources: A pytree matching ``args`` (a tuple) whose leaves are an ``int``
        label (e.g. the index of the parameter leaf) or None (untainted). A None
        may also stand for a whole subtree of ``args``, e.g. the optimizer state.
      out_sources: Optionally, the same for the output of ``fn``: which outputs
        belong to a leaf. Random numbers may reach an output labelled None
        (shared state) but no other; without ``out_sources`` they may reach no
        output at all (PRNG keys may).

    Returns:
      None if no equation combines values carrying two distinct labels and no
      random value reaches parameter data, otherwise a short description of the
      first offending primitive and its source location.

    Raises:
      Exception: Whatever tracing ``fn`` raises.
      ValueError: If ``sources`` does not match the structure of ``args``.
    """
    closed, out_shape, args = _traced(fn, args)
    facts = [_Fact(frozenset({lab})) if lab is not None else _CLEAN for lab in _input_labels(closed, sources, args)]
    try:
        _Analysis(strict=False).check(closed, facts, _output_labels(closed, out_sources, out_shape))
    except CouplingError as e:
        return str(e)
    return None


def analyze_leaves(fn: Callable[..., Any], *args: Any, sources: Any, out_sources: Any = None,
                   collective: bool = False) -> LeafAnalysis:
    """Tells, per labelled leaf, whether ``fn`` mixes its coordinates; refuses leaf mixing.

    Like :func:`find_leaf_coupling`, but an equation that mixes coordinates of
    one leaf (a reduction, a matrix product, a position mask, an opaque
    kernel, ...) is recorded rather than refused: the leaf is ``coupled`` and
    needs whole tensors, the others may be sliced. Non-scalar inputs labelled
    None count as position-dependent, scalar leaves are never coupled.

    Args:
      fn: The function to analyse, e.g. ``lambda g, s, p: tx.update(g, s, p)``.
      *args: Pytrees of arrays or ``jax.ShapeDtypeStruct`` to trace ``fn`` on.
      sources: A pytree prefix of ``args`` (a tuple) with an ``int`` label or
        None per leaf or subtree, as for :func:`find_leaf_coupling`.
      out_sources: Optionally, which outputs of ``fn`` belong to a leaf, as for
        :func:`find_leaf_coupling`.
      collective: Accept full reductions of a leaf's coordinate-wise values
        (:func:`collective_kind`): the leaf is not coupled by them, and their
        scalar results may meet other leaves (``LeafAnalysis.crossing``).

    Returns:
      The coupled labels, why, and the labels each output of ``fn`` depends on.

    Raises:
      CouplingError: If an equation combines values of two distinct leaves, or a
        random value reaches parameter data.
      ValueError: If ``sources`` does not match the structure of ``args``.
      Exception: Whatever tracing ``fn`` raises.
    """
    closed, out_shape, args = _traced(fn, args)
    facts = []
    for var, lab in zip(closed.jaxpr.invars, _input_labels(closed, sources, args)):
        big = _size(var) > 1
        if lab is None:
            facts.append(_Fact(positional=_SHARED) if big else _CLEAN)
        else:
            facts.append(_Fact(frozenset({lab}), frozenset({lab}) if big else _NONE))
    analysis = _Analysis(strict=False, collective=collective)
    outs = analysis.check(closed, facts, _output_labels(closed, out_sources, out_shape))
    return LeafAnalysis(frozenset(analysis.reasons), dict(analysis.reasons), tuple(f.labels for f in outs),
                        frozenset(analysis.reduced), analysis.crossing, tuple(f.reduced for f in outs),
                        frozenset(analysis.draws), tuple(f.coords for f in outs))


class _Labels:
    """Opaque (non-pytree) holder of the labels one ``sources`` leaf expands to."""

    def __init__(self, labels: list[int | None]):
        self.labels = labels


def _expand_sources(sources: Any, tree: Any) -> list[int | None]:
    """Flattens ``sources`` (a prefix of ``tree``, None being a leaf) to one label per leaf of ``tree``."""
    expanded = jax.tree.map(
        lambda lab, sub: _Labels([lab] * len(jax.tree.leaves(sub))),
        sources, tree, is_leaf=lambda x: x is None,
    )
    holders = jax.tree.leaves(expanded, is_leaf=lambda x: isinstance(x, _Labels))
    return [lab for h in holders for lab in h.labels]


def _input_labels(closed: jcore.ClosedJaxpr, sources: Any, args: tuple[Any, ...]) -> list[int | None]:
    """One label per input of ``closed``, from ``sources`` (a prefix of ``args``)."""
    labels = _expand_sources(tuple(sources), args)
    if len(labels) != len(closed.jaxpr.invars):
        raise ValueError(f"sources give {len(labels)} labels but fn has {len(closed.jaxpr.invars)} array inputs")
    return [None if lab is None else int(lab) for lab in labels]


def _output_labels(closed: jcore.ClosedJaxpr, out_sources: Any, out_shape: Any) -> list[int | None] | None:
    """One label per output of ``closed`` from ``out_sources`` (a prefix of ``out_shape``), or None."""
    if out_sources is None:
        return None
    labels = _expand_sources(out_sources, out_shape)
    if len(labels) != len(closed.jaxpr.outvars):
        raise ValueError(f"out_sources give {len(labels)} labels but fn has {len(closed.jaxpr.outvars)} outputs")
    return [None if lab is None else int(lab) for lab in labels]


# Primitives that only move or reshape values; their count differs between a scalar leaf and its 1-element slice.
_SHAPE_ONLY = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type", "copy",
                         "copy_p", "pjit", "jit", "closed_call", "reshard"})
# Equation parameters that describe shapes, axes or program structure: they differ between a tensor and its slice.
_SHAPE_PARAMS = frozenset({
    "shape", "dimensions", "broadcast_dimensions", "axes", "axis", "dimension", "sizes", "new_sizes",
    "start_indices", "limit_indices", "slice_sizes", "strides", "permutation", "length", "num_consts",
    "num_carry", "cond_nconsts", "body_nconsts", "sharding", "out_sharding", "split_transpose",
    "_split_transpose",
})


def program_signature(fn: Callable[..., Any], *args: Any) -> list[str]:
    """What `fn(*args)` computes, one string per equation in order and through sub-jaxprs, without shape-only ones.

    Each entry is the primitive name, then in brackets its parameters that are scalars and not about shapes
    (``integer_pow[y=2]``), then in parentheses its operands if any is a known scalar value, ``_`` standing for
    the others (``mul(_,0.9)``). Scalar literals, scalar constants and broadcasts of them are known values, also
    inside called jaxprs. An elementwise optimizer has the same signature on a parameter and on a slice of it; a
    transformation whose behaviour depends on parameter shapes (a weight-decay mask computed from `ndim`, a
    scale of ``1 / g.size``) does not.

    Used by the tests (``tests/test_coupling.py``), to check the entries :func:`leaf_programs` builds on.
    """
    out: list[str] = []
    closed, _, _ = _traced(fn, args)
    _walk(closed.jaxpr, _known_consts(closed), out)
    return out


def _walk(jaxpr: jcore.Jaxpr, known: dict[Any, str], out: list[str]) -> None:
    """Appends :func:`program_signature`'s entries for `jaxpr` (whose known scalar values are `known`) to `out`."""
    for eqn in jaxpr.eqns:
        values = [_scalar_repr(v.val) if isinstance(v, jcore.Literal) else known.get(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name not in _SHAPE_ONLY:
            out.append(_signature_entry(eqn, values))
        elif name not in _CALLS and values and values[0] is not None:
            known[eqn.outvars[0]] = values[0]  # A moved or broadcast known scalar has the same value.
        _walk_bodies(eqn, values, out)


def _walk_bodies(eqn: Any, values: Sequence[str | None], out: list[str]) -> None:
    body = _call_body(eqn)
    for sub in subjaxprs(eqn.params):
        inner = _known_consts(sub)
        if sub is body:
            inner.update((v, x) for v, x in zip(_open(sub).invars, values) if x is not None)
        _walk(_open(sub), inner, out)


def leaf_programs(fn: Callable[..., Any], *args: Any, sources: Any, out_sources: Any,
                  names: dict[str, str] | None = None, collective: bool = False) -> dict[int | None, tuple[str, ...]]:
    """What `fn` computes for each labelled leaf, as a text that is equal for two leaves, or for one leaf in two
    traces, exactly when the same program runs on them (whatever their shapes).

    Every equation whose operands carry one label belongs to that leaf's program. Its entry is its
    :func:`program_signature` entry (sub-jaxprs included) with each operand named by where it comes from: the
    leaf's own values by their order of appearance (its inputs first, in input order), unlabelled inputs by their
    position among the unlabelled inputs, and values computed without any label (a step count's bias correction,
    a schedule) by what computes them, so two leaves that read different shared values (two learning rates)
    differ. Moves and broadcasts rename a value, as in :func:`program_signature`. The leaf's outputs
    (`out_sources`) are listed the same way; key None lists the unlabelled outputs (the shared state). A leaf that
    an equation combines with another leaf has no program (it is left out).

    Args:
      fn: The function to analyse, e.g. ``lambda g, s, p: tx.update(g, s, p)``.
      *args: Pytrees of arrays or ``jax.ShapeDtypeStruct`` to trace ``fn`` on.
      sources: A pytree prefix of ``args`` with an ``int`` label or None per leaf or subtree.
      out_sources: The same for the output of ``fn``.
      names: Shared across calls, so that the same shared computation has the same name in several traces.
      collective: A full reduction of one leaf's values (:func:`collective_kind`) belongs to its program, but its
        result is named by the leaf and its position there and carries no label, as every device computes it
        (a global norm then adds shared values, not leaves).

    Returns:
      Label (or None) -> its program, for every label whose values no equation mixes with another label's.
    """
    closed, out_shape, args = _traced(fn, args)
    walker = _LeafPrograms(closed, {} if names is None else names, collective)
    return walker.run(_input_labels(closed, sources, args), _output_labels(closed, out_sources, out_shape))


class _LeafPrograms:
    """The walk of :func:`leaf_programs`: per variable its label and its name, per label its program."""

    def __init__(self, closed: jcore.ClosedJaxpr, names: dict[str, str], collective: bool = False):
        self.closed = closed
        self.names = names
        self.collective = collective
        self.label_of: dict[Any, int] = {}
        self.name: dict[Any, str] = {v: "c?" for v in closed.jaxpr.constvars}
        self.name.update((v, f"k{x}") for v, x in _known_consts(closed).items())
        self.programs: dict[int | None, list[str]] = {None: []}
        self.counts: dict[int, int] = {}
        self.mixed: set[int] = set()

    def run(self, in_labels: list[int | None], out_labels: list[int | None]) -> dict[int | None, tuple[str, ...]]:
        jaxpr = self.closed.jaxpr
        unlabelled = 0
        for var, lab in zip(jaxpr.invars, in_labels):
            if lab is None:
                self.name[var] = f"in{unlabelled}:{var.aval.dtype}"
                unlabelled += 1
            else:
                self._own(var, lab)
                self.programs.setdefault(lab, []).append(f"in:{var.aval.dtype}")
        self._walk(jaxpr.eqns)
        for var, lab in zip(jaxpr.outvars, out_labels):
            if lab is not None and not isinstance(var, jcore.Literal) and self.label_of.get(var, lab) != lab:
                self.mixed.add(lab)
            self.programs.setdefault(lab, []).append(f"out:{self._ref(var)}:{var.aval.dtype}")
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
            body = _call_body(eqn) if eqn.primitive.name in _CALLS else None
            if body is not None:
                self._inline(eqn, body)
                continue
            labs = {self.label_of[v] for v in eqn.invars if not isinstance(v, jcore.Literal) and v in self.label_of}
            if len(labs) > 1:
                self.mixed.update(labs)
                for out in eqn.outvars:
                    self.label_of[out], self.name[out] = min(labs), "?"
            elif eqn.primitive.name in _SHAPE_ONLY and eqn.primitive.name not in _CALLS and len(eqn.invars) == 1:
                for out in eqn.outvars:  # a moved value is the same value
                    self._alias(out, eqn.invars[0])
            else:
                self._equation(eqn, labs.pop() if labs else None)

    def _inline(self, eqn: Any, body: Any) -> None:
        """A call (a jit over a whole tree): its equations, as if written in place."""
        sub = _open(body)
        self.name.update((v, "c?") for v in sub.constvars)
        self.name.update((v, f"k{x}") for v, x in _known_consts(body).items())
        for inner, outer in zip(sub.invars, eqn.invars):
            self._alias(inner, outer)
        self._walk(sub.eqns)
        for outer, inner in zip(eqn.outvars, sub.outvars):
            self._alias(outer, inner)

    def _equation(self, eqn: Any, lab: int | None) -> None:
        refs = [self._ref(v) for v in eqn.invars]
        body: list[str] = []
        _walk_bodies(eqn, [r[1:] if r.startswith("k") else None for r in refs], body)  # known scalars by value
        entry = (f"{_signature_entry(eqn, [None] * len(refs))}({','.join(refs)})"
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
    """``name[param=value,...](operand,...)`` for :func:`program_signature`."""
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
    """``repr`` of a one-element array's value, or None if it has more elements (or none)."""
    try:
        array = np.asarray(value)
    except Exception:  # noqa: BLE001  (e.g. a PRNG key array)
        return None
    return repr(array.reshape(()).item()) if array.size == 1 else None


def _known_consts(jaxpr: Any) -> dict[Any, str]:
    """The scalar constants of a ClosedJaxpr, by constvar."""
    if not isinstance(jaxpr, jcore.ClosedJaxpr):
        return {}
    found = ((v, _scalar_repr(c)) for v, c in zip(jaxpr.jaxpr.constvars, jaxpr.consts))
    return {v: x for v, x in found if x is not None}


def subjaxprs(params: dict[str, Any]) -> list[Any]:
    """Every sub-jaxpr in an equation's params (ClosedJaxpr or Jaxpr, possibly in tuples), as found."""
    found: list[Any] = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                found.append(item)
    return found


def _open(jaxpr: Any) -> jcore.Jaxpr:
    """The Jaxpr of a ClosedJaxpr."""
    return jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr


def _call_body(eqn: Any) -> Any:
    """The sub-jaxpr (ClosedJaxpr or Jaxpr) of a call-like equation whose invars/outvars match the equation's."""
    name = eqn.primitive.name
    if name in _CALLS:
        candidates = [eqn.params[k] for k in _CALL_PARAMS if k in eqn.params]
    elif name in _KNOWN or name in _KERNELS or name in _CALLBACKS:
        return None  # E.g. the reducer of `reduce` or `reduce_window`, or a Pallas kernel body, is no call.
    else:  # Unknown higher-order primitive (shard_map, composite, ...): accept only an exact fit.
        candidates = subjaxprs(eqn.params)
        if len(candidates) != 1:
            return None
    for sub in candidates:
        inner = _open(sub)
        if len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars):
            return sub
    return None


def _shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


def _size(atom: Any) -> int:
    return math.prod(_shape(atom))


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
    except Exception:  # noqa: BLE001  (source info is private JAX API: never fail an analysis over it)
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


def _opaque(name: str) -> str:
    """What an opaque primitive is, as a phrase."""
    if name in _KERNELS:
        return "an opaque kernel (custom call / Pallas) the analysis cannot see into"
    if name in _CALLBACKS:
        return "a host callback the analysis cannot see into"
    return "a primitive the analysis does not know"


def _made_here(name: str) -> str:
    """What a position-dependent result of primitive ``name`` is, as a phrase."""
    if name in ("iota", "iota_2x32_shape"):
        return "makes a value that depends on array positions (`jnp.arange`, `jnp.indices`, a triangular mask, ...)"
    if name in _POSITIONAL:
        return "builds an array whose values may depend on positions"
    return _opaque(name) + "; its result may depend on positions"


_COLLECTIVE_KINDS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "dot_general": "sum"}


def collective_kind(eqn: Any) -> str | None:
    """``"sum"``, ``"max"`` or ``"min"`` if ``eqn`` reduces whole arrays to one element, else None.

    A full reduction is `reduce_sum`, `reduce_max` or `reduce_min` whose result has one element, or a
    `dot_general` of two operands of one shape contracting all their axes in the same order (`jnp.vdot`). On
    coordinate slices it is the reduction of each device's slice (its padding set to the reduction's identity)
    followed by `psum`, `pmax` or `pmin` over the devices: the same scalar on every device.
    """
    name = eqn.primitive.name
    kind = _COLLECTIVE_KINDS.get(name)
    if kind is None or not eqn.outvars or _size(eqn.outvars[0]) != 1:
        return None
    if name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = eqn.invars
        dims = tuple(range(len(_shape(lhs))))
        if lb or rb or _shape(lhs) != _shape(rhs) or tuple(lc) != dims or tuple(rc) != dims:
            return None
    return kind


def _structural_violation(eqn: Any, tainted: Sequence[Any]) -> str | None:
    """Why a known first-order equation with the operands ``tainted`` mixes coordinates, or None."""
    name = eqn.primitive.name
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
        if list(tainted) == [operand] and _size(operand) == out_size:
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


def _join(facts: Sequence[_Fact]) -> _Fact:
    """The fact of a value computed from values with ``facts``: unions, and the first origins."""
    labels = coords = reduced = _NONE
    random = positional = None
    control = False
    for f in facts:
        if f is _CLEAN:
            continue
        control = control or f.control
        labels = labels | f.labels if labels else f.labels
        coords = coords | f.coords if coords else f.coords
        reduced = reduced | f.reduced if reduced else f.reduced
        random = random or f.random
        positional = positional or f.positional
    return _Fact(labels, coords, random, positional, reduced, control)


def _fit(var: Any, fact: _Fact) -> _Fact:
    """``fact`` for the value ``var``: a value of at most one element is never position-dependent."""
    if fact.positional is not None and _size(var) <= 1:
        return fact._replace(positional=None)
    return fact


def _key(facts: Sequence[_Fact]) -> list[tuple[Any, ...]]:
    """What a loop's fixed point compares (origins are kept from the first iteration that sets them)."""
    return [(f.labels, f.coords, f.random is None, f.positional is None, f.reduced, f.control) for f in facts]


class _Analysis:
    """Forward propagation of facts over a jaxpr.

    Mixing of two labels and random values meeting parameter data always raise
    :class:`CouplingError`. Mixing coordinates of a leaf raises in ``strict``
    mode, and is otherwise recorded in ``reasons`` (first reason per label).
    With ``collective``, a full reduction (:func:`collective_kind`) of
    coordinate-wise values outside control flow mixes nothing: its scalar is
    what a collective over the slices gives every device, so it carries no
    label (``reduced`` records the leaves whose reductions it depends on, and
    ``crossing`` whether such a scalar meets another leaf).
    """

    def __init__(self, strict: bool, collective: bool = False):
        self.strict = strict
        self.collective = collective
        self.reasons: dict[int, str] = {}
        self.reduced: set[int] = set()
        self.draws: set[int] = set()  # leaves whose values met random numbers drawn in their shape
        self.crossing: str | None = None  # where a reduction of one leaf first meets another leaf
        self._stack: list[Any] = []  # Enclosing equations, for source locations.
        self._split = 0  # Enclosing branches whose predicate depends on parameter data.

    def check(self, closed: jcore.ClosedJaxpr, facts: Sequence[_Fact], out_labels: Sequence[int | None] | None
              ) -> list[_Fact]:
        """Runs ``closed`` and refuses random values reaching outputs; returns the output facts."""
        outs = self.run(closed, facts)
        for i, fact in enumerate(outs):
            origin = fact.random
            if origin is None:
                continue
            if out_labels is None and origin.number:
                raise self._random(origin, "reach an output of the update")
            if out_labels is not None and out_labels[i] is not None:
                raise self._random(origin, f"reach an output of parameter leaf {out_labels[i]}")
        return outs

    def run(self, jaxpr: Any, facts: Sequence[_Fact]) -> list[_Fact]:
        """Propagates input facts through ``jaxpr`` (a Jaxpr or ClosedJaxpr)."""
        env: dict[Any, _Fact] = {}
        if isinstance(jaxpr, jcore.ClosedJaxpr):
            env.update((v, _Fact(positional=_CONSTANT)) for v, c in zip(jaxpr.jaxpr.constvars, jaxpr.consts)
                       if np.size(c) > 1)
            jaxpr = jaxpr.jaxpr
        env.update((v, _fit(v, f)) for v, f in zip(jaxpr.invars, facts))

        def read(atom: Any) -> _Fact:
            if isinstance(atom, jcore.Literal):
                return _Fact(positional=_LITERAL) if _size(atom) > 1 else _CLEAN
            return env.get(atom, _CLEAN)

        for eqn in jaxpr.eqns:
            outs = self._equation(eqn, [read(v) for v in eqn.invars])
            env.update((v, _fit(v, f)) for v, f in zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def _equation(self, eqn: Any, facts: list[_Fact]) -> list[_Fact]:
        """The result facts of one equation."""
        name = eqn.primitive.name
        if name in _SINKS:
            return [_CLEAN] * len(eqn.outvars)
        if name in _CONTROL:
            outs = {"cond": self._cond, "while": self._while, "scan": self._scan}[name](eqn, facts)
            if name == "cond":  # (the evaluator follows a leaf's coordinates through branches, not loops)
                return outs
            return [f._replace(control=True) if self.collective and f.coords else f for f in outs]
        body = _call_body(eqn)
        if body is not None:
            return self._nested(eqn, body, facts)
        if name in _PER_OPERAND_IDENTITY and len(facts) == len(eqn.outvars):
            return list(facts)
        return self._first_order(eqn, facts)

    def _first_order(self, eqn: Any, facts: list[_Fact]) -> list[_Fact]:
        """The result fact of a first-order equation, shared by all its results."""
        name = eqn.primitive.name
        out = _join(facts)
        if len(out.labels) > 1:
            raise self._error(eqn, f"mixes parameter leaves {sorted(out.labels)}")
        if not self.crossing and len(out.labels | out.reduced) > 1:
            self.crossing = _describe([*self._stack, eqn], "combines full reductions of parameter leaves "
                                      f"{sorted(out.labels | out.reduced)} (a global norm)")
        if (out.coords or out.labels) and self._collective(eqn, facts, out):
            # (a scalar leaf's value counts too: on slices one device holds it, the others padding)
            self.reduced.update(out.coords | out.labels)
            return [_Fact(reduced=out.reduced | out.coords | out.labels)] * len(eqn.outvars)
        if out.coords:
            self._check_coordinates(eqn, facts, out.coords)
        if name in _RANDOM:
            number = name in _RANDOM_NUMBERS
            what = "draws random numbers" if number else "makes or transforms a PRNG key"
            out = out._replace(random=_Origin(what, (*self._stack, eqn), number, name == "random_bits"))
        elif out.positional is None and (name in _POSITIONAL or name not in _KNOWN):
            out = out._replace(positional=_Origin(_made_here(name), (*self._stack, eqn)))
        if out.random is not None:
            out = self._drawn(eqn, facts, out)
        return [out] * len(eqn.outvars)

    def _drawn(self, eqn: Any, facts: Sequence[_Fact], out: _Fact) -> _Fact:
        """``out`` for an equation consuming random values: still aligned with the draw if it is elementwise in
        them (`_Origin.aligned`); where aligned numbers meet a leaf's values where every device runs (outside loops
        and branches on parameter data: `_in_control`) in a collective analysis, the result is that leaf's data (its draws recorded), which slices reproduce exactly; any other
        meeting of random values and parameter data is refused."""
        randoms = [v for v, f in zip(eqn.invars, facts) if f.random is not None]
        aligned = out.random.aligned and (eqn.primitive.name == "random_bits" or (
            all(f.random is None or f.random.aligned for f in facts)
            and _structural_violation(eqn, randoms) is None))
        if not aligned and out.random.aligned:
            out = out._replace(random=dataclasses.replace(out.random, aligned=False))
        if not out.labels:
            return out
        if aligned and self.collective and not self._in_control() and not out.control:
            self.draws.update(out.labels)
            return out._replace(random=None)
        raise self._random(out.random, f"meet parameter-derived values in `{eqn.primitive.name}`")

    def _collective(self, eqn: Any, facts: Sequence[_Fact], out: _Fact) -> bool:
        """Whether ``eqn`` is a full reduction that runs as a collective on slices: outside control flow (the
        evaluator reduces only there), of values that are neither random nor position-dependent."""
        if not self.collective or collective_kind(eqn) is None or out.random is not None or out.control:
            return False
        if any(f.positional is not None for f in facts):
            return False
        return not self._in_control()

    def _in_control(self) -> bool:
        """Whether the equation at hand runs inside a loop, or inside a branch that devices may not all take
        (its predicate differs between devices holding different slices): no collective can run there."""
        return self._split > 0 or any(e.primitive.name in ("while", "scan") for e in self._stack)

    def _check_coordinates(self, eqn: Any, facts: Sequence[_Fact], coords: Taint) -> None:
        """Records (or raises) coordinate mixing by ``eqn`` of the leaves ``coords``, if it mixes them."""
        name = eqn.primitive.name
        chain = (*self._stack, eqn)
        positional = next((f.positional for f in facts if f.positional is not None), None)
        if name not in _KNOWN:
            self._couple(coords, chain, f"{_opaque(name)}; it consumes a parameter-derived value")
        elif positional is not None:
            wrong = "a coordinate slice would pair it with the wrong coordinates"
            if positional.eqns:
                self._couple(coords, positional.eqns,
                             f"{positional.what}, and `{name}` combines it with a parameter-derived value: {wrong}")
            else:
                self._couple(coords, chain, f"combines a parameter-derived value with {positional.what}: {wrong}")
        else:
            reason = _structural_violation(eqn, [v for v, f in zip(eqn.invars, facts) if f.coords])
            if reason is not None and self.collective and collective_kind(eqn) is not None:
                reason += (" inside a loop (`while`, `scan`) or a branch on parameter data, or of a value computed "
                           "there: zero1 runs full reductions on slices as collectives only where every device "
                           "runs them")
            if reason is not None:
                self._couple(coords, chain, reason)

    def _couple(self, coords: Taint, eqns: Sequence[Any], reason: str) -> None:
        """Coordinates of the leaves ``coords`` are mixed, as ``eqns[-1]`` shows."""
        if self.strict:
            raise CouplingError(_describe(eqns, reason))
        new = coords - self.reasons.keys()
        if new:
            message = _describe(eqns, reason)
            self.reasons.update((label, message) for label in new)

    def _error(self, eqn: Any, reason: str) -> CouplingError:
        return CouplingError(_describe([*self._stack, eqn], reason))

    @staticmethod
    def _random(origin: _Origin, where: str) -> CouplingError:
        """Refuses the random value made at ``origin`` because its values ``where``."""
        things = "the numbers" if origin.number else "values derived from the key"
        why = "zero1 splits the update across devices, which would not draw what optax draws on one device"
        return CouplingError(_describe(origin.eqns, f"{origin.what}, and {things} {where}: {why}"))

    def _nested(self, eqn: Any, jaxpr: Any, facts: Sequence[_Fact]) -> list[_Fact]:
        """Runs a sub-jaxpr of ``eqn`` with ``eqn`` on the location stack."""
        self._stack.append(eqn)
        try:
            return self.run(jaxpr, facts)
        finally:
            self._stack.pop()

    def _control(self, eqn: Any, pred: _Fact, outs: list[_Fact], what: str) -> list[_Fact]:
        """Adds the fact of a branch/loop predicate to every result (control dependence)."""
        if pred is _CLEAN:
            return outs
        outs = [_join((t, pred)) for t in outs]
        crossed = next((t.labels | t.reduced for t in outs if len(t.labels | t.reduced) > 1), None)
        if not self.crossing and crossed is not None:
            self.crossing = _describe([*self._stack, eqn], f"{what} combines full reductions of parameter leaves "
                                      f"{sorted(crossed)}")
        mixed = next((t.labels for t in outs if len(t.labels) > 1), None)
        if mixed is not None:
            raise self._error(eqn, f"{what} depends on a leaf and selects values of parameter leaves {sorted(mixed)}")
        if pred.coords:
            self._couple(pred.coords, (*self._stack, eqn), f"{what} depends on parameter-derived data")
        noisy = next((t for t in outs if t.random is not None and t.labels), None)
        if noisy is not None:
            raise self._random(noisy.random, f"meet parameter-derived values through a {what}")
        return outs

    def _cond(self, eqn: Any, facts: list[_Fact]) -> list[_Fact]:
        """All branches on the operands; the index (first operand) is a control dependence."""
        index, ops = facts[0], facts[1:]
        outs = [_CLEAN] * len(eqn.outvars)
        split = bool(index.labels or index.coords)
        self._split += split
        try:
            for branch in eqn.params["branches"]:
                outs = [_join(pair) for pair in zip(outs, self._nested(eqn, branch, ops))]
        finally:
            self._split -= split
        return self._control(eqn, index, outs, "branch predicate")

    def _while(self, eqn: Any, facts: list[_Fact]) -> list[_Fact]:
        """Iterates the carry facts to a fixed point; the loop predicate is a control dependence."""
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, carry = facts[:nc], facts[nc:nc + nb], facts[nc + nb:]
        while True:
            pred = self._nested(eqn, p["cond_jaxpr"], cond_consts + carry)[0]
            body_out = self._nested(eqn, p["body_jaxpr"], body_consts + carry)
            new = self._control(eqn, pred, [_join(pair) for pair in zip(carry, body_out)], "loop condition")
            if _key(new) == _key(carry):
                return carry
            carry = new

    def _scan(self, eqn: Any, facts: list[_Fact]) -> list[_Fact]:
        """Iterates the carry facts to a fixed point over ``consts + carry + xs``.

        Scanning over a parameter-derived array, or stacking one, mixes
        coordinates along the scanned axis; stacked results (``ys``) may depend
        on the iteration and so on their position.
        """
        nc, nk = _compat.scan_counts(eqn)
        consts, carry, xs = facts[:nc], facts[nc:nc + nk], facts[nc + nk:]
        xs_coords = _join(xs).coords
        if xs_coords:
            self._couple(xs_coords, (*self._stack, eqn),
                         "iterates over a parameter-derived array (mixes coordinates along the scanned axis)")
        while True:
            outs = self._nested(eqn, eqn.params["jaxpr"], consts + carry + xs)
            new = [_join(pair) for pair in zip(carry, outs[:nk])]
            if _key(new) == _key(carry):
                break
            carry = new
        ys = outs[nk:]
        ys_coords = _join(ys).coords
        if ys_coords:
            self._couple(ys_coords, (*self._stack, eqn), "stacks a parameter-derived value along a new axis")
        stacked = _Origin("stacks per-iteration values into an array whose values may depend on positions",
                          (*self._stack, eqn))
        return carry + [y if y.positional else y._replace(positional=stacked) for y in ys]
