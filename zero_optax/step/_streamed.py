"""Offload's streamed updates: the stored arrays stay in host memory and pass through the device a chunk (sliced
groups) or a bucket (an owner's leaves) at a time, so the device never holds the whole shard. The engine's first and
last stages move the small arrays (`_offload`); the sliced and owned stages call these when `step.streamed`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from zero_optax.layout import _inner_state
from zero_optax.layout._layout import Group
from zero_optax.layout._stored import MASTER
from zero_optax.layout._state import SlicedState
from zero_optax.step import _groups, _offload, _packed, _reduce


@dataclasses.dataclass(frozen=True, eq=False)
class _GroupStream:
    """What every chunk of one group's streamed update reads (offload).

    Attributes:
      arrays: the group's stored arrays in host memory: its histories, then (with `master`) its master copy.
      grads, params: this device's parts of the group's gradient and parameter buffers (on the device).
      master: whether the group's master copy steps with it (a step that is no micro-step).
      p_dtype: the parameter dtype the new master values are rounded to.
    """

    step: _groups.Step
    g: int
    group: Group
    arrays: list
    grads: jax.Array
    params: jax.Array | None
    rank: jax.Array
    master: bool
    p_dtype: Any


def groups(groups: _groups.Groups, step: _groups.Step, grads: list[jax.Array], params: list[jax.Array] | None, state,
                    p_dtypes: list) -> tuple:
    """The group views' update with the groups' arrays in host memory, chunk by chunk (at most `bucket_bytes`
    of all a group's arrays, in a `fori_loop`, so the device holds one chunk's state at a time). Returns what
    every device receives (None for a micro-step), the new stored state, master copies and old shared values.
    """
    layout, stepping, chunk_bytes = step.layout, step.stepping, groups.cfg.bucket_bytes
    shared_old = groups.shared_values(layout, state.inner_state)
    step = dataclasses.replace(step, shared_old=shared_old)
    master = state.master is not None and stepping
    values, histories, masters, shared_new = [], [], [], None
    for g, group in enumerate(layout.groups):
        arrays = list(state.inner_state.histories[g]) + ([state.master[g]] if master else [])
        width = sum(np.dtype(a.dtype).itemsize for a in arrays) or 1
        size = group.size if chunk_bytes <= 0 else max(1, min(group.size, chunk_bytes // width))
        rank = step.ranks[layout.zero_axes(layout.leaves[group.first])]

        stream = _GroupStream(step, g, group, arrays, grads[g], None if params is None else params[g], rank,
                              master, p_dtypes[g])

        def chunk(start, length, carry, stream=stream):
            return _chunk(groups, stream, start, length, carry)
        carry = chunk(0, size, (list(arrays), None, None))  # the first chunk types the loop's carry
        full = group.size // size
        if full > 1:
            carry = lax.fori_loop(1, full, lambda c, carry, size=size, chunk=chunk: chunk(c * size, size, carry),
                                  carry)
        if group.size % size:
            carry = chunk(full * size, group.size % size, carry)
        new_arrays, out, shared = carry
        values.append(out)
        histories.append(tuple(new_arrays[:len(new_arrays) - master]))
        if master:
            masters.append(new_arrays[-1])
        shared_new = shared if shared_new is None else shared_new
    new = SlicedState(_inner_state.tree(layout, [shared_new[j][None] for j in layout.shared_entries]),
                      tuple(histories))
    return (values if stepping else None), new, tuple(masters) if master else state.master, shared_old

def _chunk(groups: _groups.Groups, s: _GroupStream, start, length: int, carry) -> tuple:
    """One chunk `[start, start + length)` of group `s.g`; `carry`: its arrays so far, the results every device
    receives (None before the first chunk), and the shared entries' new values."""
    new_arrays, out, _ = carry
    old = [_offload.fetch(a, start, length) for a in s.arrays]
    hist, m_old = (old[:-1], old[-1]) if s.master else (old, None)
    g_c = lax.dynamic_slice_in_dim(s.grads, start, length)
    p_c = m_old if s.master else (None if s.params is None else lax.dynamic_slice_in_dim(s.params, start, length))
    ok = s.step.denom.ok
    u, shared, h = groups.run_view(s.step, s.g, g_c, p_c, hist, p_c is not None)
    mask = _groups.valid(s.step.layout, s.group, s.rank, start, length)
    results = [_reduce.skip_if_empty(ok, _groups.zero_padding(x, mask), y) for x, y in zip(h, hist)]
    if s.step.stepping:
        m_new, value = _groups.stepped(u, m_old, mask, ok, s.p_dtype)
        if s.master:
            results.append(m_new)
        if out is None:  # typed by the update below (varying where `value` is)
            out = jnp.zeros((s.group.size,), value.dtype)
        out = lax.dynamic_update_slice_in_dim(out, value, start, 0)
    new_arrays = [_offload.store(a, x, start) for a, x in zip(new_arrays, results)]
    return new_arrays, out, shared


def owned(owned: Any, step: _groups.Step, r: int, mine: list[int], g: dict[int, jax.Array], buffers
              ) -> tuple[dict, dict]:
    """Device `r`'s update with its buffers in host memory, bucket by bucket of its leaves: each bucket's
    entries come to the device, are updated and written back before the next is read. Returns the new
    buffers and the updates of `mine`."""
    layout = step.layout
    offsets = layout.state_packing.offsets[r]
    u_all: dict[int, jax.Array] = {}
    for bucket in _packed.stream_buckets(layout, r, mine, owned.cfg.bucket_bytes):
        entries = [j for j in layout.rank_entries(r) if layout.entries[j].leaf in bucket and
                   (step.stepping or layout.entries[j].role != MASTER)]  # a micro-step leaves the masters alone
        ranges = _packed.spans(offsets, {j: layout.entries[j].size for j in entries})
        pieces = [_offload.fetch(buffers[d], lo, hi - lo) for d, lo, hi in ranges]
        stored = _packed.read(pieces, ranges, offsets, {j: layout.entries[j].shape for j in entries})
        values, u = owned.view_update(step, r, bucket, {i: g[i] for i in bucket}, stored)
        values = _reduce.skip_if_empty(step.denom.ok, _packed.unstacked(values), stored)
        buffers = dict(buffers)
        for (d, lo, _), x in zip(ranges, _packed.write(values, ranges, offsets)):
            buffers[d] = _offload.store(buffers[d], x, lo)
        buffers = lax.optimization_barrier(buffers)  # the next bucket is read after this one is written
        u_all.update(_packed.unstacked(u))
    return buffers, u_all
