"""Owned leaves: one device updates each of them as a whole tensor.

Whole tensors keep matrix optimizers exact (Muon's orthogonalisation, Adafactor's factored moments, LAMB's trust
ratio, Shampoo's preconditioners). In SPMD every device must hold blocks of one shape, so device `r` packs the
state of the leaves it owns into per-dtype buffers padded to the largest device's share, and one `lax.switch` on
the device index runs each device's own inner update. Gradients reach owners by a reduce-scatter of owner-packed
buffers (or an all-reduce, when padding would move more bytes); results return to every device by an all-gather
of the same packing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zero_optax.transform import _layout
from zero_optax.transform._layout import Layout, Packing


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


def leaf_plan(layout: Layout, dtypes: dict[int, str]) -> Packing:
    """Where each owned leaf's gradient or update (in `dtypes[leaf]`) sits in its owner's row of a collective."""
    return _layout.pack_plan([[(i, leaf.size, dtypes[i]) for i, leaf in enumerate(layout.leaves)
                               if leaf.owner == r and i in dtypes] for r in range(layout.world_size)])


def choose_reduce(reduce: str | None, plan: Packing, nbytes: int, n: int) -> str | None:
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
    return "psum_scatter" if scatter <= 2 * nbytes else "psum"


def scatter_rows(values: dict[int, jax.Array], plan: Packing, n: int) -> dict[str, jax.Array]:
    """One `[n * size]` buffer per dtype whose row `r` holds the values of the leaves device `r` owns."""
    rows = {i: (d, r * plan.sizes[d] + off) for r in range(n) for i, (d, off) in plan.offsets[r].items()}
    return pack(values, rows, {d: n * size for d, size in plan.sizes.items()})


def gathered_leaves(gathered: dict[str, jax.Array], plan: Packing, layout: Layout) -> dict[int, jax.Array]:
    """Each owned leaf's value from all-gathered `[n, size]` buffers, read from its owner's row."""
    out = {}
    for r, offsets in enumerate(plan.offsets):
        for i, (dtype, off) in offsets.items():
            leaf = layout.leaves[i]
            out[i] = lax.slice_in_dim(gathered[dtype][r], off, off + leaf.size).reshape(leaf.shape)
    return out


def switch(rank: jax.Array, branches: Sequence[Callable], *operands):
    """`lax.switch` on the device index, or the only branch directly."""
    if len(branches) == 1:
        return branches[0](*operands)
    return lax.switch(rank, list(branches), *operands)


# ---------------------------------------------------------------------- offload: streamed through the device

Span = tuple[str, int, int]
"""`(dtype, start, stop)`: a contiguous range of one of a device's packed buffers."""


def stream_buckets(layout: Layout, r: int, leaves: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Device `r`'s owned `leaves`, in order, in buckets of at most `bucket_bytes` of stored state (histories and
    master copies; a leaf with more is a bucket of its own): what an offloaded step brings to the device at once.
    Leaves with 96, 96 and 200 bytes of state and `bucket_bytes=256`, say, make the buckets `[[a, b], [c]]`.
    """
    nbytes = dict.fromkeys(leaves, 0)
    for j in layout.rank_entries(r):
        if layout.entries[j].leaf in nbytes:
            nbytes[layout.entries[j].leaf] += layout.entries[j].nbytes
    out: list[list[int]] = []
    total = 0
    for i in leaves:
        if not out or bucket_bytes <= 0 or total + nbytes[i] > bucket_bytes:
            out.append([])
            total = 0
        out[-1].append(i)
        total += nbytes[i]
    return out


def spans(offsets: dict[int, tuple[str, int]], sizes: dict[int, int]) -> list[Span]:
    """The contiguous ranges of the packed buffers that hold the items `sizes` (item -> size) placed at `offsets`:
    one per run of items that follow each other in one buffer.

    Examples:
      >>> spans({0: ("float32", 0), 1: ("float32", 4), 2: ("float32", 10), 3: ("float32", 7)},
      ...       {0: 4, 1: 3, 2: 2, 3: 0})
      [('float32', 0, 7), ('float32', 10, 12)]
    """
    return _layout.runs(sorted((*offsets[j], n) for j, n in sizes.items() if n))


def _span_of(where: tuple[str, int], ranges: Sequence[Span]) -> int:
    return next(k for k, (d, lo, hi) in enumerate(ranges) if d == where[0] and lo <= where[1] < hi)


def read(pieces: Sequence[jax.Array], ranges: Sequence[Span], offsets: dict[int, tuple[str, int]],
         shapes: dict[int, tuple[int, ...]]) -> dict[int, jax.Array]:
    """The items `shapes` (item -> shape) from `pieces`, the contents of `ranges` (in their buffers' dtypes)."""
    out = {}
    for j, shape in shapes.items():
        if not int(np.prod(shape)):  # an empty item has no range
            out[j] = jnp.zeros(shape, offsets[j][0])
            continue
        k = _span_of(offsets[j], ranges)
        lo = offsets[j][1] - ranges[k][1]
        out[j] = lax.slice_in_dim(pieces[k], lo, lo + int(np.prod(shape))).reshape(shape)
    return out


def write(values: dict[int, jax.Array], ranges: Sequence[Span], offsets: dict[int, tuple[str, int]]
          ) -> list[jax.Array]:
    """The contents of `ranges` holding `values` (item -> array, every item of the ranges): the inverse of `read`."""
    parts: list[list] = [[] for _ in ranges]
    for j in sorted(values, key=lambda j: offsets[j][1]):
        if values[j].size:
            parts[_span_of(offsets[j], ranges)].append(values[j].reshape(-1).astype(offsets[j][0]))
    return [p[0] if len(p) == 1 else jnp.concatenate(p) for p in parts]
