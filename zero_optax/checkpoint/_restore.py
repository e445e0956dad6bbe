"""Restoring zero1 states into a target: everything checked before any array data is read.

A plain restore needs the saved layout itself (world size, owners, slots, packing). A restore onto another mesh
(`reshard=True`) needs only what resharding keeps: the partition, the leaves' paths, dtypes, kinds and logical
shapes, the inner-state tree, the entries and the master dtype. Orbax reads a checkpoint it wrote at the target's
own layouts; otherwise each device's region is read or re-cut (`_regions`), placed on its device and released
before the next, so host memory peaks near one device block. A refusal names every difference it finds, each
leaf and entry by path, and the fix (`_differences`).

Examples:
  >>> from zero_optax.checkpoint import _restore
  >>> _restore.RESHARD_KEYS  # what a restore with `reshard=True` compares
  ('partition', 'leaves', 'state_tree', 'entries', 'master_dtype')
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from etils import epath

from zero_optax.checkpoint import _arrays, _differences, _paths, _record, _regions, _schema, _store
from zero_optax.core._errors import ZeroCheckpointError
from zero_optax.layout._stored import AUTO, StoredLayout, StoredViews
from zero_optax.step import _offload

OrbaxRead = Callable[[Any, dict[str, jax.ShapeDtypeStruct]], dict[str, jax.Array]]
PLAIN_KEYS = ("partition", "owners", "leaves", "state_tree", "entries", "master_dtype", "mesh_axes", "arrays",
              "packing")
RESHARD_KEYS = ("partition", "leaves", "state_tree", "entries", "master_dtype")
_PER_MESH = ("slots", "owner", "group")
"""Leaf fields that resharding changes; a sliced leaf's `_BLOCKS` too (`_regions`)."""
_BLOCKS = ("shape", "axes", "blocks", "dims", *_record.PLACEMENT)


def concrete_sharding(sharding: Any, what: str) -> jax.sharding.Sharding:
    """The sharding to load into; one over an `AbstractMesh` is made concrete with the mesh of `jax.set_mesh`."""
    if not isinstance(sharding, jax.sharding.Sharding):
        raise ZeroCheckpointError(
            f"{what} has no sharding; use the state from `tx.init` on the restoring mesh, or abstract leaves "
            "jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding).")
    if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(sharding.mesh, jax.sharding.AbstractMesh):
        mesh = jax.sharding.get_mesh()
        if mesh.empty or mesh.abstract_mesh != sharding.mesh:
            raise ZeroCheckpointError(
                f"{what} is sharded over an abstract mesh ({sharding.mesh}), which names no devices. Restore "
                "inside `with jax.set_mesh(mesh):` with the concrete mesh, or give the target leaves "
                "NamedSharding(mesh, spec).")
        return jax.sharding.NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)
    return sharding


def build(array: _arrays.StoredArray, sharding: jax.sharding.Sharding,
          region: Callable[[_arrays.StoredArray, _store.Region], np.ndarray]) -> jax.Array:
    """The global array `array` laid out by `sharding`, each distinct device block computed by `region` and held
    in host memory only until it is on its devices."""
    devices: dict[_store.Region, list[Any]] = defaultdict(list)  # (jax.Device: jaxlib ships no type stubs)
    for device, index in sharding.addressable_devices_indices_map(array.shape).items():
        assert index is not None  # (a device of the sharding holds a block)
        devices[tuple(s.indices(d)[:2] for s, d in zip(index, array.shape))].append(device)
    singles = []
    for key, group in devices.items():
        block = region(array, key)
        singles += [jax.device_put(block, device) for device in group]
        del block  # host memory holds one block at a time
    return jax.make_array_from_single_device_arrays(array.shape, on_device(sharding), singles)


