"""What zero1 puts on the wire: every collective it emits, the buckets they move, and the dtype each travels in.

A step's stages (`zero_optax.step._engine`) move values between devices only through a `Wire`, built once
from the config:

* sliced leaves travel in *buckets* (`plan`): contiguous per-dtype buffers of whole leaves' slices (DeepSpeed's and
  FSDP's device), so a tree of hundreds of leaves costs a few reduce-scatters and all-gathers instead of one per
  leaf. A bucket is closed once it holds at least `bucket_bytes`, so a tree of `B` bytes needs at most
  `ceil(B / bucket_bytes)` buckets per dtype and group. Gradients are summed in `sum_dtype` (`reduce_dtype`, else
  `master_dtype`, else their own); results travel in the dtype they have.
* owned leaves travel packed per owner (`zero_optax.step._owned`): `scatter_packed`, `gather_packed`; the
  blocks of owned leaves sharded over tensor-parallel axes are gathered over those axes (`gather_blocks`);
* scalars: the global weight (`weight_sum`), the accumulation cycle's position (`agree`), and the full reductions
  an inner update computes over a sliced leaf (`joint`, `zero_optax.step._varying`).

With replica axes (`zero1(..., replica_axis=)`, issue 32) gradients are reduced on two levels: reduce-scattered
over the ZeRO axes (the fast network), then only this device's shard all-reduced over the replica axes (the slow
one: 1/N of the bytes), so every replica holds the same shard. Weights are summed over both. Everything after the
reduction (the inner update, the joint reductions, the all-gathers) is the same on every replica and moves over the
ZeRO axes only.

Every collective goes through the primitives at the bottom of `Wire` (`_sum`, `_scatter`, `_gather`, and `joint`
for max and min), over the axes they are given; the gradients' reductions add the replica level
(`_reduce_sum`, `_reduce_scatter`). A new way to move values (quantized collectives) is a change to those and to
the fields `Wire.of` fills, and nothing else.

Quantized collectives (`zero1(..., quantize=zo.Quantize(...))`, issue 33, kernels in
`zero_optax.step._quantize`): with `grads="int8"` the gradients' reduce-scatters (`_reduce_scatter`) travel
as int8 blocks through an all-to-all and are summed in float32, and so does the replica level (a quantized
reduce-scatter over the replica axes, then an int8 all-gather of the sums); with `params="int8"` the all-gathers
of new parameter values (`gather_rows`, `gather_packed`) travel as int8 blocks. Weights, the joint reductions and
the tensor-parallel gathers stay exact.
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
from zero_optax.step import _quantize
from zero_optax.layout._layout import Layout
from zero_optax.step._slots import own_slice, padded, split, unpadded

DEFAULT_BUCKET_BYTES = 4 << 20
"""Chosen by `benchmarks/collectives.py --section buckets` and `benchmarks/first_step.py` (`benchmarks/RESULTS.md`):
with at most `MAX_BUCKET_LEAVES` leaves a bucket, 4 MiB keeps a tree of B bytes within 2 x ceil(B / 4 MiB)
collectives per step, and a 4 MiB collective is long enough to amortise its launch latency on GPUs."""

ALONE_BYTES = {"cpu": 64 << 10}
"""Per backend, the size from which a sliced leaf travels alone even below `bucket_bytes` (elsewhere: from
`bucket_bytes`). A leaf in a bucket is copied into the bucket before the reduce-scatter and out of it after the
all-gather, and a leaf alone is not: its gathered values are the step's output (`zero_optax.apply_gradients`
writes each new parameter once, as GSPMD's step does). On XLA:CPU a collective's launch costs less than copying
64 KiB twice, so from there leaves travel alone and the GPT tree's step writes what GSPMD's writes (figures in
`benchmarks/RESULTS.md`, "The default step"); many small leaves still share buckets (the 1000-leaf tree). On GPUs
and TPUs a launch costs more than copying megabytes, so there buckets take every leaf below `bucket_bytes`."""

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


_JOINT = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}


@dataclasses.dataclass(frozen=True)
class Wire:
    """The collectives of one zero1 configuration.

    Attributes:
      axes: the ZeRO axes (`axis_name` as a tuple): what the owned leaves, weights and cycle positions travel over.
        A bucket of sliced leaves travels over its own `Bucket.axes` (the ZeRO axes minus a leaf's own).
      bucket_bytes: the size at which a bucket closes (`plan`); `<= 0` gives one bucket per leaf.
      alone_bytes: the size from which a leaf travels alone below `bucket_bytes` (`ALONE_BYTES`); None: from
        `bucket_bytes` only.
      sum_dtype_of: the dtype gradients are summed in when it is set (`reduce_dtype` or `master_dtype`).
      replicas: the replica axes (`zero1(..., replica_axis=)`): gradients and weights are also summed over these,
        after the ZeRO axes' reduce-scatter; nothing else crosses them.
      quantize: `zero_optax.step._quantize.Quantize`, or None: every collective exact.
    """

    axes: tuple[str, ...]
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    sum_dtype_of: np.dtype | None = None
    alone_bytes: int | None = None
    replicas: tuple[str, ...] = ()
    quantize: _quantize.Quantize | None = None

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

    def plan(self, layout: Layout, indices: Sequence[int], dtypes: Sequence[str]) -> list[Bucket]:
        """Groups the sliced leaves `indices` (with the dtype each travels in) into buckets of at least
        `bucket_bytes`.

        A leaf of at least `alone_bytes` travels alone, and the smaller ones around it keep filling the open
        bucket: a leaf alone in its all-gather needs no cut out of a shared buffer, so its gathered values can be
        the step's output (`zero_optax.apply_gradients`). `bucket_bytes <= 0` gives one bucket per leaf.

        Example: float32 leaves of 1, 100 and 2 KiB, `bucket_bytes` 4 MiB and `alone_bytes` 64 KiB make the
        buckets `[(1,), (0, 2)]` (the leaf alone first: a bucket is listed when it closes).
        """
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
        return out

    # ------------------------------------------------------------------ sliced leaves, bucket by bucket

    def reduce_scatter(self, grads: dict[int, jax.Array], layout: Layout, buckets: Sequence[Bucket]
                       ) -> dict[int, jax.Array]:
        """Each device's `(slots,)` block of every sliced leaf's summed gradient, in the bucket's dtype (still to
        be divided by the reduction's denominator)."""
        out = {}
        for b in buckets:
            leaves = [layout.leaves[i] for i in b.leaves]
            if not b.axes or leaves[0].group == 1:  # one device: its gradient is the sum (over the replicas)
                rows = [self._replica_sum(padded(grads[i].astype(b.dtype), leaf)) for i, leaf in zip(b.leaves, leaves)]
            else:
                rows = split(self.reduce_scatter_rows(grads, layout, [b])[0], [leaf.slots for leaf in leaves])
            out.update(zip(b.leaves, rows))
        return out

    def reduce_scatter_rows(self, grads: dict[int, jax.Array], layout: Layout, buckets: Sequence[Bucket]
                            ) -> list[jax.Array]:
        """Like `reduce_scatter`, but each bucket's row whole (the concatenation of its leaves' `(slots,)`
        parts), for buckets of groups of more than one device.

        A bucket is `[group, sum(slots)]`: row `r` is the concatenation of device `r`'s slices of its leaves, so
        one tiled reduce-scatter leaves every device its row.
        """
        out = []
        for b in buckets:
            leaves = [layout.leaves[i] for i in b.leaves]
            group = leaves[0].group
            parts = [padded(grads[i].astype(b.dtype), leaf).reshape(group, leaf.slots)
                     for i, leaf in zip(b.leaves, leaves)]
            stacked = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
            out.append(self._reduce_scatter(stacked, b.axes)[0])
        return out

    def all_reduce_slices(self, grads: dict[int, jax.Array], layout: Layout, buckets: Sequence[Bucket],
                          ranks: dict) -> dict[int, jax.Array]:
        """Like `reduce_scatter`, but all-reduces the bucket and slices it (3x the wire volume with the gather).

        The bucket is one variadic all-reduce of its leaves (no concatenation: `lax.psum` of a list is one op).
        """
        out = {}
        for b in buckets:
            leaves = [layout.leaves[i] for i in b.leaves]
            parts = self._reduce_sum([grads[i].astype(b.dtype) for i in b.leaves], b.axes)
            for i, leaf, g in zip(b.leaves, leaves, parts):
                out[i] = own_slice(g, leaf, ranks[b.axes])
        return out

    def gather(self, values: dict[int, jax.Array], layout: Layout, buckets: Sequence[Bucket]
               ) -> dict[int, jax.Array]:
        """The full block of every sliced leaf of `buckets`, invariant across the group, from each device's
        `(slots,)` values: one all-gather per bucket of the concatenated values."""
        out = {}
        for b in buckets:
            leaves = [layout.leaves[i] for i in b.leaves]
            parts = [values[i].astype(b.dtype) for i in b.leaves]
            if b.axes and leaves[0].group > 1:
                out.update(self.gather_rows([parts[0] if len(parts) == 1 else jnp.concatenate(parts)], layout, [b]))
                continue
            if b.axes and _compat.vma_enabled(b.axes):  # one device: a gather of one block only retypes the value
                # as invariant (XLA:CPU keeps it as a copy, a psum costs more); untyped (`check_vma=False`), it
                # needs none
                parts = [self._gather(p, b.axes, tiled=True) for p in parts]
            for i, leaf, x in zip(b.leaves, leaves, parts):
                out[i] = unpadded(x, leaf)
        return out

    def gather_rows(self, rows: Sequence[jax.Array], layout: Layout, buckets: Sequence[Bucket]
                    ) -> dict[int, jax.Array]:
        """Like `gather`, from each bucket's row whole, for buckets of groups of more than one device."""
        out = {}
        for b, row in zip(buckets, rows):
            leaves = [layout.leaves[i] for i in b.leaves]
            cols = self._gather_values(row.astype(b.dtype), b.axes).reshape(leaves[0].group, -1)
            cuts = [0, *itertools.accumulate(leaf.slots for leaf in leaves)]
            for i, leaf, (a, c) in zip(b.leaves, leaves, itertools.pairwise(cuts)):
                out[i] = unpadded(cols[:, a:c].reshape(-1), leaf)
        return out

    # ------------------------------------------------------------------ owned leaves and whole values

    def scatter_packed(self, rows: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Owner-packed `[n * size]` gradient buffers reduce-scattered: every device keeps the sum of its own row."""
        return {d: self._reduce_scatter(b, self.axes) for d, b in rows.items()}

    @property
    def packs_owned_gradients(self) -> bool:
        """Whether owned leaves' gradients must travel owner-packed (`scatter_packed`) rather than all-reduced:
        with replica axes only each owner's row then crosses them, and quantized gradients travel by
        reduce-scatters only (`zero_optax.step._owned.choose_reduce`)."""
        return bool(self.replicas) or self._quantized("grads", self.axes)

    def gather_packed(self, buffers: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Every device's packed buffers (owned leaves' updates, or with master copies their new values), gathered
        to every device as `[n, size]` (typed invariant)."""
        return {d: self._gather_values(b, self.axes).reshape(-1, b.shape[0]) for d, b in buffers.items()}

    def gather_blocks(self, x, axes: tuple[str, ...]):
        """Every device's `x` (a pytree) from all devices of the tensor-parallel `axes`, stacked on a new leading
        axis (row-major over `axes`), typed invariant over them: the blocks of owned leaves sharded over those
        axes, which their owner updates whole (`zero_optax.step._tp_owned`)."""
        return jax.tree.map(lambda b: self._gather(b, axes), x)

    def all_reduce(self, x):
        """The sum of gradients `x` (a pytree, one collective) over every device of the ZeRO and replica axes;
        invariant across them."""
        return self._reduce_sum(x, self.axes)

    def invariant(self, x):
        """`x` (a pytree, the same on every device of a one-device group) typed invariant over the ZeRO axes: a
        psum over one device."""
        return self._sum(x, self.axes)

    def weight_sum(self, w: jax.Array) -> jax.Array:
        """The sum of every device's weight (a scalar) over the ZeRO and replica axes."""
        return self._reduce_sum(w, self.axes)

    def agree(self, x: jax.Array) -> jax.Array:
        """`x`, the same on every device, typed invariant across the ZeRO axes (the largest value: one scalar)."""
        return lax.pmax(x, self.axes) if _compat.vma_enabled(self.axes) else x

    def joint(self, local: jax.Array, kind: str) -> jax.Array:
        """The `kind` ("sum", "max" or "min") reduction over the axes of every device's `local` reduction of its
        slice of one leaf: a few bytes on the wire. Every device gets the same value."""
        return _JOINT[kind](local, self.axes) if self.axes else local

    # ------------------------------------------------------------------ the primitives

    def _reduce_sum(self, x, axes: tuple[str, ...]):
        """Gradients summed over `axes` and the replica axes (one all-reduce; none over no axis)."""
        axes = self.replicas + tuple(axes)
        return self._sum(x, axes) if axes else x

    def _quantized(self, kind: str, axes: Sequence[str], x: jax.Array | None = None) -> bool:
        """Whether a collective of `kind` over `axes` (of the value `x`: a floating one) is quantized."""
        return (self.quantize is not None and self.quantize.quantizes(kind, axes)
                and (x is None or jnp.issubdtype(x.dtype, jnp.floating)))

    def _reduce_scatter(self, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        """Gradients reduce-scattered over `axes`, then this device's block all-reduced over the replica axes."""
        if self._quantized("grads", axes, x):
            n = _compat.axis_size(axes)
            block = quantized_reduce_scatter(x.reshape(-1), axes, self.quantize.block_size)
            block = block.astype(x.dtype).reshape(x.shape[0] // n, *x.shape[1:])
        else:
            block = self._scatter(x, axes)
        return self._replica_sum(block)

    def _replica_sum(self, x: jax.Array) -> jax.Array:
        """A gradient block summed over the replica axes: an all-reduce, or quantized a reduce-scatter
        (int8 through an all-to-all, summed in float32) of its `R` parts and an int8 all-gather of the sums."""
        if not self.replicas:
            return x
        if not self._quantized("grads", self.replicas, x):
            return self._sum(x, self.replicas)
        r, flat = _compat.axis_size(self.replicas), x.reshape(-1)
        rows = -(-flat.shape[0] // r)
        part = quantized_reduce_scatter(jnp.pad(flat, (0, r * rows - flat.shape[0])), self.replicas,
                                        self.quantize.block_size)
        total = quantized_all_gather(part, self.replicas, self.quantize.block_size)[:flat.shape[0]]
        return total.astype(x.dtype).reshape(x.shape)

    def _gather_values(self, x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        """The 1-D `x` of every device of `axes`, concatenated (typed invariant); new parameter values as int8
        blocks where `params` is quantized over `axes`."""
        if self._quantized("params", axes, x):
            return quantized_all_gather(x, axes, self.quantize.block_size)
        return self._gather(x, axes, tiled=True)

    @staticmethod
    def _sum(x, axes: tuple[str, ...]):
        return lax.psum(x, axes)

    @staticmethod
    def _scatter(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        return _compat.psum_scatter(x, axes)

    @staticmethod
    def _gather(x: jax.Array, axes: tuple[str, ...], tiled: bool = False) -> jax.Array:
        return _compat.all_gather_invariant(x, axes, tiled=tiled)


# ---------------------------------------------------------------------- quantized collectives (issue 33)

def quantized_all_gather(x: jax.Array, axes: tuple[str, ...], block_size: int) -> jax.Array:
    """Every device's `x` over `axes`, concatenated (like `all_gather_invariant(x, axes, tiled=True)`), each
    block as its block-wise int8 rounding. Inside `jax.shard_map`.

    Each device quantizes its own `x`; the codes and the scales are all-gathered
    (`_quantize.wire_bytes(x.size, block_size)` per device instead of `x.nbytes`) and every sender's block is
    dequantized. Typed invariant across
    `axes` (so `out_specs=P()` holds over them).

    Args:
      x: this device's 1-D floating block, the same length on every device.
      axes: the mesh axes to gather over (row-major device order over a tuple).
      block_size: elements per scale.

    Returns:
      `[n * x.size]` in `x.dtype`, `n` the product of the sizes of `axes`.
    """
    block_size = _quantize.check_block_size(block_size)
    x = _quantize.check_vector(x, "quantized_all_gather")
    axes = _quantize.check_axes(axes, "quantized_all_gather")
    n = _compat.axis_size(axes, "quantized_all_gather")
    size = x.shape[0]
    q, scales = _quantize.quantize(x, block_size)
    q = _compat.all_gather_invariant(q, axes, tiled=True).reshape(n, -1)
    scales = _compat.all_gather_invariant(scales, axes, tiled=True).reshape(n, -1)
    return _quantize.dequantize_rows(q, scales, block_size)[:, :size].reshape(-1).astype(x.dtype)


def quantized_reduce_scatter(x: jax.Array, axes: tuple[str, ...], block_size: int) -> jax.Array:
    """This device's part of the sum over `axes` of every device's `x` (like `psum_scatter(x, axes)`), each part
    quantized block-wise by its sender; float32. Inside `jax.shard_map`.

    `x` is `n` parts of `rows` elements, part `r` destined to device `r` (`n` the product of the sizes of `axes`,
    devices row-major over a tuple). Each part is zero-padded to `_quantize.padded_size(rows, block_size)` and
    quantized; one all-to-all of the codes and one of the scales hand every device the `n` parts destined to it
    (`n * _quantize.wire_bytes(rows, block_size)` bytes through each device), which it dequantizes and sums in
    float32, senders in order 0..n-1. Typed varying across `axes`, as `psum_scatter`'s result is.

    Args:
      x: this device's 1-D floating `[n * rows]` values.
      axes: the mesh axes to reduce over.
      block_size: elements per scale.

    Returns:
      float32 `[rows]`.
    """
    block_size = _quantize.check_block_size(block_size)
    x = _quantize.check_vector(x, "quantized_reduce_scatter")
    axes = _quantize.check_axes(axes, "quantized_reduce_scatter")
    n = _compat.axis_size(axes, "quantized_reduce_scatter")
    if x.shape[0] % n:
        raise _errors.ZeroError(f"quantized_reduce_scatter: x's length {x.shape[0]} is not a multiple of the {n} "
                                f"devices of {axes}.")
    rows = x.shape[0] // n
    parts = _quantize.pad_last(x.astype(jnp.float32).reshape(n, rows), _quantize.padded_size(rows, block_size))
    q, scales = _quantize.quantize_rows(parts, block_size)
    q, scales = _compat.pvary((q, scales), axes)  # all_to_all takes values typed varying across its axes
    # lax.all_to_all over a tuple of axes (row-major, like psum_scatter's device order) works on JAX 0.10.2 and
    # 0.12 alike (tests/test_quantize.py checks the order on a (2, 4) mesh): no per-axis emulation is needed.
    axis = _compat._axis_arg(axes)
    q = lax.all_to_all(q, axis, 0, 0, tiled=True)            # row s: sender s's part for this device
    scales = lax.all_to_all(scales, axis, 0, 0, tiled=True)
    received = _quantize.dequantize_rows(q, scales, block_size)
    total = functools.reduce(operator.add, [received[s] for s in range(n)])
    return total[:rows]
