"""Every collective zero1 emits (no other module emits one), the buckets and slots sliced leaves travel in, and how.

A collective travels exact or int8 quantized (ZeRO++'s qgZ and qwZ; codec in `_quantize`), as `Wire._quantized`
chooses; another strategy adds its collectives at the bottom and a branch in `_reduce_scatter`, `_replica_sum` and
`_gather_values`. With replica axes only this device's reduce-scattered shard of a gradient crosses them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zero_optax.core import _compat, _errors
from zero_optax.layout._layout import Layout
from zero_optax.layout._stored import ParamLeaf
from zero_optax.step import _quantize

DEFAULT_BUCKET_BYTES = 4 << 20
"""Keeps a tree of B bytes within 2 x ceil(B / 4 MiB) collectives a step, each long enough to amortise its launch."""

ALONE_BYTES = {"cpu": 64 << 10}
"""Per backend, the size from which a sliced leaf travels alone below `bucket_bytes` (its gathered values are then
the step's output, with no copy out of a bucket); on XLA:CPU a launch costs less than copying 64 KiB twice."""

MAX_BUCKET_LEAVES = 32
"""A bucket also closes at this many leaves: XLA:CPU's compile time grows with the square of a buffer's slices."""


# ---------------------------------------------------------------------- the slots of sliced leaves
# Device `r` of a group of `N` owns coordinates `[r*slots, (r+1)*slots)` of a leaf's flattened block,
# `slots = ceil(size / N)`, the tail padded with zeros.

def padded(x: jax.Array, leaf: ParamLeaf) -> jax.Array:
    """The flattened block, zero-padded to `group * slots` elements."""
    flat = x.reshape(-1)
    pad = leaf.slots * leaf.group - flat.shape[0]
    return jnp.pad(flat, (0, pad)) if pad else flat


def unpadded(x: jax.Array, leaf: ParamLeaf) -> jax.Array:
    """A leaf's flattened, zero-padded block (`padded`) back in the leaf's shape."""
    return x[:leaf.size].reshape(leaf.shape) if x.shape[0] != leaf.size else x.reshape(leaf.shape)


def row_block(leaf: ParamLeaf) -> tuple[int, ...] | None:
    """The shape of a device's slots of `leaf` where they are whole rows of it, its block of rows (the leaf cut over
    its first dimension); None where they are not."""
    if leaf.group > 1 and leaf.shape and leaf.shape[0] % leaf.group == 0:
        return (leaf.shape[0] // leaf.group, *leaf.shape[1:])
    return None


def own_slice(x: jax.Array, leaf: ParamLeaf, rank: jax.Array) -> jax.Array:
    """This device's `(slots,)` coordinates of the flattened, zero-padded block `x`."""
    if leaf.group == 1:
        return x.reshape(-1)
    if x.ndim > 1 and (block := row_block(leaf)) is not None:  # whole rows: cut in the leaf's shape, read in place
        return lax.dynamic_slice_in_dim(x, rank * block[0], block[0], allow_negative_indices=False).reshape(-1)
    return lax.dynamic_slice_in_dim(padded(x, leaf), rank * leaf.slots, leaf.slots, allow_negative_indices=False)


def pieces(x: jax.Array, bounds: Sequence[tuple[int, int]], axis: int = 0) -> list[jax.Array]:
    """`x[a:b]` along `axis` for each `(a, b)` of `bounds`, read at offsets XLA cannot fold into its programs.

    XLA:CPU compiles a program per distinct fused computation: pieces of one buffer cut at constant offsets are one
    program each (with the update they feed), while at offsets behind an `optimization_barrier` the pieces of a
    size share one. The values are the same. A piece that is the whole of `x` is `x`."""
    whole = [a == 0 and b == x.shape[axis] for a, b in bounds]
    starts = [a for (a, _), w in zip(bounds, whole) if not w]
    if len(starts) < 2 or max(starts) >= np.iinfo(np.int32).max:
        return [x if w else lax.slice_in_dim(x, a, b, axis=axis) for (a, b), w in zip(bounds, whole)]
    opaque = iter(lax.optimization_barrier(tuple(np.int32(a) for a in starts)))
    return [x if w else lax.dynamic_slice_in_dim(x, next(opaque), b - a, axis=axis, allow_negative_indices=False)
            for (a, b), w in zip(bounds, whole)]


def split(flat: jax.Array, sizes: Sequence[int]) -> list[jax.Array]:
    """The 1-D `flat` cut into consecutive pieces of `sizes`."""
    if len(sizes) == 1:
        return [flat]
    cuts = list(itertools.accumulate(sizes))[:-1]
    return jnp.split(flat, cuts)


def concat(parts: Sequence[jax.Array], axis: int = 0) -> jax.Array:
    """`parts` concatenated along `axis` (a single part as it is)."""
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Leaves whose slices travel in one collective: same ZeRO axes, own axes and dtype, in tree order."""

    leaves: tuple[int, ...]
    axes: tuple[str, ...]
    dtype: str


_JOINT = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}


@dataclasses.dataclass(frozen=True)
class Wire:
    """The collectives of one zero1 configuration over its ZeRO `axes` and, for gradients and weights, `replicas`;
    gradients are summed in `sum_dtype_of` (`reduce_dtype`, else `master_dtype`) where set."""

    axes: tuple[str, ...]
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    sum_dtype_of: np.dtype | None = None
    alone_bytes: int | None = None
    replicas: tuple[str, ...] = ()
    quantize: _quantize.Quantize | None = None
    _plans: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, cfg) -> Wire:
        """The wire of a `zero_optax.layout._planner.Config` on the default backend."""
        wide = cfg.reduce_dtype if cfg.reduce_dtype is not None else cfg.master_dtype
        return cls(cfg.axes, cfg.bucket_bytes, None if wide is None else np.dtype(wide),
                   ALONE_BYTES.get(jax.default_backend()), cfg.replica_axes, cfg.quantize)

    def sum_dtype(self, dtype) -> str:
        """The dtype name a gradient of `dtype` is summed in."""
        return np.dtype(self.sum_dtype_of if self.sum_dtype_of is not None else dtype).name

    # ------------------------------------------------------------------ the bucket plan

    def plan(self, layout: Layout, indices: Sequence[int], dtypes: Sequence[str]) -> tuple[Bucket, ...]:
        """The buckets of the sliced leaves `indices` travelling in `dtypes`, memoised (not planned at every trace)."""
        key = (layout, tuple(indices), tuple(dtypes))
        if key not in self._plans:
            self._plans[key] = self._plan(*key)
        return self._plans[key]

    def _plan(self, layout: Layout, indices: tuple[int, ...], dtypes: tuple[str, ...]) -> tuple[Bucket, ...]:
        """Buckets closed at `bucket_bytes` or `MAX_BUCKET_LEAVES`; a leaf of `alone_bytes` travels alone."""
        alone = self.bucket_bytes if self.alone_bytes is None else min(self.alone_bytes, self.bucket_bytes)
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
                if size >= alone:
                    out.append(Bucket((i,), axes, dtype))
                    continue
                current.append(i)
                nbytes += size
                if nbytes >= self.bucket_bytes or len(current) >= MAX_BUCKET_LEAVES:
                    out.append(Bucket(tuple(current), axes, dtype))
                    current, nbytes = [], 0
            if current:
                out.append(Bucket(tuple(current), axes, dtype))
        return tuple(out)

    # ------------------------------------------------------------------ sliced leaves, bucket by bucket

    def reduce_scatter(self, grads: dict[int, jax.Array], layout: Layout, buckets: Sequence[Bucket]
                       ) -> list[jax.Array]:
        """Each bucket's row of this device's `(slots,)` blocks of its leaves' summed gradients: one tiled
        reduce-scatter of `[group, sum(slots)]`, row `r` device `r`'s slices."""
        out = []
        for b in buckets:
            leaves = [layout.leaves[i] for i in b.leaves]
            parts = [padded(grads[i].astype(b.dtype), leaf) for i, leaf in zip(b.leaves, leaves)]
            if not b.axes or leaves[0].group == 1:  # one device: its gradient is the sum (over the replicas)
                out.append(concat([self._replica_sum(x) for x in parts]))
                continue
            rows = [x.reshape(leaf.group, leaf.slots) for x, leaf in zip(parts, leaves)]
            out.append(self._reduce_scatter(concat(rows, axis=1), b.axes)[0])
        return out

    def all_reduce_slices(self, grads: dict[int, jax.Array], layout: Layout, buckets: Sequence[Bucket],
                          ranks: dict) -> list[jax.Array]:
        """Like `reduce_scatter`, by one variadic all-reduce of each bucket, then sliced."""
        out = []
        for b in buckets:
            parts = self.all_reduce([grads[i].astype(b.dtype) for i in b.leaves], b.axes)
            out.append(concat([own_slice(g, layout.leaves[i], ranks[b.axes]) for i, g in zip(b.leaves, parts)]))
        return out

    def gather(self, rows: Sequence[jax.Array], layout: Layout, buckets: Sequence[Bucket]) -> dict[int, jax.Array]:
        """Every sliced leaf's full block, typed invariant, from each bucket's row of `(slots,)` values."""
        out = {}
        for b, row in zip(buckets, rows):
            leaves = [layout.leaves[i] for i in b.leaves]
            if b.axes and leaves[0].group > 1:
                cols = self._gather_values(row.astype(b.dtype), b.axes).reshape(leaves[0].group, -1)
                cuts = [0, *itertools.accumulate(leaf.slots for leaf in leaves)]
                blocks = [x.reshape(-1) for x in pieces(cols, list(itertools.pairwise(cuts)), axis=1)]
            else:
                blocks = split(row.astype(b.dtype), [leaf.slots for leaf in leaves])
                if b.axes and _compat.vma_enabled(b.axes):  # one device: the gather only types the value invariant
                    blocks = [_compat.all_gather_invariant(x, b.axes, tiled=True) for x in blocks]
            out.update((i, unpadded(x, leaf)) for i, x, leaf in zip(b.leaves, blocks, leaves))
        return out

    # ------------------------------------------------------------------ owned leaves and whole values

    def scatter_packed(self, rows: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Owner-packed `[n * size]` gradient buffers reduce-scattered: every device keeps the sum of its own row."""
        return {d: self._reduce_scatter(b, self.axes) for d, b in rows.items()}

    @property
    def packs_owned_gradients(self) -> bool:
        """Whether owned leaves' gradients travel owner-packed (`scatter_packed`): so that only each owner's row
        crosses replica axes, and because quantized gradients travel by reduce-scatters only."""
        return bool(self.replicas) or self._quantized("grads", self.axes)

    @property
    def sums_owned_results(self) -> bool:
        """Whether owners' results may travel by a sum (`sum_packed`): not where the parameters' gathers are
        quantized (only all-gathers are)."""
        return not self._quantized("params", self.axes)

    def sum_packed(self, buffers: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Every device's buffers, each holding its own items and zeros elsewhere, summed over the ZeRO axes."""
        return {d: lax.psum(b, self.axes) for d, b in buffers.items()}

    def gather_packed(self, buffers: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Every device's packed buffers gathered to every device as `[n, size]` (typed invariant)."""
        return {d: self._gather_values(b, self.axes).reshape(-1, b.shape[0]) for d, b in buffers.items()}

    def gather_blocks(self, x, axes: tuple[str, ...]):
        """Every device's `x` (a pytree) over the tensor-parallel `axes`, stacked row-major on a new leading axis."""
        return jax.tree.map(lambda b: _compat.all_gather_invariant(b, axes), x)

    def all_reduce(self, x, axes: tuple[str, ...] | None = None):
        """The sum of `x` (a pytree: one collective) over `axes` (by default the ZeRO axes) and the replica axes."""
        axes = self.replicas + (self.axes if axes is None else axes)
        return lax.psum(x, axes) if axes else x

    def invariant(self, x):
        """`x` (a pytree, the same on every device of a one-device group) typed invariant: a psum over one device."""
        return lax.psum(x, self.axes)

    def agree(self, x: jax.Array) -> jax.Array:
        """`x`, the same on every device, typed invariant across the ZeRO axes (a pmax of one scalar)."""
        return lax.pmax(x, self.axes) if _compat.vma_enabled(self.axes) else x

    def joint(self, local: jax.Array, kind: str) -> jax.Array:
        """The `kind` ("sum", "max" or "min") reduction over the axes of every device's `local` value."""
        return _JOINT[kind](local, self.axes) if self.axes else local

    # ------------------------------------------------------------------ the primitives

    def _quantized(self, kind: str, axes: Sequence[str], x: jax.Array | None = None) -> bool:
        """Whether a collective of `kind` over `axes` (of the value `x`: a floating one) is quantized."""
        return (self.quantize is not None and self.quantize.quantizes(kind, axes)
                and (x is None or jnp.issubdtype(x.dtype, jnp.floating)))

    @property
    def _block_size(self) -> int:
        """The block size of a quantized collective (one that `_quantized` chose)."""
        assert self.quantize is not None
        return self.quantize.block_size

    def _reduce_scatter(self, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        """Gradients reduce-scattered over `axes`, then this device's block summed over the replica axes."""
        if self._quantized("grads", axes, x):
            n = _compat.axis_size(axes)
            block = quantized_reduce_scatter(x.reshape(-1), axes, self._block_size)
            block = block.astype(x.dtype).reshape(x.shape[0] // n, *x.shape[1:])
        else:
            block = _compat.psum_scatter(x, axes)
        return self._replica_sum(block)

    def _replica_sum(self, x: jax.Array) -> jax.Array:
        """A gradient block summed over the replica axes (quantized: a reduce-scatter, then an all-gather)."""
        if not self.replicas:
            return x
        if not self._quantized("grads", self.replicas, x):
            return lax.psum(x, self.replicas)
        r, flat = _compat.axis_size(self.replicas), x.reshape(-1)
        rows = -(-flat.shape[0] // r)
        part = quantized_reduce_scatter(jnp.pad(flat, (0, r * rows - flat.shape[0])), self.replicas,
                                        self._block_size)
        total = quantized_all_gather(part, self.replicas, self._block_size)[:flat.shape[0]]
        return total.astype(x.dtype).reshape(x.shape)

    def _gather_values(self, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        """The 1-D `x` of every device of `axes`, concatenated (typed invariant), quantized where `params` is."""
        if self._quantized("params", axes, x):
            return quantized_all_gather(x, axes, self._block_size)
        return _compat.all_gather_invariant(x, axes, tiled=True)


# ---------------------------------------------------------------------- the int8 quantized strategy

def _checked(x, axes, block_size, what: str) -> tuple[jax.Array, tuple[str, ...], int, int]:
    """The quantized collectives' arguments checked: `x`, `axes`, their device count and `block_size`."""
    block_size = _quantize.check_block_size(block_size)
    x = _quantize.check_vector(x, what)
    axes = _quantize.check_axes(axes, what)
    return x, axes, _compat.axis_size(axes, what), block_size


def quantized_all_gather(x: jax.Array, axes: tuple[str, ...], block_size: int) -> jax.Array:
    """`all_gather_invariant(x, axes, tiled=True)` of the 1-D floating `x`, travelling as int8 codes and scales."""
    x, axes, n, block_size = _checked(x, axes, block_size, "quantized_all_gather")
    size = x.shape[0]
    q, scales = _quantize.quantize(x, block_size)
    q = _compat.all_gather_invariant(q, axes, tiled=True).reshape(n, -1)
    scales = _compat.all_gather_invariant(scales, axes, tiled=True).reshape(n, -1)
    return _quantize.dequantize_rows(q, scales, block_size)[:, :size].reshape(-1).astype(x.dtype)


def quantized_reduce_scatter(x: jax.Array, axes: tuple[str, ...], block_size: int) -> jax.Array:
    """`psum_scatter(x, axes)` of the 1-D floating `x`, quantized through an all-to-all, summed in float32 in order."""
    x, axes, n, block_size = _checked(x, axes, block_size, "quantized_reduce_scatter")
    if x.shape[0] % n:
        raise _errors.ZeroError(f"quantized_reduce_scatter: x's length {x.shape[0]} is not a multiple of the {n} "
                                f"devices of {axes}.")
    rows = x.shape[0] // n
    parts = _quantize.pad_last(x.astype(jnp.float32).reshape(n, rows), _quantize.padded_size(rows, block_size))
    q, scales = _quantize.quantize_rows(parts, block_size)
    q, scales = _compat.pvary((q, scales), axes)  # all_to_all takes values typed varying across its axes
    axis = _compat._axis_arg(axes)  # (a tuple of axes is row-major, as psum_scatter's order: test_quantize checks)
    q = lax.all_to_all(q, axis, 0, 0, tiled=True)  # row s: sender s's part for this device
    scales = lax.all_to_all(scales, axis, 0, 0, tiled=True)
    received = _quantize.dequantize_rows(q, scales, block_size)
    total = functools.reduce(operator.add, [received[s] for s in range(n)])
    return total[:rows]
