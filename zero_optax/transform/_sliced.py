"""Sliced leaves: every device of a leaf's ZeRO group updates `slots` consecutive coordinates of its block.

With `size` elements and a group of `N` devices a leaf has `slots = ceil(size / N)`; device `r` owns coordinates
`[r*slots, (r+1)*slots)` of the flattened block, the tail padded with zeros. The inner optimizer runs on these 1-D
slices, which is exact for transformations that act coordinate by coordinate (Adam, Lion, SGD, RMSProp, ...).

Collectives go through *buckets*: contiguous per-dtype buffers of whole leaves' slices (DeepSpeed's and FSDP's
device), so a tree of hundreds of leaves costs a few reduce-scatters and all-gathers instead of one per leaf. A
bucket is closed once it holds at least `bucket_bytes`, so a tree of `B` bytes needs at most
`ceil(B / bucket_bytes)` buckets per dtype and group.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zero_optax.core import _compat
from zero_optax.transform import _reduce
from zero_optax.transform._layout import Layout, ParamLeaf

DEFAULT_BUCKET_BYTES = 4 << 20
"""Chosen by `benchmarks/collectives.py --section buckets` and `benchmarks/first_step.py` (`benchmarks/RESULTS.md`):
with at most `MAX_BUCKET_LEAVES` leaves a bucket, 4 MiB keeps a tree of B bytes within 2 x ceil(B / 4 MiB)
collectives per step, and a 4 MiB collective is long enough to amortise its launch latency on GPUs."""

MAX_BUCKET_LEAVES = 32
"""A bucket also closes at this many leaves: XLA:CPU's compile time grows with the square of the number of slices
taken from one buffer (0.64 s for a 100-leaf update unbucketed, 1.2 s with 32-leaf buckets, 2.3 s with one
bucket), so longer buckets cost seconds of compilation for no bandwidth gain."""


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Leaves whose slices travel in one collective: same ZeRO axes, own axes and dtype, in tree order."""

    leaves: tuple[int, ...]
    axes: tuple[str, ...]
    dtype: str


def plan_buckets(layout: Layout, indices: Sequence[int], dtypes: Sequence[str], bucket_bytes: int) -> list[Bucket]:
    """Groups the sliced leaves `indices` (with the dtype each travels in) into buckets of at least `bucket_bytes`.

    A leaf of at least `bucket_bytes` travels alone, and the smaller ones around it keep filling the open bucket:
    a leaf alone in its all-gather needs no cut out of a shared buffer, so its gathered values can be the step's
    output (`zero_optax.apply_gradients`). `bucket_bytes <= 0` gives one bucket per leaf.
    """
    out: list[Bucket] = []
    keyed = {}
    for i, dtype in zip(indices, dtypes):
        leaf = layout.leaves[i]
        keyed.setdefault((layout.zero_axes(leaf), leaf.axes, dtype), []).append(i)
    for (axes, _, dtype), members in keyed.items():
        current: list[int] = []
        nbytes = 0
        for i in members:
            leaf = layout.leaves[i]
            size = leaf.slots * leaf.group * np.dtype(dtype).itemsize
            if size >= bucket_bytes:
                out.append(Bucket((i,), axes, dtype))
                continue
            current.append(i)
            nbytes += size
            if nbytes >= bucket_bytes or len(current) >= MAX_BUCKET_LEAVES:
                out.append(Bucket(tuple(current), axes, dtype))
                current, nbytes = [], 0
        if current:
            out.append(Bucket(tuple(current), axes, dtype))
    return out


def _padded(x: jax.Array, leaf: ParamLeaf) -> jax.Array:
    """The flattened block, zero-padded to `group * slots` elements."""
    flat = x.reshape(-1)
    pad = leaf.slots * leaf.group - flat.shape[0]
    return jnp.pad(flat, (0, pad)) if pad else flat


def own_slice(x: jax.Array, leaf: ParamLeaf, rank: jax.Array) -> jax.Array:
    """This device's `(slots,)` coordinates of the flattened, zero-padded block `x`."""
    if leaf.group == 1:
        return x.reshape(-1)
    return lax.dynamic_slice_in_dim(_padded(x, leaf), rank * leaf.slots, leaf.slots, allow_negative_indices=False)


def _split(flat: jax.Array, sizes: Sequence[int]) -> list[jax.Array]:
    if len(sizes) == 1:
        return [flat]
    cuts = list(itertools.accumulate(sizes))[:-1]
    return jnp.split(flat, cuts)


