"""A zero1 state's arrays per entry, outside `shard_map`: what checkpoints and `gather_state` read and write.

An entry's 1-D array is its member's columns of every row of its group's array; both are sharded row by row over
the same mesh axes, so cutting and joining (`unowned`, `stored`) move no data between devices.

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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zero_optax.step import _offload
from zero_optax.layout import _inner_state, _specs
from zero_optax.layout._layout import Group, Layout
from zero_optax.layout._state import SlicedState, ZeroState, canonical, shared_arrays


def _mesh_of(arrays: list[Any]) -> Any:
    """The mesh of the arrays' shardings, their types' or the context's; None under auto axes."""
    for x in arrays:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            return getattr(x.sharding, "mesh", None)
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty:
            return mesh
    return _specs.context_mesh()


@functools.lru_cache(maxsize=64)
def _program(layout: Layout, mesh: Any, op: Callable, master: bool, traced: bool) -> Any:
    """`op` (`_cut_all` or `_join_all`) on each device's rows of `mesh`; jitted unless `traced`."""
    specs = tuple(_specs.history_spec(layout, layout.leaves[g.first]) for g in layout.groups)
    history_specs = tuple(tuple(s for _ in g.histories[0]) for s, g in zip(specs, layout.groups))
    entry_specs = {j: specs[layout.stored_at[j][0]] for j in _entry_order(layout)}
    if op is _cut_all:
        in_specs = (history_specs, specs if master else None)
        out_specs = [entry_specs[j] for j in _entry_order(layout)]
    else:
        joined = _joined(layout)
        in_specs = {j: entry_specs[j] for g in joined for j in _group_entries(layout.groups[g])}
        out_specs = (tuple(history_specs[g] for g in joined), tuple(specs[g] for g in joined) if master else None)
    mapped = jax.shard_map(functools.partial(op, layout, master), mesh=mesh, in_specs=(in_specs,),
                           out_specs=out_specs, check_vma=False)
    return mapped if traced else jax.jit(mapped)


def _per_device(layout: Layout, op: Callable, master: bool, inputs: Any) -> Any:
    """`op` of `inputs`, inside `shard_map` on their mesh where one is known."""
    arrays = jax.tree.leaves(inputs)
    mesh = _mesh_of(arrays)
    if mesh is None:
        return op(layout, master, inputs)
    traced = any(isinstance(x, jax.core.Tracer) for x in arrays)
    return _program(layout, mesh, op, master, traced)(inputs)


def _cut_all(layout: Layout, _, inputs) -> list[jax.Array]:
    """Every group's local row (`inputs`: histories, master copies) cut into its members' parts, `_entry_order`."""
    histories, master = inputs
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
    """The groups to join: all but a lone 1-D leaf, whose entry's array already is its group's (stored as is)."""
    return tuple(g for g, group in enumerate(layout.groups) if len(group.leaves) > 1 or group.shape is not None)


def _group_entries(group: Group) -> list[int]:
    """The entries stored in `group`'s arrays, in `_cut_all` order."""
    return [h[k] for k in range(len(group.histories[0])) for h in group.histories] + list(group.masters)


def _entry_order(layout: Layout) -> list[int]:
    """The sliced entries in `_cut_all` order."""
    return [j for group in layout.groups for j in _group_entries(group)]


def unowned(state: ZeroState) -> dict[int, jax.Array]:
    """Entry index -> global array of the shared entries (`[N, *shape]`) and the sliced ones (1-D), in device
    memory."""
    layout = state.layout
    out = shared_arrays(canonical(state))
    if not layout.groups:
        return out
    histories = _offload.fetched(state.inner_state.histories)
    master = _offload.fetched(state.master)
    values = _per_device(layout, _cut_all, master is not None, (histories, master))
    out.update(zip(_entry_order(layout), values))
    return out


def sliced_shardings(state: ZeroState) -> dict[int, Any]:
    """Entry index -> the sharding of its global array in a state like `state` (that of its group's arrays)."""
    out = {}
    for g, group in enumerate(state.layout.groups):
        sharding = _group_sharding(state, g)
        if group.shape is not None and isinstance(sharding, jax.sharding.NamedSharding):  # its rows, one dimension
            sharding = jax.sharding.NamedSharding(sharding.mesh, P(*sharding.spec[:1]),
                                                  memory_kind=sharding.memory_kind)
        out.update(dict.fromkeys(_group_entries(group), sharding))
    return out


def _join_all(layout: Layout, master: bool, values: dict[int, jax.Array]):
    """The stored arrays of the `_joined` groups, joined from their entries'."""
    histories, masters = [], []
    for group in (layout.groups[g] for g in _joined(layout)):
        histories.append(tuple(_join_row(layout, group, [values[h[k]] for h in group.histories])
                               for k in range(len(group.histories[0]))))
        if master:
            masters.append(_join_row(layout, group, [values[j] for j in group.masters]))
    return tuple(histories), (tuple(masters) if master else None)


def _join_row(layout: Layout, group: Group, values: list[jax.Array]) -> jax.Array:
    if len(values) == 1:  # in the leaf's shape where the group keeps it (`Group.shape`)
        return values[0] if group.shape is None else values[0].reshape(-1, *group.shape[1:])
    n = values[0].shape[0] // layout.leaves[group.first].slots
    return jnp.concatenate([v.reshape(n, layout.leaves[i].slots) for i, v in zip(group.leaves, values)],
                           axis=1).reshape(-1)


def stored(template: ZeroState, values: dict[int, jax.Array]) -> tuple[SlicedState, tuple | None]:
    """The inverse of `unowned`: the inner state and master copies of a state like `template` holding `values`."""
    layout = template.layout
    shared = _inner_state.tree(layout, [values[j] for j in layout.shared_entries])
    master = template.master is not None
    if not layout.groups:
        return SlicedState(shared, ()), (() if master else None)
    values = _offload.fetched({j: values[j] for j in _entry_order(layout)})
    joined = _joined(layout)
    inputs = {j: values[j] for g in joined for j in _group_entries(layout.groups[g])}
    done_h, done_m = _per_device(layout, _join_all, master, inputs) if joined else ((), None)
    done_h, done_m = dict(zip(joined, done_h)), dict(zip(joined, done_m or ()))
    histories, masters = [], []
    for g, group in enumerate(layout.groups):
        kind = getattr(_group_sharding(template, g), "memory_kind", None)
        h = done_h[g] if g in done_h else tuple(values[j] for j in group.histories[0])
        histories.append(tuple(_offload.placed(x, kind) for x in h))
        if master:
            masters.append(_offload.placed(done_m[g] if g in done_m else values[group.masters[0]], kind))
    return SlicedState(shared, tuple(histories)), (tuple(masters) if master else None)


def _group_sharding(template: ZeroState, g: int) -> Any:
    arrays = list(template.inner_state.histories[g]) + ([] if template.master is None else [template.master[g]])
    return getattr(arrays[0], "sharding", None) if arrays else None
