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
