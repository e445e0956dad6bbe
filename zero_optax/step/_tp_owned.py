"""Owned leaves sharded over tensor-parallel axes: their owner gathers the blocks and updates the whole tensor.

The devices of the owner's ZeRO rank all-gather the reduced gradient blocks over those axes, all run the inner update
on the whole tensor (each keeping the leaf's whole state) and keep their own block of the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax import lax

from zero_optax.core import _compat
from zero_optax.step import _packed
from zero_optax.layout._layout import Layout
from zero_optax.layout._stored import Packing, ParamLeaf
from zero_optax.step._wire import Wire


def tp_axes(layout: Layout, leaves: Sequence[int]) -> tuple[str, ...]:
    """The tensor-parallel axes the tensor-parallel owned `leaves` are sharded over, in mesh order."""
    cut = {a for i in leaves for a in layout.leaves[i].axes if layout.leaves[i].tp_owned}
    return tuple(a for a, _ in layout.axis_sizes if a in cut)


def gather_whole(wire: Wire, layout: Layout, leaf: ParamLeaf, x: jax.Array) -> jax.Array:
    """The whole parameter from every device's block `x` of it (one all-gather over `leaf.axes`)."""
    blocks = wire.gather_blocks(x, leaf.axes)
    return assemble(layout, leaf, blocks.reshape(_grid(layout, leaf.axes) + leaf.shape))


def _grid(layout: Layout, axes: Sequence[str]) -> tuple[int, ...]:
    """The sizes of the mesh `axes`: the leading shape of blocks gathered over them."""
    return tuple(dict(layout.axis_sizes)[a] for a in axes)


def assemble(layout: Layout, leaf: ParamLeaf, blocks: jax.Array) -> jax.Array:
    """The whole tensor from `blocks[k_1, ..., k_m]` along `leaf.axes` (row-major where axes share a dimension)."""
    m = len(leaf.axes)
    perm = []
    for d, cut in enumerate(leaf.dims):
        perm += [leaf.axes.index(a) for a in cut] + [m + d]
    return blocks.transpose(perm).reshape(layout.whole_shape(leaf))


def own_block(leaf: ParamLeaf, whole: jax.Array) -> jax.Array:
    """This device's block of the whole tensor `whole` (the inverse of `assemble`)."""
    for d, cut in enumerate(leaf.dims):
        if cut:
            n = leaf.shape[d]
            whole = lax.dynamic_slice_in_dim(whole, _compat.axis_index(cut) * n, n, d)
    return whole


@dataclasses.dataclass(frozen=True)
class Gathered:
    """Rows of owner-packed blocks (dtype -> `[devices of axes, size]`) gathered over the tensor-parallel `axes`."""

    plan: Packing
    rows: dict[str, jax.Array]
    axes: tuple[str, ...]

    def whole(self, layout: Layout, r: int, i: int) -> jax.Array:
        """Leaf `i`'s whole value, on the devices of its owner `r`."""
        leaf = layout.leaves[i]
        dtype, off = self.plan.offsets[r][i]
        x = self.rows[dtype][:, off:off + leaf.size].reshape(_grid(layout, self.axes) + leaf.shape)
        # the leaf's blocks are the same along gathered axes it is not cut over: position 0 of those
        x = x[tuple(slice(None) if a in leaf.axes else 0 for a in self.axes)]
        return assemble(layout, leaf, x)


def own_row(layout: Layout, values: dict[int, jax.Array], plan: Packing, rank: jax.Array) -> dict[str, jax.Array]:
    """This device's row of `plan`: the blocks of the leaves its ZeRO rank owns, packed (a switch on the rank)."""
    varying = layout.axes + tp_axes(layout, list(values))

    def branch(r):
        return lambda v: _compat.pvary(_packed.pack({i: v[i] for i in plan.offsets[r]}, plan.offsets[r],
                                                   plan.sizes), varying)
    return _packed.switch(rank, [branch(r) for r in range(layout.world_size)], values)


def gather(wire: Wire, layout: Layout, rows: dict[str, jax.Array], plan: Packing, leaves: Sequence[int]
           ) -> Gathered:
    """`rows` (this device's row of `plan`) gathered over the tensor-parallel axes of `leaves` (outside the switch)."""
    axes = tp_axes(layout, leaves)
    return Gathered(plan, wire.gather_blocks(rows, axes), axes)

