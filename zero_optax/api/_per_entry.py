"""A zero1 state's arrays per entry, outside `shard_map`: what checkpoints and `gather_state` read and write.

`ZeroState` stores the histories (and master copies) of a group of sliced leaves as one array
(`zero_optax.step._groups`); everything that presents the state per leaf sees it through this module. A group
array has one row of `size` elements per device (the leaf's blocks, then its ZeRO group), each row the
concatenation of the members' `slots`; an entry's own 1-D array, `blocks * group * slots` elements laid out the
same way, is the member's columns of every row. Both are sharded row by row over the same mesh axes, so cutting
and joining moves no data between devices. A group kept in its leaf's shape (`Group.shape`) holds the same
elements in the same order, so its entry is the array flattened.

Examples:
  >>> import jax, jax.numpy as jnp, optax, zero_optax as zo
  >>> from zero_optax.api import _per_entry
  >>> mesh = jax.make_mesh((1,), ("data",))
  >>> state = zo.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh).init({"a": jnp.ones(3), "b": jnp.ones(2)})
  >>> [tuple(x.shape) for x in jax.tree.leaves(state.inner_state)]   # count, then mu and nu of both leaves
  [(1,), (5,), (5,)]
  >>> {state.layout.entries[j].path: tuple(x.shape) for j, x in _per_entry.unowned(state).items()}
  {'[0].count': (1,), "[0].mu['a']": (3,), "[0].mu['b']": (2,), "[0].nu['a']": (3,), "[0].nu['b']": (2,)}
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zero_optax.step import _offload
from zero_optax.layout import _inner_state, _specs
from zero_optax.layout._layout import Group, Layout
from zero_optax.layout._state import SlicedState, ZeroState, canonical, shared_arrays


def _spec(layout: Layout, group: Group) -> P:
    return _specs.history_spec(layout, layout.leaves[group.first])


def _mesh_of(arrays: list[Any]) -> Any:
    """The mesh the group arrays are laid out on: their sharding's (concrete), their type's (traced under
    explicit axes) or the context's; None if none is known (traced under auto axes: plain slicing then)."""
    for x in arrays:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            return getattr(x.sharding, "mesh", None)
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty:
            return mesh
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


@functools.lru_cache(maxsize=64)
def _program(layout: Layout, mesh: Any, op: str, master: bool, traced: bool) -> Any:
    """`_cut_all` (`op` "cut") or `_join_all` ("join") of `layout` on each device's rows of `mesh` (`shard_map`),
    so no data moves between devices; jitted unless `traced` (already inside `jax.jit`)."""
    specs = tuple(_spec(layout, g) for g in layout.groups)
    history_specs = tuple(tuple(s for _ in g.histories[0]) for s, g in zip(specs, layout.groups))
    entry_specs = {j: specs[layout.stored_at[j][0]] for j in _entry_order(layout)}
    if op == "cut":
        def fn(args):
            return _cut_all(layout, *args)
        in_specs = (history_specs, specs if master else None)
        out_specs = [entry_specs[j] for j in _entry_order(layout)]
    else:
        joined = _joined(layout)

        def fn(values):
            return _join_all(layout, values, master, joined)
        in_specs = {j: entry_specs[j] for g in joined for j in _group_entries(layout.groups[g])}
        out_specs = (tuple(history_specs[g] for g in joined), tuple(specs[g] for g in joined) if master else None)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs, check_vma=False)
    return mapped if traced else jax.jit(mapped)


def _per_device(layout: Layout, op: str, master: bool, inputs: Any) -> Any:
    arrays = jax.tree.leaves(inputs)
    mesh = _mesh_of(arrays)
    if mesh is None:
        return _cut_all(layout, *inputs) if op == "cut" else _join_all(layout, inputs, master, _joined(layout))
    traced = any(isinstance(x, jax.core.Tracer) for x in arrays)
    return _program(layout, mesh, op, master, traced)(inputs)


def _cut_all(layout: Layout, histories, master) -> list[jax.Array]:
    """Inside each device (or on global arrays): every group's local row cut into its members' parts."""
    out = []
    for g, group in enumerate(layout.groups):
        for x in histories[g]:
            out += _cut_row(layout, group, x)
        if master is not None:
            out += _cut_row(layout, group, master[g])
    return out


def _cut_row(layout: Layout, group: Group, x: jax.Array) -> list[jax.Array]:
    rows = x.reshape(-1, group.size)
    return [rows[:, off:off + layout.leaves[i].slots].reshape(-1) for i, off in zip(group.leaves, group.offsets)]


def _joined(layout: Layout) -> tuple[int, ...]:
    """The groups whose stored arrays are joined from their entries' arrays: all but a lone leaf kept 1-D, whose
    entry's global array already is its group's (same elements, shape and sharding) and is stored as it is."""
    return tuple(g for g, group in enumerate(layout.groups) if len(group.leaves) > 1 or group.shape is not None)


def _group_entries(group: Group) -> list[int]:
    """The entries stored in `group`'s arrays: its members' histories, then their master copies."""
    return [j for h in group.histories for j in h] + list(group.masters)