def reduce_scatter(grads: dict[int, jax.Array], layout: Layout, buckets: Sequence[Bucket]) -> dict[int, jax.Array]:
    """Each device's `(slots,)` block of every sliced leaf's summed gradient, in the bucket's dtype (still to be
    divided by the reduction's denominator).

    A bucket is `[group, sum(slots)]`: row `r` is the concatenation of device `r`'s slices of its leaves, so one
    tiled reduce-scatter leaves every device its row.
    """
    out = {}
    for b in buckets:
        leaves = [layout.leaves[i] for i in b.leaves]
        if not b.axes or leaves[0].group == 1:  # one device: its gradient is the sum
            rows = [_padded(grads[i].astype(b.dtype), leaf) for i, leaf in zip(b.leaves, leaves)]
        else:
            rows = _split(reduce_scatter_rows(grads, layout, [b])[0], [leaf.slots for leaf in leaves])
        out.update(zip(b.leaves, rows))
    return out


def reduce_scatter_rows(grads: dict[int, jax.Array], layout: Layout, buckets: Sequence[Bucket]) -> list[jax.Array]:
    """Like `reduce_scatter`, but each bucket's row whole (the concatenation of its leaves' `(slots,)` parts), for
    buckets of groups of more than one device."""
    out = []
    for b in buckets:
        leaves = [layout.leaves[i] for i in b.leaves]
        group = leaves[0].group
        parts = [_padded(grads[i].astype(b.dtype), leaf).reshape(group, leaf.slots)
                 for i, leaf in zip(b.leaves, leaves)]
        stacked = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
        out.append(_compat.psum_scatter(stacked, b.axes)[0])
    return out


def gather_rows(rows: Sequence[jax.Array], layout: Layout, buckets: Sequence[Bucket]) -> dict[int, jax.Array]:
    """Like `gather`, from each bucket's row whole, for buckets of groups of more than one device."""
    out = {}
    for b, row in zip(buckets, rows):
        leaves = [layout.leaves[i] for i in b.leaves]
        cols = _compat.all_gather_invariant(row.astype(b.dtype), b.axes, tiled=True).reshape(leaves[0].group, -1)
        cuts = [0, *itertools.accumulate(leaf.slots for leaf in leaves)]
        for i, leaf, (a, c) in zip(b.leaves, leaves, itertools.pairwise(cuts)):
            out[i] = _unpadded(cols[:, a:c].reshape(-1), leaf)
    return out


def _unpadded(x: jax.Array, leaf: ParamLeaf) -> jax.Array:
    """A leaf's flattened, zero-padded block (`_padded`) back in the leaf's shape."""
    return x[:leaf.size].reshape(leaf.shape) if x.shape[0] != leaf.size else x.reshape(leaf.shape)


def own_rows(values: dict[int, jax.Array], layout: Layout, leaves: Sequence[int], rank: jax.Array) -> jax.Array:
    """This device's slots of every leaf of `leaves` (of one ZeRO group), concatenated."""
    parts = [own_slice(values[i], layout.leaves[i], rank) for i in leaves]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def all_reduce_slices(grads: dict[int, jax.Array], layout: Layout, buckets: Sequence[Bucket],
                      denom: _reduce.Denominator, out_dtypes: dict[int, str], ranks) -> dict[int, jax.Array]:
    """Like `reduce_scatter`, but all-reduces the bucket and slices it (3x the wire volume with the gather).

    The bucket is one variadic all-reduce of its leaves (no concatenation: `lax.psum` of a list is one op).
    """
    out = {}
    for b in buckets:
        leaves = [layout.leaves[i] for i in b.leaves]
        parts = [grads[i].astype(b.dtype) for i in b.leaves]
        if b.axes:
            parts = lax.psum(parts, b.axes)
        for i, leaf, g in zip(b.leaves, leaves, parts):
            out[i] = _reduce.divide(own_slice(g, leaf, ranks[b.axes]), denom, out_dtypes[i])
    return out


def gather(values: dict[int, jax.Array], layout: Layout, buckets: Sequence[Bucket]) -> dict[int, jax.Array]:
    """The full block of every sliced leaf of `buckets`, invariant across the group, from each device's `(slots,)`
    values: one all-gather per bucket of the concatenated values."""
    out = {}
    for b in buckets:
        leaves = [layout.leaves[i] for i in b.leaves]
        parts = [values[i].astype(b.dtype) for i in b.leaves]
        if b.axes and leaves[0].group > 1:
            out.update(gather_rows([parts[0] if len(parts) == 1 else jnp.concatenate(parts)], layout, [b]))
            continue
        if b.axes and _compat.vma_enabled(b.axes):  # one device: a gather of one block only retypes the value as
            # invariant (XLA:CPU keeps it as a copy, a psum costs more); untyped (`check_vma=False`), it needs none
            parts = [_compat.all_gather_invariant(p, b.axes, tiled=True) for p in parts]
        for i, leaf, x in zip(b.leaves, leaves, parts):
            out[i] = _unpadded(x, leaf)
    return out
