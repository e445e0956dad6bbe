"""The parameter trees and inner transformations the tests share with `benchmarks/`, defined once here.

* `gpt_params`: a GPT-shaped pytree of nested dicts (no forward pass: the arrays have a small GPT's shapes);
  `tensor_parallel_specs`: Megatron-style `PartitionSpec`s for it.
* `bucket_tree`: the 86-leaf, single-dtype tree of the bucket measurements.
* `muon_recipe`: the usual Muon recipe (Muon for hidden matrices, AdamW for the embedding and the vectors).

`benchmarks/` imports these; the tests import nothing from `benchmarks/`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
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


def bucket_tree() -> dict:
    """86 float32 leaves: a 7-layer GPT without the final layer-norm bias."""
    params = gpt_params(2048, 256, 7)
    del params["ln_f"]["bias"]
    return params


def muon_recipe() -> optax.GradientTransformation:
    """The usual Muon recipe: Muon for the hidden matrices, AdamW for the embedding and every vector."""
    def labels(params: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda path, x: "muon" if x.ndim == 2 and "embed" not in jax.tree_util.keystr(path) else "adamw", params)

    return optax.partition({"muon": optax.contrib.muon(2e-2), "adamw": optax.adamw(3e-4, weight_decay=0.1)}, labels)
