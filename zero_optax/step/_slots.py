"""The slot geometry of sliced leaves: device `r` of a group of `N` owns coordinates `[r*slots, (r+1)*slots)` of a
leaf's flattened block, `slots = ceil(size / N)`, the tail padded with zeros.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from zero_optax.layout._layout import Layout
from zero_optax.layout._stored import ParamLeaf


def padded(x: jax.Array, leaf: ParamLeaf) -> jax.Array:
    """The flattened block, zero-padded to `group * slots` elements."""
    flat = x.reshape(-1)
    pad = leaf.slots * leaf.group - flat.shape[0]
    return jnp.pad(flat, (0, pad)) if pad else flat


def unpadded(x: jax.Array, leaf: ParamLeaf) -> jax.Array:
    """A leaf's flattened, zero-padded block (`padded`) back in the leaf's shape."""
    return x[:leaf.size].reshape(leaf.shape) if x.shape[0] != leaf.size else x.reshape(leaf.shape)


def own_slice(x: jax.Array, leaf: ParamLeaf, rank: jax.Array) -> jax.Array:
    """This device's `(slots,)` coordinates of the flattened, zero-padded block `x`."""
    if leaf.group == 1:
        return x.reshape(-1)
    return lax.dynamic_slice_in_dim(padded(x, leaf), rank * leaf.slots, leaf.slots, allow_negative_indices=False)


def split(flat: jax.Array, sizes: Sequence[int]) -> list[jax.Array]:
    """The 1-D `flat` cut into consecutive pieces of `sizes`."""
    if len(sizes) == 1:
        return [flat]
    cuts = list(itertools.accumulate(sizes))[:-1]
    return jnp.split(flat, cuts)


def concat(parts: Sequence[jax.Array], axis: int = 0) -> jax.Array:
    """`parts` concatenated along `axis` (a single part as it is)."""
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)


def own_rows(values: dict[int, jax.Array], layout: Layout, leaves: Sequence[int], rank: jax.Array) -> jax.Array:
    """This device's slots of every leaf of `leaves` (of one ZeRO group), concatenated."""
    return concat([own_slice(values[i], layout.leaves[i], rank) for i in leaves])
