"""Moving state in and out of zero1: `gather_state`, `master_params` (on global arrays) and `scatter_state`."""

from __future__ import annotations

from typing import Any

import jax

from zero_optax.core import _compat
from zero_optax.core._errors import ZeroError
from zero_optax.api import _per_entry
from zero_optax.layout import _handle, _keys
from zero_optax.step import _offload
from zero_optax.layout._layout import Layout
from zero_optax.layout._stored import MASTER
from zero_optax.layout._state import GATHER, ZeroState, find_states, is_state


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


def _sources(state: ZeroState) -> tuple[dict[int, jax.Array], dict[str, jax.Array]]:
    """The unowned entries' global arrays and the replicated owned buffers, in device memory."""
    state = _offload.fetched(state)
    return _per_entry.unowned(state), {d: _compat.replicate(b) for d, b in state.buffers.items()}


def _entry(layout: Layout, j: int, unowned: dict[int, jax.Array], buffers: dict[str, jax.Array]) -> jax.Array:
    """The full value of entry `j`, read from `_sources`."""
    e = layout.entries[j]
    kind = layout.kind(e)
    if kind == "owned":
        leaf = layout.leaves[e.leaf]
        dtype, off = layout.state_packing.offsets[leaf.owner][j]
        return jax.lax.slice_in_dim(buffers[dtype][leaf.owner], off, off + e.size).reshape(e.shape)
    value = _compat.replicate(unowned[j])
    if kind == "shared":
        return _keys.to_key(value[0], e.key_impl)
    leaf = layout.leaves[e.leaf]
    return value[:leaf.size].reshape(leaf.shape)


def _gather_one(state: ZeroState) -> Any:
    layout = _require_global(state, "zo.gather_state")
    sources = _sources(state)
    values = [_entry(layout, j, *sources) for j in layout.inner_entries]
    return jax.tree.unflatten(layout.state_treedef, values)


GATHER.append(_gather_one)


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
    by_leaf = {layout.entries[j].leaf: j for j, e in enumerate(layout.entries) if e.role == MASTER}
    sources = _sources(state)
    return jax.tree.unflatten(layout.treedef, [_entry(layout, by_leaf[i], *sources)
                                               for i in range(len(layout.leaves))])


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
    return zero.bound.init(params, inner_state) if zero.outside() else zero.engine.init(params, inner_state)
