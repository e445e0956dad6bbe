"""Offload's streamed updates: the stored arrays stay in host memory and pass through the device a chunk (sliced
groups) or a bucket (an owner's leaves) at a time, so the device never holds the whole shard."""

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


def groups(groups: _groups.Groups, step: _groups.Step, grads: list[jax.Array], params: list[jax.Array] | None, state,
           p_dtypes: list) -> tuple:
    """The group views' update, `bucket_bytes` of a group's host arrays at a time: what every device receives (None
    for a micro-step), the new stored state, master copies and old shared values."""
    layout, stepping, ok, chunk_bytes = step.layout, step.stepping, step.denom.ok, groups.cfg.bucket_bytes
    shared_old = groups.shared_values(layout, state.inner_state)
    step = dataclasses.replace(step, shared_old=shared_old)
    master = state.master is not None and stepping

    def one(g: int, group: Group) -> tuple:
        """Group `g`'s new arrays, what every device receives and the new shared values."""
        arrays = list(state.inner_state.histories[g]) + ([state.master[g]] if master else [])
        rank = step.ranks[layout.zero_axes(layout.leaves[group.first])]

        def chunk(start, length, carry):
            new_arrays, out, _ = carry
            old = [_offload.fetch(a, start, length) for a in arrays]
            hist, m_old = (old[:-1], old[-1]) if master else (old, None)
            g_c = lax.dynamic_slice_in_dim(grads[g], start, length)
            p_c = m_old if master else (None if params is None else lax.dynamic_slice_in_dim(params[g], start, length))
            u, shared, h = groups.run_view(step, g, g_c, p_c, hist, p_c is not None)
            mask = _groups.valid(layout, group, rank, start, length)
            results = [_reduce.skip_if_empty(ok, _groups.zero_padding(x, mask), y) for x, y in zip(h, hist)]
            if stepping:
                m_new, value = _groups.stepped(u, m_old, mask, ok, p_dtypes[g])
                if master:
                    results.append(m_new)
                if out is None:  # typed by the update below (varying where `value` is)
                    out = jnp.zeros((group.size,), value.dtype)
                out = lax.dynamic_update_slice_in_dim(out, value, start, 0)
            return [_offload.store(a, x, start) for a, x in zip(new_arrays, results)], out, shared
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
    new = SlicedState(_inner_state.tree(layout, [shared_new[j][None] for j in layout.shared_entries]),
                      tuple(tuple(a[:len(a) - master]) for a, _, _ in done))
    masters = tuple(a[-1] for a, _, _ in done) if master else state.master
    return ([out for _, out, _ in done] if stepping else None), new, masters, shared_old


def owned(owned: Any, step: _groups.Step, r: int, mine: list[int], g: dict[int, jax.Array], buffers
              ) -> tuple[dict, dict]:
    """Device `r`'s update of `mine`, a bucket of its host buffers at a time: the new buffers and the updates."""
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
