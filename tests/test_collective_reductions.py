"""Reductions inside the inner transformation (global norms, trust ratios) run exactly across the shards (issue 29).

The flat partition (and "auto", which then slices every leaf) computes a full reduction of a sliced leaf, a sum,
max or min of all its coordinates, as a reduction of each device's slice with a collective over the devices:
`clip_by_global_norm`, `polyak_sgd`, LAMB, LARS, fromage and novograd (whose per-leaf norm, reduced inside a
`lax.cond`, every device keeps) keep 1/N of their state and match plain optax on one device fed the reduced
gradient; so do reductions inside a `lax.scan` (a `fori_loop` of known length: every device runs every iteration).
Partial reductions (factored moments), matrix products and reductions inside `while` loops stay refused.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h

VALUE = {"value": jnp.float32(0.25)}

OPTIMIZERS = {
    "polyak_sgd": (lambda: optax.polyak_sgd(max_learning_rate=0.5), VALUE),
    "clip_adamw": (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1)), {}),
    "lamb": (lambda: optax.lamb(1e-2), {}),
    "lars": (lambda: optax.lars(1e-2), {}),
    "fromage": (lambda: optax.fromage(1e-2), {}),
    "novograd": (lambda: optax.novograd(1e-2, weight_decay=0.1), {}),
}


def _run_zero(tx, params, grads_seq, n, extra):
    mesh = h.mesh_of(n)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))

    def step(params, state, grads):
        updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, params, **extra)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P("data"))))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    state = init(params)
    for g in grads_seq:
        params, state = step(params, state, jax.device_put(g, NamedSharding(mesh, P("data"))))
    return params, state


def _run_oracle(inner, params, grads_seq, extra):
    state = inner.init(params)
    update = jax.jit(lambda g, s, p: inner.update(g, s, p, **extra))
    for g in grads_seq:
        u, state = update(h.reduced(g), state, params)
        params = optax.apply_updates(params, u)
    return params, state


@pytest.mark.parametrize("partition", ["flat", "auto"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_matches_single_device_optax(name, partition):
    make, extra = OPTIMIZERS[name]
    params = h.small_params()
    grads = h.gradient_sequence(params, 3, steps=3)
    zp, zs = _run_zero(zo.zero1(make(), axis_name="data", partition=partition), params, grads, 3, extra)
    rp, rs = _run_oracle(make(), params, grads, extra)
    h.assert_matches(zp, zs, rp, rs, rtol=1e-5)
    layout = zo.describe(zs)
    assert layout.joint and all(s == "sliced" for s in layout.sharding)
    assert all(len(g.leaves) == 1 for g in layout.groups)  # a norm of a group's buffer would mix its members


def test_the_clip_clips():
    """The global norm of these gradients is well above the threshold, so the clip changes every update."""
    params = h.small_params()
    grads = h.gradient_sequence(params, 3, steps=2)
    norm = float(optax.tree.norm(h.reduced(grads[0])))
    assert norm > 2.0
    clipped = lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1.0))
    zp, zs = _run_zero(zo.zero1(clipped(), axis_name="data"), params, grads, 3, {})
    rp, rs = _run_oracle(clipped(), params, grads, {})
    h.assert_matches(zp, zs, rp, rs, rtol=1e-5)
    unclipped, _ = _run_oracle(optax.sgd(1.0), params, grads, {})
    assert not np.allclose(np.asarray(unclipped["vec"]), np.asarray(rp["vec"]))


def test_state_is_sharded():
    """LAMB's moments are sliced: each device keeps 1/N of them (plus padding), not whole leaves."""
    params = {"w": jnp.ones((64, 48)), "b": jnp.ones((48,))}
    tx = zo.zero1(optax.lamb(1e-2), axis_name="data")
    state = jax.jit(jax.shard_map(tx.init, mesh=h.mesh_of(8), in_specs=P(), out_specs=P("data")))(params)
    layout = zo.describe(state)
    full = 2 * 4 * (64 * 48 + 48)
    assert max(layout.state_bytes_per_device) <= full / 8 + 64


def test_mesh_bound_on_8_devices():
    make = lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.lamb(1e-2))
    mesh = h.mesh_of(8)
    z_params, z_state, r_params, r_state = h.run_mesh_bound(zo.zero1(make(), axis_name="data", mesh=mesh), make(),
                                                            h.small_params(), 3, mesh)
    h.assert_matches(z_params, z_state, r_params, r_state, rtol=1e-5)
    assert zo.describe(z_state).joint


def _init(tx, params, n=3):
    return jax.shard_map(tx.init, mesh=h.mesh_of(n), in_specs=P(), out_specs=P("data"))(params)


