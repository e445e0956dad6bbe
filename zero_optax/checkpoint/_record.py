"""The record of a zero1 checkpoint: a versioned JSON document, `<item>/zero_record.json`, beside the arrays.

The arrays are zarr3 over OCDBT, written by Orbax (`"storage": "orbax"`) or by TensorStore alone (`"tensorstore"`,
the offline `zo.reshard`), under the same names. The record (format version 3)::

    {"format": "zero_optax.record", "format_version": 3, "zero_optax_version": "0.5.0",
     "storage": "orbax" | "tensorstore",
     "tree": "<zero_optax.core._names.tree_signature of the saved pytree, each zero1 state shown as *>",
     "states": [{                    # one per zero1 state of the saved pytree, in tree order
        "partition": "flat" | "leaf" | "auto", "axis_name": "data" | ["replica", "data"], "world_size": 8,
        "mesh_axes": [["model", 2]],  # the other mesh axes parameters are sharded over, with their sizes
        "replica_axes": [["replica", 2]],  # optional: the mesh axes the state is replicated over (stored once)
        "master_dtype": null | "float32",
        "accumulate": {"mode": "local", "steps": 4},  # optional: accumulate="local"'s per-device sums are stored
        "owners": null | [int or null per leaf],
        "leaves":  [{"path", "shape", "dtype", "slots", "owner", "axes", "blocks", "group"[, "dims"],
                     "spec", "global_shape"}],
                     # dims: an owned leaf sharded over tensor-parallel axes, the axes cutting each dimension;
                     # its entries have the whole parameter's shape.
                     # spec: the placement, the axes cutting each dimension (naming exactly `axes`), null where
                     # the run did not know it; global_shape: the parameter's logical shape, null without spec
        "state_tree": "<tree_signature of the inner optimizer's state>",
        "entries": [{"path", "leaf", "shape", "dtype", "role"[, "key_impl"]}],   # key_impl: a typed key's data
        "clocks":  {entry path: number},  # shared scalar entries (step counts), the same on every device
        "arrays":  [{"name", "shape", "dtype", "spec", "entry", "buffer"[, "local"]}],   # see `_arrays`
        "packing": null | {"sizes": {dtype: n}, "offsets": [[[entry, dtype, offset], ...] per device]}}]}

Shapes are local blocks. Nothing is pickled, and `_schema` checks every field before anything is read. Optional
fields are written only where used. Format 2 (zero_optax 0.2 to 0.4) is format 3 without `spec` and
`global_shape`: its leaves' placement is unknown, and it is still read.

Two record fields reach no array: a leaf's shape where only its size matters (`[5, 3]` and `[15]` store the same
history), and an owned entry's shape that ends a packed buffer short of its size. So every checkpoint also keeps
a copy of all leaf and entry shapes (`shapes_table`) where editing the record alone does not reach: Orbax's
`_METADATA` (`custom_metadata`), or for `zo.reshard`'s output the zarr3 `attributes` of each state's first array.
Checkpoints of 0.2.0 lack the copy.

Examples:
  >>> from zero_optax.checkpoint import _record
  >>> _record.shapes_table({"leaves": [{"shape": [5, 3]}, {"shape": []}], "entries": [{"shape": [2]}]})
  {'leaves': [[5, 3], []], 'entries': [[2]]}
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

from zero_optax.checkpoint import _arrays, _paths, _store
from zero_optax.core import _names
from zero_optax.core._errors import ZeroCheckpointError
from zero_optax.core._version import __version__
from zero_optax.layout._state import canonical, shared_arrays
from zero_optax.layout._stored import LOCAL, ParamLeaf, StoredViews, known_sizes, whole_shape

FORMAT = "zero_optax.record"
FORMAT_VERSION = 3
READ_VERSIONS = (2, 3)
"""The record format versions this release reads (it writes `FORMAT_VERSION`)."""
PLACEMENT = ("spec", "global_shape")
"""The leaf fields format 3 adds: what format-2 records lack."""
STORAGE_ORBAX = "orbax"
STORAGE_TENSORSTORE = "tensorstore"
MAX_RECORD_BYTES = 64 << 20
"""Records larger than this are refused before they are read (a 1024-device, 1000-leaf record is about 1 MB)."""
MAX_DEPTH = 16
"""JSON nesting deeper than this is refused before parsing (the format nests 7 levels)."""
SHAPES_KEY = "zero_optax_shapes"
"""The key of the copy of the shapes in Orbax's `custom_metadata` and in a zarr3 array's `attributes`."""
ORBAX_METADATA = "_METADATA"
"""Orbax's metadata file of a PyTree item (`tree_metadata`, `custom_metadata`, ...)."""
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_OPTIONAL = ("local", "dims", "key_impl")


def as_json(x: Any) -> dict[str, Any]:
    """A `StoredArray`, `ParamLeaf` or `StateEntry` as the record shows it, `_OPTIONAL` fields only where set."""
    return {f.name: _lists(getattr(x, f.name)) for f in dataclasses.fields(x)
            if f.name not in _OPTIONAL or getattr(x, f.name) not in (None, ())}


