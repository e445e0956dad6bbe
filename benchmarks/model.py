"""GPT-shaped parameter pytrees and synthetic per-device gradients.

The benchmarks time only the optimizer step, so there is no forward pass: the "model" is just a
nested dict of arrays with the shapes of a small GPT (`gpt_params`, defined with the tests' other trees in
`tests/_models.py`, so the tests check the trees measured here), and gradients are random arrays of the same
shapes (one independent gradient per data-parallel device, stacked on a leading axis).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests._models import Params, gpt_params, tensor_parallel_specs

__all__ = ["gpt_params", "param_count", "per_device_grads", "tensor_parallel_specs", "tree_bytes"]


def param_count(tree: Any) -> int:
    """Total number of elements over all array leaves."""
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))


def tree_bytes(tree: Any) -> int:
    """Total bytes over all leaves of a pytree of arrays or ``ShapeDtypeStruct``s (full, unsharded)."""
    return int(
        sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))
    )


def per_device_grads(params: Params, mesh: Mesh, axis_name: str = "data", seed: int = 1, scale: float = 1e-2) -> Params:
    """Random gradients, one independent gradient per device along ``axis_name``.

    Every leaf gets shape ``(N, *leaf.shape)`` and sharding ``P(axis_name)``, so each device holds
    exactly its own full-size local gradient (what it would have after its backward pass, before
    any data-parallel reduction). Generated directly on the devices.
    """
    n = mesh.shape[axis_name]
    leaves, treedef = jax.tree_util.tree_flatten(params)
    sharding = NamedSharding(mesh, P(axis_name))

    def make(key: jax.Array) -> list[jax.Array]:
        ks = jax.random.split(key, len(leaves))
        return [
            (scale * jax.random.normal(k, (n, *x.shape), jnp.float32)).astype(x.dtype)
            for k, x in zip(ks, leaves)
        ]

    out = jax.jit(make, out_shardings=[sharding] * len(leaves))(jax.random.PRNGKey(seed))
    return jax.tree_util.tree_unflatten(treedef, out)
