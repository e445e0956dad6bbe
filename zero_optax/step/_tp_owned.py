"""Owned leaves sharded over tensor-parallel axes: their owner gathers the blocks and updates the whole tensor.

A leaf that needs an owner (Muon's matrices, Adafactor's) may be sharded over mesh axes other than the ZeRO axes
(`P(None, "model")`). Its `ParamLeaf.dims` say which axes cut which dimension; zero1 reads them from the
parameters' `PartitionSpec`s (mesh-bound, `zo.state_specs`, or `zero1(..., param_specs=...)`). A step:

1. The gradient blocks are reduced over the ZeRO axes as for any owned leaf, in buffers of their own (their
   values differ along the tensor-parallel axes, the other owned leaves' do not); each device of the owner's ZeRO
   rank then holds the reduced gradient of its own block (one row of the owner-packed buffers).
2. Those devices all-gather their rows over the tensor-parallel axes (`gather`: one all-gather per dtype,
   outside the `lax.switch`, the same program on every device) and assemble the whole gradient (`whole_leaf`).
   Without master copies the parameter's blocks travel the same way.
3. Every device of the owner's rank runs the inner update on the whole tensor (the same values on each: its
   state is typed invariant over the tensor-parallel axes), so Newton-Schulz sees the whole matrix.
4. Each keeps its own block of the result (`own_block`), which the all-gather over the ZeRO axes brings to the
   devices holding that block.

State: the owner's tensor-parallel peers each keep the leaf's whole state (the packed buffers are replicated over
those axes), so an owned leaf's state costs its whole size on each of them.

The all-gathers over the tensor-parallel axes are the wire's (`zero_optax.step._wire.Wire.gather_blocks`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax import lax

from zero_optax.core import _compat
from zero_optax.step import _owned
from zero_optax.layout._layout import Layout, Packing, ParamLeaf
from zero_optax.step._wire import Wire


def tp_axes(layout: Layout, leaves: Sequence[int]) -> tuple[str, ...]:
    """The tensor-parallel axes the tensor-parallel owned `leaves` are sharded over, in mesh order."""
    cut = {a for i in leaves for a in layout.leaves[i].axes if layout.leaves[i].tp_owned}
    return tuple(a for a, _ in layout.axis_sizes if a in cut)


def gather_whole(wire: Wire, layout: Layout, leaf: ParamLeaf, x: jax.Array) -> jax.Array:
    """The whole parameter from every device's block `x` of it (one all-gather over `leaf.axes`)."""
    blocks = wire.gather_blocks(x, leaf.axes)
    sizes = dict(layout.axis_sizes)
    return assemble(layout, leaf, blocks.reshape(tuple(sizes[a] for a in leaf.axes) + leaf.shape))


# ---------------------------------------------------------------------- blocks and whole tensors

def assemble(layout: Layout, leaf: ParamLeaf, blocks: jax.Array) -> jax.Array:
    """The whole tensor from its blocks, `blocks[k_1, ..., k_m]` the block at position `k` along `leaf.axes`.

    A dimension cut by axes `(a, b)` (`P(("a", "b"))`) holds the blocks row-major over `(a, b)`, as `shard_map`
    lays them out.
    """
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
    """Rows of owner-packed blocks, gathered over the tensor-parallel axes: what the owners of tensor-parallel
    leaves read their whole values from, inside their switch branch.

    Attributes:
      plan: where each leaf's block sits in its owner's row (`_owned.leaf_plan`).
      rows: dtype -> `[devices of axes, size]`, row `k` the row of the `k`-th device along `axes`.
      axes: the tensor-parallel axes gathered over (mesh order).
    """

    plan: Packing
    rows: dict[str, jax.Array]
    axes: tuple[str, ...]

    def whole(self, layout: Layout, r: int, i: int) -> jax.Array:
        """Leaf `i`'s whole value, on the devices of its owner `r`."""
        leaf = layout.leaves[i]
        dtype, off = self.plan.offsets[r][i]
        sizes = dict(layout.axis_sizes)
        x = self.rows[dtype][:, off:off + leaf.size]
        x = x.reshape(tuple(sizes[a] for a in self.axes) + leaf.shape)
        # (the leaf's blocks are the same along gathered axes it is not sharded over: position 0 of those)
        x = x[tuple(slice(None) if a in leaf.axes else 0 for a in self.axes)]
        return assemble(layout, leaf, x)


def own_row(layout: Layout, values: dict[int, jax.Array], plan: Packing, rank: jax.Array) -> dict[str, jax.Array]:
    """This device's row of `plan`: the values (blocks every device holds) of the leaves its ZeRO rank owns,
    packed, one `lax.switch` branch per rank."""
    varying = layout.axes + tp_axes(layout, list(values))

    def branch(r):
        return lambda v: _compat.pvary(_owned.pack({i: v[i] for i in plan.offsets[r]}, plan.offsets[r],
                                                   plan.sizes), varying)
    return _owned.switch(rank, [branch(r) for r in range(layout.world_size)], values)


def gather(wire: Wire, layout: Layout, rows: dict[str, jax.Array], plan: Packing, leaves: Sequence[int]
           ) -> Gathered:
    """`rows` (this device's row of `plan`) gathered over the tensor-parallel axes of `leaves` (one all-gather per
    dtype, `[devices, size]` buffers)."""
    axes = tp_axes(layout, leaves)
    return Gathered(plan, wire.gather_blocks(rows, axes), axes)

