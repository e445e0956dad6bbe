"""A second copy of the record's leaf and entry shapes, kept in the stored arrays' own metadata, checked against it.

Two record fields reach no array: a leaf's shape where only its size matters (`[5, 3]` and `[15]` store the same
history), and an owned entry's shape that ends a packed buffer short of its size. So every checkpoint also keeps
all leaf and entry shapes where editing the record alone does not reach: Orbax's `_METADATA` (`custom_metadata`),
or for `zo.reshard`'s output the zarr3 `attributes` of each state's first array. Checkpoints of 0.2.0 lack the copy.

Examples:
  >>> from zero_optax.checkpoint import _shapes
  >>> _shapes.table({"states": [{"leaves": [{"shape": [5, 3]}, {"shape": []}], "entries": [{"shape": [2]}]}]})
  [{'leaves': [[5, 3], []], 'entries': [[2]]}]
"""

from __future__ import annotations

import json
from typing import Any

import orbax.checkpoint as ocp

from zero_optax.checkpoint import _paths, _record, _store
from zero_optax.core._errors import ZeroCheckpointError

KEY = "zero_optax_shapes"
"""The key of the copy in Orbax's `custom_metadata` and in a zarr3 array's `attributes`."""
ORBAX_METADATA = "_METADATA"
"""Orbax's metadata file of a PyTree item (`tree_metadata`, `custom_metadata`, ...)."""


def table(record: dict[str, Any]) -> list[dict[str, list]]:
    """Per state of a record (JSON): the shapes of its leaves and of its entries."""
    return [{"leaves": [list(x["shape"]) for x in s["leaves"]], "entries": [list(e["shape"]) for e in s["entries"]]}
            for s in record["states"]]


def describe(layout) -> dict[str, list]:
    """The shapes of a layout's leaves and entries, as the copy holds them (the items of `table`)."""
    return {"leaves": [list(x.shape) for x in layout.leaves], "entries": [list(e.shape) for e in layout.entries]}


def pytree_save(arrays: dict[str, Any], record: dict[str, Any]) -> ocp.args.PyTreeSave:
    """Orbax's save arguments for the arrays of `record`, with the copy in `custom_metadata`."""
    return ocp.args.PyTreeSave(arrays, custom_metadata={KEY: table(record)})


def _json(data: bytes, where: str) -> Any:
    if len(data) > _record.MAX_RECORD_BYTES:
        raise ZeroCheckpointError(f"{where} is {len(data)} bytes, more than zero_optax reads "
                                  f"({_record.MAX_RECORD_BYTES}); the checkpoint is damaged.")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ZeroCheckpointError(f"{where} is not valid JSON ({type(e).__name__}); the checkpoint is damaged.") \
            from None


def stored(directory, saved, store: _store.ItemArrays) -> list[Any]:
    """The copy of every state's shapes kept with the arrays (None for a state, or all, where there is none)."""
    if saved.storage == _record.STORAGE_ORBAX:
        path = directory / ORBAX_METADATA
        with _paths.reading(path):
            if not path.exists():
                raise ZeroCheckpointError(f"{directory} is incomplete or damaged: Orbax's {ORBAX_METADATA} is "
                                          "missing. Nothing was loaded.")
            meta = _json(path.read_bytes(), str(path))
        custom = meta.get("custom_metadata") if isinstance(meta, dict) else None
        copy = custom.get(KEY) if isinstance(custom, dict) else None
        if copy is None:  # written by zero_optax 0.2.0
            return [None] * len(saved.states)
        if not isinstance(copy, list) or len(copy) != len(saved.states):
            raise ZeroCheckpointError(f"{path}: its `custom_metadata.{KEY}` does not describe the record's "
                                      f"{len(saved.states)} zero1 states; the checkpoint is damaged.")
        return copy
    out = []
    for s in saved.states:
        value = store.read_key(f"{s.arrays[0].name}/zarr.json") if s.arrays else None
        meta = _json(value, f"{directory}: array {s.arrays[0].name}'s zarr.json") if value is not None else None
        attributes = meta.get("attributes") if isinstance(meta, dict) else None
        out.append(attributes.get(KEY) if isinstance(attributes, dict) else None)
    return out


def check(directory, saved, store: _store.ItemArrays) -> None:
    """Refuses, naming the first field that differs, a record whose shapes differ from the copy."""
    for s, copy in zip(saved.states, stored(directory, saved, store)):
        want = describe(s.layout)
        if copy is None or copy == want:
            continue
        for field in ("leaves", "entries"):
            got = copy.get(field) if isinstance(copy, dict) else None
            if not isinstance(got, list) or len(got) != len(want[field]):
                raise ZeroCheckpointError(
                    f"{directory}: the record's `states[{s.index}].{field}` has {len(want[field])} items, but the "
                    f"stored arrays' metadata lists "
                    f"{len(got) if isinstance(got, list) else _record.short(got)} shapes; the record is damaged.")
            for i, (a, b) in enumerate(zip(want[field], got)):
                if a != b:
                    raise ZeroCheckpointError(
                        f"{directory}: the record's `states[{s.index}].{field}[{i}].shape` is {a}, but the stored "
                        f"arrays' metadata says {_record.short(b)}; the record is damaged.")
        raise ZeroCheckpointError(f"{directory}: the stored arrays' metadata of state {s.index} is damaged.")