def _lists(x: Any) -> Any:
    return [_lists(y) for y in x] if isinstance(x, tuple) else x


def global_shape(mesh: dict[str, int], leaf: ParamLeaf) -> tuple[int, ...] | None:
    """A leaf's logical shape, from its block's shape, `spec` and the axis sizes a record keeps (`mesh`, its
    `mesh_axes`, and the leaf's block count); None where the spec, or the size of an axis it names, is unknown."""
    sizes = known_sizes(mesh, leaf)
    return None if leaf.spec is None or sizes is None else whole_shape(leaf.shape, leaf.spec, sizes)


def state_record(layout: StoredViews, k: int, clocks: dict[str, Any] | None = None) -> dict[str, Any]:
    """The record of zero1 state number `k` of a checkpoint, with layout `layout`."""
    zero = set(layout.axes)
    mesh = {a: s for a, s in layout.axis_sizes if a not in zero}
    pack = layout.state_packing
    out = {
        "partition": layout.partition,
        "axis_name": layout.axis_name if isinstance(layout.axis_name, str) else list(layout.axis_name),
        "world_size": layout.world_size,
        "mesh_axes": [[a, s] for a, s in mesh.items()],
        "master_dtype": layout.master_dtype,
        "owners": None if layout.owners is None else list(layout.owners),
        "leaves": [dict(as_json(x), global_shape=_lists(global_shape(mesh, x))) for x in layout.leaves],
        "state_tree": layout.state_tree,
        "entries": [as_json(e) for e in layout.entries],
        "clocks": dict(clocks or {}),
        "arrays": [as_json(a) for a in _arrays.stored_arrays(layout, k)],
        "packing": None if not pack.sizes else {
            "sizes": dict(sorted(pack.sizes.items())),
            "offsets": [[[j, d, off] for j, (d, off) in sorted(o.items())] for o in pack.offsets]},
    }
    if layout.accumulate == LOCAL:  # sharded accumulators are ordinary entries; local ones are extra arrays
        out["accumulate"] = {"mode": layout.accumulate, "steps": layout.accumulate_steps}
    if layout.replica_sizes:
        out["replica_axes"] = [[a, s] for a, s in layout.replica_sizes]
    return out


def new_record(tree: str, states: list[dict[str, Any]], storage: str) -> dict[str, Any]:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "zero_optax_version": __version__,
            "storage": storage, "tree": tree, "states": states}


def clock_entries(layout: StoredViews) -> list[int]:
    """The entries the record shows as clocks: shared real scalars (step counts, injected hyperparameters)."""
    return [j for j, e in enumerate(layout.entries)
            if e.leaf is None and e.size == 1 and np.dtype(e.dtype).kind in "biuf"]


def read_clocks(state) -> dict[str, Any]:
    """The values of a state's clocks (`clock_entries`), from this host's first device."""
    values = shared_arrays(canonical(state))
    return {state.layout.entries[j].path: np.asarray(values[j].addressable_shards[0].data).reshape(-1)[0].item()
            for j in clock_entries(state.layout)}


def write(directory: Any, record: dict[str, Any]) -> None:
    """Writes the record into the item directory `directory` (any path Orbax accepts)."""
    (_paths.as_path(directory) / _names.RECORD_FILE).write_bytes(json.dumps(record, indent=1, sort_keys=True).encode())


def _depth(data: bytes) -> int:
    """The deepest nesting of `[`/`{` in JSON text, strings skipped, without parsing it."""
    code = np.frombuffer(_STRINGS.sub(b'""', data), np.uint8)
    step = np.isin(code, (ord("["), ord("{"))).astype(np.int64) - np.isin(code, (ord("]"), ord("}")))
    return int(np.cumsum(step).max(initial=0))


def decode(data: bytes, where: str) -> dict[str, Any]:
    """The record in `data` after checking its nesting, JSON syntax, format and version."""
    if _depth(data) > MAX_DEPTH:
        raise ZeroCheckpointError(f"{where} nests JSON deeper than a zero_optax record does ({MAX_DEPTH} levels); "
                                  "the checkpoint is damaged.")
    try:
        record = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ZeroCheckpointError(f"{where} is not valid JSON ({type(e).__name__}: {e}); the checkpoint is "
                                  "damaged.") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise ZeroCheckpointError(f"{where} is not a zero_optax record (format is {short(found)}, expected "
                                  f"{FORMAT!r}).")
    version = record.get("format_version")
    if version not in READ_VERSIONS or not isinstance(version, int) or isinstance(version, bool):
        raise ZeroCheckpointError(
            f"{where} has record format version {short(version)}; this zero_optax ({__version__}) reads versions "
            f"{' and '.join(map(str, READ_VERSIONS))} only. "
            + ("Checkpoints of zero_optax 0.1 (version 1) cannot be read: save them again with zero_optax 0.1's "
               "restore and this release's save." if version == 1 else
               "Upgrade zero_optax to read newer checkpoints." if isinstance(version, int) and version > 3 else
               "The record is damaged."))
    return record


