"""Owned leaves: one device updates each of them as a whole tensor, which keeps matrix optimizers exact.

In SPMD every device holds blocks of one shape, so device `r` packs what it owns into per-dtype buffers padded to
the largest share, and one `lax.switch` on the device index runs each device's own inner update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zero_optax.layout import _stored
from zero_optax.layout._layout import Layout
from zero_optax.layout._stored import Packing
from zero_optax.step._wire import concat

Key = int | tuple[int, ...]
"""An item of a packing, or the same item of a stack's members (`Layout.stacks`), their values stacked."""
K = TypeVar("K", bound=Key)


def side_by_side(offsets: dict[int, tuple[str, int]], items: Sequence[int], size: int) -> bool:
    """Whether `items`, each of `size` elements, follow each other in one buffer at `offsets`."""
    dtype, start = offsets[items[0]]
    return all(offsets[j] == (dtype, start + k * size) for k, j in enumerate(items))


def _pieces(values: Mapping[K, jax.Array], offsets: dict[int, tuple[str, int]]):
    """`(dtype, offset, 1-D value)` for every value: a stack in one piece where its members lie side by side."""
    for key, x in values.items():
        if isinstance(key, tuple) and side_by_side(offsets, key, x[0].size):
            yield (*offsets[key[0]], x.reshape(-1))
        else:
            yield from ((*offsets[j], v.reshape(-1)) for j, v in unstacked({key: x}).items())


def pack(values: Mapping[K, jax.Array], offsets: dict[int, tuple[str, int]], sizes: dict[str, int],
         base: dict[str, jax.Array] | None = None) -> dict[str, jax.Array]:
    """`values` (item or stack -> array) at `offsets` of per-dtype buffers: in place in (donated) `base`, else new."""
    pieces: dict[str, list] = {d: [] for d in sizes}
    for dtype, off, x in _pieces(values, offsets):
        pieces[dtype].append((off, x.astype(dtype)))
    if base is not None:
        out = dict(base)
        for d, ps in pieces.items():
            for off, x in ps:
                out[d] = lax.dynamic_update_slice_in_dim(out[d], x, off, 0)
        return out
    return {d: _concatenated(ps, sizes[d], d) for d, ps in pieces.items()}


def _concatenated(pieces: list[tuple[int, jax.Array]], size: int, dtype: str) -> jax.Array:
    """One buffer of `size` holding the 1-D `pieces` (offset, value; not overlapping), zeros between them."""
    parts, at = [], 0
    for off, x in sorted(pieces, key=lambda p: p[0]):
        if off > at:
            parts.append(jnp.zeros((off - at,), dtype))
        parts.append(x)
        at = off + x.shape[0]
    if at < size or not parts:
        parts.append(jnp.zeros((size - at,), dtype))
    return concat(parts)


@dataclasses.dataclass(frozen=True, eq=False)
class Row:
    """Items packed in one device's 1-D `buffers` (dtype -> buffer) at `offsets`, read on demand, each through
    `convert(value, item)` (a division, a cast), except `values` (whole tensor-parallel leaves) read as they are."""

    buffers: dict[str, jax.Array]
    offsets: dict[int, tuple[str, int]]
    shapes: dict[int, tuple[int, ...]]
    convert: Callable[[jax.Array, int], jax.Array] = lambda x, _: x
    values: dict[int, jax.Array] = dataclasses.field(default_factory=dict)

    def __contains__(self, item: int) -> bool:
        return item in self.offsets or item in self.values

    def _read(self, item: int, count: int) -> jax.Array:
        dtype, off = self.offsets[item]
        size = int(np.prod(self.shapes[item]))
        return lax.slice_in_dim(self.buffers[dtype], off, off + count * size)

    def __getitem__(self, item: int) -> jax.Array:
        if item in self.values:
            return self.values[item]
        return self.convert(self._read(item, 1).reshape(self.shapes[item]), item)

    def stack(self, items: Sequence[int]) -> jax.Array:
        """The values of `items` (of one shape and dtype) stacked on a leading axis."""
        shape = self.shapes[items[0]]
        if side_by_side(self.offsets, items, int(np.prod(shape))):
            return self.convert(self._read(items[0], len(items)).reshape((len(items), *shape)), items[0])
        return jnp.stack([self[j] for j in items])


