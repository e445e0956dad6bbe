"""Values stacked along leading axes: a history of shape `(memory, *param.shape)` (L-BFGS's) holds, per coordinate
of its parameter, one value per leading index, so writing or reading it at an index every coordinate shares
(`x.at[i].set(g)`, `x[i]`) acts coordinate by coordinate. A value's `lead` counts such leading axes (0: all its
axes are coordinate axes); on coordinate slices the value is `(*leading, slots)`. `lead_of` says what an equation
consuming values of known leads makes of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from zero_optax.analysis import _programs

Leads = Sequence[int | None]
"""Per operand of an equation, its lead where it depends on parameter coordinates, else None."""
Result = tuple[int, str | None]
"""The lead of an equation's result, and None; or why it mixes coordinates."""

_SPREADS = "broadcasts a parameter-derived value to a different number of elements"


def fits(shape: Sequence[int], lead: int, k: int) -> bool:
    """Whether a value of `shape` with `lead` leading axes also reads as one with `k` (the axes between are unit)."""
    lo, hi = sorted((lead, k))
    return all(d == 1 for d in shape[lo:hi])


def lead_of(eqn: Any, leads: Leads, plain: Sequence[bool]) -> Result | None:
    """The lead of the result of `eqn` on operands of `leads`, or why it mixes coordinates; None where no operand
    is stacked and `eqn` stacks nothing (the caller's rules for coordinates then decide). `plain`: per operand,
    whether it holds no parameter data (an index every device computes alike)."""
    rule = _RULES.get(eqn.primitive.name)
    if rule is not None and (any(leads) or eqn.primitive.name in _STACKING):
        return rule(eqn, leads, plain)
    if not any(leads):
        return None
    if eqn.primitive.name in _programs.ELEMENTWISE:
        return _elementwise(eqn, leads)
    return 0, f"is not elementwise in a history stacked along {max(k or 0 for k in leads)} leading axes"


def _tainted(eqn: Any, leads: Leads) -> list[tuple[tuple[int, ...], int]]:
    return [(_programs.shape(v), lead) for v, lead in zip(eqn.invars, leads) if lead is not None]


def _elementwise(eqn: Any, leads: Leads) -> Result:
    """Operands of the result's shape whose leading axes agree (unit axes aside)."""
    out = _programs.shape(eqn.outvars[0])
    tainted = _tainted(eqn, leads)
    if any(shape != out for shape, _ in tainted):
        return 0, _SPREADS
    lead = max(lead for _, lead in tainted)
    if not all(fits(shape, k, lead) for shape, k in tainted):
        return 0, "combines values stacked along different leading axes"
    return lead, None


def _broadcast(eqn: Any, leads: Leads, plain: Sequence[bool]) -> Result:
    """New leading axes (a history of copies), or unit axes anywhere."""
    del plain
    shape, out, lead = _programs.shape(eqn.invars[0]), _programs.shape(eqn.outvars[0]), leads[0] or 0
    dims, added = tuple(eqn.params["broadcast_dimensions"]), len(out) - len(shape)
    if dims == tuple(range(added, len(out))) and out[added:] == shape:
        return lead + added, None
    if _programs.size(eqn.invars[0]) != _programs.size(eqn.outvars[0]) or list(dims) != sorted(dims):
        return 0, _SPREADS
    return (dims[lead - 1] + 1 if lead else 0), None


def _squeeze(eqn: Any, leads: Leads, plain: Sequence[bool]) -> Result:
    del plain
    lead = leads[0] or 0
    return lead - sum(d < lead for d in eqn.params["dimensions"]), None


def _reshape(eqn: Any, leads: Leads, plain: Sequence[bool]) -> Result:
    """A row-major reshape that keeps the leading axes."""
    del plain
    shape, out, lead = _programs.shape(eqn.invars[0]), _programs.shape(eqn.outvars[0]), leads[0] or 0
    if eqn.params.get("dimensions") is None and out[:lead] == shape[:lead]:
        return lead, None
    return 0, "reshapes a stacked history across its leading axes"


def _transpose(eqn: Any, leads: Leads, plain: Sequence[bool]) -> Result:
    del plain
    shape, perm, lead = _programs.shape(eqn.invars[0]), tuple(eqn.params["permutation"]), leads[0] or 0
    moved = [p for p in perm[lead:] if shape[p] != 1]
    if perm[:lead] == tuple(range(lead)) and moved == sorted(moved):
        return lead, None
    return 0, "transposes a parameter-shaped value"


def _reduce(eqn: Any, leads: Leads, plain: Sequence[bool]) -> Result:
    """A reduction over leading axes (and unit ones)."""
    del plain
    shape, axes, lead = _programs.shape(eqn.invars[0]), eqn.params["axes"], leads[0] or 0
    if all(a < lead or shape[a] == 1 for a in axes):
        return lead - sum(a < lead for a in axes), None
    return 0, f"reduces a parameter-derived value over axes of sizes {[shape[a] for a in axes]}"


def _cumulative(eqn: Any, leads: Leads, plain: Sequence[bool]) -> Result:
    del plain
    shape, axis, lead = _programs.shape(eqn.invars[0]), eqn.params["axis"], leads[0] or 0
    if axis < lead or shape[axis] == 1:
        return lead, None
    return 0, f"accumulates a parameter-derived value along an axis of size {shape[axis]}"


def _indexed(plain: Sequence[bool]) -> str | None:
    if not all(plain):
        return "indexes a stacked history at positions computed from parameter data"
    return None