def read(directory: Any) -> dict[str, Any]:
    """The record of an item directory, its size, syntax, format and version checked (its fields: `_schema`);
    on object stores also that the directory was marked finished (`_paths`)."""
    path = _paths.as_path(directory) / _names.RECORD_FILE
    with _paths.reading(path):
        if not path.parent.is_dir():
            raise ZeroCheckpointError(f"{path.parent} is not a zero_optax checkpoint: no such directory.")
        _paths.check(path.parent)
        if not path.exists():
            raise ZeroCheckpointError(f"{path.parent} is not a zero_optax checkpoint: {_names.RECORD_FILE} is "
                                      "missing.")
        size = path.stat().length
        if size > MAX_RECORD_BYTES:
            raise ZeroCheckpointError(f"{path} is {size} bytes, more than a zero_optax record may hold "
                                      f"({MAX_RECORD_BYTES}); the checkpoint is damaged.")
        data = path.read_bytes()
    return decode(data, str(path))


def short(x: Any) -> str:
    """A JSON value as a short text, for error messages."""
    try:
        s = json.dumps(x, sort_keys=True)
    except (TypeError, ValueError):
        s = repr(x)
    return s if len(s) < 200 else s[:197] + "..."


def shapes_table(state: dict[str, Any]) -> dict[str, list]:
    """The copy of a state's record (JSON): the shapes of its leaves and of its entries."""
    return {field: [list(x["shape"]) for x in state[field]] for field in ("leaves", "entries")}


def pytree_save(arrays: dict[str, Any], record: dict[str, Any]) -> ocp.args.PyTreeSave:
    """Orbax's save arguments for the arrays of `record`, with the copy in `custom_metadata`."""
    metadata: dict[str, Any] = {SHAPES_KEY: [shapes_table(s) for s in record["states"]]}
    return ocp.args.PyTreeSave(arrays, custom_metadata=metadata)


def _json(data: bytes, where: str) -> Any:
    if len(data) > MAX_RECORD_BYTES:
        raise ZeroCheckpointError(f"{where} is {len(data)} bytes, more than zero_optax reads "
                                  f"({MAX_RECORD_BYTES}); the checkpoint is damaged.")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ZeroCheckpointError(f"{where} is not valid JSON ({type(e).__name__}); the checkpoint is damaged.") \
            from None


def stored_shapes(directory, saved, store: _store.ItemArrays) -> list[Any]:
    """The copy of every state's shapes kept with the arrays (None for a state, or all, where there is none)."""
    if saved.storage == STORAGE_ORBAX:
        path = directory / ORBAX_METADATA
        with _paths.reading(path):
            if not path.exists():
                raise ZeroCheckpointError(f"{directory} is incomplete or damaged: Orbax's {ORBAX_METADATA} is "
                                          "missing. Nothing was loaded.")
            meta = _json(path.read_bytes(), str(path))
        custom = meta.get("custom_metadata") if isinstance(meta, dict) else None
        copy = custom.get(SHAPES_KEY) if isinstance(custom, dict) else None
        if copy is None:  # written by zero_optax 0.2.0
            return [None] * len(saved.states)
        if not isinstance(copy, list) or len(copy) != len(saved.states):
            raise ZeroCheckpointError(f"{path}: its `custom_metadata.{SHAPES_KEY}` does not describe the record's "
                                      f"{len(saved.states)} zero1 states; the checkpoint is damaged.")
        return copy
    out = []
    for s in saved.states:
        value = store.read_key(f"{s.arrays[0].name}/zarr.json") if s.arrays else None
        meta = _json(value, f"{directory}: array {s.arrays[0].name}'s zarr.json") if value is not None else None
        attributes = meta.get("attributes") if isinstance(meta, dict) else None
        out.append(attributes.get(SHAPES_KEY) if isinstance(attributes, dict) else None)
    return out


def check_shapes(directory, saved, store: _store.ItemArrays) -> None:
    """Refuses, naming the first field that differs, a record whose shapes differ from the copy."""
    for s, copy in zip(saved.states, stored_shapes(directory, saved, store)):
        want = shapes_table(state_record(s.layout, s.index))
        if copy is None or copy == want:
            continue
        for field in ("leaves", "entries"):
            got = copy.get(field) if isinstance(copy, dict) else None
            if not isinstance(got, list) or len(got) != len(want[field]):
                raise ZeroCheckpointError(
                    f"{directory}: the record's `states[{s.index}].{field}` has {len(want[field])} items, but the "
                    f"stored arrays' metadata lists "
                    f"{len(got) if isinstance(got, list) else short(got)} shapes; the record is damaged.")
            for i, (a, b) in enumerate(zip(want[field], got)):
                if a != b:
                    raise ZeroCheckpointError(
                        f"{directory}: the record's `states[{s.index}].{field}[{i}].shape` is {a}, but the stored "
                        f"arrays' metadata says {short(b)}; the record is damaged.")
        raise ZeroCheckpointError(f"{directory}: the stored arrays' metadata of state {s.index} is damaged.")