def stacked(values: Row | dict[int, jax.Array], items: Sequence[int]) -> jax.Array:
    """`values[j]` for `j` in `items`, stacked on a leading axis (one slice of a `Row` where it can)."""
    return values.stack(items) if isinstance(values, Row) else jnp.stack([values[j] for j in items])


def unstacked(values: Mapping[K, jax.Array]) -> dict[int, jax.Array]:
    """`values` item by item: a stack's value cut into its members'."""
    out: dict[int, jax.Array] = {}
    for key, x in values.items():
        if isinstance(key, tuple):
            out.update((j, x[m]) for m, j in enumerate(key))
        else:
            out[key] = x
    return out


def leaf_plan(layout: Layout, dtypes: dict[int, str]) -> Packing:
    """Where each owned leaf of `dtypes` sits in its owner's row: in tree order, a stack's members after its first."""
    first = {i: (s[0], k) for s in layout.stacks for k, i in enumerate(s)}
    return _stored.pack_plan([[(i, layout.leaves[i].size, dtypes[i])
                               for i in sorted(range(len(layout.leaves)), key=lambda i: first.get(i, (i, 0)))
                               if layout.leaves[i].owner == r and i in dtypes] for r in range(layout.world_size)])


def row_starts(plan: Packing, layout: Layout) -> tuple[list[dict[str, int]], dict[str, int]]:
    """Where each (padded) row of `plan` starts in one buffer per dtype that holds the rows' used parts one after
    the other, shortest first (so the padding of each row, zeros, falls on the rows after it and the buffer needs no
    room beyond them; a row with nothing of a dtype starts at 0), and that buffer's length. For `sums_results`:
    each device's row placed there, and the buffers summed over the devices."""
    used = [{d: max([off + layout.leaves[i].size for i, (e, off) in offsets.items() if e == d] or [0])
             for d in plan.sizes} for offsets in plan.offsets]
    starts: list[dict[str, int]] = [dict.fromkeys(plan.sizes, 0) for _ in plan.offsets]
    length = {}
    for d, size in plan.sizes.items():
        at = 0
        for r in sorted((r for r, u in enumerate(used) if u[d]), key=lambda r: used[r][d]):
            starts[r][d] = at
            at += used[r][d]
        length[d] = max([at] + [starts[r][d] + size for r, u in enumerate(used) if u[d]])
    return starts, length


def sums_results(layout: Layout, rows: Packing) -> bool:
    """Whether the owners' results, packed in `rows` (`leaf_plan`), travel by one sum of the rows placed one after
    the other (`row_starts`) rather than an all-gather of the rows, padded to the largest owner's: when the rows,
    `n` times, would move more than twice the summed buffer's bytes (devices owning leaves of unequal sizes)."""
    n = layout.world_size
    if n == 1 or not rows.sizes:
        return False
    _, length = row_starts(rows, layout)
    nbytes = {d: np.dtype(d).itemsize for d in rows.sizes}
    return n * sum(size * nbytes[d] for d, size in rows.sizes.items()) > 2 * sum(
        size * nbytes[d] for d, size in length.items())


def choose_reduce(reduce: str | None, plan: Packing, nbytes: int, n: int, packed: bool = False) -> str | None:
    """The gradient collective: "auto" picks the one moving fewer bytes, or the reduce-scatter when `packed`."""
    if reduce is None:
        return None
    if n == 1:
        return "psum"
    if reduce != "auto":
        return reduce
    if packed:
        return "psum_scatter"
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
        row = Row({d: gathered[d][r] for d in {d for d, _ in offsets.values()}}, offsets,
                  {i: layout.leaves[i].shape for i in offsets})
        out.update((i, row[i]) for i in offsets)
    return out


def switch(rank: jax.Array, branches: Sequence[Callable], *operands, owns: Sequence[Any] | None = None):
    """`lax.switch` on the device index, or the only branch directly; with `owns` (per device, what it owns),
    devices that own alike (nothing, say) share one branch, so the program grows with the owned leaves, not the
    devices."""
    if owns is not None:
        index: dict[Any, int] = {}
        table = [index.setdefault(k, len(index)) for k in owns]
        branches = [branches[table.index(b)] for b in range(len(index))]
        rank = jnp.asarray(table, jnp.int32)[rank] if len(branches) > 1 else rank
    if len(branches) == 1:
        return branches[0](*operands)
    return lax.switch(rank, list(branches), *operands)
