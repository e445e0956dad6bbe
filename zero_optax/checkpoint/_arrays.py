"""Which arrays a zero1 state stores in a checkpoint: their names, global shapes, dtypes and shardings.

A `ZeroState` holds three kinds of arrays (see `zero_optax.layout._state`), and a checkpoint stores each as
one global array under a name from `zero_optax.core._names`:

* `<k>.entry<j>` for every entry `j` that is not owned: a shared entry as `[N, *shape]` (one identical copy per
  device, sharding `P(ZeRO axes)`), a sliced leaf's history or master slice as a 1-D array of
  `blocks * group * slots` elements (sharding `P((*leaf axes, *ZeRO axes))`), in which block `b`'s padded
  coordinates are the contiguous range `[b * group * slots, (b + 1) * group * slots)`;
* `<k>.buffer_<dtype>` for every packed buffer of owned entries, `[N, size]` (sharding `P(ZeRO axes)`).

The order of `stored_arrays` is the order of `state_values` (inner state, then master copies, then buffers), so
a state can be taken apart for saving and rebuilt from restored arrays without naming its fields twice.

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

from zero_optax.core import _names
from zero_optax.api import _per_entry
from zero_optax.step import _offload
from zero_optax.layout._layout import LOCAL, MASTER, Layout, Packing, StoredLayout
from zero_optax.layout._state import ZeroState, canonical, shared_arrays


@dataclasses.dataclass(frozen=True)
class StoredArray:
    """One global array of a stored zero1 state.

    Attributes:
      name: its name in the checkpoint (`zero_optax.core._names`).
      shape: its global shape.
      dtype: its dtype name.
      spec: the mesh axes each dimension is sharded over (the array's `PartitionSpec`, one tuple per dimension).
      entry: the state entry it holds (shared or sliced), or None for a packed buffer.
      buffer: the dtype of the packed buffer it is, or None for an entry.
      local: `accumulate="local"`: the parameter leaf whose per-device gradient sums it holds, `[devices, *shape]`
        (every device of the replica and history axes, `Layout.local_axes`).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    spec: tuple[tuple[str, ...], ...]
    entry: int | None = None
    buffer: str | None = None
    local: int | None = None


def unowned_entries(layout: StoredLayout | Layout) -> list[int]:
    """The entries stored as arrays of their own, in `stored_arrays` order: the inner state's shared and sliced
    entries (the leaves of `state.inner_state`), then the master slices of sliced leaves (of `state.master`)."""
    inner = list(layout.unpacked_entries)
    masters = [j for j, e in enumerate(layout.entries) if e.role == MASTER and layout.kind(e) == "sliced"]
    return inner + masters


def stored_arrays(layout: StoredLayout | Layout, k: int, pack: Packing | None = None) -> list[StoredArray]:
    """The arrays zero1 state number `k` of a checkpoint stores, in `state_values` order."""
    zero = tuple(layout.axes)
    out = []
    for j in unowned_entries(layout):
        e = layout.entries[j]
        if e.leaf is None:
            out.append(StoredArray(_names.entry_array(k, j), (layout.world_size, *e.shape), e.dtype,
                                   (zero,) + ((),) * len(e.shape), entry=j))
        else:
            leaf = layout.leaves[e.leaf]
            out.append(StoredArray(_names.entry_array(k, j), (leaf.blocks * leaf.group * leaf.slots,), e.dtype,
                                   (layout.history_axes(leaf),), entry=j))
    pack = layout.state_packing if pack is None else pack
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


def state_values(state: ZeroState) -> list[Any]:
    """The arrays of `state`, in `stored_arrays` order: per entry, as the record describes them (a group's
    stored arrays are cut into its members' histories, `zero_optax.api._per_entry`)."""
    per_entry = _per_entry.unowned(state)
    values = [per_entry[j] for j in unowned_entries(state.layout)]
    values += [state.buffers[d] for d in sorted(state.buffers)]
    return values + ([] if state.local is None else jax.tree.leaves(state.local))


def target_structs(state: ZeroState) -> list[jax.ShapeDtypeStruct]:
    """Shape, dtype and sharding of every array `stored_arrays` lists, for restoring into `state` (concrete or
    abstract), without reading or cutting its arrays."""
    layout = state.layout
    shardings = _per_entry.sliced_shardings(state)
    shared = shared_arrays(canonical(state))
    out = []
    for j in unowned_entries(layout):
        if j in shared:
            x = shared[j]
            out.append(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)))
        else:
            e, leaf = layout.entries[j], layout.leaves[layout.entries[j].leaf]
            out.append(jax.ShapeDtypeStruct((leaf.blocks * leaf.group * leaf.slots,), e.dtype, sharding=shardings[j]))
    rest = [state.buffers[d] for d in sorted(state.buffers)] + jax.tree.leaves(state.local)
    return out + [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)) for x in rest]


def rebuild(template: ZeroState, values: list[Any]) -> ZeroState:
    """A state with the structure and layout of `template` holding `values` (in `stored_arrays` order), each array
    in the memory kind of `template`'s (`values` read into device memory move to host memory once, joined)."""
    layout = template.layout
    unowned = unowned_entries(layout)
    inner, master = _per_entry.stored(template, dict(zip(unowned, values)))
    inner = inner._replace(shared=_placed_like(inner.shared, template.inner_state.shared))
    n = len(unowned)
    n_buffers = len(template.buffers)
    buffers = _placed_like(dict(zip(sorted(template.buffers), values[n:n + n_buffers])), template.buffers)
    local = None
    if template.local is not None:
        local = _placed_like(jax.tree.unflatten(jax.tree.structure(template.local), values[n + n_buffers:]),
                             template.local)
    return ZeroState(inner, buffers, master, layout, local)


def _placed_like(tree: Any, template: Any) -> Any:
    """`tree`'s arrays in the memory kinds of `template`'s (abstract or concrete)."""
    def one(x, t):
        return _offload.placed(x, getattr(getattr(t, "sharding", None), "memory_kind", None))
    return jax.tree.map(one, tree, template)
