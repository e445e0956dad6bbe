"""Bucketed collectives of sliced leaves: few collective ops per step, the same wire volume and the same result."""

import math
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h
from tests._models import bucket_tree
from benchmarks.hlo import WIRE_WEIGHTS, collective_ops
from zero_optax.step._wire import ALONE_BYTES, DEFAULT_BUCKET_BYTES, MAX_BUCKET_LEAVES, Wire

N = 8


def _compiled_step(tx, params, grads, mesh):
    init, step = h.zero_fns(tx, mesh)
    state = init(params)
    compiled = step.lower(params, state, grads).compile()
    return compiled, state


def _collectives_and_results(tree, mesh, **kwargs):
    params = jax.device_put(tree, NamedSharding(mesh, P()))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(tree))
    rng = np.random.default_rng(0)
    grads = jax.device_put(jax.tree.map(lambda x: rng.standard_normal((N, *x.shape)).astype(np.float32), tree),
                           NamedSharding(mesh, P("data")))
    compiled, state = _compiled_step(zo.zero1(optax.adamw(1e-3), axis_name="data", **kwargs), params, grads, mesh)
    ops = collective_ops(compiled.as_text())
    wire = sum(WIRE_WEIGHTS[o["kind"]] * o["bytes"] * o["multiplier"] for o in ops) / nbytes
    return sum(o["multiplier"] for o in ops), wire, compiled(params, state, grads)


def test_86_leaf_tree_needs_few_collectives_and_matches_the_per_leaf_step():
    """On XLA:CPU the 29 matrices (>= 64 KiB) travel alone, the 57 vectors (<= 4 KiB) in buckets of 32 leaves."""
    mesh = h.mesh_of(N)
    tree = bucket_tree()
    sizes = [x.nbytes for x in jax.tree.leaves(tree)]
    assert len(sizes) == 86 and ALONE_BYTES["cpu"] == 64 << 10
    alone = sum(s >= ALONE_BYTES["cpu"] for s in sizes)
    assert alone == 29 and max(s for s in sizes if s < ALONE_BYTES["cpu"]) <= 4096
    results = {name: _collectives_and_results(tree, mesh, **kwargs)
               for name, kwargs in (("default", {}), ("per_leaf", {"bucket_bytes": 0}))}
    assert results["default"][0] == 2 * (alone + math.ceil((86 - alone) / MAX_BUCKET_LEAVES)) == 62
    assert results["per_leaf"][0] == 2 * 86
    assert results["default"][1] == results["per_leaf"][1] == 2.0
    for a, b in zip(jax.tree.leaves(results["default"][2]), jax.tree.leaves(results["per_leaf"][2])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_accelerator_rule_puts_every_leaf_below_bucket_bytes_in_buckets(monkeypatch):
    """Where a launch costs more than a copy (GPUs, TPUs: no `ALONE_BYTES` entry), every leaf below
    `bucket_bytes` shares a bucket: the 86-leaf tree of 24.2 MB needs at most 2 x ceil(bytes / 4 MiB)
    collectives."""
    monkeypatch.delitem(ALONE_BYTES, "cpu")
    tree = bucket_tree()
    nbytes = sum(x.nbytes for x in jax.tree.leaves(tree))
    count, wire, _ = _collectives_and_results(tree, h.mesh_of(N))
    assert count <= 2 * math.ceil(nbytes / DEFAULT_BUCKET_BYTES) == 12
    assert wire == 2.0


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


def test_a_leaf_alone_beside_its_group_mates_matches_optax():
    """Leaves of 96 KiB hold 12 KiB per device at N = 8, so they share a group's buffer with the small leaves
    (`_plan.FUSE_BYTES`) while travelling alone on XLA:CPU (>= 64 KiB): one group, split across buckets. With
    uneven sizes (24,577 and 13 coordinates do not divide 8), both step forms equal plain optax."""
    params = {"big": jnp.linspace(-1.0, 1.0, 24_577, dtype=jnp.float32).reshape(1, -1),
              "big2": jnp.full((96, 256), 0.5, jnp.float32), "b": jnp.arange(13.0, dtype=jnp.float32),
              "s": jnp.float32(0.25)}
    assert params["big"].nbytes >= ALONE_BYTES["cpu"] and params["big"].nbytes // N <= 1 << 14
    grads = h.gradient_sequence(params, N, steps=3)
    rp, rs = h.run_oracle(optax.adamw(1e-2), params, grads)
    tx = zo.zero1(optax.adamw(1e-2), axis_name="data")
    for one_call in (False, True):
        zp, zs, _ = h.run_zero(tx, params, grads, N, one_call=one_call)
        h.assert_matches(zp, zs, rp, rs)
    paths = [leaf.path for leaf in zs.layout.leaves]
    fused = [{paths[i] for i in g.leaves} for g in zs.layout.groups]
    assert any({"['big']", "['b']"} <= f for f in fused), fused  # a big leaf shares a group with a small one


def test_the_bucket_plan_is_computed_once_per_tree_not_per_trace():
    """A second trace of the same step (a new `jax.jit`) asks the wire for its plan again and gets the stored one."""
    params = h.small_params()
    grads = h.gradient_sequence(params, N, steps=2)
    tx = zo.zero1(optax.adamw(1e-2), axis_name="data")
    with mock.patch.object(Wire, "plan", autospec=True, side_effect=Wire.plan) as asked, \
            mock.patch.object(Wire, "_plan", autospec=True, side_effect=Wire._plan) as planned:
        h.run_zero(tx, params, grads, N)
        first = (asked.call_count, planned.call_count)
        zp, zs, _ = h.run_zero(tx, params, grads, N)
    assert first[0] >= 1 and first[1] >= 1
    assert asked.call_count == 2 * first[0] and planned.call_count == first[1]
    rp, rs = h.run_oracle(optax.adamw(1e-2), params, grads)
    h.assert_matches(zp, zs, rp, rs)