def test_partial_reductions_stay_refused():
    """Adafactor's factored moments reduce a matrix over one axis: no collective of scalars makes that exact."""
    params = {"w": jnp.ones((128, 130))}
    with pytest.raises(zo.ZeroCouplingError, match=r"partition=\"flat\".*reduces a parameter-derived value over axes"):
        _init(zo.zero1(optax.adafactor(1e-2), axis_name="data"), params)
    with pytest.raises(zo.ZeroCouplingError, match=r"transposes a parameter-shaped value"):
        _init(zo.zero1(optax.contrib.muon(1e-2), axis_name="data"), params)


@pytest.mark.parametrize("partition", ["flat", "auto"])
def test_novograd_per_leaf_norm_on_every_device(partition):
    """novograd keeps one scalar per leaf, its gradient's squared norm, reduced inside its first-step `lax.cond`:
    every leaf is sliced, and every device keeps the same norms, which `optax.tree.get` reads as plain optax's."""
    mesh = h.mesh_of(8)
    tx = zo.zero1(optax.novograd(1e-2), axis_name="data", mesh=mesh, partition=partition)
    z_params, z_state, r_params, r_state = h.run_mesh_bound(tx, optax.novograd(1e-2), h.small_params(), 3, mesh)
    h.assert_matches(z_params, z_state, r_params, r_state)
    layout = zo.describe(z_state)
    assert set(layout.sharding) == {"sliced"} and len(layout.replicas) == len(layout.leaves)
    got = optax.tree.get(z_state, "nu")
    np.testing.assert_allclose(float(got["dense"]["w"]), float(r_state[0].nu["dense"]["w"]), rtol=1e-6)


def test_novograd_checkpoint_resumes_at_other_world_sizes(tmp_path):
    """The per-leaf norms are shared state in the checkpoint: restored at 3 and 5 devices, exact."""
    h.assert_resumes_anywhere(lambda: optax.novograd(1e-2), tmp_path)


def _looped(loop):
    """Updates scaled by a norm of the updates that `loop(body, init)` accumulates."""
    def update(u, state, params=None):
        del params
        scale = loop(lambda c: c + sum(jnp.sum(x * x) for x in jax.tree.leaves(u)), 0.0)
        return jax.tree.map(lambda g: g / (1 + scale), u), state
    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def _fori(body, init):
    return jax.lax.fori_loop(0, 2, lambda i, c: body(c), init)  # (a `scan`: its length is known)


def _while(body, init):
    return jax.lax.while_loop(lambda c: c < 10.0, body, init)


def test_reduction_inside_a_scan_runs_on_slices():
    """A norm computed inside a `lax.fori_loop` of fixed length (a `scan`): every device runs every iteration, so
    it runs as a collective there, exactly (optax.lbfgs's inner products run so)."""
    mesh = h.mesh_of(8)
    tx = zo.zero1(_looped(_fori), axis_name="data", mesh=mesh)
    z_params, z_state, r_params, r_state = h.run_mesh_bound(tx, _looped(_fori), h.small_params(), 2, mesh)
    h.assert_matches(z_params, z_state, r_params, r_state)


def test_reduction_inside_a_while_loop_is_refused():
    """A norm computed inside a `lax.while_loop` body (whose trip count may depend on the data) cannot run as a
    collective on slices: flat refuses it, naming the loop."""
    with pytest.raises(zo.ZeroCouplingError, match=r"inside a loop"):
        _init(zo.zero1(_looped(_while), axis_name="data"), h.small_params())


def test_auto_refuses_a_global_norm_over_owned_leaves():
    """clip_by_global_norm before Muon: Muon's matrices need owners, whose norms cannot join the collective."""
    params = {"w": jnp.ones((8, 6)), "b": jnp.ones((6,))}
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.contrib.muon(1e-2))
    with pytest.raises(zo.ZeroCouplingError, match=r"(?s)partition=\"auto\".*clip_by_global_norm.*need whole tensors"
                                                   r".*reduce_gradients"):
        _init(zo.zero1(clipped, axis_name="data", partition="auto"), params)


def test_offload_refuses_reductions():
    with pytest.raises(zo.ZeroCouplingError, match=r"offload=True"):
        _init(zo.zero1(optax.lamb(1e-2), axis_name="data", offload=True), h.small_params())


def test_collective_kind():
    from zero_optax.analysis import _programs

    def kinds(fn, *args):
        return [_programs.collective_kind(e) for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns]
    x = jnp.ones((3, 4))
    assert "sum" in kinds(jnp.sum, x) and "max" in kinds(jnp.max, x) and "min" in kinds(jnp.min, x)
    assert "sum" in kinds(jnp.vdot, x, x)
    assert set(kinds(lambda a: jnp.sum(a, axis=0), x)) == {None}
    assert set(kinds(lambda a: a.T @ a, x)) == {None}
