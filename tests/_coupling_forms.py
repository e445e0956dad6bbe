"""Plain forms of the coupling analysis and the program signatures, which only the tests use: each answers one
question on a traced function, where zero1's plan asks `analyze_leaves`, `on_slices` and `leaf_programs`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zero_optax.analysis import _coupling, _programs
from zero_optax.core._errors import ZeroCouplingError as CouplingError


def find_coordinate_coupling(fn: Callable[..., Any], *args: Any, collective: bool = False) -> str | None:
    """None if `fn(*args)` is elementwise in all its non-scalar inputs, else where it mixes coordinates.

    Every input leaf of more than one element is a source; scalars (step counts, hyperparameters) are not. A
    reduction over an axis of size > 1, a matrix product, a gather, a transpose, a broadcast that changes the
    element count, a branch on such data, an opaque kernel, or combining such data with a position-dependent value
    (`iota`, a non-scalar constant) couples; so do random numbers reaching such data or an output. `collective`
    accepts full reductions (`collective_kind`) outside control flow.
    """
    closed, _, _ = _programs.trace(fn, *args)
    try:
        _coupling._Analysis(strict=True, collective=collective).check(closed, _coupling._coordinate_facts(closed),
                                                                        None)
    except CouplingError as e:
        return str(e)
    return None


def find_leaf_coupling(fn: Callable[..., Any], *args: Any, sources: Any, out_sources: Any = None) -> str | None:
    """None if no equation of `fn(*args)` combines values of two labelled leaves and no random value reaches
    parameter data, else the first offending primitive and where it is (`sources`, `out_sources`: as for
    `analyze_leaves`)."""
    traced = _programs.trace(fn, *args)
    in_labels, out_labels = _programs.labels(traced, sources, out_sources)
    facts = [_coupling._Fact(frozenset({lab})) if lab is not None else _coupling._CLEAN for lab in in_labels]
    try:
        _coupling._Analysis(strict=False).check(traced.closed, facts, out_labels)
    except CouplingError as e:
        return str(e)
    return None


def program_signature(fn: Callable[..., Any], *args: Any) -> list[str]:
    """What `fn(*args)` computes (`_programs.signature`): equal on a parameter and on a slice of it for an
    elementwise optimizer, different where the update depends on shapes (a mask from `ndim`, `1 / g.size`)."""
    out: list[str] = []
    closed, _, _ = _programs.trace(fn, *args)
    _programs.signature(closed.jaxpr, _programs.known_consts(closed), out)
    return out
