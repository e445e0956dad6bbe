"""Offload: every array a zero1 state stores lives in each device's `pinned_host` memory between steps.

With `zero1(..., offload=True)` a step streams the state through the device (`jax.device_put` between memory spaces
inside `shard_map`) in buckets of about `bucket_bytes`, so the device never holds it whole. XLA:CPU lowers such
moves to nothing (one RAM): there only the entry parameters and results are marked host. The streamed updates pass
a chunk (sliced groups) or a bucket (an owner's leaves) of the host arrays through the device at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax import lax

from zero_optax.core._errors import ZeroError
from zero_optax.layout import _stored
from zero_optax.layout._layout import Group, Layout
from zero_optax.layout._stored import MASTER
from zero_optax.step import _groups, _packed, _reduce, _wire

if TYPE_CHECKING:
    from jax._src.core import MemorySpace  # jax.memory.Space (`jax.memory` is a namespace type checkers cannot read)

HOST = "pinned_host"
DEVICE = "device"


def check_devices(devices: Iterable[Any]) -> None:
    """Refuses `offload=True` on devices that have no `pinned_host` memory.

    Examples:
      >>> import jax
      >>> check_devices(jax.devices())
    """
    for d in devices:
        try:
            kinds = {m.kind for m in d.addressable_memories()}
        except (AttributeError, jax.errors.JaxRuntimeError):  # a backend without memory spaces: UNIMPLEMENTED
            kinds = set()
        if HOST not in kinds:
            raise ZeroError(
                f"zero1(offload=True) keeps the optimizer state in each device's `{HOST}` memory, but device "
                f"{d} ({getattr(d, 'platform', '?')}) exposes the memory kinds {sorted(kinds) or 'none'}. Use "
                f"offload=False on this backend, or a JAX release and backend whose devices have `{HOST}` "
                "memory (CPU, GPU and TPU do).")


def buckets(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Positions of `sizes` (bytes) in order, in buckets of at most `bucket_bytes` (a larger one alone; `0`: one each).

    Examples:
      >>> buckets([16, 16, 4], 32)
      [[0, 1], [2]]
    """
    out: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if not out or bucket_bytes <= 0 or total + n > bucket_bytes:
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out


def move(tree: Any, space: MemorySpace, bucket_bytes: int) -> Any:
    """Inside `shard_map`: every array of `tree` moved to memory `space`, one `device_put` a bucket."""
    leaves, treedef = jax.tree.flatten(tree)
    sizes = [x.size * np.dtype(x.dtype).itemsize for x in leaves]
    moved = [x for group in buckets(sizes, bucket_bytes) for x in jax.device_put([leaves[i] for i in group], space)]
    return jax.tree.unflatten(treedef, moved)


def fetch(x: jax.Array, start: Any, length: int) -> jax.Array:
    """`[start, start + length)` of the host-memory 1-D `x` on the device (XLA copies the piece alone)."""
    return jax.device_put(lax.dynamic_slice_in_dim(x, start, length), jax.memory.Space.Device)


def store(x: jax.Array, value: jax.Array, start: Any) -> jax.Array:
    """The host-memory 1-D `x` with the device array `value` written at `start` (the inverse of `fetch`)."""
    return lax.dynamic_update_slice_in_dim(x, jax.device_put(value, jax.memory.Space.Host), start, 0)


def move_small(state: Any, space: MemorySpace, bucket_bytes: int) -> Any:
    """`state` with its shared entries and local accumulators moved to `space` (the step streams the rest)."""
    inner = state._inner._replace(shared=move(state._inner.shared, space, bucket_bytes))
    return dataclasses.replace(state, _inner=inner, local=move(state.local, space, bucket_bytes))


def with_memory_kind(sharding: jax.sharding.Sharding, kind: str | None) -> jax.sharding.Sharding:
    """`sharding` placed in memory `kind` (None keeps it)."""
    if kind is None or getattr(sharding, "memory_kind", None) == kind:
        return sharding
    return sharding.with_memory_kind(kind)


def _same(x: jax.Array) -> jax.Array:
    return x


def placed(x: Any, kind: str | None) -> Any:
    """A concrete array `x` in memory `kind`, its sharding otherwise kept (None, or a traced `x`, keeps it).

    The move is a jitted identity: an eager `jax.device_put` of an array a program wrote to `pinned_host` fails on
    JAX 0.12.1's CPU client ("Unsupported layout used for PjRt CPU buffers"), the program's copy does not."""
    if kind is None or not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or \
            x.sharding.memory_kind == kind:
        return x
    return jax.jit(_same, out_shardings=x.sharding.with_memory_kind(kind))(x)


def fetched(state: Any) -> Any:
    """`state` with every array (concrete or traced) in host memory brought to device memory, outside the step."""
    def one(x):
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            return x if x.sharding.memory_kind is None else placed(x, DEVICE)
        host = getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host  # older JAX types none
        return jax.device_put(x, jax.memory.Space.Device) if host else x
    return jax.tree.map(one, state)


# ---------------------------------------------------------------------- the updates streamed through the device

Span = tuple[str, int, int]
"""`(dtype, start, stop)`: a contiguous range of one of a device's packed buffers."""


