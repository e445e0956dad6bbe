"""The zero1 states of a checkpointed pytree, and the arrays each stores: names, global shapes, dtypes, shardings.

A zero1 state may stand alone, nest in a larger optax state, or sit in Flax `nnx.Variable`s (stripped first); every
other leaf is refused. A state's arrays:
* `<k>.entry<j>`: an unowned entry; a shared one as `[N, *shape]` (a copy per device), a sliced leaf's history
  as 1-D `blocks * group * slots` elements, block `b` at `[b * group * slots, (b + 1) * group * slots)` (a history
  stacked along leading axes holds `(*lead, slots)` per device, row-major, in place of `slots`);
* `<k>.buffer_<dtype>`: a packed buffer of owned entries, `[N, size]`;
* `<k>.local<i>`: `accumulate="local"`'s per-device gradient sums of leaf `i`.

`stored_arrays`, `state_values`, `target_structs` and `rebuild` share one order.

Examples:
  >>> import jax.numpy as jnp, optax, jax, zero_optax as zo
  >>> from zero_optax.checkpoint import _arrays
  >>> mesh = jax.make_mesh((1,), ("data",))
  >>> tx = zo.zero1(optax.adam(1e-2), axis_name="data")
  >>> state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=jax.P(), out_specs=jax.P("data")))(
  ...     {"w": jnp.ones(3)})
  >>> [(a.name, a.shape) for a in _arrays.stored_arrays(state.layout, 0)]
  [('0.entry0000', (1,)), ('0.entry0001', (3,)), ('0.entry0002', (3,))]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from zero_optax.api import _transfer
from zero_optax.core import _compat, _names
from zero_optax.core._errors import ZeroCheckpointError
from zero_optax.layout._state import ZeroState, canonical, is_state, shared_arrays
from zero_optax.layout._stored import LOCAL, MASTER, StoredViews
from zero_optax.step import _offload


@dataclasses.dataclass(frozen=True)
class Split:
    """A pytree taken apart at its zero1 states: `(path, state)` of each in tree order (`<root>` for the tree
    itself), and the tree's `_names.tree_signature` with each shown as `*`."""

    states: list[tuple[str, ZeroState]]
    signature: str
    treedef: Any


def split(tree: Any, what: str) -> Split:
    """The zero1 states of `tree` (Flax Variables stripped); refuses a tree without one or with other leaves."""
    tree = _compat.pure(tree)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_state)
    for path, leaf in flat:
        if not is_state(leaf):
            raise ZeroCheckpointError(
                f"{what} has a leaf outside any zero1 state at `{_names.key_path(path)}` ({type(leaf).__name__}). "
                "ZeroSave/ZeroRestore handle only zero1 states (and empty nodes such as optax.EmptyState()); save "
                "other arrays with ocp.args.StandardSave as a separate item of ocp.args.Composite.")
    if not flat:
        raise ZeroCheckpointError(f"{what} contains no zero1 state (a ZeroState from zero_optax.zero1).")
    return Split([(_names.key_path(path) or "<root>", leaf) for path, leaf in flat],
                 _names.tree_signature(tree, is_leaf=is_state), treedef)


def put_back(original: Any, parts: Split, states: list[ZeroState]) -> Any:
    """`states` in place of the zero1 states of `original`, keeping its Flax Variables if it has any."""
    pure = jax.tree.unflatten(parts.treedef, states)
    if _compat.pure(original) is original:
        return pure
    return jax.tree.unflatten(jax.tree.structure(original), jax.tree.leaves(pure))


def where(i: int, path: str) -> str:
    """How error messages name zero1 state `i`."""
    return f"zero1 state {i} (at `{path}`)"


@dataclasses.dataclass(frozen=True)
class StoredArray:
    """One global array of a stored zero1 state: `spec` names the mesh axes each dimension is sharded over, and it
    holds an unowned `entry`, the packed `buffer` of a dtype, or the `local` gradient sums of a leaf."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    spec: tuple[tuple[str, ...], ...]
    entry: int | None = None
    buffer: str | None = None
    local: int | None = None


def unowned_entries(layout: StoredViews) -> list[int]:
    """The entries stored as arrays of their own: the inner state's unpacked entries, then sliced master slices."""
    return [*layout.unpacked_entries,
            *(j for j, e in enumerate(layout.entries) if e.role == MASTER and layout.kind(e) == "sliced")]