def _entry_order(layout: Layout) -> list[int]:
    """The sliced entries in `_cut_all` order."""
    order = []
    for group in layout.groups:
        for k in range(len(group.histories[0])):
            order += [h[k] for h in group.histories]
        order += list(group.masters)
    return order


def unowned(state: ZeroState) -> dict[int, jax.Array]:
    """Entry index -> its global array, for the shared entries (`[N, *shape]`, as stored) and the sliced
    histories and master copies (`(blocks * group * slots,)`), cut from the group arrays on each device (an
    offloaded state's in device memory)."""
    layout = state.layout
    out = shared_arrays(canonical(state))
    if not layout.groups:
        return out
    histories = _offload.fetched(state.inner_state.histories)
    master = _offload.fetched(state.master)
    values = _per_device(layout, "cut", master is not None, (histories, master))
    out.update(zip(_entry_order(layout), values))
    return out


def sliced_shardings(state: ZeroState) -> dict[int, Any]:
    """Entry index -> the sharding of its global array in a state like `state` (that of its group's arrays)."""
    layout = state.layout
    out = {}
    for g, group in enumerate(layout.groups):
        sharding = _group_sharding(state, g)
        if group.shape is not None and isinstance(sharding, jax.sharding.NamedSharding):  # its rows, one dimension
            sharding = jax.sharding.NamedSharding(sharding.mesh, P(*sharding.spec[:1]),
                                                  memory_kind=sharding.memory_kind)
        for j in [j for h in group.histories for j in h] + list(group.masters):
            out[j] = sharding
    return out


def _join_all(layout: Layout, values: dict[int, jax.Array], master: bool, groups: tuple[int, ...]):
    """Inside each device (or on global arrays): the stored arrays of `groups`, joined from their entries'."""
    histories, masters = [], []
    for group in (layout.groups[g] for g in groups):
        histories.append(tuple(_join_row(layout, group, [values[h[k]] for h in group.histories])
                               for k in range(len(group.histories[0]))))
        if master:
            masters.append(_join_row(layout, group, [values[j] for j in group.masters]))
    return tuple(histories), (tuple(masters) if master else None)


def _join_row(layout: Layout, group: Group, values: list[jax.Array]) -> jax.Array:
    if len(values) == 1:  # per device or global, in the leaf's shape where the group keeps it (`Group.shape`)
        return values[0] if group.shape is None else values[0].reshape(-1, *group.shape[1:])
    n = values[0].shape[0] // layout.leaves[group.first].slots
    return jnp.concatenate([v.reshape(n, layout.leaves[i].slots) for i, v in zip(group.leaves, values)],
                           axis=1).reshape(-1)


def stored(template: ZeroState, values: dict[int, jax.Array]) -> tuple[SlicedState, tuple | None]:
    """The inverse of `unowned`: the stored inner state and master copies of a state like `template` holding the
    entries' global arrays `values` (entry index -> array), in the shardings (and memory) of `template`'s."""
    layout = template.layout
    shared = _inner_state.tree(layout, [values[j] for j in layout.shared_entries])
    has_master = template.master is not None
    if not layout.groups:
        return SlicedState(shared, ()), (() if has_master else None)
    needed = _offload.fetched({j: values[j] for j in _entry_order(layout)})
    histories, master = _join(layout, has_master, needed)
    histories = tuple(tuple(_offload.placed(x, _memory_kind(template, g)) for x in h) for g, h in enumerate(histories))
    if master is not None:
        master = tuple(_offload.placed(x, _memory_kind(template, g)) for g, x in enumerate(master))
    return SlicedState(shared, histories), master


def _join(layout: Layout, master: bool, values: dict[int, jax.Array]) -> tuple[tuple, tuple | None]:
    """Every group's stored arrays (histories, and master copies if `master`) from its entries' global arrays.

    A lone leaf kept 1-D (every leaf above `_plan.FUSE_BYTES` per device, on a mesh whose ZeRO group is more than
    one device) stores its entries' arrays as they are: no program runs and nothing is copied, so a restore holds
    the state once, not once as entries and once as groups (`benchmarks/RESULTS.md`). The other groups are joined
    on each device (`_join_all`).
    """
    joined = _joined(layout)
    inputs = {j: values[j] for g in joined for j in _group_entries(layout.groups[g])}
    done_h, done_m = _per_device(layout, "join", master, inputs) if joined else ((), None)
    done_h, done_m = dict(zip(joined, done_h)), dict(zip(joined, done_m or ()))
    histories, masters = [], []
    for g, group in enumerate(layout.groups):
        histories.append(done_h[g] if g in done_h else tuple(values[j] for j in group.histories[0]))
        masters.append(done_m[g] if g in done_m else values[group.masters[0]] if master else None)
    return tuple(histories), (tuple(masters) if master else None)


def _memory_kind(template: ZeroState, g: int) -> str | None:
    return getattr(_group_sharding(template, g), "memory_kind", None)


def _group_sharding(template: ZeroState, g: int) -> Any:
    arrays = list(template.inner_state.histories[g]) + ([] if template.master is None else [template.master[g]])
    return getattr(arrays[0], "sharding", None) if arrays else None
