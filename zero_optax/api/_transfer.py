"""Moving state in and out of zero1: `gather_state`, `master_params` (on global arrays), `scatter_state`, and a
state's arrays per entry outside `shard_map`, which checkpoints read and write (`unowned`, `stored`).

An entry's 1-D array is its member's columns of every row of its group's array; both are sharded row by row over
the same mesh axes, so cutting and joining move no data between devices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zero_optax.api import _bound
from zero_optax.core import _compat
from zero_optax.core._errors import ZeroError
from zero_optax.layout import _handle, _inner_state, _keys, _specs, _view
from zero_optax.layout._layout import Group, Layout
from zero_optax.layout._state import SlicedState, ZeroState, canonical, find_states, is_state, shared_arrays
from zero_optax.layout._stored import MASTER
from zero_optax.step import _offload


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
    """Entry index -> global array of the shared entries (`[N, *shape]`) and the sliced ones (1-D), on device."""
    layout = state.layout
    out = shared_arrays(canonical(state))
    if not layout.groups:
        return out
    histories = _offload.fetched(state._inner.histories)
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
    arrays = list(template._inner.histories[g]) + ([] if template.master is None else [template.master[g]])
    return getattr(arrays[0], "sharding", None) if arrays else None


def _require_global(state: ZeroState, what: str) -> Layout:
    """`state`'s layout; refuses a state inside `shard_map` or holding sliced blocks of a tensor-parallel leaf."""
    layout = state.layout
    if _compat.is_bound(layout.axes):
        raise ZeroError(
            f"{what} reads the global state; call it outside shard_map (eagerly or inside jax.jit), on the state "
            "that a shard_map'ed init or update returned.")
    for leaf in layout.leaves:
        if leaf.blocks > 1 and leaf.sliced:  # an owned leaf's state is whole
            raise ZeroError(
                f"{what}: the parameter `{leaf.path}` is sharded over mesh axes {leaf.axes}, and the state records "
                "its blocks, not how they tile the global parameter. Gather such states inside shard_map, block "
                "by block, or keep them in zero1 form (checkpoints reshard them).")
    return layout


def _values(state: ZeroState, entries: Sequence[int]) -> list[jax.Array]:
    """The full values of `entries` of a global `state`, in device memory."""
    state = _offload.fetched(state)
    arrays, buffers = unowned(state), {d: _compat.replicate(b) for d, b in state.buffers.items()}
    return [_entry(state.layout, j, arrays, buffers) for j in entries]


def _entry(layout: Layout, j: int, arrays: dict[int, jax.Array], buffers: dict[str, jax.Array]) -> jax.Array:
    """The full value of entry `j`, from the `unowned` arrays and the replicated owned buffers."""
    e = layout.entries[j]
    if e.leaf is None:  # a shared entry
        return _keys.to_key(_compat.replicate(arrays[j])[0], e.key_impl)
    leaf = layout.leaves[e.leaf]
    if layout.kind(e) == "owned":
        owner = leaf.owner
        assert owner is not None  # (an owned leaf's)
        dtype, off = layout.state_packing.offsets[owner][j]
        return jax.lax.slice_in_dim(buffers[dtype][owner], off, off + e.size).reshape(e.shape)
    full = _compat.replicate(arrays[j])
    if len(e.shape) > 1:  # a stacked history (`(*lead, slots)` per device): each row cut as the leaf is
        rows = jnp.moveaxis(full.reshape(-1, *e.shape), 0, -2).reshape(*e.shape[:-1], -1)
        return rows[..., :leaf.size].reshape(*e.shape[:-1], *leaf.shape)
    return full[:leaf.size].reshape(leaf.shape)


def _gather_one(state: ZeroState) -> Any:
    layout = _require_global(state, "zo.gather_state")
    return jax.tree.unflatten(layout.state_treedef, _values(state, layout.inner_entries))


def _read_entries(state: ZeroState, entries: Sequence[int]) -> list[jax.Array]:
    """The full values of `entries`, for a read of a per-parameter field of the state (`layout._view`)."""
    _require_global(state, "Reading a per-parameter field of a zero1 state")
    return _values(state, entries)


_view.GATHER.append(_read_entries)


