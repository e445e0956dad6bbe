"""Bad input gets a clear ValueError that names what is wrong and how to fix it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h


def test_init_outside_shard_map_shows_the_pattern():
    tx = zo.zero1(optax.adam(1e-2), axis_name="data")
    with pytest.raises(zo.ZeroError, match=r"no enclosing jax.shard_map binds it[\s\S]*in_specs=P\(\), out_specs=P"):
        tx.init(h.small_params())
    with pytest.raises(zo.ZeroError, match="shard_map"):
        zo.reduce_gradients("data").update(h.small_params(), None)


def test_unbound_axis_name():
    tx = zo.zero1(optax.adam(1e-2), axis_name="batch")
    with pytest.raises(zo.ZeroError, match=r"needs the mesh axis `batch`"):
        jax.shard_map(tx.init, mesh=h.mesh_of(2), in_specs=P(), out_specs=P("data"))(h.small_params())


def test_update_outside_shard_map():
    mesh = h.mesh_of(2)
    tx = zo.zero1(optax.adam(1e-2), axis_name="data")
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))(h.small_params())
    with pytest.raises(zo.ZeroError, match="no enclosing jax.shard_map"):
        tx.update(h.small_params(), state, h.small_params())


@pytest.mark.parametrize("partition", ["flat", "leaf"])
def test_gradient_structure_and_shape_mismatch(partition):
    mesh = h.mesh_of(2)
    params = h.small_params()
    tx = zo.zero1(optax.adam(1e-2), axis_name="data", partition=partition)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))(params)

    def step(grads, state):
        return tx.update(grads, state, params)

    run = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P("data")))
    missing = dict(params)
    del missing["vec"]
    with pytest.raises(zo.ZeroStructureError, match="gradients do not have the structure of the parameters"):
        run(missing, state)
    wrong = dict(params, vec=jnp.zeros((12,)))
    with pytest.raises(zo.ZeroStructureError, match=r"gradients leaf `\['vec'\]` has shape \(12,\), but the "
                                                     r"parameter has shape \(13,\)"):
        run(wrong, state)


def test_state_from_another_world_size():
    params = h.small_params()
    tx = zo.zero1(optax.adam(1e-2), axis_name="data")
    state = jax.jit(jax.shard_map(tx.init, mesh=h.mesh_of(2), in_specs=P(), out_specs=P("data")))(params)
    mesh4 = h.mesh_of(4)
    state4 = jax.device_put(jax.tree.map(lambda x: jnp.concatenate([x, x]), state), NamedSharding(mesh4, P("data")))
    step = jax.shard_map(lambda g, s: tx.update(g, s, params), mesh=mesh4, in_specs=(P(), P("data")),
                         out_specs=(P(), P("data")))
    with pytest.raises(zo.ZeroStructureError, match=r"initialised for axis `data` with 2 devices, but update runs "
                                                     r"over axis `data` with 4[\s\S]*zero_optax.reshard"):
        step(params, state4)


def test_negative_weight():
    mesh = h.mesh_of(2)
    params = h.small_params()
    tx = zo.zero1(optax.adam(1e-2), axis_name="data")
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))(params)

    def step(s, w):
        return tx.update(zo.as_local(params, "data"), s, params, weight=w)

    concrete = jax.shard_map(lambda s: step(s, -1.0), mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data")))
    with pytest.raises(zo.ZeroError, match=r"`weight` must be >= 0"):
        concrete(state)
    traced = jax.jit(jax.shard_map(lambda s, w: step(s, w[0]), mesh=mesh, in_specs=(P("data"), P("data")),
                                   out_specs=(P(), P("data"))))
    weights = jax.device_put(jnp.array([1.0, -2.0]), NamedSharding(mesh, P("data")))
    with pytest.raises(Exception, match=r"negative `weight`"):
        jax.block_until_ready(traced(state, weights))
    # The runtime reports the failed callback again at the next barrier; a good step replaces it.
    with pytest.raises(Exception, match=r"negative `weight`"):
        jax.effects_barrier()
    jax.block_until_ready(traced(state, jnp.abs(weights)))
    jax.effects_barrier()
    with pytest.raises(zo.ZeroError, match="`weight` must be a scalar"):
        jax.shard_map(lambda s: step(s, np.ones(2)), mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data")))(state)


@pytest.mark.parametrize("inner, culprit", [
    # (clip_by_global_norm and LAMB's trust ratio run exactly since issue 29: tests/test_collective_reductions.py)
    (optax.adafactor(1e-2), "factored"),
    (optax.contrib.muon(1e-2), "newton_schulz"),
    (optax.chain(optax.clip_by_global_norm(1.0), optax.contrib.muon(1e-2)), "newton_schulz"),
])
def test_flat_refuses_transformations_that_couple_coordinates(inner, culprit):
    tx = zo.zero1(inner, axis_name="data")
    params = dict(h.small_params(), big=jnp.zeros((130, 129)))
    with pytest.raises(zo.ZeroCouplingError, match=rf"(?s)cannot run this inner transformation on coordinate "
                                                   rf"slices.*{culprit}.*partition=\"leaf\".*reduce_gradients"):
        jax.shard_map(tx.init, mesh=h.mesh_of(2), in_specs=P(), out_specs=P("data"))(params)


def test_bad_arguments():
    with pytest.raises(zo.ZeroError, match="`partition` must be"):
        zo.zero1(optax.adam(1e-2), axis_name="data", partition="rows")
    with pytest.raises(zo.ZeroError, match="`reduce` must be"):
        zo.zero1(optax.adam(1e-2), axis_name="data", reduce="allreduce")
    with pytest.raises(zo.ZeroError, match="`axis_name`"):
        zo.zero1(optax.adam(1e-2), axis_name="")
    with pytest.raises(zo.ZeroError, match="describe expects a state returned by a zero1"):
        zo.describe(optax.adam(1e-2).init({"a": jnp.ones(2)}))


def test_flat_refuses_masks_computed_from_parameter_shapes():
    """A callable mask that reads `ndim` would see 1-D slices and silently drop weight decay: refused."""
    params = h.small_params()
    by_ndim = optax.adamw(1e-2, weight_decay=0.5, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    tx = zo.zero1(by_ndim, axis_name="data")
    with pytest.raises(zo.ZeroCouplingError, match=r"(?s)applies \d+ operations to the parameters but \d+ to "
                                                   r"coordinate slices.*pass the tree instead"):
        jax.shard_map(tx.init, mesh=h.mesh_of(3), in_specs=P(), out_specs=P("data"))(params)
    labelled = optax.partition({"m": optax.adam(1e-2), "v": optax.sgd(1e-2)},
                               lambda p: jax.tree.map(lambda x: "m" if x.ndim == 2 else "v", p))
    with pytest.raises(zo.ZeroCouplingError, match="inner state on coordinate slices has the structure"):
        jax.shard_map(zo.zero1(labelled, axis_name="data").init, mesh=h.mesh_of(3), in_specs=P(),
                      out_specs=P("data"))(params)


def _plateau_run(tx, n, values, params, grads, varying=False):
    mesh = h.mesh_of(n)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))

    def step(p, s, g, v):
        g = jax.tree.map(lambda x: x[0], g)
        value = v[0] if varying else jax.lax.pmean(v[0], "data")
        u, s = tx.update(g, s, p, value=value)
        return optax.apply_updates(p, u), s

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data")),
                                 out_specs=(P(), P("data"))))
    shard = NamedSharding(mesh, P("data"))
    p, s = jax.device_put(params, NamedSharding(mesh, P())), init(params)
    for g, v in zip(grads, values):
        p, s = step(p, s, jax.device_put(g, shard), jax.device_put(jnp.asarray(v, jnp.float32), shard))
    return p, s


@pytest.mark.parametrize("partition", ["flat", "leaf"])
def test_extra_arguments_reach_the_inner_transformation(partition):
    """reduce_on_plateau needs `value=`: exact against optax when every device passes the same value."""
    n = 4
    inner = lambda: optax.chain(optax.sgd(1e-1), optax.contrib.reduce_on_plateau(patience=1, cooldown=0))
    params = h.small_params()
    grads = h.gradient_sequence(params, n, steps=5)
    losses = [np.full(n, v) for v in (3.0, 3.0, 3.0, 2.0, 2.0)]  # a plateau: the scale drops
    tx = zo.zero1(inner(), axis_name="data", partition=partition)
    zp, zs = _plateau_run(tx, n, losses, params, grads)
    ref, rs = inner(), None
    rs = ref.init(params)
    rp = params
    for g, v in zip(grads, losses):
        u, rs = ref.update(h.reduced(g), rs, rp, value=jnp.float32(v[0]))
        rp = optax.apply_updates(rp, u)
    h.assert_matches(zp, zs, rp, rs)
    assert float(rs[1].scale) < 1.0  # the plateau was reached, so the test exercises the extra argument


def test_extra_arguments_that_differ_between_devices_are_refused():
    n = 4
    inner = optax.chain(optax.sgd(1e-1), optax.contrib.reduce_on_plateau())
    params = h.small_params()
    tx = zo.zero1(inner, axis_name="data")
    with pytest.raises(zo.ZeroStructureError, match=r"extra argument `value` differs between the devices"):
        _plateau_run(tx, n, [np.arange(n, dtype=np.float32)], params, h.gradient_sequence(params, n, 1),
                     varying=True)


def test_a_typed_prng_key_per_parameter_is_refused():
    """A key shared by all parameters is kept (tests/test_random_draws.py); one per parameter is not."""
    per_leaf = optax.GradientTransformation(lambda p: jax.tree.map(lambda _: jax.random.key(0), p),
                                            lambda u, s, p=None: (u, s))
    tx = zo.zero1(per_leaf, axis_name="data", partition="leaf")
    with pytest.raises(zo.ZeroCouplingError, match=r"typed PRNG key \(threefry2x32\) for one parameter"):
        jax.shard_map(tx.init, mesh=h.mesh_of(2), in_specs=P(), out_specs=P("data"))(h.small_params())


def _bad_inner(kind):
    """Inner transformations whose update returns something other than what their init promised."""
    base = optax.adam(1e-2)

    def update(g, s, p=None):
        u, s = base.update(g, s, p)
        if kind == "updates":
            return {"extra": jnp.zeros(())}, s
        return u, (s, s)
    return optax.GradientTransformation(base.init, update)


@pytest.mark.parametrize("partition", ["flat", "leaf"])
@pytest.mark.parametrize("kind", ["updates", "state"])
def test_inner_results_are_checked_against_the_layout(partition, kind):
    tx = zo.zero1(_bad_inner(kind), axis_name="data", partition=partition)
    params = h.small_params()
    with pytest.raises(zo.ZeroError):
        h.run_zero(tx, params, h.gradient_sequence(params, 2, 1), 2)


@pytest.mark.parametrize("partition", ["flat", "leaf"])
def test_updates_keep_the_inner_dtype(partition):
    """An inner transformation that returns float32 updates for bf16 parameters keeps them float32."""
    params = h.small_params(jnp.bfloat16)
    inner = optax.chain(optax.adam(1e-2), optax.stateless(lambda u, p: jax.tree.map(
        lambda x: x.astype(jnp.float32), u)))
    tx = zo.zero1(inner, axis_name="data", partition=partition, reduce_dtype=jnp.float32)
    mesh = h.mesh_of(3)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))
    step = jax.jit(jax.shard_map(lambda p, s, g: tx.update(jax.tree.map(lambda x: x[0], g), s, p), mesh=mesh,
                                 in_specs=(P(), P("data"), P("data")), out_specs=(P(), P("data"))))
    grads = h.gradient_sequence(params, 3, 1)[0]
    updates, _ = step(params, init(params), jax.device_put(grads, NamedSharding(mesh, P("data"))))
    want = jax.eval_shape(inner.update, h.reduced(grads), inner.init(params), params)[0]
    assert [u.dtype for u in jax.tree.leaves(updates)] == [w.dtype for w in jax.tree.leaves(want)]
    assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(updates))


def _raw_key_noise():
    """Gradient noise from a raw uint32 key carried in the state (what optax.add_noise does with a typed one)."""
    def init_fn(params):
        del params
        return jax.random.PRNGKey(0)

    def update_fn(updates, key, params=None):
        key, sub = jax.random.split(key)
        return jax.tree.map(lambda g: g + 0.1 * jax.random.normal(sub, g.shape), updates), key
    return optax.GradientTransformation(init_fn, update_fn)


def test_random_numbers_are_refused_naming_the_operation():
    """The leaf partition cannot draw as one device does (`"auto"` and `"flat"` run it exactly: below, and
    tests/test_random_draws.py)."""
    tx = zo.zero1(optax.chain(_raw_key_noise(), optax.adam(1e-2)), axis_name="data", partition="leaf")
    with pytest.raises(zo.ZeroCouplingError, match=r"`random_(bits|wrap)`"):
        jax.shard_map(tx.init, mesh=h.mesh_of(2), in_specs=P(), out_specs=P("data"))(h.small_params())


def test_raw_key_noise_runs_exactly_under_flat():
    """The flat partition reads a raw key in shared state as shared state (not parameter data), as `"auto"`
    does: each device draws the whole leaf's numbers and keeps its slots."""
    mesh = h.mesh_of(8)
    tx = zo.zero1(optax.chain(_raw_key_noise(), optax.adam(1e-2)), axis_name="data", mesh=mesh, partition="flat")
    ref = optax.chain(_raw_key_noise(), optax.adam(1e-2))
    h.assert_matches(*h.run_mesh_bound(tx, ref, h.small_params(), 3, mesh))


