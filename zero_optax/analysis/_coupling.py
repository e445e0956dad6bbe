"""What a partition may do: proofs, from the inner update's jaxpr, that it does not couple values that devices
update apart (`on_slices` for coordinate slices, `analyze_leaves` for owned leaves). Both propagate a `_Fact` per
value through every equation conservatively: an unknown primitive mixes what it consumes.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jaxlib
import numpy as np

from zero_optax.analysis import _programs, _stacked
from zero_optax.core import _compat
from zero_optax.core._errors import ZeroCouplingError

Taint = frozenset[int]
_NONE: Taint = frozenset()


@dataclasses.dataclass(frozen=True)
class LeafAnalysis:
    """What `analyze_leaves` found: the leaves whose coordinates the update mixes (`reasons`: the first equation
    that does, per leaf), those it fully reduces, where a reduction of one leaf first meets another (`crossing`),
    those meeting random numbers drawn in their shape, and per output the leaves it depends on (`output_taints`),
    coordinate by coordinate (`output_coords`), through full reductions (`output_reductions`)."""

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
    """Where a random or position-dependent value was made: `what` it is (a phrase), the enclosing `eqns` ending with
    the one that made it, whether it holds random `number`s (not a key), and whether only elementwise operations
    followed `random_bits` (`aligned`: a device holding a slice reproduces it by drawing the whole leaf)."""

    what: str
    eqns: tuple[Any, ...] = ()
    number: bool = False
    aligned: bool = False


class _Fact(NamedTuple):
    """What the analysis knows about one value."""

    labels: Taint = _NONE  # parameter leaves the value depends on
    coords: Taint = _NONE  # leaves (of more than one element) it depends on coordinate by coordinate
    random: _Origin | None = None  # set if it derives from a random primitive
    positional: _Origin | None = None  # set if, not being parameter-derived, it may vary by position
    reduced: Taint = _NONE  # leaves whose full (collective) reductions the value depends on
    control: bool = False  # set if it passed through a `while` loop (its coordinates no longer reduce exactly)
    lead: int = 0  # leading axes that are no coordinates (`_stacked`), where it depends on coordinates


_CLEAN = _Fact()
_CONSTANT = _Origin("a non-scalar constant (an array the function closes over)")
_LITERAL = _Origin("a non-scalar literal")
_SHARED = _Origin("non-scalar shared state (an input without a parameter label, e.g. a vector hyperparameter)")


def _coordinate_facts(closed: _programs.ClosedJaxpr, untainted: frozenset[int] = frozenset(),
                      scalar_leaves: frozenset[int] = frozenset(), inputs: Inputs | None = None) -> list[_Fact]:
    """One label for every non-scalar input but the `untainted` ones (a PRNG key's data) and for the
    `scalar_leaves` (one-element parameter data); `inputs`: which are shared state, which stacked histories."""
    inputs = inputs or Inputs()
    scalar = _Fact(frozenset({0}))

    def fact(k: int, var: Any) -> _Fact:
        if _programs.size(var) <= 1 or k in untainted:
            return scalar if k in scalar_leaves else _CLEAN
        if k in inputs.shared:
            return _Fact(positional=_SHARED)
        return _Fact(frozenset({0}), frozenset({0}), lead=inputs.leads.get(k, 0))
    return [fact(k, v) for k, v in enumerate(closed.jaxpr.invars)]


class Inputs(NamedTuple):
    """What the analyses know of an update's inputs beyond their labels, by flat input index: the `shared` state
    (no parameter's) and the `leads` of stacked histories (`_stacked`: `(memory, *param.shape)`)."""

    shared: frozenset[int] = frozenset()
    leads: Mapping[int, int] = {}


class Slices(NamedTuple):
    """What an update needs on slices: `joint`, whether it has full reductions or draws in a leaf's shape (every
    leaf's slice at once); per flattened output, whether it depends on inputs coordinate by coordinate."""

    joint: bool
    coordinate_outputs: tuple[bool, ...]


def on_slices(fn: Callable[..., Any] | _programs.Traced, *args: Any, untainted: frozenset[int] = frozenset(),
              scalar_leaves: frozenset[int] = frozenset(), inputs: Inputs | None = None) -> Slices:
    """What `fn` needs on coordinate slices; `ZeroCouplingError` where it mixes coordinates other than by full
    reductions outside branches on parameter data and `while` loops (`untainted`, `scalar_leaves`, `inputs`: as
    for `_coordinate_facts`)."""
    closed = _programs.trace(fn, *args).closed
    analysis = _Analysis(strict=True, collective=True)
    outs = analysis.check(closed, _coordinate_facts(closed, untainted, scalar_leaves, inputs), None)
    return Slices(bool(analysis.reduced or analysis.draws), tuple(bool(f.coords) for f in outs))


def analyze_leaves(fn: Callable[..., Any] | _programs.Traced, *args: Any, sources: Any, out_sources: Any = None,
                   collective: bool = False, leads: Mapping[int, int] | None = None) -> LeafAnalysis:
    """Which labelled leaves `fn(*args)` mixes the coordinates of; `ZeroCouplingError` where it mixes two leaves or
    random values reach outputs not labelled None. `sources` (`out_sources`): a prefix of `args` (of the output) with
    an int label or None per subtree; with `collective`, a full reduction of a leaf does not couple it; `leads`: by
    flat input index, the leading axes of a stacked history (`_stacked`)."""
    traced = _programs.trace(fn, *args)
    in_labels, out_labels = _programs.labels(traced, sources, out_sources)
    facts = []
    for k, (var, lab) in enumerate(zip(traced.closed.jaxpr.invars, in_labels)):
        big = _programs.size(var) > 1
        if lab is None:
            facts.append(_Fact(positional=_SHARED) if big else _CLEAN)
        else:
            facts.append(_Fact(frozenset({lab}), frozenset({lab}) if big else _NONE,
                               lead=(leads or {}).get(k, 0) if big else 0))
    analysis = _Analysis(strict=False, collective=collective)
    outs = analysis.check(traced.closed, facts, out_labels)
    return LeafAnalysis(frozenset(analysis.reasons), dict(analysis.reasons), tuple(f.labels for f in outs),
                        frozenset(analysis.reduced), analysis.crossing, tuple(f.reduced for f in outs),
                        frozenset(analysis.draws), tuple(f.coords for f in outs))


_JAX_DIRS = tuple(os.path.dirname(f) + os.sep for f in (getattr(m, "__file__", None) for m in (jax, jaxlib)) if f)
_STDLIB = sysconfig.get_paths().get("stdlib", "\0") + os.sep


def _is_internal(filename: str) -> bool:
    if filename.startswith(_JAX_DIRS) or filename in (__file__, _programs.__file__):  # (`_programs.trace`)
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
    """Formatted source frames of `eqn` outside jax internals, innermost first."""
    try:  # (private JAX API, which may move or change: never fail an analysis over it)
        from jax._src import source_info_util  # pylint: disable=g-import-not-at-top

        codes, lastis = eqn.source_info.traceback.raw_frames()  # (None, an AttributeError, when JAX records none)
        frames = [source_info_util.raw_frame_to_frame(code, lasti)
                  for code, lasti in zip(codes, lastis) if not _is_internal(code.co_filename)]
        return [f"{_short_path(f.file_name)}:{f.start_line} ({f.function_name})" for f in frames]
    except (ImportError, AttributeError, TypeError, ValueError):
        return []


def _describe(eqns: Sequence[Any], reason: str) -> str:
    """`eqns[-1]`'s primitive (`eqns`: a chain of enclosing equations), its innermost user frame and, where it
    differs, the innermost `update` function's frame (which names the transformation)."""
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
    if name in _programs.KERNELS:
        return "an opaque kernel (custom call / Pallas) the analysis cannot see into"
    if name in _programs.CALLBACKS:
        return "a host callback the analysis cannot see into"
    return "a primitive the analysis does not know"


def _made_here(name: str) -> str:
    """What a position-dependent result of primitive `name` is, as a phrase."""
    if name in ("iota", "iota_2x32_shape"):
        return "makes a value that depends on array positions (`jnp.arange`, `jnp.indices`, a triangular mask, ...)"
    if name in _programs.POSITIONAL:
        return "builds an array whose values may depend on positions"
    return _opaque(name) + "; its result may depend on positions"


def _structural_violation(eqn: Any, tainted: Sequence[Any]) -> str | None:
    """Why a known first-order equation with the operands `tainted` mixes coordinates, or None."""
    name = eqn.primitive.name
    out_size = _programs.size(eqn.outvars[0]) if eqn.outvars else 0
    if name in _programs.ELEMENTWISE:
        if any(_programs.size(v) != out_size for v in tainted):
            return "broadcasts a parameter-derived value to a different number of elements"
        return None
    params = eqn.params
    operand = eqn.invars[0]
    shape = _programs.shape(operand)
    if name == "squeeze" or (name == "reshape" and params.get("dimensions") is None):
        return None  # row-major reshapes keep element order
    if name == "broadcast_in_dim":
        if list(tainted) == [operand] and _programs.size(operand) == out_size:
            return None  # only unit dimensions added
        return "broadcasts a parameter-derived value to a different number of elements"
    if name == "transpose":
        moved = [p for p in params["permutation"] if shape[p] != 1]
        return None if moved == sorted(moved) else "transposes a parameter-shaped value"
    if name in _programs.REDUCTIONS:
        sizes = [shape[a] for a in params["axes"]]
        if all(s == 1 for s in sizes):
            return None
        return f"reduces a parameter-derived value over axes of sizes {sizes}"
    if name in _programs.CUMULATIVE:
        size = shape[params["axis"]]
        return None if size == 1 else f"accumulates a parameter-derived value along an axis of size {size}"
    return "is not elementwise in a parameter-derived operand"


def _join(facts: Sequence[_Fact]) -> _Fact:
    """The fact of a value computed from values with `facts`: unions, and the first origins."""
    labels = coords = reduced = _NONE
    random = positional = None
    control = False
    lead = 0
    for f in facts:
        if f is _CLEAN:
            continue
        control = control or f.control
        lead = max(lead, f.lead) if f.coords else lead
        labels = labels | f.labels if labels else f.labels
        coords = coords | f.coords if coords else f.coords
        reduced = reduced | f.reduced if reduced else f.reduced
        random = random or f.random
        positional = positional or f.positional
    return _Fact(labels, coords, random, positional, reduced, control, lead)


def _fit(var: Any, fact: _Fact) -> _Fact:
    """`fact` for the value `var`: a value of at most one element is never position-dependent."""
    if fact.positional is not None and _programs.size(var) <= 1:
        return fact._replace(positional=None)
    return fact


def _literal(atom: Any) -> _Fact:
    return _Fact(positional=_LITERAL) if _programs.size(atom) > 1 else _CLEAN


def _key(facts: Sequence[_Fact]) -> list[tuple[Any, ...]]:
    """What a loop's fixed point compares (origins are kept from the first iteration that sets them)."""
    return [(f.labels, f.coords, f.random is None, f.positional is None, f.reduced, f.control, f.lead)
            for f in facts]


class _Analysis:
    """Forward propagation of facts over a jaxpr: mixing two labels, or random values meeting parameter data,
    raises; mixing a leaf's coordinates raises if `strict`, else is recorded in `reasons`. With `collective`, a full
    reduction where every device runs it (not in a `while` loop or a branch on parameter data; a `scan` runs its
    iterations on every device) is a collective on slices, whose scalar carries no label."""

    def __init__(self, strict: bool, collective: bool = False):
        self.strict = strict
        self.collective = collective
        self.reasons: dict[int, str] = {}
        self.reduced: set[int] = set()
        self.draws: set[int] = set()  # leaves whose values met random numbers drawn in their shape
        self.crossing: str | None = None  # where a reduction of one leaf first meets another leaf
        self._stack: list[Any] = []  # enclosing equations, for source locations
        self._split = 0  # enclosing branches whose predicate depends on parameter data

    def check(self, closed: _programs.ClosedJaxpr, facts: Sequence[_Fact], out_labels: Sequence[int | None] | None
              ) -> list[_Fact]:
        """Runs `closed` and refuses random values reaching outputs; returns the output facts."""
        outs = self.run(closed, facts)
        for i, origin in enumerate(f.random for f in outs):
            if origin is not None and out_labels is None and origin.number:
                raise self._random(origin, "reach an output of the update")
            if origin is not None and out_labels is not None and out_labels[i] is not None:
                raise self._random(origin, f"reach an output of parameter leaf {out_labels[i]}")
        return outs

    def run(self, program: Any, facts: Sequence[_Fact]) -> list[_Fact]:
        """Propagates input facts through `program` (`_programs.evaluate` on facts)."""
        jaxpr, consts = _compat.jaxpr_parts(program)
        return _programs.evaluate(
            jaxpr, [_Fact(positional=_CONSTANT) if np.size(c) > 1 else _CLEAN for c in consts],
            [_fit(v, f) for v, f in zip(jaxpr.invars, facts)],
            lambda eqn, ins: [_fit(v, f) for v, f in zip(eqn.outvars, self._equation(eqn, ins))], _literal)

    def _equation(self, eqn: Any, facts: list[_Fact]) -> list[_Fact]:
        """The result facts of one equation."""
        name = eqn.primitive.name
        if name in _programs.SINKS:
            return [_CLEAN] * len(eqn.outvars)
        if name in _programs.CONTROL:
            outs = {"cond": self._cond, "while": self._while, "scan": self._scan}[name](eqn, facts)
            if name != "while":  # (the evaluator follows a leaf's coordinates through branches and scans)
                return outs
            return [f._replace(control=True) if self.collective and f.coords else f for f in outs]
        body = _programs.call_body(eqn)
        if body is not None:
            return self._nested(eqn, body, facts)
        if name in _programs.PER_OPERAND_IDENTITY and len(facts) == len(eqn.outvars):
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
        stacked = None  # (the lead of a result `_stacked` proves per coordinate: no position-dependent value)
        if out.coords:
            stacked = self._check_coordinates(eqn, facts, out.coords)
            out = out._replace(lead=stacked or 0)
        if name in _programs.RANDOM:
            number = name in _programs.RANDOM_NUMBERS
            what = "draws random numbers" if number else "makes or transforms a PRNG key"
            out = out._replace(random=_Origin(what, (*self._stack, eqn), number, name == "random_bits"))
        elif out.positional is None and stacked is None and (name in _programs.POSITIONAL
                                                             or name not in _programs.KNOWN):
            out = out._replace(positional=_Origin(_made_here(name), (*self._stack, eqn)))
        if out.random is not None:
            out = self._drawn(eqn, facts, out)
        return [out] * len(eqn.outvars)

    def _drawn(self, eqn: Any, facts: Sequence[_Fact], out: _Fact) -> _Fact:
        """`out` for an equation consuming random values, still `aligned` if elementwise in them; only aligned numbers
        meeting a leaf where every device runs, in a collective analysis, are accepted (a draw)."""
        origin = out.random
        assert origin is not None  # called for random values only
        randoms = [v for v, f in zip(eqn.invars, facts) if f.random is not None]
        aligned = origin.aligned and (eqn.primitive.name == "random_bits" or (
            all(f.random is None or f.random.aligned for f in facts)
            and _structural_violation(eqn, randoms) is None))
        if not aligned and origin.aligned:
            origin = dataclasses.replace(origin, aligned=False)
            out = out._replace(random=origin)
        if not out.labels:
            return out
        if aligned and self.collective and not self._in_loop() and not out.control:
            self.draws.update(out.labels)
            return out._replace(random=None)
        raise self._random(origin, f"meet parameter-derived values in `{eqn.primitive.name}`")

    def _collective(self, eqn: Any, facts: Sequence[_Fact], out: _Fact) -> bool:
        """Whether `eqn` is a full reduction of values neither random nor position-dependent, outside control
        flow (where alone the evaluator reduces)."""
        return (self.collective and _programs.collective_kind(eqn) is not None and out.random is None
                and not out.control and all(f.positional is None for f in facts) and not self._in_control()
                and len({f.lead for f in facts if f.coords}) <= 1
                and all(f.lead < len(_programs.shape(v)) for v, f in zip(eqn.invars, facts) if f.coords))

    def _in_control(self) -> bool:
        """Whether the equation at hand runs in a `while` loop (its trip count may depend on the data), or in a
        branch devices may not all take (no collective there)."""
        return self._split > 0 or any(e.primitive.name == "while" for e in self._stack)

    def _in_loop(self) -> bool:
        """Whether the equation at hand runs in a loop or in a branch devices may not all take (no draw there)."""
        return self._split > 0 or any(e.primitive.name in ("while", "scan") for e in self._stack)

    def _check_coordinates(self, eqn: Any, facts: Sequence[_Fact], coords: Taint) -> int | None:
        """Records (or raises) coordinate mixing by `eqn` of the leaves `coords`, if it mixes them; the lead of
        its result where `_stacked` proves it per coordinate, else None."""
        name = eqn.primitive.name
        chain = (*self._stack, eqn)
        positional = next((f.positional for f in facts if f.positional is not None), None)
        if name not in _programs.KNOWN:
            self._couple(coords, chain, f"{_opaque(name)}; it consumes a parameter-derived value")
        elif positional is not None:
            wrong = "a coordinate slice would pair it with the wrong coordinates"
            if positional.eqns:
                self._couple(coords, positional.eqns,
                             f"{positional.what}, and `{name}` combines it with a parameter-derived value: {wrong}")
            else:
                self._couple(coords, chain, f"combines a parameter-derived value with {positional.what}: {wrong}")
        else:
            stacked = _stacked.lead_of(eqn, [f.lead if f.coords else None for f in facts],
                                       [not (f.labels or f.coords) and f.random is None for f in facts])
            lead, reason = stacked or (None, _structural_violation(eqn, [v for v, f in zip(eqn.invars, facts)
                                                                         if f.coords]))
            if reason is not None and self.collective and _programs.collective_kind(eqn) is not None:
                reason += (" inside a loop (`while`) or a branch on parameter data, or of a value computed "
                           "there: zero1 runs full reductions on slices as collectives only where every device "
                           "runs them")
            if reason is None:
                return lead
            self._couple(coords, chain, reason)
        return None

    def _couple(self, coords: Taint, eqns: Sequence[Any], reason: str) -> None:
        """Coordinates of the leaves `coords` are mixed, as `eqns[-1]` shows."""
        if self.strict:
            raise ZeroCouplingError(_describe(eqns, reason))
        new = coords - self.reasons.keys()
        if new:
            message = _describe(eqns, reason)
            self.reasons.update((label, message) for label in new)

    def _error(self, eqn: Any, reason: str) -> ZeroCouplingError:
        return ZeroCouplingError(_describe([*self._stack, eqn], reason))

    @staticmethod
    def _random(origin: _Origin, where: str) -> ZeroCouplingError:
        """Refuses the random value made at `origin` because its values `where`."""
        things = "the numbers" if origin.number else "values derived from the key"
        why = "zero1 splits the update across devices, which would not draw what optax draws on one device"
        return ZeroCouplingError(_describe(origin.eqns, f"{origin.what}, and {things} {where}: {why}"))

    def _nested(self, eqn: Any, jaxpr: Any, facts: Sequence[_Fact]) -> list[_Fact]:
        """Runs a sub-jaxpr of `eqn` with `eqn` on the location stack."""
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
        noisy = next((t.random for t in outs if t.random is not None and t.labels), None)
        if noisy is not None:
            raise self._random(noisy, f"meet parameter-derived values through a {what}")
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
        """Iterates the carry facts to a fixed point; scanning over or stacking a parameter-derived array mixes
        coordinates along that axis."""
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

