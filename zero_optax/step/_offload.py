"""Offload: the arrays a zero1 state stores live in each device's `pinned_host` memory between steps.

With `zero1(..., offload=True)` every array of the `ZeroState` (sliced histories, owned buffers, master copies,
accumulators, step counts) is placed in host memory by `init`, and stays there. The rule is about *where* arrays
live, not about what they are, so anything a `ZeroState` holds follows it. A step streams the stored state through
the device (`jax.device_put(x, jax.memory.Space.Device)` inside `shard_map`, and back with `Space.Host`), so the
device never holds it whole:

* the groups' arrays (the sliced leaves' histories, sharded accumulators and master copies) chunk by chunk of at
  most `bucket_bytes` of all of a group's arrays together (`zero_optax.step._groups.Groups.update_streamed`);
* the owned buffers (`partition="leaf"`, `"auto"`) bucket by bucket of the leaves a device owns: at most
  `bucket_bytes` of their state, or one leaf's if it has more, since a matrix optimizer updates a whole tensor
  (`zero_optax.step._engine.Engine._owned_streamed`);
* the small arrays (step counts and other shared entries) and `accumulate="local"`'s local sums, which are
  gradient-sized, come to the device for the step and go back (`small_to_device`, `small_to_host`: the first
  and last stages of `zero_optax.step._engine.Engine.update`).

The small arrays move in buckets of at least `bucket_bytes` (the notion the collectives use): one `device_put` of
several arrays per bucket. On GPU and TPU each moved array lowers to one `annotate_device_placement` custom call, which
XLA's host-offload passes turn into a copy; XLA:CPU lowers `device_put` between memory kinds to nothing (host and
device memory are the same RAM), so there only the entry parameters and results are marked host (`S(5)`):
`zero_optax/core/_hlo.py` counts both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from zero_optax.core._errors import ZeroError

HOST = "pinned_host"
DEVICE = "device"


def memory_kinds(device: Any) -> set[str]:
    """The memory kinds `device` exposes (`device`, `pinned_host`, `unpinned_host` on CPU, GPU and TPU)."""
    memories = getattr(device, "addressable_memories", None)
    if memories is None:
        return set()
    try:
        return {m.kind for m in memories()}
    except jax.errors.JaxRuntimeError:  # (a backend without memory spaces: UNIMPLEMENTED)
        return set()


def check_devices(devices: Sequence[Any]) -> None:
    """Refuses `offload=True` on devices that have no `pinned_host` memory.

    Examples:
      >>> import jax
      >>> check_devices(jax.devices())
    """
    for d in devices:
        kinds = memory_kinds(d)
        if HOST not in kinds:
            raise ZeroError(
                f"zero1(offload=True) keeps the optimizer state in each device's `{HOST}` memory, but device "
                f"{d} ({getattr(d, 'platform', '?')}) exposes the memory kinds {sorted(kinds) or 'none'}. Use "
                f"offload=False on this backend, or a JAX release and backend whose devices have `{HOST}` "
                "memory (CPU, GPU and TPU do).")


def buckets(arrays: Sequence[Any], bucket_bytes: int) -> list[list[int]]:
    """Indices of `arrays` in order, grouped into buckets closed once they hold at least `bucket_bytes`.

    `bucket_bytes <= 0` gives one bucket per array.

    Examples:
      >>> import numpy as np
      >>> buckets([np.zeros(4, np.float32), np.zeros(4, np.float32), np.zeros(1, np.float32)], 32)
      [[0, 1], [2]]
    """
    out: list[list[int]] = []
    current: list[int] = []
    nbytes = 0
    for i, x in enumerate(arrays):
        current.append(i)
        nbytes += int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
        if nbytes >= bucket_bytes:
            out.append(current)
            current, nbytes = [], 0
    if current:
        out.append(current)
    return out


def _move(tree: Any, space, bucket_bytes: int) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    moved = list(leaves)
    for group in buckets(leaves, bucket_bytes):
        for i, x in zip(group, jax.device_put([leaves[i] for i in group], space)):
            moved[i] = x
    return jax.tree.unflatten(treedef, moved)


def to_host(state: Any, bucket_bytes: int) -> Any:
    """Inside `shard_map`: every array of `state` moved to `pinned_host` memory, in buckets."""
    return _move(state, jax.memory.Space.Host, bucket_bytes)


def to_device(state: Any, bucket_bytes: int) -> Any:
    """Inside `shard_map`: every array of `state` moved to device memory, in buckets."""
    return _move(state, jax.memory.Space.Device, bucket_bytes)


def fetch(x: jax.Array, start: Any, length: int) -> jax.Array:
    """Inside `shard_map`: `[start, start + length)` of the host-memory 1-D array `x`, on the device. A dynamic
    slice of host memory, then a move: the pattern XLA's host offloader turns into a copy of the piece alone."""
    return jax.device_put(lax.dynamic_slice_in_dim(x, start, length), jax.memory.Space.Device)


def store(x: jax.Array, value: jax.Array, start: Any) -> jax.Array:
    """Inside `shard_map`: the host-memory 1-D array `x` with the device array `value` moved to host memory and
    written at `start` (the inverse of `fetch`)."""
    return lax.dynamic_update_slice_in_dim(x, jax.device_put(value, jax.memory.Space.Host), start, 0)


def _small(state: Any, to, bucket_bytes: int) -> Any:
    inner = state.inner_state._replace(shared=to(state.inner_state.shared, bucket_bytes))
    return dataclasses.replace(state, inner_state=inner, local=to(state.local, bucket_bytes))


def small_to_device(state: Any, bucket_bytes: int) -> Any:
    """The first stage of an offloaded step: the state's small arrays (shared entries such as step counts, and
    local accumulators, which are gradient-sized) brought to the device. The stored histories, owned buffers and
    master copies stay in host memory: the step streams them through the device itself (`_groups.Groups.
    update_streamed`, `_engine.Engine._owned_streamed`)."""
    return _small(state, to_device, bucket_bytes)


def small_to_host(state: Any, bucket_bytes: int) -> Any:
    """The last stage of an offloaded step: the new state's small arrays returned to host memory."""
    return _small(state, to_host, bucket_bytes)


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
    """`state` with every array in host memory brought to device memory, for code that reads it outside the
    step (`gather_state`): concrete arrays keep their sharding in `device` memory, traced ones (under `jax.jit`)
    are moved with `jax.memory.Space.Device`."""
    def one(x):
        sharding = getattr(x, "sharding", None)
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            if getattr(sharding, "memory_kind", DEVICE) not in (None, DEVICE):
                return jax.device_put(x, sharding.with_memory_kind(DEVICE))
            return x
        host = getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host  # (older releases type none)
        return jax.device_put(x, jax.memory.Space.Device) if host else x
    return jax.tree.map(one, state)
