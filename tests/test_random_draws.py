"""Typed PRNG keys in the inner state and random numbers drawn in the parameters' shapes (issue 29).

`optax.noisy_sgd` (`optax.add_noise`) keeps a typed key and adds `jax.random.normal(key_i, leaf.shape)` to every
leaf, `key_i` split from one key over all leaves. Through zero1 each device holds slices of the leaves, yet must add
the very numbers plain optax adds to those coordinates: zero1 stores the key's data on every device and draws each
leaf's numbers whole, keeping its slice. The oracle is plain optax on one device fed the reduced gradient.
"""

import _harness as h
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo

STEPS = 3


def noisy():
    return optax.noisy_sgd(0.1, eta=0.5, key=jax.random.key(4))


def _keys_equal(a, b):
    np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))


@pytest.mark.parametrize("partition", ["flat", "auto"])
def test_noisy_sgd_in_shard_map(partition):
    """Every coordinate gets plain optax's noise: shapes that do not divide 8, a scalar; the key advances alike."""
    params = h.small_params()
    grads = h.gradient_sequence(params, 8, STEPS)
    tx = zo.zero1(noisy(), axis_name="data", partition=partition)
    z_params, z_state, _ = h.run_zero(tx, params, grads, 8)
    r_params, r_state = h.run_oracle(noisy(), params, grads)
    assert zo.describe(z_state).joint
    h.assert_matches(z_params, z_state, r_params, r_state)


@pytest.mark.parametrize("partition", ["flat", "auto"])
def test_noisy_sgd_mesh_bound(partition):
    mesh = h.mesh_of(8)
    tx = zo.zero1(noisy(), axis_name="data", mesh=mesh, partition=partition)
    z_params, z_state, r_params, r_state = h.run_mesh_bound(tx, noisy(), h.small_params(), STEPS, mesh)
    h.assert_matches(z_params, z_state, r_params, r_state)
    _keys_equal(optax.tree.get(z_state, "rng_key").value, r_state[0].rng_key)
    _keys_equal(zo.gather_state(z_state)[0].rng_key, r_state[0].rng_key)


def test_chain_with_adam_and_a_key_in_shared_state():
    """Noise added before Adam's moments, through a chain: the histories hold the noisy gradients."""
    def inner():
        return optax.chain(optax.add_noise(0.3, 0.55, key=jax.random.key(9)), optax.adam(1e-2))
    mesh = h.mesh_of(8)
    tx = zo.zero1(inner(), axis_name="data", mesh=mesh)
    h.assert_matches(*h.run_mesh_bound(tx, inner(), h.small_params(), STEPS, mesh))


def test_raw_key_noise_under_auto():
    """A raw uint32 key (`jax.random.PRNGKey`) and one subkey for every leaf's draw: exact under "auto" too."""
    def raw_key_noise():
        def update_fn(updates, key, params=None):
            del params
            key, sub = jax.random.split(key)
            return jax.tree.map(lambda g: g + 0.1 * jax.random.normal(sub, g.shape), updates), key
        return optax.chain(optax.GradientTransformation(lambda p: jax.random.PRNGKey(0), update_fn),
                           optax.sgd(1e-2))
    mesh = h.mesh_of(8)
    tx = zo.zero1(raw_key_noise(), axis_name="data", mesh=mesh, partition="auto")
    h.assert_matches(*h.run_mesh_bound(tx, raw_key_noise(), h.small_params(), STEPS, mesh))


def test_key_is_a_typed_key_to_optax_tools():
    """`optax.tree.get` gives the key plain optax holds, `tree.set` of a new key is kept, and `scatter_state` of
    a plain state continues exactly."""
    mesh = h.mesh_of(8)
    params = jax.device_put(h.small_params(), NamedSharding(mesh, P()))
    tx = zo.zero1(noisy(), axis_name="data", mesh=mesh)
    state = tx.init(params)
    key = optax.tree.get(state, "rng_key")
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ()
    _keys_equal(key.value, noisy().init(params)[0].rng_key)

    plain = noisy().init(h.small_params())
    plain = (plain[0]._replace(rng_key=jax.random.key(123), count=jnp.asarray(5)), *plain[1:])
    state = zo.scatter_state(tx, plain, params)
    g = jax.tree.map(lambda x: jnp.cos(x * 3), h.small_params())
    u, state = jax.jit(tx.update)(jax.device_put(g, NamedSharding(mesh, P())), state, params)
    r_u, r_state = noisy().update(g, plain, h.small_params())
    for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(r_u)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)
    _keys_equal(zo.gather_state(state)[0].rng_key, r_state[0].rng_key)

    state = optax.tree.set(state, rng_key=jax.random.key(77))
    _keys_equal(zo.gather_state(state)[0].rng_key, jax.random.key(77))


def test_checkpoint_restores_at_another_world_size(tmp_path):
    """Saved at 8 devices after 2 steps, restored at 3 (`reshard=True`) and offline at 5: the key and every
    history arrive exactly, and training continues as the uninterrupted plain optax run."""
    h.assert_resumes_anywhere(
        lambda: optax.chain(optax.add_noise(0.3, 0.55, key=jax.random.key(9)), optax.adam(1e-2)), tmp_path)


def test_refusals_name_the_random_numbers():
    params = h.small_params()
    mesh = h.mesh_of(8)
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    with pytest.raises(zo.ZeroCouplingError, match="random numbers"):
        zo.zero1(noisy(), axis_name="data", mesh=mesh, partition="leaf").init(placed)
    muon_noise = optax.chain(optax.add_noise(0.3, 0.55, key=jax.random.key(0)),
                             optax.contrib.muon(1e-2))
    with pytest.raises(zo.ZeroCouplingError, match="random numbers to leaves"):
        zo.zero1(muon_noise, axis_name="data", mesh=mesh, partition="auto").init(placed)


def test_misaligned_draw_is_refused():
    """Numbers drawn in a leaf's shape but transposed before they meet it pair with other coordinates on a slice:
    refused, naming the draw."""
    def transposed_noise():
        def update(u, state, params=None):
            del params
            return jax.tree.map(lambda g: g + jax.random.normal(state, g.shape[::-1]).T, u), state
        return optax.GradientTransformation(lambda p: jax.random.key(0), update)
    mesh = h.mesh_of(8)
    params = jax.device_put({"w": jnp.ones((5, 7))}, NamedSharding(mesh, P()))
    with pytest.raises(zo.ZeroCouplingError, match="random_bits"):
        zo.zero1(transposed_noise(), axis_name="data", mesh=mesh, partition="flat").init(params)
