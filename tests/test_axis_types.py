"""The mesh-bound zero1 on meshes of every axis type (`Auto`, `Explicit`, and `Explicit` data with `Auto` model),
1-D and 2-D, for every partition: the same training code runs with plain optax and with zero1 on the same mesh,
and both match single-device optax fed the global mean gradient."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo

A, E = AxisType.Auto, AxisType.Explicit
MESHES = {  # name: (shape, axis names, axis types)
    "1d-auto": ((4,), ("data",), (A,)),
    "1d-explicit": ((4,), ("data",), (E,)),
    "2d-auto": ((4, 2), ("data", "model"), (A, A)),
    "2d-explicit": ((4, 2), ("data", "model"), (E, E)),
    "2d-mixed": ((4, 2), ("data", "model"), (E, A)),
}
INNER = {
    "flat": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "leaf": lambda: optax.contrib.muon(1e-2, adam_learning_rate=1e-2),
    "auto": lambda: optax.contrib.muon(1e-2, adam_learning_rate=1e-2),
}
VOCAB, CLASSES, BATCH, STEPS = 11, 6, 8, 3


def make_mesh(name: str) -> jax.sharding.Mesh:
    shape, names, types = MESHES[name]
    return jax.make_mesh(shape, names, axis_types=types, devices=jax.devices()[:math.prod(shape)])


def initial_params() -> dict:
    # (11, 5) and (5, 6): neither divides the data axis; `w` splits over "model" into (5, 3) blocks.
    rng = np.random.default_rng(0)
    return {"embed": rng.standard_normal((VOCAB, 5)).astype(np.float32) * 0.5,
            "w": rng.standard_normal((5, CLASSES)).astype(np.float32) * 0.5,
            "b": np.zeros(CLASSES, np.float32), "s": np.float32(1.5)}


def batch(t: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(10 + t)
    return rng.integers(0, VOCAB, (BATCH, 3)).astype(np.int32), rng.integers(0, CLASSES, (BATCH, 3)).astype(np.int32)


def loss_fn(p, ids, labels, *, gathers: bool):
    """A token classifier. Written for `Auto` data axes it gathers (embedding lookup, integer-label cross-entropy),
    as most model code does; for `Explicit` data axes it uses one-hot products, whose gradients shard with the batch
    (an `Explicit` mesh refuses the gather's scatter gradient without an `out_sharding`)."""
    if gathers:
        x = p["embed"][ids]
        logits = jnp.tanh(x @ p["w"] + p["b"]) * p["s"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    x = jax.nn.one_hot(ids, VOCAB) @ p["embed"]
    logits = jnp.tanh(x @ p["w"] + p["b"]) * p["s"]
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, CLASSES)).mean()


def param_specs(mesh: jax.sharding.Mesh, partition: str) -> dict:
    # Muon orthogonalises whole matrices: tensor-parallel blocks only where the partition slices elementwise.
    tensor_parallel = "model" in mesh.axis_names and partition == "flat"
    return {"embed": P(), "w": P(None, "model") if tensor_parallel else P(), "b": P(), "s": P()}


def train(tx, mesh, specs, gathers):
    """The same training code for every optimizer: `jax.grad` of the global loss under `jax.jit`."""
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in initial_params().items()}
    on_data = NamedSharding(mesh, P("data"))

    @jax.jit
    def step(p, s, ids, labels):
        g = jax.grad(loss_fn)(p, ids, labels, gathers=gathers)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    state = tx.init(params)
    for t in range(STEPS):
        ids, labels = (jax.device_put(x, on_data) for x in batch(t))
        params, state = step(params, state, ids, labels)
    return params, state


def oracle(inner, gathers):
    """Plain optax on one device, fed the global mean gradient."""
    params = jax.tree.map(jnp.asarray, initial_params())
    state = inner.init(params)
    grad = jax.jit(jax.grad(lambda p, i, l: loss_fn(p, i, l, gathers=gathers)))
    for t in range(STEPS):
        u, state = inner.update(grad(params, *batch(t)), state, params)
        params = optax.apply_updates(params, u)
    return params


@pytest.mark.parametrize("partition", sorted(INNER))
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_mesh_bound_on_every_axis_type(mesh_name, partition):
    mesh = make_mesh(mesh_name)
    gathers = mesh.axis_types[0] == A
    specs = param_specs(mesh, partition)
    tx = zo.zero1(INNER[partition](), axis_name="data", mesh=mesh, partition=partition)
    params, state = train(tx, mesh, specs, gathers)
    plain, _ = train(INNER[partition](), mesh, specs, gathers)
    ref = oracle(INNER[partition](), gathers)
    for k in ref:
        np.testing.assert_allclose(np.asarray(params[k]), np.asarray(ref[k]), rtol=5e-5, atol=5e-6, err_msg=k)
        np.testing.assert_allclose(np.asarray(plain[k]), np.asarray(ref[k]), rtol=5e-5, atol=5e-6, err_msg=k)
        # Parameters keep their shardings through the update.
        assert params[k].sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), params[k].ndim), k
    # The state is sharded over "data" (and over "model" where the parameter is): 1/N of each leaf per device.
    blocks = mesh.shape.get("model", 1) if specs["w"] != P() else 1
    layout = zo.describe(state)
    assert layout.world_size == 4
    for leaf in jax.tree.leaves(state):
        assert max(s.data.size for s in leaf.addressable_shards) * 4 <= leaf.size * blocks
