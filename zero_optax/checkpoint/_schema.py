"""A decoded record checked field by field into `SavedState`s, before any of it is used.

Every problem is a `ZeroCheckpointError` naming the field (`states[0].leaves[2].slots`). Array names are never read
from the record: they are formatted from the checked layout, and the record's list must equal them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from zero_optax.checkpoint import _arrays, _paths, _record
from zero_optax.core._errors import ZeroCheckpointError
from zero_optax.layout._stored import (
    AUTO,
    FLAT,
    LEAF,
    LOCAL,
    MASTER,
    MASTER_PREFIX,
    STATE,
    ParamLeaf,
    StateEntry,
    StoredLayout,
    slot_count,
    whole_shape,
)

DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                    "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"})
"""The dtypes a zero1 checkpoint may store."""
MAX_WORLD_SIZE = 1 << 20
MAX_ITEMS = 1 << 22
"""At most this many leaves, entries or arrays per state."""
MAX_NDIM = 32
MAX_ELEMENTS = 1 << 48
MAX_NAME = 1 << 16
"""The longest path or axis name, in characters."""
_TOP = {"format", "format_version", "zero_optax_version", "storage", "tree", "states"}
_STATE = {"partition", "axis_name", "world_size", "mesh_axes", "master_dtype", "owners", "leaves", "state_tree",
          "entries", "clocks", "arrays", "packing"}
_LEAF = {"path", "shape", "dtype", "slots", "owner", "axes", "blocks", "group"}
_ENTRY = {"path", "leaf", "shape", "dtype", "role"}


@dataclasses.dataclass(frozen=True)
class SavedState:
    """One checked zero1 state of a checkpoint (`index` among them); `clocks`: its shared scalars' values by path."""

    index: int
    layout: StoredLayout
    arrays: tuple[_arrays.StoredArray, ...]
    clocks: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Saved:
    """A checkpoint's record, checked: the saved pytree's signature, how its arrays are stored, its states."""

    tree: str
    storage: str
    states: tuple[SavedState, ...]


@dataclasses.dataclass(frozen=True)
class _Checker:
    """Checks one value of a record each; `fail` names the field."""

    where: str

    def fail(self, field: str, problem: str):
        raise ZeroCheckpointError(f"{self.where}: the record's `{field}` {problem}; the record is damaged.")

    def dict(self, x, field: str, keys: set[str], optional: set[str] | frozenset[str] = frozenset()) -> dict:
        if not isinstance(x, dict):
            self.fail(field, f"is a {type(x).__name__}, not an object")
        keys = keys | (optional & set(x))
        missing, extra = sorted(keys - set(x)), sorted(set(x) - keys)
        if missing:
            self.fail(field, f"lacks {', '.join(map(repr, missing))}")
        if extra:
            self.fail(field, f"has unknown fields {', '.join(_record.short(k) for k in extra[:5])}")
        return x

    def list(self, x, field: str, max_len: int = MAX_ITEMS) -> list:
        if not isinstance(x, list):
            self.fail(field, f"is a {type(x).__name__}, not a list")
        if len(x) > max_len:
            self.fail(field, f"has {len(x)} items, more than {max_len}")
        return x

    def int(self, x, field: str, lo: int, hi: int) -> int:
        if isinstance(x, bool) or not isinstance(x, int):
            self.fail(field, f"is {_record.short(x)}, not an integer")
        if not lo <= x <= hi:
            self.fail(field, f"is {x}, outside [{lo}, {hi}]")
        return x

    def str(self, x, field: str, max_len: int = MAX_NAME, empty: bool = False) -> str:
        if not isinstance(x, str):
            self.fail(field, f"is {_record.short(x)}, not a string")
        if len(x) > max_len or (not x and not empty):
            self.fail(field, f"has {len(x)} characters, expected 1 to {max_len}")
        return x

    def dtype(self, x, field: str) -> str:
        if not isinstance(x, str) or x not in DTYPES:
            self.fail(field, f"is {_record.short(x)}, not one of the dtypes zero_optax stores "
                      f"({', '.join(sorted(DTYPES))})")
        return x

    def shape(self, x, field: str) -> tuple[int, ...]:
        shape = tuple(self.int(d, f"{field}[{i}]", 0, MAX_ELEMENTS)
                      for i, d in enumerate(self.list(x, field, MAX_NDIM)))
        if math.prod(shape) > MAX_ELEMENTS:
            self.fail(field, f"has {math.prod(shape)} elements, more than {MAX_ELEMENTS}")
        return shape

    def names(self, x, field: str) -> tuple[str, ...]:
        names = tuple(self.str(a, f"{field}[{i}]") for i, a in enumerate(self.list(x, field, 64)))
        if len(set(names)) != len(names):
            self.fail(field, f"repeats an axis name: {_record.short(list(names))}")
        return names


