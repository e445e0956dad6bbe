"""Mixed precision (sharded master copies) and moving state in and out of zero1, against plain optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h
from tests._models import gpt_params

STEPS = 50
INNER = {"flat": lambda: optax.adamw(3e-3, weight_decay=0.1), "leaf": lambda: optax.contrib.muon(1e-2)}


def bf16_grads(params, n: int, steps: int):
    """Per-device bf16 gradients, `[n, *shape]` per leaf."""
    return [jax.tree.map(lambda g: g.astype(jnp.bfloat16), g) for g in h.gradient_sequence(params, n, steps)]


def reference(inner, params32, grads_seq):
    """float32 single-device optax fed the same bf16 gradients, reduced (mean over devices) in float32."""
    state = inner.init(params32)
    update = jax.jit(inner.update)
    for g in grads_seq:
        mean = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64).mean(0), jnp.float32), g)
        u, state = update(mean, state, params32)
        params32 = optax.apply_updates(params32, u)
    return params32, state


def run_master(tx, init_params, params_bf16, grads_seq, n: int):
    mesh = h.mesh_of(n)
    init, step = h.zero_fns(tx, mesh)
    state = init(jax.device_put(init_params, NamedSharding(mesh, P())))
    params = jax.device_put(params_bf16, NamedSharding(mesh, P()))
    shard = NamedSharding(mesh, P("data"))
    for g in grads_seq:
        params, state = step(params, state, jax.device_put(g, shard))
    return params, state


@pytest.mark.parametrize("partition", ["flat", "leaf"])
@pytest.mark.parametrize("init_dtype", [jnp.float32, jnp.bfloat16])
def test_master_copy_matches_float32_optax_and_params_are_its_rounding(partition, init_dtype):
    n = 8
    params32 = h.small_params()
    params_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params32)
    # The master copy starts from exactly what init receives.
    start = jax.tree.map(lambda x: x.astype(init_dtype), params32)
    grads = bf16_grads(params32, n, STEPS)
    tx = zo.zero1(INNER[partition](), axis_name="data", partition=partition, master_dtype=jnp.float32)
    params, state = run_master(tx, start, params_bf16, grads, n)
    ref_params, ref_state = reference(INNER[partition](), jax.tree.map(lambda x: x.astype(jnp.float32), start), grads)

    master = zo.master_params(state)
    for p, m, r in zip(jax.tree.leaves(params), jax.tree.leaves(master), jax.tree.leaves(ref_params)):
        assert p.dtype == jnp.bfloat16 and m.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(m), np.asarray(r), rtol=1e-4, atol=1e-5)
        # apply_updates moved the bf16 parameters exactly onto the master copy rounded to bf16 ...
        np.testing.assert_array_equal(np.asarray(p).view(np.uint16), np.asarray(m.astype(jnp.bfloat16)).view(np.uint16))
        # ... which is the float32 reference rounded to bf16: rounding never accumulated.
        np.testing.assert_array_equal(np.asarray(p).view(np.uint16), np.asarray(r.astype(jnp.bfloat16)).view(np.uint16))
    got = zo.gather_state(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref_state)):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("partition", ["flat", "leaf"])
def test_describe_reports_master_bytes(partition):
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), h.small_params())
    tx = zo.zero1(optax.adam(1e-2), axis_name="data", partition=partition, master_dtype=jnp.float32)
    state = jax.eval_shape(jax.shard_map(tx.init, mesh=h.mesh_of(3), in_specs=P(), out_specs=P("data")), params)
    layout = zo.describe(state)
    sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(params)]
    assert layout.master_dtype == "float32"
    if partition == "leaf":  # each master copy once, on its owner
        assert sum(layout.master_bytes_per_device) == 4 * sum(sizes)
    else:  # every device a float32 slice of every leaf
        assert layout.master_bytes_per_device == (4 * sum(-(-s // 3) for s in sizes),) * 3
    assert "master bytes per device" in layout.summary()


def test_flat_master_state_bytes_are_12_bytes_per_parameter_over_n():
    """AdamW with float32 master copies of bf16 parameters: state + master <= 1.01 x 12 B x params / N + counts."""
    n = 8
    params = gpt_params(512, 64, 2, dtype=jnp.bfloat16)
    tx = zo.zero1(optax.adamw(1e-3), axis_name="data", master_dtype=jnp.float32)
    mesh = h.mesh_of(n)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))(
        jax.device_put(params, NamedSharding(mesh, P())))
    per_device = {}
    for x in jax.tree.leaves(state):
        for s in x.addressable_shards:
            per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    step_counts = 4  # one int32 count per device
    assert max(per_device.values()) <= 1.01 * 12 * count / n + step_counts


def test_master_requires_params_and_a_float_dtype():
    with pytest.raises(zo.ZeroError, match="master_dtype"):
        zo.zero1(optax.adam(1e-2), axis_name="data", master_dtype=jnp.int32)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), h.small_params())
    tx = zo.zero1(optax.adam(1e-2), axis_name="data", master_dtype=jnp.float32)
    mesh = h.mesh_of(2)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))(params)
    step = jax.shard_map(lambda s: tx.update(zo.as_local(params, "data"), s), mesh=mesh, in_specs=P("data"),
                         out_specs=(P(), P("data")))
    with pytest.raises(zo.ZeroStructureError, match=r"needs the parameters"):
        step(state)


def _plain(inner, params, grads_seq, state=None):
    state = inner.init(params) if state is None else state
    update = jax.jit(inner.update)
    for g in grads_seq:
        u, state = update(h.reduced(g), state, params)
        params = optax.apply_updates(params, u)
    return params, state


@pytest.mark.parametrize("partition", ["flat", "leaf"])
def test_plain_optax_to_zero1_and_back(partition):
    """plain optax for k steps -> scatter -> zero1 for k more == plain optax for 2k; and back through gather."""
    n, k = 3, 3
    inner = INNER[partition]
    params = h.small_params()
    grads = h.gradient_sequence(params, n, 2 * k)
    want_params, want_state = _plain(inner(), params, grads)

    mesh = h.mesh_of(n)
    tx = zo.zero1(inner(), axis_name="data", partition=partition)
    p, s = _plain(inner(), params, grads[:k])
    scatter = jax.jit(jax.shard_map(lambda p, s: zo.scatter_state(tx, s, p), mesh=mesh, in_specs=(P(), P()),
                                    out_specs=P("data")))
    _, step = h.zero_fns(tx, mesh)
    state = scatter(p, s)
    p = jax.device_put(p, NamedSharding(mesh, P()))
    for g in grads[k:]:
        p, state = step(p, state, jax.device_put(g, NamedSharding(mesh, P("data"))))
    h.assert_matches(p, state, want_params, want_state, rtol=5e-5)

    # zero1 for k steps -> gather_state (under jit too) -> plain optax for k more.
    zp, zs, _ = h.run_zero(tx, params, grads[:k], n)
    plain = jax.jit(zo.gather_state)(zs)
    assert jax.tree.structure(plain) == jax.tree.structure(want_state)
    got_params, got_state = _plain(inner(), jax.device_get(zp), grads[k:], jax.device_get(plain))
    for a, b in zip(jax.tree.leaves((got_params, got_state)), jax.tree.leaves((want_params, want_state))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=5e-5, atol=1e-6)


def test_mesh_bound_scatter_and_master_params():
    n = 4
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    params = h.small_params()
    plain = optax.adam(1e-2).init(params)
    tx = zo.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh, master_dtype=jnp.float32)
    state = zo.scatter_state(tx, plain, params)
    for x in jax.tree.leaves(state):
        assert all(s.data.size * n == x.size for s in x.addressable_shards)
    for master in (zo.master_params(state), jax.jit(zo.master_params)(state)):
        for a, b in zip(jax.tree.leaves(master), jax.tree.leaves(params)):
            np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(jax.jit(zo.gather_state)(state)), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(zo.ZeroStructureError, match="scatter_state"):
        zo.scatter_state(tx, optax.adabelief(1e-2).init(params)[0], params)


def test_master_padding_stays_zero():
    """An inner update that moves zero coordinates (a constant shift) must not leak into the padding."""
    n = 3
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), h.small_params())
    inner = optax.chain(optax.sgd(1e-2), optax.stateless(lambda u, p: jax.tree.map(lambda x: x + 1e-3, u)))
    tx = zo.zero1(inner, axis_name="data", master_dtype=jnp.float32)
    mesh = h.mesh_of(n)
    init, step = h.zero_fns(tx, mesh)
    state = init(jax.device_put(h.small_params(), NamedSharding(mesh, P())))
    p = jax.device_put(params, NamedSharding(mesh, P()))
    for g in bf16_grads(params, n, 3):
        p, state = step(p, state, jax.device_put(g, NamedSharding(mesh, P("data"))))
    layout = zo.describe(state)
    stored = h.stored_entries(state)
    for j, e in enumerate(layout.entries):
        if e.role == "master" and layout.leaves[e.leaf].sliced:
            leaf = layout.leaves[e.leaf]
            assert not stored[j][leaf.size:].any(), leaf.path
