"""Offload: every array a zero1 state stores lives in each device's `pinned_host` memory between steps.

With `zero1(..., offload=True)` a step streams the state through the device (`jax.device_put` between memory spaces
inside `shard_map`) in buckets of about `bucket_bytes`, so the device never holds it whole. XLA:CPU lowers such
moves to nothing (one RAM): there only the entry parameters and results are marked host.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from zero_optax.core._errors import ZeroError

HOST = "pinned_host"
DEVICE = "device"


def check_devices(devices: Sequence[Any]) -> None:
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


def buckets(arrays: Sequence[Any], bucket_bytes: int) -> list[list[int]]:
    """Indices of `arrays` in order, in buckets closed once they hold `bucket_bytes` (`<= 0`: one array each).

    Examples:
      >>> import numpy as np
      >>> buckets([np.zeros(4, np.float32), np.zeros(4, np.float32), np.zeros(1, np.float32)], 32)
      [[0, 1], [2]]
    """
    out: list[list[int]] = [[]]
    nbytes = 0
    for i, x in enumerate(arrays):
        if nbytes >= bucket_bytes:
            out.append([])
            nbytes = 0
        out[-1].append(i)
        nbytes += math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
    return [b for b in out if b]


def move(tree: Any, space: jax.memory.Space, bucket_bytes: int) -> Any:
    """Inside `shard_map`: every array of `tree` moved to memory `space`, one `device_put` a bucket."""
    leaves, treedef = jax.tree.flatten(tree)
    moved = [x for group in buckets(leaves, bucket_bytes) for x in jax.device_put([leaves[i] for i in group], space)]
    return jax.tree.unflatten(treedef, moved)


def fetch(x: jax.Array, start: Any, length: int) -> jax.Array:
    """`[start, start + length)` of the host-memory 1-D `x` on the device (XLA copies the piece alone)."""
    return jax.device_put(lax.dynamic_slice_in_dim(x, start, length), jax.memory.Space.Device)


def store(x: jax.Array, value: jax.Array, start: Any) -> jax.Array:
    """The host-memory 1-D `x` with the device array `value` written at `start` (the inverse of `fetch`)."""
    return lax.dynamic_update_slice_in_dim(x, jax.device_put(value, jax.memory.Space.Host), start, 0)


def move_small(state: Any, space: jax.memory.Space, bucket_bytes: int) -> Any:
    """`state` with its shared entries and local accumulators moved to `space` (the step streams the rest)."""
    inner = state.inner_state._replace(shared=move(state.inner_state.shared, space, bucket_bytes))
    return dataclasses.replace(state, inner_state=inner, local=move(state.local, space, bucket_bytes))


def with_memory_kind(sharding: jax.sharding.Sharding, kind: str | None) -> jax.sharding.Sharding:
    """`sharding` placed in memory `kind` (None keeps it)."""
    if kind is None or getattr(sharding, "memory_kind", None) == kind:
        return sharding
    return sharding.with_memory_kind(kind)


def placed(x: Any, kind: str | None) -> Any:
    """A concrete array `x` in memory `kind`, its sharding otherwise kept (None, or a traced `x`, keeps it)."""
    if kind is None or not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or \
            x.sharding.memory_kind == kind:
        return x
    return jax.device_put(x, x.sharding.with_memory_kind(kind))


def fetched(state: Any) -> Any:
    """`state` with every array (concrete or traced) in host memory brought to device memory, outside the step."""
    def one(x):
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            return x if x.sharding.memory_kind is None else placed(x, DEVICE)
        host = getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host  # older JAX types none
        return jax.device_put(x, jax.memory.Space.Device) if host else x
    return jax.tree.map(one, state)