def _slice(eqn: Any, leads: Leads, plain: Sequence[bool]) -> Result:
    """A static slice of leading axes only."""
    del plain
    shape, p, lead = _programs.shape(eqn.invars[0]), eqn.params, leads[0] or 0
    strides = p.get("strides") or (1,) * len(shape)
    if all(a == 0 for a in p["start_indices"][lead:]) and tuple(p["limit_indices"][lead:]) == shape[lead:] \
            and all(s == 1 for s in strides[lead:]):
        return lead, None
    return 0, "slices a parameter-derived value along its coordinates"


def _dynamic_slice(eqn: Any, leads: Leads, plain: Sequence[bool]) -> Result:
    """`x[i]` of a history: leading axes at indices every device shares, whole coordinates."""
    shape, lead = _programs.shape(eqn.invars[0]), leads[0]
    if lead is None:
        return 0, "slices an array at positions computed from parameter data"
    why = _indexed(plain[1:])
    if why is None and tuple(eqn.params["slice_sizes"][lead:]) != shape[lead:]:
        why = "slices a parameter-derived value along its coordinates"
    return lead, why


def _update_lead(op_rank: int, op_lead: int | None, upd_lead: int | None, upd_rank: int) -> int:
    """The operand's lead in a write of an update: the operand's if it is parameter data, else the one that reads
    the update's coordinates as the operand's trailing axes."""
    if op_lead is not None:
        return op_lead
    assert upd_lead is not None  # (the result depends on coordinates)
    return op_rank - (upd_rank - upd_lead)


def _dynamic_update_slice(eqn: Any, leads: Leads, plain: Sequence[bool]) -> Result:
    """`x.at[i].set(g)` as a slice: the update covers whole coordinates at leading indices every device shares."""
    op, upd = _programs.shape(eqn.invars[0]), _programs.shape(eqn.invars[1])
    lead = _update_lead(len(op), leads[0], leads[1], len(upd))
    why = _indexed(plain[2:])
    if why is None and (lead < 0 or upd[lead:] != op[lead:] or
                        (leads[1] is not None and not fits(upd, leads[1], lead))):
        why = "writes a parameter-derived value across coordinates"
    return lead, why


def _scatter(eqn: Any, leads: Leads, plain: Sequence[bool]) -> Result:
    """`x.at[i].set(g)` (or `.add`, ...): indices address leading axes only, every device computes them alike,
    and each update window covers the coordinates whole, as the update's trailing axes."""
    dn = eqn.params["dimension_numbers"]
    op, upd = _programs.shape(eqn.invars[0]), _programs.shape(eqn.invars[2])
    coords = len(op) - leads[0] if leads[0] is not None else len(upd) - (leads[2] or 0)
    lead, windows = len(op) - coords, tuple(dn.update_window_dims)
    why = _indexed(plain[1:2])
    leading = set(dn.inserted_window_dims) | set(dn.scatter_dims_to_operand_dims)
    whole = coords == 0 or (windows[-coords:] == tuple(range(len(upd) - coords, len(upd)))
                            and upd[len(upd) - coords:] == op[lead:])
    batched = getattr(dn, "operand_batching_dims", ()) or getattr(dn, "scatter_indices_batching_dims", ())
    if why is None and (lead < 0 or batched or any(d >= lead for d in leading) or not whole
                        or (leads[2] is not None and not fits(upd, leads[2], len(upd) - coords))):
        why = "writes a parameter-derived value across coordinates"
    return lead, why


def _gather(eqn: Any, leads: Leads, plain: Sequence[bool]) -> Result:
    """`x[i]` as a gather: indices address leading axes only, slices cover the coordinates whole."""
    dn, sizes = eqn.params["dimension_numbers"], tuple(eqn.params["slice_sizes"])
    op, out, lead = _programs.shape(eqn.invars[0]), _programs.shape(eqn.outvars[0]), leads[0]
    if lead is None:
        return 0, "gathers an array at positions computed from parameter data"
    coords = len(op) - lead
    why = _indexed(plain[1:2])
    offsets = tuple(dn.offset_dims)
    batched = getattr(dn, "operand_batching_dims", ()) or getattr(dn, "start_indices_batching_dims", ())
    leading = set(dn.collapsed_slice_dims) | set(dn.start_index_map)
    whole = sizes[lead:] == op[lead:] and (coords == 0 or offsets[-coords:] == tuple(range(len(out) - coords,
                                                                                           len(out))))
    if why is None and (batched or any(d >= lead for d in leading) or not whole):
        why = "gathers a parameter-derived value across coordinates"
    return len(out) - coords, why


_RULES: dict[str, Callable[[Any, Leads, Sequence[bool]], Result]] = {
    "broadcast_in_dim": _broadcast, "squeeze": _squeeze, "reshape": _reshape, "transpose": _transpose,
    "slice": _slice, "dynamic_slice": _dynamic_slice, "dynamic_update_slice": _dynamic_update_slice,
    "gather": _gather, **dict.fromkeys(_programs.REDUCTIONS, _reduce),
    **dict.fromkeys(_programs.CUMULATIVE, _cumulative),
    **dict.fromkeys(("scatter", "scatter-add", "scatter_add", "scatter-sub", "scatter-mul", "scatter-min",
                     "scatter-max"), _scatter),
}
_STACKING = frozenset({"broadcast_in_dim", "dynamic_update_slice", "scatter", "scatter-add", "scatter_add",
                       "scatter-sub", "scatter-mul", "scatter-min", "scatter-max"})
"""What may stack a value of no lead: copies along new leading axes, writes into a history
(`zeros((m, *shape)).at[i].set(g)`)."""
