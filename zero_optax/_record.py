"""The versioned, validated record of a ZeRO optimizer state: a JSON document plus raw arrays.

An item directory written by `ZeroCheckpointHandler` (and by `zero_optax.reshard`) holds::

    zero_record.json          the record below (written once, by process 0)
    arrays/<state>.<name>/    one zarr array per stored array (zero_optax._store), each host writing its own rows

The record (format version 1)::

    {"format": "zero_optax.record", "format_version": 1, "zero_optax_version": "0.1.0",
     "tree": "<treedef of the saved pytree, with each zero1 state as a leaf>",
     "states": [{                         # one per zero1 state in the saved pytree, in tree order
        "partition": "flat" | "leaf", "axis_name": "data", "world_size": 8,
        "owners": null | [int per leaf],
        "leaves":  [{"path", "shape", "dtype", "slots", "owner"}],   # trainable parameter leaves
        "state_tree": "<treedef of the inner state, with its type names>",
        "entries": [{"path", "leaf", "shape", "dtype"}],              # inner-state leaves, in flatten order
        "clocks":  {entry path: scalar},  # shared scalar entries (step counts ...), identical on every device
        "arrays":  [{"name", "shape", "dtype", "entry": j} | {"name", "shape", "dtype", "buffer": dtype}],
        "packing": null | {"sizes": {dtype: n}, "offsets": [[[entry, dtype, offset], ...] per device]}}]}

Flat states store one array per entry, `[N, *entry.shape]` (row r = device r). Leaf states store their packed
per-dtype buffers, `[N, size]`. Nothing is pickled: loading a checkpoint never runs code.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from zero_optax._errors import ZeroCheckpointError
from zero_optax._layout import FLAT, LEAF, Layout, ParamLeaf, StateEntry

FORMAT = "zero_optax.record"
FORMAT_VERSION = 1
RECORD_FILE = "zero_record.json"
ARRAYS_DIR = "arrays"


def _version() -> str:
    from zero_optax import __version__  # pylint: disable=g-import-not-at-top
    return __version__


def array_names(layout: Layout, index: int) -> list[dict[str, Any]]:
    """The arrays a state with this layout stores, with their global shapes."""
    n = layout.world_size
    if layout.partition == FLAT:
        return [{"name": f"{index}.entry{j:04d}", "shape": [n, *e.shape], "dtype": e.dtype, "entry": j}
                for j, e in enumerate(layout.entries)]
    return [{"name": f"{index}.buffer_{d}", "shape": [n, size], "dtype": d, "buffer": d}
            for d, size in layout.state_packing.sizes.items()]


def state_arrays(state) -> list[jax.Array]:
    """The arrays of one zero1 state, in the order of `array_names`."""
    if state.layout.partition == FLAT:
        return jax.tree.leaves(state.inner_state)
    return [state.buffers[d] for d in state.layout.state_packing.sizes]


def layout_record(layout: Layout, index: int, clocks: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON-ready record of one state's layout."""
    packing = None
    if layout.partition == LEAF:
        p = layout.state_packing
        packing = {"sizes": dict(p.sizes),
                   "offsets": [[[j, d, off] for j, (d, off) in sorted(o.items())] for o in p.offsets]}
    return {
        "partition": layout.partition,
        "axis_name": layout.axis_name,
        "world_size": layout.world_size,
        "owners": None if layout.owners is None else list(layout.owners),
        "leaves": [{"path": x.path, "shape": list(x.shape), "dtype": x.dtype, "slots": x.slots, "owner": x.owner}
                   for x in layout.leaves],
        "state_tree": layout.state_tree,
        "entries": [{"path": e.path, "leaf": e.leaf, "shape": list(e.shape), "dtype": e.dtype}
                    for e in layout.entries],
        "clocks": clocks or {},
        "arrays": array_names(layout, index),
        "packing": packing,
    }


def layout_from_record(rec: dict[str, Any]) -> Layout:
    """A `Layout` (without a parameter treedef) rebuilt from a state record, for offline tools."""
    leaves = tuple(ParamLeaf(x["path"], tuple(x["shape"]), x["dtype"], x["slots"], x["owner"]) for x in rec["leaves"])
    entries = tuple(StateEntry(e["path"], e["leaf"], tuple(e["shape"]), e["dtype"]) for e in rec["entries"])
    return Layout(rec["partition"], rec["axis_name"], rec["world_size"], leaves, entries, None,
                  rec.get("state_tree", ""))


def read_clocks(state) -> dict[str, Any]:
    """Values of the shared scalar entries (step counts ...), read from this host's first device."""
    layout = state.layout
    clocks = {}
    for j, e in enumerate(layout.entries):
        if e.leaf is not None or e.size != 1:
            continue
        if layout.partition == FLAT:
            arr = jax.tree.leaves(state.inner_state)[j]
            shard = np.asarray(arr.addressable_shards[0].data).reshape(-1)
            value = shard[0]
        else:
            arr = state.buffers[e.dtype]
            shard = arr.addressable_shards[0]
            rank = shard.index[0].start or 0
            _, off = layout.state_packing.offsets[rank][j]
            value = np.asarray(shard.data).reshape(-1)[off]
        clocks[e.path] = value.item()
    return clocks


def write_record(directory: str | os.PathLike, record: dict[str, Any]) -> None:
    """Writes the JSON record atomically (temporary file, then rename)."""
    path = os.path.join(os.fspath(directory), RECORD_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def read_record(directory: str | os.PathLike) -> dict[str, Any]:
    """The record of an item directory, after checking its format and version."""
    path = os.path.join(os.fspath(directory), RECORD_FILE)
    if not os.path.exists(path):
        raise ZeroCheckpointError(f"{os.fspath(directory)} is not a zero_optax checkpoint: {RECORD_FILE} is missing.")
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise ZeroCheckpointError(f"{path} is not valid JSON ({e}); the checkpoint is damaged.") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise ZeroCheckpointError(f"{path} is not a zero_optax record (format is {found!r}, expected {FORMAT!r}).")
    version = record.get("format_version")
    if version != FORMAT_VERSION:
        raise ZeroCheckpointError(
            f"{path} has record format version {version!r}; this zero_optax ({_version()}) reads version "
            f"{FORMAT_VERSION}. Upgrade zero_optax to read newer checkpoints.")
    return record


def new_record(tree_str: str, states: list[dict[str, Any]]) -> dict[str, Any]:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "zero_optax_version": _version(),
            "tree": tree_str, "states": states}


_KEYS = ("partition", "owners", "leaves", "state_tree", "entries", "arrays")


def first_difference(saved: dict[str, Any], target: dict[str, Any], where: str) -> str | None:
    """A sentence naming the first way a saved state record differs from the target's, or None."""
    if saved["world_size"] != target["world_size"]:
        return (f"{where} was saved with world size {saved['world_size']}, but the target state has "
                f"{target['world_size']} devices. Convert the checkpoint first with "
                f"zero_optax.reshard(src, dst, world_size={target['world_size']}) "
                f"(or `python -m zero_optax.reshard SRC DST --world-size {target['world_size']}`).")
    for key in _KEYS:
        a, b = saved.get(key), target.get(key)
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                return f"{where}: {key} has {len(a)} items in the checkpoint but {len(b)} in the target."
            for i, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    return f"{where}: {key}[{i}] is {_short(x)} in the checkpoint but {_short(y)} in the target."
        return f"{where}: {key} is {_short(a)} in the checkpoint but {_short(b)} in the target."
    return None


def _short(x: Any) -> str:
    s = json.dumps(x, sort_keys=True)
    return s if len(s) < 200 else s[:197] + "..."