def load(directory: Any) -> Saved:
    """The checked record of the item directory `directory`."""
    path = _paths.as_path(directory)
    return parse(_record.read(path), str(path))


def parse(record: dict[str, Any], where: str) -> Saved:
    """Checks every field of a decoded record; returns what it describes."""
    c = _Checker(where)
    c.dict(record, "<record>", _TOP)
    c.str(record["zero_optax_version"], "zero_optax_version", 256)
    storage = record["storage"]
    if storage not in (_record.STORAGE_ORBAX, _record.STORAGE_TENSORSTORE):
        c.fail("storage", f"is {_record.short(storage)}, not \"orbax\" or \"tensorstore\"")
    tree = c.str(record["tree"], "tree", _record.MAX_RECORD_BYTES)
    states = c.list(record["states"], "states", MAX_ITEMS)
    if not states:
        c.fail("states", "is empty: the checkpoint holds no zero1 state")
    placed = record["format_version"] != 2  # (format 2 records no placement)
    return Saved(tree, storage, tuple(_state(c, s, k, placed) for k, s in enumerate(states)))


def _state(c: _Checker, rec: Any, k: int, placed: bool) -> SavedState:
    f = f"states[{k}]"
    c.dict(rec, f, _STATE, {"accumulate", "replica_axes"})
    partition = rec["partition"]
    if partition not in (FLAT, LEAF, AUTO):
        c.fail(f"{f}.partition", f"is {_record.short(partition)}, not \"flat\", \"leaf\" or \"auto\"")
    axis_name, zero = _axis_name(c, rec["axis_name"], f)
    n = c.int(rec["world_size"], f"{f}.world_size", 1, MAX_WORLD_SIZE)
    mesh = _mesh_axes(c, rec["mesh_axes"], f, zero)
    master_dtype = rec["master_dtype"]
    if master_dtype is not None:
        c.dtype(master_dtype, f"{f}.master_dtype")
    leaves = tuple(_placement(c, x, f"{f}.leaves[{i}]", _leaf(c, x, f"{f}.leaves[{i}]", partition, zero, mesh, n),
                              placed, zero, mesh)
                   for i, x in enumerate(c.list(rec["leaves"], f"{f}.leaves")))
    paths = [x.path for x in leaves]
    if len(set(paths)) != len(paths):
        c.fail(f"{f}.leaves", "repeats a leaf path")
    entries = _entries(c, rec["entries"], f, leaves, master_dtype, mesh)
    state_tree = c.str(rec["state_tree"], f"{f}.state_tree", _record.MAX_RECORD_BYTES)
    accumulate, steps = None, 1
    if "accumulate" in rec:
        acc = c.dict(rec["accumulate"], f"{f}.accumulate", {"mode", "steps"})
        if acc["mode"] != LOCAL:
            c.fail(f"{f}.accumulate.mode", f"is {_record.short(acc['mode'])}, not \"{LOCAL}\"")
        accumulate, steps = LOCAL, c.int(acc["steps"], f"{f}.accumulate.steps", 2, 2 ** 31 - 1)
    replicas = _mesh_axes(c, rec.get("replica_axes", []), f, zero, "replica_axes", mesh)
    layout = StoredLayout(partition, axis_name, n, leaves, entries, state_tree, master_dtype, tuple(mesh.items()),
                          accumulate, steps, tuple(replicas.items()))
    arrays = _implied(c, rec, f, layout, k)
    clocks = _clocks(c, rec["clocks"], f, layout)
    return SavedState(k, layout, arrays, clocks)