def _host_kernel():
    """An elementwise kernel the analysis cannot see into (a host callback, like a custom call or Pallas kernel)."""
    def double(x):
        return jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                                 vmap_method="broadcast_all")
    return optax.chain(optax.stateless(lambda u, p: jax.tree.map(double, u)), optax.sgd(1e-2))


def test_opaque_kernels_are_refused_unless_assumed_elementwise():
    params = h.small_params()
    tx = zo.zero1(_host_kernel(), axis_name="data")
    with pytest.raises(zo.ZeroCouplingError, match=r"(?s)`pure_callback`.*assume_elementwise=True"):
        jax.shard_map(tx.init, mesh=h.mesh_of(3), in_specs=P(), out_specs=P("data"))(params)
    grads = h.gradient_sequence(params, 3, steps=2)
    zp, zs, _ = h.run_zero(zo.zero1(_host_kernel(), axis_name="data", assume_elementwise=True), params, grads, 3)
    rp, rs = h.run_oracle(_host_kernel(), params, grads)
    h.assert_matches(zp, zs, rp, rs)


@pytest.mark.parametrize("partition", ["flat", "auto"])
def test_a_function_valued_extra_argument_is_refused_by_name(partition):
    """optax.contrib.sophia needs `obj_fn`, a function of the whole parameters: zero1 refuses it at init, naming it,
    where optax alone would stop deep inside its Hutchinson estimator."""
    mesh = h.mesh_of(2)
    tx = zo.zero1(optax.contrib.sophia(1e-2), axis_name="data", partition=partition)
    with pytest.raises(zo.ZeroCouplingError, match=r"obj_fn[\s\S]*function of the whole\s+parameters"):
        jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data"))(h.small_params())
