"""GPT-shaped parameter pytrees and synthetic per-device gradients.

The benchmarks time only the optimizer step, so there is no forward pass: the "model" is just a
nested dict of arrays with the shapes of a small GPT, and gradients are random arrays of the same
shapes (one independent gradient per data-parallel device, stacked on a leading axis).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

Params = dict[str, Any]


def gpt_params(
    vocab: int,
    d_model: int,
    n_layers: int,
    mlp_ratio: int = 4,
    dtype: Any = jnp.float32,
    seed: int = 0,
) -> Params:
    """Build a GPT-shaped parameter pytree of nested dicts.

    Layout: ``embed`` (vocab, d); ``layers`` -> ``layer_{i}`` with ``ln1``/``ln2`` (scale, bias: (d,)),
    ``attn`` (``qkv`` (d, 3d) + ``qkv_bias`` (3d,), ``proj`` (d, d) + ``proj_bias`` (d,)) and ``mlp``
    (``mlp_in`` (d, r*d) + bias, ``mlp_out`` (r*d, d) + bias); ``ln_f`` (scale, bias).
    Matrices are N(0, 0.02^2), biases zero, layer-norm scales one.
    """
    d, h = d_model, mlp_ratio * d_model
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 1 + 4 * n_layers))

    def normal(shape: tuple[int, ...]) -> jax.Array:
        return (0.02 * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def ln() -> dict[str, jax.Array]:
        return {"scale": jnp.ones((d,), dtype), "bias": jnp.zeros((d,), dtype)}

    layers = {}
    for i in range(n_layers):
        layers[f"layer_{i}"] = {
            "ln1": ln(),
            "attn": {
                "qkv": normal((d, 3 * d)),
                "qkv_bias": jnp.zeros((3 * d,), dtype),
                "proj": normal((d, d)),
                "proj_bias": jnp.zeros((d,), dtype),
            },
            "ln2": ln(),
            "mlp": {
                "mlp_in": normal((d, h)),
                "mlp_in_bias": jnp.zeros((h,), dtype),
                "mlp_out": normal((h, d)),
                "mlp_out_bias": jnp.zeros((d,), dtype),
            },
        }
    return {"embed": normal((vocab, d)), "layers": layers, "ln_f": ln()}


def tensor_parallel_specs(params: Params, axis: str = "model") -> Any:
    """Megatron-style `PartitionSpec`s for a `gpt_params` tree: the embedding and the qkv / mlp_in projections
    column-parallel (with their biases), proj / mlp_out row-parallel, everything else replicated."""
    def spec(path: Any, x: Any) -> P:
        name = jax.tree_util.keystr(path)
        if x.ndim == 2 and any(k in name for k in ("qkv", "mlp_in", "embed")):
            return P(None, axis)
        if x.ndim == 2:
            return P(axis, None)
        if "qkv_bias" in name or "mlp_in_bias" in name:
            return P(axis)
        return P()
    return jax.tree_util.tree_map_with_path(spec, params)


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