def _axis_name(c: _Checker, rec: Any, f: str) -> tuple[str | tuple[str, ...], tuple[str, ...]]:
    """A state's `axis_name` (a name, or a non-empty list of distinct names) and its ZeRO axes as a tuple."""
    if isinstance(rec, str):
        return rec, (c.str(rec, f"{f}.axis_name"),)
    zero = c.names(rec, f"{f}.axis_name")
    if not zero:
        c.fail(f"{f}.axis_name", "is an empty list")
    return zero, zero


def _mesh_axes(c: _Checker, rec: Any, f: str, zero: tuple[str, ...], field: str = "mesh_axes",
               mesh: dict[str, int] | None = None) -> dict[str, int]:
    """A state's `mesh_axes` (or `replica_axes`, none of `mesh`): `[name, size]` pairs of non-ZeRO axes."""
    axes = {}
    for i, pair in enumerate(c.list(rec, f"{f}.{field}", 64)):
        pair = c.list(pair, f"{f}.{field}[{i}]", 2)
        if len(pair) != 2:
            c.fail(f"{f}.{field}[{i}]", "is not a [name, size] pair")
        name = c.str(pair[0], f"{f}.{field}[{i}][0]")
        if name in zero or name in axes:
            c.fail(f"{f}.{field}[{i}][0]", f"repeats the axis `{name}`")
        if name in (mesh or {}):
            c.fail(f"{f}.{field}[{i}][0]", f"names `{name}`, which is one of `mesh_axes`")
        axes[name] = c.int(pair[1], f"{f}.{field}[{i}][1]", 1, MAX_WORLD_SIZE)
    return axes


def _implied(c: _Checker, rec: dict, f: str, layout: StoredLayout, k: int) -> tuple[_arrays.StoredArray, ...]:
    """The arrays state `k` stores, its `owners`, `packing` and `arrays` checked to be what its leaves imply."""
    want = _record.state_record(layout, k)
    if rec["owners"] != want["owners"]:
        c.fail(f"{f}.owners", f"is {_record.short(rec['owners'])}, but the leaves say {_record.short(want['owners'])}")
    if rec["packing"] != want["packing"]:
        c.fail(f"{f}.packing", "does not match the owners and entries")
    if rec["arrays"] != want["arrays"]:
        c.fail(f"{f}.arrays", "does not list the arrays its layout stores")
    return tuple(_arrays.stored_arrays(layout, k))


def _clocks(c: _Checker, rec: Any, f: str, layout: StoredLayout) -> dict[str, Any]:
    """A state's `clocks`: a number for each of its shared scalar entries, and nothing else."""
    clocks = c.dict(rec, f"{f}.clocks", {layout.entries[j].path for j in _record.clock_entries(layout)})
    for path, value in clocks.items():
        if not isinstance(value, (bool, int, float)) or isinstance(value, int) and not -2 ** 64 < value < 2 ** 64:
            c.fail(f"{f}.clocks[{_record.short(path)}]", f"is {_record.short(value)}, not a number a scalar entry "
                   "can hold")
    return dict(clocks)