def gather_state(state: Any) -> Any:
    """The plain optax state of the inner transformation, as `inner.update` on one device holds it.

    Args:
      state: a zero1 state, or a tree (a chain's state) holding one; global, outside `shard_map`.

    Returns:
      The same tree with each zero1 state replaced by its inner transformation's full state.

    Raises:
      ZeroError: `state` holds no zero1 state, or is read inside `shard_map`.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, zero_optax as zo
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = zo.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh)
      >>> plain = zo.gather_state(tx.init({"w": jnp.ones(3)}))
      >>> plain[0].mu["w"].shape
      (3,)
    """
    if not find_states(state):
        raise ZeroError(f"zo.gather_state expects a state holding a zero1 state, got {type(state).__name__}.")
    return jax.tree.map(lambda x: _gather_one(x) if is_state(x) else x, state, is_leaf=is_state)


def master_params(state: Any) -> Any:
    """The full master copy of the parameters.

    Args:
      state: the state of a `zero1(..., master_dtype=...)`, or a tree holding one (the first is read); global,
        outside `shard_map`.

    Returns:
      A tree like the parameters, in `master_dtype`.

    Raises:
      ZeroError: `state` holds no zero1 state, or one without a master copy.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, zero_optax as zo
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = zo.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh, master_dtype=jnp.float32)
      >>> zo.master_params(tx.init({"w": jnp.ones(3, jnp.bfloat16)}))["w"].dtype
      dtype('float32')
    """
    found = find_states(state)
    if not found:
        raise ZeroError(f"zo.master_params expects a zero1 state, got {type(state).__name__}.")
    state = found[0]
    layout = _require_global(state, "zo.master_params")
    if layout.master_dtype is None:
        raise ZeroError("zo.master_params: this zero1 state keeps no master copy; create the transformation with "
                        "master_dtype=jnp.float32 (say).")
    masters = [j for j, e in enumerate(layout.entries) if e.role == MASTER]  # (one per leaf, in leaf order)
    return jax.tree.unflatten(layout.treedef, _values(state, masters))


def scatter_state(tx: Any, inner_state: Any, params: Any) -> ZeroState:
    """Builds the zero1 state of `tx` from a plain optax state of its inner transformation.

    The reverse of `gather_state`, run where `tx.init` runs; with `master_dtype` the master copy starts from
    `params`.

    Args:
      tx: a transformation returned by `zero_optax.zero1`.
      inner_state: the inner transformation's state for `params`, as it is on one device.
      params: the parameters, as `tx.init` takes them.

    Returns:
      The zero1 state, as `tx.init(params)` returns it but holding `inner_state`'s values.

    Raises:
      ZeroError: `tx` is not a transformation `zero1` returned.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, zero_optax as zo
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> params = {"w": jnp.ones(3)}
      >>> plain = optax.adam(1e-2).init(params)
      >>> tx = zo.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh)
      >>> state = zo.scatter_state(tx, plain, params)
      >>> zo.describe(state).world_size
      1
    """
    zero = _handle.zero1_of(tx, "zo.scatter_state")
    params = _compat.pure(params)
    inner_state = jax.tree.map(_keys.to_data, inner_state)
    bound = zero.outside()
    return bound.init(params, inner_state) if bound is not None else zero.engine.init(params, inner_state)


