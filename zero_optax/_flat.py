"""`partition="flat"`: every device owns an equal, contiguous slice of every flattened parameter.

With `count` elements and world size `N`, a leaf has `slots = ceil(count / N)`; device `r` owns coordinates
`[r*slots, (r+1)*slots)`, the tail padded with zeros. The inner optimizer runs on the 1-D slices, which is exact
for transformations that act coordinate by coordinate (Adam, Lion, SGD, RMSProp, ...); `init` proves that from
the inner transformation's jaxpr and refuses the others.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax

from zero_optax import _compat, _coupling, _layout, _reduce
from zero_optax._errors import ZeroCouplingError
from zero_optax._layout import FLAT, Layout
from zero_optax._state import ZeroFlatState
from zero_optax._validate import check_layout, check_tree

COUPLING_HELP = """\
Flat slices are exact only for transformations that act coordinate by coordinate. Either
  * use partition="leaf", which updates every parameter as a whole tensor on one owner device
    (Muon, Adafactor, LAMB, Shampoo), or
  * move the global operation before zero1, on the reduced gradient:
        optax.chain(zo.reduce_gradients("{axis}"), optax.clip_by_global_norm(1.0),
                    zo.zero1(inner, axis_name="{axis}", reduce=False))"""


def _pad_flat(x: jax.Array, slots: int, n: int) -> jax.Array:
    flat = x.reshape(-1)
    pad = slots * n - flat.shape[0]
    return jnp.pad(flat, (0, pad)) if pad else flat


def _own_slice(x: jax.Array, slots: int, n: int, rank: jax.Array) -> jax.Array:
    """This device's `[1, slots]` row of the flattened, zero-padded `x`.

    The inner optimizer runs on rows shaped like the stored state (`[1, slots]` per device), so no reshape
    separates a donated state buffer from its update; XLA:CPU copies whole buffers around such reshapes.
    """
    if n == 1:
        return x.reshape(1, -1)
    return lax.dynamic_slice_in_dim(_pad_flat(x, slots, n), rank * slots, slots)[None]


def _gather_leaf(u: jax.Array, leaf: _layout.ParamLeaf, axis_name: str, n: int) -> jax.Array:
    if n == 1:  # nothing to gather; a one-device psum only retypes the value as replicated (XLA drops it)
        return lax.psum(u, axis_name).reshape(leaf.shape)
    full = _compat.all_gather_invariant(u, axis_name).reshape(-1)
    return full[:leaf.size].reshape(leaf.shape)


def _to_rows(state, layout: Layout):
    """Inner state -> stored state: coordinate histories already are `[1, slots]` rows; shared entries gain one."""
    values, treedef = jax.tree.flatten(state)
    return jax.tree.unflatten(treedef, [x if e.leaf is not None else x[None] for x, e in zip(values, layout.entries)])


def _from_rows(state, layout: Layout):
    """Stored state -> inner state (the inverse of `_to_rows`)."""
    values, treedef = jax.tree.flatten(state)
    return jax.tree.unflatten(treedef, [x if e.leaf is not None else x[0] for x, e in zip(values, layout.entries)])


def _zero_padding(state, layout: Layout, rank: jax.Array):
    """Keeps the padded tail of every coordinate history at zero (some optimizers add eps to it)."""
    values, treedef = jax.tree.flatten(state)
    out = []
    for x, entry in zip(values, layout.entries):
        if entry.leaf is not None:
            leaf = layout.leaves[entry.leaf]
            if leaf.slots * layout.world_size != leaf.size:
                valid = jnp.arange(leaf.slots) + rank * leaf.slots < leaf.size
                x = jnp.where(valid, x, jnp.zeros_like(x))
        out.append(x)
    return jax.tree.unflatten(treedef, out)


SHAPE_HELP = """\
The inner transformation does something different on the 1-D coordinate slices that flat zero1 gives it than on
the full parameters, so its result would be silently wrong. Usually a mask or label function reads the parameter
shapes (for example `mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)`): compute it once from the real
parameters and pass the tree instead, e.g. `mask=jax.tree.map(lambda x: x.ndim > 1, params)`. Or use
partition="leaf", which gives the inner transformation whole parameters."""


def _check_coordinatewise(inner, params, axis_name: str, slots: list[int]) -> None:
    """Refuses inner transformations whose flat-slice execution would differ from the full-parameter one."""
    structs = _layout.abstract(params)
    state = jax.eval_shape(inner.init, structs)
    where = _coupling.find_coordinate_coupling(lambda g, s, p: inner.update(g, s, p), structs, state, structs)
    if where is not None:
        raise ZeroCouplingError(
            f"zero1(partition=\"flat\") cannot run this inner transformation on coordinate slices: it applies "
            f"{where}, which mixes coordinates of a parameter (a norm, a matrix product, a factored moment or a "
            f"global check).\n{COUPLING_HELP.format(axis=axis_name)}")
    leaves, treedef = jax.tree.flatten(structs)
    sliced = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct((1, k), x.dtype) for x, k in zip(leaves, slots)])
    sliced_state = jax.eval_shape(inner.init, sliced)
    if jax.tree.structure(sliced_state) != jax.tree.structure(state):
        raise ZeroCouplingError(
            f"zero1(partition=\"flat\"): the inner state on coordinate slices has the structure "
            f"{jax.tree.structure(sliced_state)}, but on the parameters {jax.tree.structure(state)}.\n{SHAPE_HELP}")
    full = _coupling.program_signature(lambda g, s, p: inner.update(g, s, p), structs, state, structs)
    part = _coupling.program_signature(lambda g, s, p: inner.update(g, s, p), sliced, sliced_state, sliced)
    if full != part:
        i = next((i for i, (a, b) in enumerate(zip(full, part)) if a != b), min(len(full), len(part)))
        raise ZeroCouplingError(
            f"zero1(partition=\"flat\"): the inner update applies {len(full)} operations to the parameters but "
            f"{len(part)} to coordinate slices (first difference at operation {i}: "
            f"{full[i] if i < len(full) else 'none'} vs {part[i] if i < len(part) else 'none'}).\n{SHAPE_HELP}")


def flat_layout(inner, treedef, leaves: tuple[_layout.ParamLeaf, ...], axis_name: str, n: int) -> Layout:
    slices = [jax.ShapeDtypeStruct((leaf.slots,), leaf.dtype) for leaf in leaves]
    entries, state_tree = _layout.discover_entries(inner.init, treedef, slices)
    for e in entries:
        if e.leaf is not None and e.shape != (leaves[e.leaf].slots,):
            raise ZeroCouplingError(
                f"zero1(partition=\"flat\"): the inner state `{e.path}` of leaf `{leaves[e.leaf].path}` has shape "
                f"{e.shape} on a slice of {leaves[e.leaf].slots} coordinates, so it is not a per-coordinate "
                f"history.\n{COUPLING_HELP.format(axis=axis_name)}")
    return Layout(FLAT, axis_name, n, leaves, entries, treedef, state_tree)


def flat_zero1(inner: optax.GradientTransformationExtraArgs, axis_name: str, reduce, reduce_dtype
               ) -> optax.GradientTransformationExtraArgs:
    """The flat-partition transformation; `zero_optax.zero1` validates the arguments."""

    def init_fn(params):
        n = _compat.axis_size(axis_name)
        treedef, leaves = _layout.param_leaves(params, n, FLAT)
        _check_coordinatewise(inner, params, axis_name, [leaf.slots for leaf in leaves])
        layout = flat_layout(inner, treedef, leaves, axis_name, n)
        rank = lax.axis_index(axis_name)
        sliced = [_own_slice(x, leaf.slots, n, rank) for x, leaf in zip(jax.tree.leaves(params), layout.leaves)]
        inner_state = _zero_padding(inner.init(jax.tree_util.tree_unflatten(layout.treedef, sliced)), layout, rank)
        return ZeroFlatState(_to_rows(inner_state, layout), layout)

    def update_fn(grads, state, params=None, *, weight=None, **extra_args):
        layout = check_layout(state, ZeroFlatState, axis_name)
        n, rank = layout.world_size, lax.axis_index(axis_name)
        g_leaves = check_tree(grads, layout, "gradients")
        denom = _reduce.denominator(weight, axis_name, n)
        mode = "psum" if reduce == "psum_scatter" and n == 1 else reduce  # one device: nothing to scatter
        if mode == "psum_scatter":
            g_slices = [_reduce.scatter_mean(_pad_flat(g, leaf.slots, n), axis_name, denom, reduce_dtype)[None]
                        for g, leaf in zip(g_leaves, layout.leaves)]
        else:
            if mode == "psum":
                g_leaves = jax.tree.leaves(_reduce.mean_gradients(g_leaves, axis_name, denom, reduce_dtype))
            g_slices = [_own_slice(g, leaf.slots, n, rank) for g, leaf in zip(g_leaves, layout.leaves)]
        p_slices = None
        if params is not None:
            p_slices = jax.tree_util.tree_unflatten(
                layout.treedef, [_own_slice(p, leaf.slots, n, rank)
                                 for p, leaf in zip(check_tree(params, layout, "parameters"), layout.leaves)])
        old = _from_rows(state.inner_state, layout)
        u_slices, new = inner.update(jax.tree_util.tree_unflatten(layout.treedef, g_slices), old, p_slices,
                                     **extra_args)
        new = _reduce.skip_if_empty(denom.ok, _zero_padding(new, layout, rank), old)
        u_slices = _reduce.skip_if_empty(denom.ok, u_slices, jax.tree.map(jnp.zeros_like, u_slices))
        updates = [_gather_leaf(u, leaf, axis_name, n) for u, leaf in zip(jax.tree.leaves(u_slices), layout.leaves)]
        return (jax.tree_util.tree_unflatten(layout.treedef, updates),
                ZeroFlatState(_to_rows(new, layout), layout))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