def stream_buckets(layout: Layout, r: int, leaves: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Device `r`'s owned `leaves` in buckets of at most `bucket_bytes` of stored state (a larger leaf alone)."""
    nbytes = dict.fromkeys(leaves, 0)
    for j in layout.rank_entries(r):
        leaf = layout.entries[j].leaf
        if leaf in nbytes:
            nbytes[leaf] += layout.entries[j].nbytes
    return [[leaves[k] for k in b] for b in buckets([nbytes[i] for i in leaves], bucket_bytes)]


def _span_of(where: tuple[str, int], ranges: Sequence[Span]) -> int:
    """The index of the range holding the position `where`."""
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
    return [_wire.concat(p) for p in parts]


def stream_groups(groups: _groups.Groups, step: _groups.Step, grads: list[jax.Array], params: list[jax.Array] | None,
                  state, p_dtypes: list) -> tuple:
    """The group views' update, `bucket_bytes` of a group's host arrays at a time: what every device receives (None
    for a micro-step), the new stored state, master copies and old shared values."""
    layout, stepping, ok, chunk_bytes = step.layout, step.stepping, step.denom.ok, groups.cfg.bucket_bytes
    shared_old = groups.shared_values(layout, state._inner)
    step = dataclasses.replace(step, shared_old=shared_old)
    master = state.master is not None and stepping

    def one(g: int, group: Group) -> tuple:
        """Group `g`'s new arrays, what every device receives and the new shared values."""
        arrays = list(state._inner.histories[g]) + ([state.master[g]] if master else [])
        rank = _groups.group_rank(layout, group, step.ranks)

        def chunk(start, length, carry):
            new_arrays, out, _ = carry
            old = [fetch(a, start, length) for a in arrays]
            hist, m_old = (old[:-1], old[-1]) if master else (old, None)
            g_c = lax.dynamic_slice_in_dim(grads[g], start, length)
            p_c = m_old if master else (None if params is None else lax.dynamic_slice_in_dim(params[g], start, length))
            u, shared, h = groups.run_view(step, g, g_c, p_c, hist, p_c is not None)
            mask = _groups.valid(layout, group, rank, start, length)
            results = [_reduce.skip_if_empty(ok, _groups.zero_padding(x, mask), y) for x, y in zip(h, hist)]
            if stepping:
                assert u is not None  # (a group's view holds its leaf)
                m_new, value = _groups.stepped(u, m_old, mask, ok, p_dtypes[g])
                if master:
                    results.append(m_new)
                if out is None:  # typed by the update below (varying where `value` is)
                    out = jnp.zeros((group.size,), value.dtype)
                out = lax.dynamic_update_slice_in_dim(out, value, start, 0)
            return [store(a, x, start) for a, x in zip(new_arrays, results)], out, shared
        width = sum(np.dtype(a.dtype).itemsize for a in arrays) or 1
        size = group.size if chunk_bytes <= 0 else max(1, min(group.size, chunk_bytes // width))
        carry = chunk(0, size, (arrays, None, None))  # the first chunk types the loop's carry
        full = group.size // size
        if full > 1:
            carry = lax.fori_loop(1, full, lambda c, carry: chunk(c * size, size, carry), carry)
        if group.size % size:
            carry = chunk(full * size, group.size % size, carry)
        return carry

    done = [one(g, group) for g, group in enumerate(layout.groups)]
    shared_new = done[0][2]
    new = _groups.stored_state(layout, shared_new, [tuple(a[:len(a) - master]) for a, _, _ in done])
    masters = tuple(a[-1] for a, _, _ in done) if master else state.master
    return ([out for _, out, _ in done] if stepping else None), new, masters, shared_old


def stream_owned(owned: Any, step: _groups.Step, r: int, mine: list[int], g: _packed.Row | dict[int, jax.Array],
                 buffers) -> tuple[dict, dict]:
    """Device `r`'s update of `mine`, a bucket of its host buffers at a time: the new buffers and the updates."""
    layout = step.layout
    offsets = layout.state_packing.offsets[r]
    u_all: dict[int, jax.Array] = {}
    for bucket in stream_buckets(layout, r, mine, owned.cfg.bucket_bytes):
        entries = [j for j in layout.rank_entries(r) if layout.entries[j].leaf in bucket and
                   (step.stepping or layout.entries[j].role != MASTER)]  # a micro-step leaves the masters alone
        ranges = _stored.runs(sorted((*offsets[j], layout.entries[j].size) for j in entries if layout.entries[j].size))
        pieces = [fetch(buffers[d], lo, hi - lo) for d, lo, hi in ranges]
        stored = read(pieces, ranges, offsets, {j: layout.entries[j].shape for j in entries})
        values, u = owned.view_update(step, r, bucket, {i: g[i] for i in bucket}, stored)
        values = _reduce.skip_if_empty(step.denom.ok, _packed.unstacked(values), stored)
        buffers = dict(buffers)
        for (d, lo, _), x in zip(ranges, write(values, ranges, offsets)):
            buffers[d] = store(buffers[d], x, lo)
        buffers = lax.optimization_barrier(buffers)  # the next bucket is read after this one is written
        u_all.update(_packed.unstacked(u))
    return buffers, u_all