def on_device(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """`sharding` in device memory: blocks are read into device memory, then placed where the target keeps them."""
    return _offload.with_memory_kind(sharding, _offload.DEVICE if getattr(sharding, "memory_kind", None) else None)


def checked_arrays(path: epath.Path, saved: _schema.Saved) -> tuple[_store.ItemArrays, list[dict[int, np.ndarray]]]:
    """The arrays of the item at `path`, checked present and complete, and each state's shared entries' values."""
    store = _store.ItemArrays(path)
    _record.check_shapes(path, saved, store)
    store.check([a for s in saved.states for a in s.arrays])
    return store, [_regions.shared_values(s, store.read, str(path)) for s in saved.states]


class _Target(NamedTuple):
    """One zero1 state of the target, checked against the saved one."""

    state: Any                                  # the target state (its layout, and structure to rebuild)
    specs: list[_arrays.StoredArray]            # the arrays it stores
    shardings: list[jax.sharding.Sharding]      # where each of them goes
    same: bool                                  # the saved layout is its own: the arrays load as they are


def restore(directory: Any, target: Any, reshard: bool, orbax_read: OrbaxRead) -> Any:
    """The zero1 states saved in `directory`, in the structure, layouts and shardings of `target`."""
    path = _paths.as_path(directory)
    parts = _arrays.split(target, "The restore target")
    saved = _schema.load(path)
    trees = _differences.tree_text(saved.tree), _differences.tree_text(parts.signature)
    if len(saved.states) != len(parts.states):
        raise ZeroCheckpointError(
            f"{path} holds {len(saved.states)} zero1 states but the target has {len(parts.states)} (checkpoint "
            f"tree {trees[0]}, target tree {trees[1]}). Restore into a target built like the run that saved it.")
    plans = [_check_target(k, state_path, state, old, reshard)
             for k, ((state_path, state), old) in enumerate(zip(parts.states, saved.states))]
    if saved.tree != parts.signature:
        raise ZeroCheckpointError(
            f"{path}: the saved pytree is {trees[0]} but the target is {trees[1]} (zero1 states shown as *). "
            "Restore into a target built like the run that saved it: the same chain of transformations around "
            "zero1.")
    store, shared = checked_arrays(path, saved)
    if all(same for *_, same in plans) and saved.storage == _record.STORAGE_ORBAX:
        structs = {a.name: jax.ShapeDtypeStruct(a.shape, np.dtype(a.dtype), sharding=on_device(s))
                   for _, specs, shardings, _ in plans for a, s in zip(specs, shardings)}
        got = orbax_read(path, structs)
        restored = [_arrays.rebuild(state, [got[a.name] for a in specs]) for state, specs, _, _ in plans]
    else:
        restored = [_load(plan, old, store, values) for plan, old, values in zip(plans, saved.states, shared)]
    return _arrays.put_back(target, parts, restored)


def _check_target(k: int, state_path: str, state: Any, old: _schema.SavedState, reshard: bool) -> _Target:
    """Target state `k` checked against saved state `old` and its arrays against its own layout."""
    where = _arrays.where(k, state_path)
    check_layouts(old.layout, state.layout, k, where, reshard)
    specs = _arrays.stored_arrays(state.layout, k)
    shardings = []
    for spec, value in zip(specs, _arrays.target_structs(state), strict=True):
        what = f"{where}: the target's array {spec.name}"
        _arrays.check_value(what, spec, value)
        shardings.append(concrete_sharding(getattr(value, "sharding", None), what))
    # Without `reshard`, `check_layouts` has refused every difference: the saved layout is the target's own.
    same = not reshard or (old.layout.world_size == state.layout.world_size
                           and plain_difference(old.layout, state.layout, k, where) is None)
    return _Target(state, specs, shardings, same)


def _load(plan: _Target, old: _schema.SavedState, store: _store.ItemArrays, shared) -> Any:
    """One target state, each device's region read as saved (`plan.same`) or re-cut from the saved arrays."""
    region = ((lambda a, r: store.read(a.name, r)) if plan.same
              else _regions.Remap(old, plan.state.layout, store.read, shared).region)
    return _arrays.rebuild(plan.state, [build(a, s, region) for a, s in zip(plan.specs, plan.shardings)])


def _comparable(a: dict[str, Any], b: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two state records without the placement of every leaf one of them does not know it for (format 2, or a
    `shard_map` without `param_specs`): a placement is compared only where both know it."""
    unknown = [x["spec"] is None or y["spec"] is None for x, y in zip(a["leaves"], b["leaves"])]

    def known(rec):
        leaves = [{k: v for k, v in x.items() if k not in _record.PLACEMENT} if u else x
                  for x, u in zip(rec["leaves"], unknown)]
        return dict(rec, leaves=leaves + rec["leaves"][len(unknown):])
    return known(a), known(b)


def _invariant(rec: dict[str, Any], sliced: list[bool], blocked: list[bool]) -> dict[str, Any]:
    """The parts of a state record that resharding keeps. Leaves `blocked` (sliced, or owned in tensor-parallel
    blocks, on either side) may change blocks; entries of leaves `sliced` on either side may change shape."""
    leaves = [{k: v for k, v in x.items() if k not in _PER_MESH + (_BLOCKS if s else ())}
              for x, s in zip(rec["leaves"], blocked)]
    entries = [dict(e, shape=None) if e["leaf"] is not None and sliced[e["leaf"]] else e for e in rec["entries"]]
    return dict(rec, leaves=leaves, entries=entries)


def check_layouts(saved_layout: StoredLayout, target: StoredViews, k: int, where: str, reshard: bool) -> None:
    """Refuses, naming its differences and the fix, a saved state `k` that cannot be restored into `target`."""
    if not reshard and saved_layout.world_size != target.world_size:
        m = target.world_size
        raise ZeroCheckpointError(
            f"{where} was saved with world size {saved_layout.world_size}, but the target state has {m} devices. "
            f"Restore it with zo.ZeroRestore(target, reshard=True), or convert the checkpoint first with "
            f"zo.reshard(src, dst, world_size={m}) (`python -m zero_optax.reshard SRC DST --world-size {m}`; "
            f"zero_optax.reshard).")
    difference = partition_difference(saved_layout, target, where, reshard)
    if difference is None and not reshard:
        difference = plain_difference(saved_layout, target, k, where)
    elif difference is None:
        difference = _differences.describe(*_kept(saved_layout, target, k), where, RESHARD_KEYS)
    if difference is not None:
        raise ZeroCheckpointError(difference)
    if reshard:
        _regions.recuts(saved_layout, target, where)  # refuses a leaf whose logical shape changed


def _kept(saved: StoredViews, target: StoredViews, k: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The records of two layouts of state `k`, trimmed to what resharding keeps where both have the same leaves
    (where they do not, the leaves differ, and that is the difference to name)."""
    a, b = _comparable(_record.state_record(saved, k), _record.state_record(target, k))
    if [x.path for x in saved.leaves] != [x.path for x in target.leaves]:
        return a, b
    sliced = [x.sliced or y.sliced for x, y in zip(saved.leaves, target.leaves)]
    blocked = [s or x.tp_owned or y.tp_owned for s, x, y in zip(sliced, saved.leaves, target.leaves)]
    return _invariant(a, sliced, blocked), _invariant(b, sliced, blocked)


def plain_difference(saved: StoredViews, target: StoredViews, k: int, where: str) -> str | None:
    """The differences between the records of two layouts of state `k` that a plain restore cannot bridge."""
    return _differences.describe(*_comparable(_record.state_record(saved, k), _record.state_record(target, k)),
                                 where, PLAIN_KEYS)


def partition_difference(saved: StoredViews, target: StoredViews, where: str, reshard: bool = False) -> str | None:
    """A sentence naming how the partition differs (itself, or a leaf sliced in one and owned in the other) and
    what to do; None if it does not. With `reshard`, a leaf `"auto"` slices on one mesh and owns on the other is no
    difference when its state is a history per coordinate in both."""
    fix = ("Resharding moves a state between meshes, not between partitions: build the target with the "
           "checkpoint's zero1 settings, or move the state through plain optax (restore it on its own mesh, "
           "`zo.gather_state`, then `zo.scatter_state` with the new zero1).")
    if saved.partition != target.partition:
        return (f"{where} was saved with partition={saved.partition!r}, but the target uses "
                f"partition={target.partition!r}. {fix}")
    for i, (old, new) in enumerate(zip(saved.leaves, target.leaves)):
        if old.sliced == new.sliced or old.path != new.path:
            continue
        owned, layout = (new, target) if old.sliced else (old, saved)
        per_coordinate = all(e.shape == layout.whole_shape(owned) for e in layout.entries if e.leaf == i)
        if saved.partition == AUTO and per_coordinate:
            if reshard:
                continue
            fix = "Restore it with zo.ZeroRestore(target, reshard=True), which moves such a leaf's history."
        how = {True: "sliced (every device holds a slice of its history)",
               False: "owned (one device holds its whole state)"}
        return (f"{where}: leaf `{old.path}` is {how[old.sliced]} in the checkpoint but {how[new.sliced]} in "
                f"the target (partition={target.partition!r} chose differently, or the target's optimizer "
                f"differs). {fix}")
    return None