def _leaf(c: _Checker, rec: Any, f: str, partition: str, zero: tuple[str, ...], mesh: dict[str, int],
          n: int) -> ParamLeaf:
    c.dict(rec, f, _LEAF, {"dims", *_record.PLACEMENT})  # (`_placement` checks these)
    path = c.str(rec["path"], f"{f}.path", empty=True)
    shape = c.shape(rec["shape"], f"{f}.shape")
    dtype = c.dtype(rec["dtype"], f"{f}.dtype")
    axes = c.names(rec["axes"], f"{f}.axes")
    for a in axes:
        if a not in zero and a not in mesh:
            c.fail(f"{f}.axes", f"names `{a}`, which is neither a ZeRO axis nor one of `mesh_axes`")
    blocks = c.int(rec["blocks"], f"{f}.blocks", 1, MAX_ELEMENTS)
    group = c.int(rec["group"], f"{f}.group", 1, n)
    model = math.prod(mesh[a] for a in axes if a not in zero)
    if set(zero) <= set(axes):
        c.fail(f"{f}.axes", "names every ZeRO axis")
    if blocks % model or (blocks // model) * group != n:
        c.fail(f"{f}", f"has blocks={blocks} and group={group}, which do not fit world size {n} and axes "
               f"{_record.short(list(axes))}")
    size = math.prod(shape)
    dims = _dims(c, rec, f, shape, axes) if "dims" in rec else ()
    owner = rec["owner"]
    slots = c.int(rec["slots"], f"{f}.slots", 0, MAX_ELEMENTS)
    if owner is None:
        if dims:
            c.fail(f"{f}.dims", "is given for a sliced leaf (it applies to owned leaves only)")
        if partition == LEAF:
            c.fail(f"{f}.owner", "is null, but every leaf of the leaf partition has an owner")
        if slots != slot_count(size, group):
            c.fail(f"{f}.slots", f"is {slots}, but a block of {size} elements on {group} devices has "
                   f"{slot_count(size, group)}")
        if blocks * group * slots > MAX_ELEMENTS:
            c.fail(f"{f}", "describes a history larger than a checkpoint may hold")
    else:
        owner = c.int(owner, f"{f}.owner", 0, n - 1)
        if partition == FLAT:
            c.fail(f"{f}.owner", f"is {owner}, but the flat partition has no owners")
        if axes and not dims or group != n:  # owned leaves hold the whole leaf, cut only over their `dims`
            c.fail(f"{f}", "is owned by one device but sharded over other mesh axes")
        if slots != size:
            c.fail(f"{f}.slots", f"is {slots}, but an owned leaf keeps all its {size} elements")
    return ParamLeaf(path, shape, dtype, slots, owner, axes, blocks, group, dims)


def _dims(c: _Checker, rec: dict, f: str, shape: tuple[int, ...], axes: tuple[str, ...]
          ) -> tuple[tuple[str, ...], ...]:
    """An owned tensor-parallel leaf's `dims`: one list of axes per dimension, naming each of its `axes` once."""
    dims = tuple(c.names(cut, f"{f}.dims[{d}]") for d, cut in enumerate(c.list(rec["dims"], f"{f}.dims", 64)))
    if len(dims) != len(shape) or sorted(a for cut in dims for a in cut) != sorted(axes) or not axes:
        c.fail(f"{f}.dims", f"is {_record.short([list(x) for x in dims])}, which does not cut the {len(shape)} "
               f"dimensions over the leaf's axes {_record.short(list(axes))}, each once")
    return dims


def _placement(c: _Checker, rec: dict, f: str, leaf: ParamLeaf, placed: bool, zero: tuple[str, ...],
               mesh: dict[str, int]) -> ParamLeaf:
    """`leaf` with its `spec` (format 3): null, or per dimension the axes cutting it, naming exactly the leaf's
    axes (its `dims`, where given); and its `global_shape`, the block's shape cut as `spec` says (null without)."""
    if not placed:
        c.dict(rec, f, _LEAF, {"dims"})
        return leaf
    c.dict(rec, f, _LEAF | set(_record.PLACEMENT), {"dims"})
    spec = rec["spec"]
    if spec is None and not leaf.axes:
        c.fail(f"{f}.spec", "is null, but a leaf sharded over no other mesh axis has every dimension uncut")
    if spec is not None:
        spec = tuple(c.names(cut, f"{f}.spec[{d}]") for d, cut in enumerate(c.list(spec, f"{f}.spec", MAX_NDIM)))
        named = [a for cut in spec for a in cut]
        for a in named:
            if a not in zero and a not in mesh:
                c.fail(f"{f}.spec", f"names `{a}`, which is neither a ZeRO axis nor one of `mesh_axes`")
        if len(spec) != len(leaf.shape) or sorted(named) != sorted(leaf.axes):
            c.fail(f"{f}.spec", f"is {_record.short([list(x) for x in spec])}, which does not cut the "
                   f"{len(leaf.shape)} dimensions over the leaf's axes {_record.short(list(leaf.axes))}, each once")
        if leaf.dims and spec != leaf.dims:
            c.fail(f"{f}.spec", f"is {_record.short([list(x) for x in spec])}, but the leaf's `dims` are "
                   f"{_record.short([list(x) for x in leaf.dims])}")
    leaf = dataclasses.replace(leaf, spec=spec)
    want, got = _record.global_shape(mesh, leaf), rec["global_shape"]
    if want is None and got is not None:
        c.fail(f"{f}.global_shape", f"is {_record.short(got)}, but the leaf's spec, or the size of an axis it names, "
               "is unknown: it must be null")
    if want is not None and c.shape(got, f"{f}.global_shape") != want:
        c.fail(f"{f}.global_shape", f"is {_record.short(got)}, but the block {list(leaf.shape)} cut as `spec` says "
               f"over the axis sizes {_record.short(mesh)} is {list(want)}")
    return leaf


def _entries(c: _Checker, rec: Any, f: str, leaves: tuple[ParamLeaf, ...], master_dtype: str | None,
             mesh: dict[str, int]) -> tuple[StateEntry, ...]:
    out = []
    for j, e in enumerate(c.list(rec, f"{f}.entries")):
        g = f"{f}.entries[{j}]"
        c.dict(e, g, _ENTRY, {"key_impl"})
        path = c.str(e["path"], f"{g}.path", empty=True)
        leaf = e["leaf"]
        if leaf is not None:
            leaf = c.int(leaf, f"{g}.leaf", 0, len(leaves) - 1)
        shape = c.shape(e["shape"], f"{g}.shape")
        dtype = c.dtype(e["dtype"], f"{g}.dtype")
        role = e["role"]
        if role not in (STATE, MASTER):
            c.fail(f"{g}.role", f"is {_record.short(role)}, not \"state\" or \"master\"")
        if leaf is not None and leaves[leaf].sliced and tuple(shape[-1:]) != (leaves[leaf].slots,):  # (stacked: rows)
            c.fail(f"{g}.shape", f"is {list(shape)}, but a history of leaf {leaf} holds [{leaves[leaf].slots}]")
        key_impl = None
        if "key_impl" in e:
            key_impl = c.str(e["key_impl"], f"{g}.key_impl")
            if leaf is not None or not dtype.startswith("uint"):
                c.fail(f"{g}.key_impl", "names a PRNG key implementation, but the entry is not a shared unsigned "
                       "integer array (a key's data)")
        out.append(StateEntry(path, leaf, shape, dtype, role, key_impl))
    if len({e.path for e in out}) != len(out):
        c.fail(f"{f}.entries", "repeats an entry path")
    states = [e for e in out if e.role == STATE]
    masters = out[len(states):]
    if out[:len(states)] != states:
        c.fail(f"{f}.entries", "lists a master copy before an optimizer state entry")
    want = [] if master_dtype is None else [
        StateEntry(MASTER_PREFIX + x.path, i, (x.slots,) if x.sliced else whole_shape(x.shape, x.dims, mesh),
                   master_dtype, MASTER) for i, x in enumerate(leaves)]
    if masters != want:
        c.fail(f"{f}.entries", f"holds {len(masters)} master copies, but master_dtype={_record.short(master_dtype)} "
               f"and {len(leaves)} leaves need {len(want)} (one per leaf, in order)")
    return tuple(out)

