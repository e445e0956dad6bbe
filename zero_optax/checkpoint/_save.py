"""What a save writes: the state's arrays as one flat `{name: jax.Array}` dict for Orbax, and the record."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from zero_optax.checkpoint import _arrays, _record, _schema, _tree
from zero_optax.core._errors import ZeroCheckpointError


@dataclasses.dataclass(frozen=True)
class SavePlan:
    """Everything a save writes: array name -> the state's global array, and the JSON record."""

    arrays: dict[str, jax.Array]
    record: dict[str, Any]


def plan(tree: Any) -> SavePlan:
    """What saving `tree` writes; refuses arrays that are not live `jax.Array`s as their layouts describe them."""
    parts = _tree.split(tree, "The saved state")
    arrays, states = {}, []
    for k, (path, state) in enumerate(parts.states):
        where = _tree.where(k, path)
        layout = state.layout
        for d in {x.dtype for x in layout.leaves} | {e.dtype for e in layout.entries}:
            if d not in _schema.DTYPES:
                raise ZeroCheckpointError(f"{where} holds {d} arrays, which zero_optax checkpoints do not store "
                                          f"(they store {', '.join(sorted(_schema.DTYPES))}).")
        specs = _arrays.stored_arrays(layout, k)
        for value in jax.tree.leaves(state):
            if not isinstance(value, jax.Array) or isinstance(value, jax.core.Tracer):
                raise ZeroCheckpointError(f"{where} holds a {type(value).__name__}, not a jax.Array; save the state "
                                          "that zero1's init/update returned.")
            if value.is_deleted():
                raise ZeroCheckpointError(f"{where} holds an array that was deleted (donated to a later step?); "
                                          "save the state before passing it to a jitted function that donates it.")
        values = _arrays.state_values(state)
        if len(values) != len(specs):
            raise ZeroCheckpointError(f"{where} has {len(values)} arrays but its layout describes {len(specs)}.")
        for spec, value in zip(specs, values):
            _arrays.check_value(f"{where}: array {spec.name}", spec, value)
            arrays[spec.name] = value
        states.append(_record.state_record(layout, k, _record.read_clocks(state)))
    return SavePlan(arrays, _record.new_record(parts.signature, states, _record.STORAGE_ORBAX))
