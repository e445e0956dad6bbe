"""partition="auto": leaves the inner update treats elementwise are sliced, the others owned; exact against optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h

PARAMS = {"emb": jnp.linspace(-1, 1, 60).reshape(10, 6), "w": jnp.eye(6, 5) + 0.1, "b": jnp.linspace(0, 1, 5),
          "s": jnp.asarray(0.3)}
LABELS = {"emb": "adam", "w": "muon", "b": "adam", "s": "adam"}


def muon_recipe():
    """Muon for hidden matrices, AdamW for the embedding and the vectors (the usual recipe)."""
    return optax.partition({"muon": optax.contrib.muon(1e-2), "adam": optax.adamw(1e-2, weight_decay=0.1)}, LABELS)


S, O = "sliced", "owned"
INNER = {  # the inner transformation, and how "auto" shards emb, w, b, s
    # Its 2-D leaves go to Newton-Schulz (owned); b and s are elementwise but smaller than every owned leaf, so
    # they are owned too (they fill the owners' padding instead of adding 1/N of their state to every device).
    "contrib_muon": (lambda: optax.contrib.muon(1e-2), (O, O, O, O)),
    "muon_recipe": (muon_recipe, (S, O, O, O)),  # the embedding (AdamW) is larger than w: sliced
    "adamw": (lambda: optax.adamw(1e-2), (S, S, S, S)),  # nothing needs an owner: everything sliced
    # LAMB's trust ratios reduce each leaf to scalars, which run as collectives on slices (issue 29)
    "lamb": (lambda: optax.lamb(1e-2), (S, S, S, S)),
}


@pytest.mark.parametrize("name", sorted(INNER))
@pytest.mark.parametrize("n", [1, 3, 8])
def test_matches_single_device_optax(name, n):
    inner, sharding = INNER[name]
    grads = h.gradient_sequence(PARAMS, n, steps=4)
    tx = zo.zero1(inner(), axis_name="data", partition="auto")
    zp, zs, _ = h.run_zero(tx, PARAMS, grads, n)
    rp, rs = h.run_oracle(inner(), PARAMS, grads)
    h.assert_matches(zp, zs, rp, rs, rtol=5e-5)
    layout = zo.describe(zs)
    want = dict(zip(["['emb']", "['w']", "['b']", "['s']"], sharding))
    assert dict(zip(layout.paths, layout.sharding)) == want
    assert all(f" {how} " in layout.summary() for how in set(layout.sharding))


def test_auto_with_master_copies():
    n = 3
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
    grads = [jax.tree.map(lambda g: g.astype(jnp.bfloat16), g) for g in h.gradient_sequence(PARAMS, n, steps=5)]
    tx = zo.zero1(muon_recipe(), axis_name="data", partition="auto", master_dtype=jnp.float32)
    mesh = h.mesh_of(n)
    init, step = h.zero_fns(tx, mesh)
    state = init(jax.device_put(PARAMS, NamedSharding(mesh, P())))  # the master copy starts from float32 values
    p = jax.device_put(params, NamedSharding(mesh, P()))
    for g in grads:
        p, state = step(p, state, jax.device_put(g, NamedSharding(mesh, P("data"))))
    ref = muon_recipe()
    rs, rp = ref.init(PARAMS), PARAMS
    for g in grads:
        mean = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64).mean(0), jnp.float32), g)
        u, rs = ref.update(mean, rs, rp)
        rp = optax.apply_updates(rp, u)
    master = zo.master_params(state)
    for a, m, r in zip(jax.tree.leaves(p), jax.tree.leaves(master), jax.tree.leaves(rp)):
        np.testing.assert_allclose(np.asarray(m), np.asarray(r), rtol=5e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(m.astype(jnp.bfloat16)).view(np.uint16))


def _init(tx, params=PARAMS, n=3):
    return jax.shard_map(tx.init, mesh=h.mesh_of(n), in_specs=P(), out_specs=P("data"))(params)


def test_auto_refuses_what_mixes_leaves_or_draws_noise():
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.contrib.muon(1e-2))
    with pytest.raises(zo.ZeroCouplingError, match=r"(?s)partition=\"auto\".*clip_by_global_norm.*reduce_gradients"):
        _init(zo.zero1(clipped, axis_name="data", partition="auto"))


def test_position_dependent_masks_give_the_leaf_an_owner():
    """A mask built from positions (iota) is positional: the leaf needs its whole tensor."""
    def init_fn(params):
        return optax.EmptyState()

    def update_fn(updates, state, params=None):
        return jax.tree.map(lambda g: g * (jnp.arange(g.size).reshape(g.shape) % 2), updates), state

    inner = optax.chain(optax.GradientTransformation(init_fn, update_fn), optax.sgd(1.0))
    n = 3
    grads = h.gradient_sequence(PARAMS, n, steps=2)
    zp, zs, _ = h.run_zero(zo.zero1(inner, axis_name="data", partition="auto"), PARAMS, grads, n)
    rp, _ = h.run_oracle(inner, PARAMS, grads)
    for a, b in zip(jax.tree.leaves(zp), jax.tree.leaves(rp)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    sharding = dict(zip(zo.describe(zs).paths, zo.describe(zs).sharding))
    assert sharding["['emb']"] == "owned"  # the largest leaf: every other leaf is smaller, so all are owned
    assert set(sharding.values()) == {"owned"}


def test_assume_elementwise_is_for_the_flat_partition():
    with pytest.raises(zo.ZeroError, match="assume_elementwise"):
        zo.zero1(optax.adam(1e-2), axis_name="data", partition="auto", assume_elementwise=True)


def test_auto_behind_a_global_clip_with_reduce_false():
    n = 3
    grads = h.gradient_sequence(PARAMS, n, steps=3)
    tx = optax.chain(zo.reduce_gradients("data"), optax.clip_by_global_norm(0.5),
                     zo.zero1(muon_recipe(), axis_name="data", partition="auto", reduce=False))
    zp, zs, _ = h.run_zero(tx, PARAMS, grads, n)
    rp, rs = h.run_oracle(optax.chain(optax.clip_by_global_norm(0.5), muon_recipe()), PARAMS, grads)
    h.assert_matches(zp, zs[2], rp, rs[1], rtol=5e-5)
