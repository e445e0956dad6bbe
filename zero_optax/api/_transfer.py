"""Moving state in and out of zero1: `gather_state`, `scatter_state` and `master_params`.

`gather_state` and `master_params` read the global state (outside `shard_map`, eagerly or inside `jax.jit`):
every array of a zero1 state is a global array whose layout `zero_optax.describe` gives, so the full values are
slices and reshapes of it. `scatter_state` builds a zero1 state from a plain optax state where `tx.init` runs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zero_optax.core import _compat
from zero_optax.core._errors import ZeroError
from zero_optax.api import _per_entry, _bound
from zero_optax.layout import _keys, _specs
from zero_optax.step import _offload
from zero_optax.layout._layout import MASTER, Layout
from zero_optax.layout._state import GATHER, ZeroState, is_state
from zero_optax.api._zero1 import zero1_of


def _require_global(state: ZeroState, what: str) -> Layout:
    layout = state.layout
    if _compat.is_bound(layout.axes):
        raise ZeroError(
            f"{what} reads the global state; call it outside shard_map (eagerly or inside jax.jit), on the state "
            "that a shard_map'ed init or update returned.")
    for leaf in layout.leaves:
        if leaf.blocks > 1 and leaf.sliced:  # (an owned leaf's state is whole, `ParamLeaf.dims`)
            raise ZeroError(
                f"{what}: the parameter `{leaf.path}` is sharded over mesh axes {leaf.axes}, and the state records "
                "its blocks, not how they tile the global parameter. Gather such states inside shard_map, block "
                "by block, or keep them in zero1 form (checkpoints reshard them).")
    return layout


def _sources(state: ZeroState) -> tuple[dict[int, jax.Array], dict[str, jax.Array]]:
    """What `_entry` reads, prepared once for all entries: the unowned entries cut from the group arrays
    (`_per_entry.unowned`) and the owned leaves' packed buffers, replicated; an offloaded state's in device memory."""
    state = _offload.fetched(state)
    return _per_entry.unowned(state), {d: _compat.replicate(b) for d, b in state.buffers.items()}


def _entry(layout: Layout, j: int, unowned: dict[int, jax.Array], buffers: dict[str, jax.Array]) -> jax.Array:
    """The full value of entry `j` (a parameter-shaped history, a master copy, or a shared value), from a state's
    `_sources`."""
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
    """The plain optax state of the inner transformation, as `inner.init`/`inner.update` on one device holds it.

    Every zero1 state inside `state` (the state of `zero1(...)`, or of a chain holding one) is replaced by its
    inner transformation's full state: histories reassembled into the parameters' shapes, shared entries (step
    counts) once. Runs on the global state, outside `shard_map`, eagerly or inside `jax.jit`.

    Args:
      state: a state returned by a zero1 transformation's `init` or `update`.

    Returns:
      The same tree with each zero1 state replaced by the inner optimizer's state.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, zero_optax as zo
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = zo.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh)
      >>> plain = zo.gather_state(tx.init({"w": jnp.ones(3)}))
      >>> plain[0].mu["w"].shape
      (3,)
    """
    if not any(is_state(x) for x in jax.tree.leaves(state, is_leaf=is_state)):
        raise ZeroError(f"zo.gather_state expects a state holding a zero1 state, got {type(state).__name__}.")
    return jax.tree.map(lambda x: _gather_one(x) if is_state(x) else x, state, is_leaf=is_state)


def master_params(state: Any) -> Any:
    """The full master copy of the parameters (a tree like the parameters, in `master_dtype`).

    Runs on the global state, outside `shard_map`, eagerly or inside `jax.jit`. `state` is the state of a
    `zero1(..., master_dtype=...)` transformation (or holds one: the first one found).

    Examples:
      >>> import jax, jax.numpy as jnp, optax, zero_optax as zo
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = zo.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh, master_dtype=jnp.float32)
      >>> zo.master_params(tx.init({"w": jnp.ones(3, jnp.bfloat16)}))["w"].dtype
      dtype('float32')
    """
    found = [x for x in jax.tree.leaves(state, is_leaf=is_state) if is_state(x)]
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

    The reverse of `gather_state`: a run that checkpointed plain optax can continue under zero1, exactly. It runs
    where `tx.init` runs (inside `shard_map` over the data axis, or anywhere for a mesh-bound `tx`), and with
    `master_dtype` the master copy starts from `params`.

    Args:
      tx: a transformation returned by `zero_optax.zero1`.
      inner_state: the inner transformation's state for `params`, as `inner.init`/`inner.update` hold it on one
        device (replicated, not sharded).
      params: the parameters, as `tx.init` takes them.

    Returns:
      The zero1 state, as `tx.init(params)` returns it but holding `inner_state`'s values.

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
    zero = zero1_of(tx, "zo.scatter_state")
    params = _compat.pure(params)
    inner_state = jax.tree.map(_keys.to_data, inner_state)
    if not zero.outside():
        return zero.engine.build(params, inner_state)
    bound = zero.bound
    specs = _bound.param_specs(params, bound.mesh)
    out = _specs.tree_specs(_specs.traced_state(bound.zero_init, params, specs, bound.mesh))
    fn = jax.jit(jax.shard_map(zero.engine.build, mesh=bound.mesh, in_specs=(specs, P()), out_specs=out))
    inner_state = jax.tree.map(lambda x: _compat.reshard(jnp.asarray(x), jax.sharding.NamedSharding(bound.mesh, P())),
                               inner_state)
    with _specs.declared_specs(specs):
        return fn(_bound.placed(params, specs, bound.mesh), inner_state)