def stored_arrays(layout: StoredViews, k: int) -> list[StoredArray]:
    """The arrays zero1 state number `k` of a checkpoint stores."""
    zero = tuple(layout.axes)
    out = []
    for j in unowned_entries(layout):
        e = layout.entries[j]
        if e.leaf is None:
            out.append(StoredArray(_names.entry_array(k, j), (layout.world_size, *e.shape), e.dtype,
                                   (zero,) + ((),) * len(e.shape), entry=j))
        else:
            leaf = layout.leaves[e.leaf]
            out.append(StoredArray(_names.entry_array(k, j), (leaf.blocks * leaf.group * e.size,), e.dtype,
                                   (layout.history_axes(leaf),), entry=j))
    pack = layout.state_packing
    for d in sorted(pack.sizes):
        out.append(StoredArray(_names.buffer_array(k, d), (layout.world_size, pack.sizes[d]), d, (zero, ()),
                               buffer=d))
    if layout.accumulate == LOCAL:
        for i, leaf in enumerate(layout.leaves):
            out.append(StoredArray(_names.local_array(k, i),
                                   (layout.replica_count * leaf.blocks * leaf.group, *leaf.shape),
                                   np.dtype(np.promote_types(leaf.dtype, np.float32)).name,
                                   (layout.local_axes(leaf),) + ((),) * len(leaf.shape), local=i))
    return out


def check_value(what: str, spec: StoredArray, value: Any) -> None:
    """Refuses `value` (an array or struct, named `what`) whose shape or dtype is not `spec`'s."""
    if tuple(value.shape) != spec.shape or np.dtype(value.dtype).name != spec.dtype:
        raise ZeroCheckpointError(f"{what} is {list(value.shape)} {np.dtype(value.dtype).name} but its layout says "
                                  f"{list(spec.shape)} {spec.dtype}.")


def state_values(state: ZeroState) -> list[Any]:
    """The arrays of `state`, in `stored_arrays` order (a group's arrays cut into its members' histories)."""
    per_entry = _transfer.unowned(state)
    values = [per_entry[j] for j in unowned_entries(state.layout)]
    values += [state.buffers[d] for d in sorted(state.buffers)]
    return values + jax.tree.leaves(state.local)


def target_structs(state: ZeroState) -> list[jax.ShapeDtypeStruct]:
    """Shape, dtype and sharding of every array `stored_arrays` lists, for restoring into `state` (or abstract)."""
    def struct(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    shardings = _transfer.sliced_shardings(state)
    shared = shared_arrays(canonical(state))
    out = [struct(shared[a.entry]) if a.entry in shared else
           jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings[a.entry])
           for a in stored_arrays(state.layout, 0) if a.entry is not None]
    rest = [state.buffers[d] for d in sorted(state.buffers)] + jax.tree.leaves(state.local)
    return out + [struct(x) for x in rest]


def rebuild(template: ZeroState, values: list[Any]) -> ZeroState:
    """A state like `template` holding `values` (in `stored_arrays` order), each in `template`'s memory kinds."""
    unowned = unowned_entries(template.layout)
    inner, master = _transfer.stored(template, dict(zip(unowned, values)))
    inner = inner._replace(shared=_placed_like(inner.shared, template._inner.shared))
    n = len(unowned)
    n_buffers = len(template.buffers)
    buffers = _placed_like(dict(zip(sorted(template.buffers), values[n:n + n_buffers])), template.buffers)
    local = _placed_like(jax.tree.unflatten(jax.tree.structure(template.local), values[n + n_buffers:]),
                         template.local)  # None without local accumulators
    return ZeroState(inner, buffers, master, template.layout, local)


def _placed_like(tree: Any, template: Any) -> Any:
    """`tree`'s arrays in the memory kinds of `template`'s (abstract or concrete)."""
    def one(x, t):
        return _offload.placed(x, getattr(getattr(t, "sharding", None), "memory_kind", None))
    return jax.tree.map(one, tree, template)
