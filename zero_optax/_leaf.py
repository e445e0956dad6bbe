"""`partition="leaf"`: every parameter leaf has one owner device, which updates it as a whole tensor.

Whole tensors keep matrix optimizers exact (Muon's orthogonalisation, Adafactor's factored moments, LAMB's trust
ratio, Shampoo's preconditioners). In SPMD every device must hold blocks of one shape, so device `r` packs the
inner state of the leaves it owns (found with `optax.MaskedNode` views, as `optax.masked` does) into per-dtype
buffers padded to the largest device's share. One `lax.switch` on the device index runs each device's own
inner update; gradients reach owners by a reduce-scatter of owner-packed buffers and updates return to every
device by an all-gather of the same packing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from zero_optax import _compat, _coupling, _layout, _owners, _reduce
from zero_optax._errors import ZeroCouplingError, ZeroStructureError
from zero_optax._layout import LEAF, Layout, Packing
from zero_optax._state import ZeroLeafState
from zero_optax._validate import check_layout, check_tree

COUPLING_HELP = """\
Each leaf is updated on its owner device, so the inner transformation may not combine different leaves.
Move global operations before zero1, on the reduced gradient:
    optax.chain(zo.reduce_gradients("{axis}"), optax.clip_by_global_norm(1.0),
                zo.zero1(inner, axis_name="{axis}", partition="leaf", reduce=False))"""


def pack(values: dict[int, jax.Array], offsets: dict[int, tuple[str, int]], sizes: dict[str, int],
         base: dict[str, jax.Array] | None = None) -> dict[str, jax.Array]:
    """Writes `values` (item -> array) into per-dtype 1-D buffers of `sizes` at `offsets`.

    With `base` (the previous buffers, donated by the caller's jit), the writes are dynamic-update-slices that
    XLA performs in place, so a step touches only the bytes it changes. Without it, buffers that the values fill
    exactly are concatenated, and the others start at zero.
    """
    if base is None:
        by_dtype: dict[str, list] = {d: [] for d in sizes}
        for item, (dtype, off) in sorted(offsets.items(), key=lambda kv: kv[1][1]):
            by_dtype[dtype].append(values[item].reshape(-1).astype(dtype))
        if all(sum(x.shape[0] for x in xs) == sizes[d] for d, xs in by_dtype.items()):  # no padding: concatenate
            return {d: jnp.concatenate(xs) if len(xs) > 1 else xs[0] for d, xs in by_dtype.items()}
    out = {d: (jnp.zeros((size,), d) if base is None else base[d]) for d, size in sizes.items()}
    for item, (dtype, off) in offsets.items():
        out[dtype] = lax.dynamic_update_slice_in_dim(out[dtype], values[item].reshape(-1).astype(dtype), off, 0)
    return out


def unpack(buffers: dict[str, jax.Array], offsets: dict[int, tuple[str, int]], shapes: dict[int, tuple[int, ...]]
           ) -> dict[int, jax.Array]:
    """The inverse of `pack` for the items in `offsets`."""
    out = {}
    for item, (dtype, off) in offsets.items():
        size = int(np.prod(shapes[item]))
        out[item] = lax.slice_in_dim(buffers[dtype], off, off + size).reshape(shapes[item])
    return out


def _view(values: list, owned: set[int]) -> list:
    return [v if i in owned else optax.MaskedNode() for i, v in enumerate(values)]


def _owned(layout: Layout, rank: int) -> set[int]:
    return {i for i, leaf in enumerate(layout.leaves) if leaf.owner == rank}


def _rank_state(inner, layout: Layout, rank: int, param_structs: list):
    """The inner state treedef of device `rank`, checked against the layout's entry order."""
    tree = jax.eval_shape(inner.init, jax.tree_util.tree_unflatten(layout.treedef,
                                                                  _view(param_structs, _owned(layout, rank))))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
    expected = [layout.entries[i].path for i in layout.rank_entries(rank)]
    if paths != expected:
        raise ZeroStructureError(
            f"The inner optimizer's state on device {rank} has leaves {paths}, but the layout expects {expected}: "
            "its state order changes when leaves are masked, which zero1(partition=\"leaf\") cannot pack.")
    return jax.tree.structure(tree)


def _update_plan(layout: Layout, dtypes: list[str]) -> Packing:
    """Where each leaf's gradient and update sit in its owner's row of the reduce-scatter/all-gather buffers."""
    return _layout.pack_plan([[(i, leaf.size, dtypes[i]) for i, leaf in enumerate(layout.leaves) if leaf.owner == r]
                              for r in range(layout.world_size)])


def _choose_reduce(reduce, plan: Packing, g_leaves: list, n: int) -> str | None:
    """The gradient collective: a one-device mesh needs none, "auto" picks the one that moves fewer bytes.

    A reduce-scatter of owner-packed buffers moves `n * padded share` bytes; an all-reduce moves about twice the
    gradient bytes. They differ when one owner's share is far above the average (a large embedding).
    """
    if reduce is None:
        return None
    if n == 1:
        return "psum"
    if reduce != "auto":
        return reduce
    scatter = n * sum(size * np.dtype(d).itemsize for d, size in plan.sizes.items())
    allreduce = 2 * sum(g.size * g.dtype.itemsize for g in g_leaves)
    return "psum_scatter" if scatter <= allreduce else "psum"


def _switch(rank, branches, *operands):
    if len(branches) == 1:
        return branches[0](*operands)
    return lax.switch(rank, branches, *operands)


def leaf_layout(inner, params, axis_name: str, n: int, owners) -> Layout:
    structs, treedef = jax.tree.flatten(_layout.abstract(params))
    entries, state_tree = _layout.discover_entries(inner.init, treedef, structs)
    if owners is None:
        owners = _owners.owners_for_entries(entries, len(structs), n)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    owners = _owners.check_owners(owners, len(structs), n, paths)
    _, param_leaves = _layout.param_leaves(params, n, LEAF, owners)
    return Layout(LEAF, axis_name, n, param_leaves, entries, treedef, state_tree)


def _check_leafwise(inner, layout: Layout, params, axis_name: str) -> None:
    structs = _layout.abstract(params)
    state = jax.eval_shape(inner.init, structs)
    labels = jax.tree_util.tree_unflatten(layout.treedef, list(range(len(layout.leaves))))
    state_labels = jax.tree_util.tree_unflatten(jax.tree.structure(state), [e.leaf for e in layout.entries])
    where = _coupling.find_leaf_coupling(lambda g, s, p: inner.update(g, s, p), structs, state, structs,
                                         sources=(labels, state_labels, labels))
    if where is not None:
        raise ZeroCouplingError(
            f"zero1(partition=\"leaf\") cannot split this inner transformation across owner devices: it applies "
            f"{where}, which combines several parameter leaves (a global norm, for example).\n"
            f"{COUPLING_HELP.format(axis=axis_name)}")


def leaf_zero1(inner: optax.GradientTransformationExtraArgs, axis_name: str, owners, reduce, reduce_dtype
               ) -> optax.GradientTransformationExtraArgs:
    """The leaf-partition transformation; `zero_optax.zero1` validates the arguments."""

    def init_fn(params):
        n = _compat.axis_size(axis_name)
        layout = leaf_layout(inner, params, axis_name, n, owners)
        _check_leafwise(inner, layout, params, axis_name)
        leaves = jax.tree.leaves(params)
        structs = jax.tree.leaves(_layout.abstract(leaves))
        packing = layout.state_packing

        def branch(rank):
            def run(leaves):
                _rank_state(inner, layout, rank, structs)  # checks the entry order this device packs
                state = inner.init(jax.tree_util.tree_unflatten(layout.treedef, _view(leaves, _owned(layout, rank))))
                values = dict(zip(layout.rank_entries(rank), jax.tree.leaves(state)))
                return _compat.pvary(pack(values, packing.offsets[rank], packing.sizes), axis_name)
            return run

        buffers = _switch(lax.axis_index(axis_name), [branch(r) for r in range(n)], leaves)
        return ZeroLeafState({d: b[None] for d, b in buffers.items()}, layout)

    def update_fn(grads, state, params=None, *, weight=None, **extra_args):
        layout = check_layout(state, ZeroLeafState, axis_name)
        n, rank = layout.world_size, lax.axis_index(axis_name)
        g_leaves = check_tree(grads, layout, "gradients")
        p_leaves = None if params is None else check_tree(params, layout, "parameters")
        structs = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in layout.leaves]
        plan = _update_plan(layout, [jnp.dtype(g.dtype).name for g in g_leaves])
        shapes = {i: leaf.shape for i, leaf in enumerate(layout.leaves)}
        denom = _reduce.denominator(weight, axis_name, n)
        mode = _choose_reduce(reduce, plan, g_leaves, n)

        if mode == "psum_scatter":
            # One [n * size] buffer per dtype, row r holding the gradients of the leaves device r owns.
            rows = {i: (d, r * plan.sizes[d] + off) for r in range(n) for i, (d, off) in plan.offsets[r].items()}
            stacked = pack(dict(enumerate(g_leaves)), rows, {d: n * size for d, size in plan.sizes.items()})
            grad_input = {d: _reduce.scatter_mean(b, axis_name, denom, reduce_dtype) for d, b in stacked.items()}
        elif mode == "psum":
            grad_input = _reduce.mean_gradients(g_leaves, axis_name, denom, reduce_dtype)
        else:
            grad_input = g_leaves
        old = {d: b[0] for d, b in state.buffers.items()}
        packing = layout.state_packing

        def branch(rank):
            owned = _owned(layout, rank)

            def run(grad_input, buffers, p_leaves):
                if mode == "psum_scatter":
                    got = unpack(grad_input, plan.offsets[rank], shapes)
                    g = [got.get(i) for i in range(len(layout.leaves))]
                else:
                    g = grad_input
                treedef = _rank_state(inner, layout, rank, structs)
                entries = layout.rank_entries(rank)
                values = unpack(buffers, packing.offsets[rank], {i: layout.entries[i].shape for i in entries})
                inner_state = jax.tree_util.tree_unflatten(treedef, [values[i] for i in entries])
                p_view = None if p_leaves is None else jax.tree_util.tree_unflatten(layout.treedef,
                                                                                   _view(p_leaves, owned))
                updates, new_state = inner.update(jax.tree_util.tree_unflatten(layout.treedef, _view(g, owned)),
                                                  inner_state, p_view, **extra_args)
                u = jax.tree.leaves(updates)
                u_by_leaf = dict(zip(sorted(owned), u))
                new_buffers = pack(dict(zip(entries, jax.tree.leaves(new_state))), packing.offsets[rank],
                                   packing.sizes, base=buffers if n > 1 else None)
                if n == 1:  # the only device owns everything: no packing, no gather
                    return new_buffers, u
                u_buffers = pack(u_by_leaf, plan.offsets[rank], plan.sizes)
                return _compat.pvary((new_buffers, u_buffers), axis_name)
            return run

        new, u_buffers = _switch(rank, [branch(r) for r in range(n)], grad_input, old, p_leaves)
        new = _reduce.skip_if_empty(denom.ok, new, old)
        u_buffers = _reduce.skip_if_empty(denom.ok, u_buffers, jax.tree.map(jnp.zeros_like, u_buffers))
        if n == 1:  # a one-device psum only retypes the updates as replicated (XLA drops it)
            updates = [lax.psum(u, axis_name).astype(g.dtype) for u, g in zip(u_buffers, g_leaves)]
            return (jax.tree_util.tree_unflatten(layout.treedef, updates),
                    ZeroLeafState({d: b[None] for d, b in new.items()}, layout))
        gathered = {d: _compat.all_gather_invariant(b, axis_name) for d, b in u_buffers.items()}
        updates = []
        for i, leaf in enumerate(layout.leaves):
            dtype, off = plan.offsets[leaf.owner][i]
            updates.append(lax.slice_in_dim(gathered[dtype][leaf.owner], off, off + leaf.size).reshape(leaf.shape))
        return (jax.tree_util.tree_unflatten(layout.treedef, updates),
                ZeroLeafState({d: b[None] for d, b in new.items()}, layout))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
