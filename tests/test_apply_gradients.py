"""`zo.apply_gradients`: one call that returns the new parameters (the devices all-gather those, not the updates),
against plain optax on one device fed the globally reduced gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h
from tests import test_mesh2d as m2
from benchmarks.hlo import entry_traffic

N = 3
INNER = {"flat": lambda: optax.adamw(1e-2, weight_decay=0.1), "leaf": lambda: optax.contrib.muon(1e-2),
         "auto": lambda: optax.contrib.muon(1e-2)}


def run_in_shard_map(tx, params, grads_seq, n=N, weights_seq=None):
    """`zo.apply_gradients` inside `shard_map` on per-device gradients (and weights)."""
    params, state, _ = h.run_zero(tx, params, grads_seq, n, weights_seq, one_call=True)
    return params, state


@pytest.mark.parametrize("partition", ["flat", "leaf", "auto"])
def test_matches_optax_in_every_partition_with_weights_and_a_skipped_step(partition):
    params = h.small_params()
    grads = h.gradient_sequence(params, N, steps=4)
    weights = [[3.0, 1.0, 2.0], [0.0, 0.0, 0.0], [1.0, 0.0, 5.0], [2.0, 2.0, 1.0]]  # step 2 has no samples
    tx = zo.zero1(INNER[partition](), axis_name="data", partition=partition)
    zp, zs = run_in_shard_map(tx, params, grads, weights_seq=weights)
    rp, rs = h.run_oracle(INNER[partition](), params, grads, weights_seq=weights)
    h.assert_matches(zp, zs, rp, rs)


@pytest.mark.parametrize("partition,bucket_bytes", [("flat", 0), ("flat", 1 << 22), ("auto", 1 << 22)])
def test_mesh_bound_under_jit(partition, bucket_bytes):
    n = 8
    mesh = h.mesh_of(n)
    params = h.small_params()
    grads = h.gradient_sequence(params, n, steps=3)
    tx = zo.zero1(INNER[partition](), axis_name="data", mesh=mesh, partition=partition, bucket_bytes=bucket_bytes)
    p = jax.device_put(jax.tree.map(np.asarray, params), NamedSharding(mesh, P()))  # donated: not `params`
    state = tx.init(p)
    step = jax.jit(lambda p, s, g: zo.apply_gradients(tx, g, s, p), donate_argnums=(0, 1))
    for g in grads:
        p, state = step(p, state, jax.tree.map(lambda x: x.mean(0), g))
    rp, rs = h.run_oracle(INNER[partition](), params, grads)
    h.assert_matches(p, state, rp, rs)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(p))


@pytest.mark.parametrize("partition", ["flat", "leaf", "auto"])
def test_bf16_parameters_land_on_the_rounded_master_copy(partition):
    """Owned leaves too: their owners send the new master values rounded, which are the new parameters."""
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), h.small_params())
    params32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)  # the master copies start from these
    grads = [jax.tree.map(lambda g: g.astype(jnp.bfloat16), g) for g in h.gradient_sequence(params, N, steps=3)]
    tx = zo.zero1(INNER[partition](), axis_name="data", master_dtype=jnp.float32, partition=partition)
    zp, zs = run_in_shard_map(tx, params, grads)
    ref, ref_state = params32, INNER[partition]().init(params32)
    for g in grads:
        mean = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64).mean(0), jnp.float32), g)
        u, ref_state = INNER[partition]().update(mean, ref_state, ref)
        ref = optax.apply_updates(ref, u)
    for p, r in zip(jax.tree.leaves(zp), jax.tree.leaves(ref)):
        assert p.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(p, np.float32), np.asarray(r.astype(jnp.bfloat16), np.float32),
                                   rtol=1e-2, atol=1e-2)
    for m, r in zip(jax.tree.leaves(zo.master_params(zs)), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(m), np.asarray(r), rtol=1e-4, atol=1e-5)
    for p, m in zip(jax.tree.leaves(zp), jax.tree.leaves(zo.master_params(zs))):  # exactly the rounded master
        np.testing.assert_array_equal(np.asarray(p).view(np.uint16), np.asarray(m.astype(jnp.bfloat16)).view(np.uint16))


def test_accumulation_chains_and_plain_optax_apply_their_updates():
    params = h.small_params()
    grads = h.gradient_sequence(params, N, steps=4)
    tx = zo.zero1(INNER["flat"](), axis_name="data", accumulate_steps=2)
    zp, zs = run_in_shard_map(tx, params, grads)
    ref = optax.MultiSteps(INNER["flat"](), every_k_schedule=2)
    rp, rs = h.run_oracle(ref, params, grads)
    for a, b in zip(jax.tree.leaves((zp, zo.gather_state(zs).inner)), jax.tree.leaves((rp, rs.inner_opt_state))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)

    chain = optax.chain(zo.reduce_gradients("data"), optax.clip_by_global_norm(0.5),
                        zo.zero1(INNER["flat"](), axis_name="data", reduce=False))
    zp, _ = run_in_shard_map(chain, params, grads)
    rp, _ = h.run_oracle(optax.chain(optax.clip_by_global_norm(0.5), INNER["flat"]()), params, grads)
    for a, b in zip(jax.tree.leaves(zp), jax.tree.leaves(rp)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)

    plain = optax.sgd(0.1)
    g = jax.tree.map(lambda x: x[0], grads[0])
    new, _ = zo.apply_gradients(plain, g, plain.init(params), params)
    for a, p, d in zip(jax.tree.leaves(new), jax.tree.leaves(params), jax.tree.leaves(g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(p - 0.1 * d), rtol=1e-6, atol=1e-7)


def test_refuses_a_call_without_parameters():
    tx = zo.zero1(optax.sgd(0.1), axis_name="data", mesh=h.mesh_of(1))
    params = {"w": jnp.ones(3)}
    with pytest.raises(zo.ZeroError, match="needs the parameters"):
        zo.apply_gradients(tx, params, tx.init(params), None)


def test_gathering_new_parameters_per_leaf_writes_what_gspmd_writes():
    """With one all-gather per leaf the gathered new parameters are the step's output: the compiled step writes
    about one parameter's bytes less per device than `update` + `optax.apply_updates`, whose add is a full pass."""
    n = 8
    mesh = h.mesh_of(n)
    params = {"a": jnp.ones((64, 48)), "b": jnp.ones((48, 64)), "c": jnp.ones((128,))}  # sizes divide 8
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    tx = zo.zero1(optax.adamw(1e-2), axis_name="data", mesh=mesh, bucket_bytes=0)
    p = jax.device_put(params, NamedSharding(mesh, P()))
    state = tx.init(p)

    def update_then_apply(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    written = {}
    for name, fn in (("update", update_then_apply), ("apply", lambda p, s, g: zo.apply_gradients(tx, g, s, p))):
        traffic = entry_traffic(jax.jit(fn, donate_argnums=(0, 1)).lower(p, state, p).compile().as_text())
        written[name] = sum(k["written"] for k in traffic.values())
    assert written["update"] - written["apply"] >= 0.8 * nbytes, (written, nbytes)


def test_tensor_parallel_parameters_keep_their_sharding():
    """Mesh-bound on a 4 x 2 (data, model) mesh with tensor-parallel matrices: each block's new parameters are
    gathered over the data axis only, and the result is plain optax's on the global parameters."""
    mesh, zero_axes = m2.make_mesh("4x2")
    tx = zo.zero1(optax.adamw(1e-2, weight_decay=0.1), axis_name=zero_axes, mesh=mesh)
    params = {k: jax.device_put(v, NamedSharding(mesh, m2.TP_SPECS[k])) for k, v in m2.params_np().items()}
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: zo.apply_gradients(tx, g, s, p))
    for t in range(m2.STEPS):
        g = {k: jax.device_put(v.mean(0), NamedSharding(mesh, m2.TP_SPECS[k])) for k, v in m2.grads_np(t, 4).items()}
        params, state = step(params, state, g)
    ref, _ = m2.oracle(optax.adamw(1e-2, weight_decay=0.1), m2.STEPS, 4)
    m2.assert_params(params, ref)
    assert all(x.sharding.is_equivalent_to(NamedSharding(mesh, m2.TP_SPECS[k]), x.ndim) for k, x in params.items())