def relayout(saved: Any, tx: Any, params: Any) -> ZeroState:
    """A zero1 state saved at another data-parallel size, laid out for `tx` on its mesh, holding the same values.

    For trainers whose own checkpointer stores the state's arrays as they are and restores them only into the new
    run's shapes (a zero1 state's shapes depend on the number of devices): read the saved arrays at their stored
    shapes, then lay them out for the new run here. The saved size is read from the arrays; the step counts, the
    histories and the master copy move exactly, as `zo.gather_state` on the old mesh followed by
    `zo.scatter_state` on the new one would move them.

    Args:
      saved: the saved state's arrays, a nested mapping keyed by the state's path (attribute names and indices,
        ints or their strings), as `nnx.State.to_pure_dict()` and Orbax hold a pytree, or a zero1 state.
      tx: the zero1 transformation of the new run, bound to its mesh (`zero1(..., mesh=mesh)`), one ZeRO axis.
      params: the parameters, as `tx.init` takes them.

    Returns:
      The state `tx.init(params)` returns, holding `saved`'s values.

    Raises:
      ZeroError: `tx` is not mesh-bound over one axis, or `saved` does not hold this state at some size.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, zero_optax as zo
      >>> params = {"w": jnp.arange(3.0)}
      >>> on_2 = zo.zero1(optax.adam(1e-2), axis_name="data", mesh=jax.make_mesh((2,), ("data",)))
      >>> saved = jax.device_get(on_2.init(params))                 # as a checkpoint holds it
      >>> on_1 = zo.zero1(optax.adam(1e-2), axis_name="data", mesh=jax.make_mesh((1,), ("data",)))
      >>> state = zo.relayout(saved, on_1, params)
      >>> zo.describe(saved).world_size, zo.describe(state).world_size
      (2, 1)
    """
    zero = _handle.zero1_of(tx, "zo.relayout")
    if zero.mesh is None or len(_compat.as_tuple(zero.cfg.axis_name)) != 1:
        raise ZeroError("zo.relayout lays a state out for a zero1 bound to its mesh over one ZeRO axis: "
                        "zero1(inner, axis_name=\"data\", mesh=mesh).")
    params, found = _compat.pure(params), _by_path(_compat.pure(saved))
    axis = _compat.as_tuple(zero.cfg.axis_name)[0]
    local = _saved_layout(found, tx, params, zero.mesh, axis)
    values = []
    for path, x in jax.tree_util.tree_flatten_with_path(local)[0]:
        value = _at(found, path)
        want = (x.shape[0] * local.layout.world_size, *x.shape[1:])
        if np.shape(value) != want:
            raise ZeroError(f"zo.relayout: the saved state's `{jax.tree_util.keystr(path)}` has shape "
                            f"{np.shape(value)}, where the state saved on {local.layout.world_size} devices holds "
                            f"{want}.")
        values.append(jax.device_put(np.asarray(value), jax.devices()[0]))
    src = jax.tree.unflatten(jax.tree.structure(local), values)
    plain = jax.device_get(jax.tree.map(_keys.to_data, _gather_one(src)))  # (on the host, to reach the new mesh)
    return scatter_state(tx, plain, params)


def _saved_layout(found: dict, tx: Any, params: Any, mesh: Any, axis: str) -> ZeroState:
    """The per-device state (traced, abstract) of `tx` for `params` on `mesh` with `axis` at the saved size (the
    leading dimension of the saved step counts, one row per device)."""
    here = jax.eval_shape(tx.init, params)
    counts = jax.tree_util.tree_flatten_with_path(here._inner.shared)[0]
    if not counts:
        raise ZeroError("zo.relayout reads the saved size from the state's step counts; this state has none.")
    path = (jax.tree_util.GetAttrKey("_inner"), jax.tree_util.GetAttrKey("shared"), *counts[0][0])
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    sizes[axis] = int(np.shape(_at(found, path))[0])
    source = jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes), axis_types=mesh.abstract_mesh.axis_types)
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    return _specs.traced_state(tx, structs, _bound.param_specs(params, mesh), source)


def _name(key: Any) -> str:
    """A key path entry as a string: an attribute name, a dict key or an index."""
    return str(getattr(key, "name", getattr(key, "key", getattr(key, "idx", key))))


def _by_path(saved: Any) -> dict[tuple[str, ...], Any]:
    """`saved`'s arrays by path (`_name`s), from a nested mapping or a pytree; the stored inner state under its
    name of zero_optax 0.5 and before (`inner_state`) too."""
    found = _paths(saved)
    return {(("_inner", *path[1:]) if path[:1] == ("inner_state",) else path): v for path, v in found.items()}


def _paths(saved: Any) -> dict[tuple[str, ...], Any]:
    if isinstance(saved, Mapping):
        return {(str(k), *rest): v for k, sub in saved.items() for rest, v in _paths(sub).items()}
    return {tuple(map(_name, p)): v for p, v in jax.tree_util.tree_flatten_with_path(saved)[0]}


def _at(found: dict, path: tuple) -> Any:
    """The saved array at `path`, a key path of the state."""
    names = tuple(map(_name, path))
    if names not in found:
        raise ZeroError(f"zo.relayout: the saved state has no `{jax.tree_util.keystr(path)}`; is it the state of "
                        "this transformation, for these parameters?")
    return found[names]
