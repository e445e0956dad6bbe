"""Per-device optimizer-state memory, measured from the live arrays' shards."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import jax
import numpy as np


def state_bytes_per_device(state: Any) -> dict[Any, int]:
    """Bytes each device actually holds for ``state``: ``shard.data.nbytes`` over the
    ``addressable_shards`` of every ``jax.Array`` leaf (a replicated leaf counts on every device)."""
    out: dict[Any, int] = defaultdict(int)
    for leaf in jax.tree_util.tree_leaves(state):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            out[shard.device] += int(shard.data.nbytes)
    return dict(out)


def max_state_bytes(state: Any) -> int:
    """The largest per-device footprint of ``state`` (the one that decides whether it fits)."""
    per = state_bytes_per_device(state)
    return max(per.values()) if per else 0


def abstract_bytes(tree: Any) -> int:
    """Full (unsharded) bytes of a pytree of arrays or ``ShapeDtypeStruct``s."""
    return int(
        sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))
    )


def replicated_state_bytes(tx: Any, params: Any) -> int:
    """Bytes of the plain (unsharded) optax state ``tx.init(params)``, via ``jax.eval_shape``."""
    return abstract_bytes(jax.eval_shape(tx.init, params))


def ideal_state_bytes(tx: Any, params: Any, n: int) -> float:
    """The perfect-sharding target: replicated state bytes / N."""
    return replicated_state_bytes(tx, params) / n


def largest_leaf_state_bytes(tx: Any, params: Any) -> int:
    """State bytes attributable to the single most expensive parameter leaf.

    For each leaf ``x``: ``bytes(tx.init({"x": x})) - bytes(tx.init({}))`` (the difference removes
    per-transform constants such as step counters). A partitioner that places whole leaves on
    devices cannot do better than ``max(ideal, this)`` on its busiest device.
    """
    base = abstract_bytes(jax.eval_shape(tx.init, {}))
    best = 0
    for leaf in jax.tree_util.tree_leaves(params):
        sds = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
        best = max(best, abstract_bytes(jax.eval_shape(tx.init, {"x": sds})) - base)
    return best


def partition_bound_bytes(layout: Any) -> float:
    """The per-device state bound of a zero1 layout: sliced state / N + max(owned state / N, largest owned leaf).

    Sliced leaves split their state evenly; owned leaves keep theirs whole on one device, so the busiest device
    holds at least the largest owned leaf's state and at least the average owned share. Shared entries (step
    counts) are one copy per device. For `partition="leaf"` this is `max(ideal, largest leaf)`.
    """
    n = layout.world_size
    sliced = owned = shared = 0.0
    per_leaf: dict[int, int] = defaultdict(int)
    for e in layout.entries:
        if e.leaf is None:
            shared += e.nbytes
            continue
        leaf = layout.leaves[e.leaf]
        full = (leaf.size if leaf.sliced else e.size) * np.dtype(e.dtype).itemsize
        if leaf.sliced:
            sliced += full
        else:
            owned += full
            per_leaf[e.leaf] += full
    return shared + sliced / n + max(owned / n, max(per_leaf.values(), default=0))
