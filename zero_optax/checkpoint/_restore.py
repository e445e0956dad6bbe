"""Restoring zero1 states into a target: everything checked before any array data is read.

Orbax reads a checkpoint it wrote at the target's own layouts; otherwise each device's region is read or re-cut
(`_regions`), placed on its device and released before the next, so host memory peaks near one device block.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from etils import epath

from zero_optax.checkpoint import _arrays, _match, _paths, _record, _regions, _schema, _shapes, _store
from zero_optax.core._errors import ZeroCheckpointError
from zero_optax.step import _offload

OrbaxRead = Callable[[Any, dict[str, jax.ShapeDtypeStruct]], dict[str, jax.Array]]


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
    devices: dict[_store.Region, list[jax.Device]] = defaultdict(list)
    for device, index in sharding.addressable_devices_indices_map(array.shape).items():
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
    _shapes.check(path, saved, store)
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
    if len(saved.states) != len(parts.states):
        raise ZeroCheckpointError(
            f"{path} holds {len(saved.states)} zero1 states but the target has {len(parts.states)} (checkpoint "
            f"tree {_record.short(saved.tree)}, target tree {_record.short(parts.signature)}).")
    plans = [_check_target(k, state_path, state, old, reshard)
             for k, ((state_path, state), old) in enumerate(zip(parts.states, saved.states))]
    if saved.tree != parts.signature:
        raise ZeroCheckpointError(
            f"{path}: the saved pytree is {_record.short(saved.tree)} but the target is "
            f"{_record.short(parts.signature)} (zero1 states shown as *).")
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
    _match.check(old.layout, state.layout, k, where, reshard)
    specs = _arrays.stored_arrays(state.layout, k)
    shardings = []
    for spec, value in zip(specs, _arrays.target_structs(state), strict=True):
        what = f"{where}: the target's array {spec.name}"
        _arrays.check_value(what, spec, value)
        shardings.append(concrete_sharding(getattr(value, "sharding", None), what))
    same = (old.layout.world_size == state.layout.world_size
            and _match.plain_difference(old.layout, state.layout, k, where) is None)
    return _Target(state, specs, shardings, same)


def _load(plan: _Target, old: _schema.SavedState, store: _store.ItemArrays, shared) -> Any:
    """One target state, each device's region read as saved (`plan.same`) or re-cut from the saved arrays."""
    region = ((lambda a, r: store.read(a.name, r)) if plan.same
              else _regions.Remap(old, plan.state.layout, store.read, shared).region)
    return _arrays.rebuild(plan.state, [build(a, s, region) for a, s in zip(plan.specs, plan.shardings)])
