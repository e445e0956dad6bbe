"""Bucketed collectives of sliced leaves: few collective ops per step, the same wire volume and the same result."""

import math

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h
from tests._models import bucket_tree
from zero_optax.core._hlo import WIRE_WEIGHTS, collective_ops
from zero_optax.transform._wire import DEFAULT_BUCKET_BYTES

N = 8


def _compiled_step(tx, params, grads, mesh):
    init, step = h.zero_fns(tx, mesh)
    state = init(params)
    compiled = step.lower(params, state, grads).compile()
    return compiled, state


def test_86_leaf_tree_needs_few_collectives_and_matches_the_per_leaf_step():
    mesh = h.mesh_of(N)
    tree = bucket_tree()
    params = jax.device_put(tree, NamedSharding(mesh, P()))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(tree))
    rng = np.random.default_rng(0)
    grads = jax.device_put(jax.tree.map(lambda x: rng.standard_normal((N, *x.shape)).astype(np.float32), tree),
                           NamedSharding(mesh, P("data")))
    results = {}
    for name, kwargs in (("default", {}), ("per_leaf", {"bucket_bytes": 0})):
        compiled, state = _compiled_step(zo.zero1(optax.adamw(1e-3), axis_name="data", **kwargs), params, grads, mesh)
        ops = collective_ops(compiled.as_text())
        wire = sum(WIRE_WEIGHTS[o["kind"]] * o["bytes"] * o["multiplier"] for o in ops) / nbytes
        results[name] = (sum(o["multiplier"] for o in ops), wire, compiled(params, state, grads))
    assert len(jax.tree.leaves(tree)) == 86
    assert results["default"][0] <= 2 * math.ceil(nbytes / DEFAULT_BUCKET_BYTES)
    assert results["per_leaf"][0] == 2 * 86
    assert results["default"][1] == results["per_leaf"][1] == 2.0
    for a, b in zip(jax.tree.leaves(results["default"][2]), jax.tree.leaves(results["per_leaf"][2])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_buckets_split_by_dtype_and_by_tensor_parallel_axes():
    """Leaves of other dtypes or other mesh axes never share a bucket; results stay exact."""
    n = 4
    params = {"a": np.ones((5, 3), np.float32), "b": np.ones(7, np.float16), "c": np.ones(9, np.float32)}
    grads = h.gradient_sequence(jax.tree.map(jax.numpy.asarray, params), n, steps=2)
    tx = zo.zero1(optax.adam(1e-2), axis_name="data", bucket_bytes=1 << 30)
    zp, zs, step = h.run_zero(tx, params, grads, n)
    rp, rs = h.run_oracle(optax.adam(1e-2), params, grads)
    h.assert_matches(zp, zs, rp, rs)
    mesh = h.mesh_of(n)
    compiled = step.lower(zp, zs, jax.device_put(grads[0], NamedSharding(mesh, P("data")))).compile()
    kinds = sorted(o["kind"] for o in collective_ops(compiled.as_text()))
    # One float32 bucket (a, c) and one float16 bucket (b), each reduce-scattered and all-gathered once.
    assert kinds == ["all-gather"] * 2 + ["reduce-scatter"] * 2
