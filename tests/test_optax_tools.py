"""optax's own tools on zero1 states, each against the same tool on plain optax's state on one device:
`optax.tree.get` / `optax.tree.set`, `optax.tree_map_params`, `optax.contrib.schedule_free_eval_params`, and
optax's wrappers around zero1 (`MultiSteps`, `reduce_on_plateau`, `mechanize`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h

MESH = h.mesh_of(8)


def _params():
    return {"w": jnp.linspace(-1.0, 1.0, 15).reshape(5, 3), "b": jnp.float32(2.0), "v": jnp.ones(13)}


def _grads(params, steps=4):
    return [jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1)) + 0.1, params) for i in range(steps)]


def _zero(inner, partition="flat"):
    return zo.zero1(inner, axis_name="data", mesh=MESH, partition=partition)


def _step(tx, **extra):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state
    return jax.jit(step)


def _on_mesh(tree):
    return jax.device_put(tree, NamedSharding(MESH, P()))


def _close(a, b, rtol=1e-6, atol=1e-7):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.parametrize("partition", ["flat", "auto"])
def test_tree_get_and_set_reach_shared_fields(partition):
    """The injected learning rate and the step count read as plain optax's; setting the learning rate between
    steps (outside and inside `jax.jit`) changes the run as it changes plain optax's."""
    make = lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    tx, ref = _zero(make(), partition), make()
    params = _params()
    z_params, r_params = _on_mesh(params), params
    z_state, r_state = tx.init(z_params), ref.init(r_params)
    z_step, r_step = _step(tx), _step(ref)
    set_lr = jax.jit(lambda s, lr: optax.tree.set(s, learning_rate=lr))
    for t, g in enumerate(_grads(params)):
        if t == 1:
            z_state, r_state = optax.tree.set(z_state, learning_rate=0.02), optax.tree.set(r_state, learning_rate=0.02)
        if t == 2:
            z_state, r_state = set_lr(z_state, 0.05), set_lr(r_state, 0.05)
        z_params, z_state = z_step(z_params, z_state, _on_mesh(g))
        r_params, r_state = r_step(r_params, r_state, g)
        for name in ("learning_rate", "b1"):
            assert float(optax.tree.get(z_state, name)) == float(optax.tree.get(r_state, name))
        counts = optax.tree.get_all_with_path(z_state, "count")
        assert [int(c) for _, c in counts] == [int(c) for _, c in optax.tree.get_all_with_path(r_state, "count")]
    _close(z_params, r_params)
    # read inside jax.jit too
    got = jax.jit(lambda s: 2.0 * optax.tree.get(s, "learning_rate"))(z_state)
    assert float(got) == pytest.approx(0.1)


def test_tree_get_per_parameter_field_names_gather_state():
    """A per-parameter field (Adam's `mu`) reads as a tree of markers with the plain field's shapes and dtypes,
    whose values zero1 does not hold there: using one as an array raises an error that names zo.gather_state."""
    params = _params()
    tx = _zero(optax.adam(0.1, mu_dtype=jnp.bfloat16))
    state = tx.init(_on_mesh(params))
    plain = optax.adam(0.1, mu_dtype=jnp.bfloat16).init(params)
    mu, want = optax.tree.get(state, "mu"), optax.tree.get(plain, "mu")
    assert jax.tree.structure(want) == jax.tree.structure(jax.tree.map(lambda _: 0, mu, is_leaf=_is_marker),
                                                         is_leaf=_is_marker)
    for got, x in zip(jax.tree.leaves(mu, is_leaf=_is_marker), jax.tree.leaves(want), strict=True):
        assert (got.shape, got.dtype) == (x.shape, x.dtype)
    with pytest.raises(zo.ZeroStructureError, match="zo.gather_state"):
        jnp.asarray(mu["w"])
    np.testing.assert_array_equal(zo.gather_state(state)[0].mu["w"], want["w"])


def _is_marker(x):
    return type(x).__name__ == "Sharded"


def test_tree_map_params():
    """optax.tree_map_params: the identity leaves the state as it is (optax's AliasTest does this before training);
    a zero1 state holds no parameter-shaped tree, so `transform_non_params` receives the state whole."""
    tx = _zero(optax.adamw(0.1))
    state = tx.init(_on_mesh(_params()))
    same = optax.tree_map_params(tx, lambda v: v, state)
    assert jax.tree.structure(same) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(state), strict=True):
        assert a is b
    seen = []
    optax.tree_map_params(tx, lambda v: v, state, transform_non_params=lambda s: seen.append(s))
    assert seen == [state]


def test_schedule_free_eval_params():
    """optax.contrib.schedule_free_eval_params reads `state.b1` and `state.z`: the same evaluation parameters as
    plain optax's after several steps."""
    make = lambda: optax.contrib.schedule_free_adamw(0.1, warmup_steps=2)
    tx, ref = _zero(make()), make()
    params = _params()
    z_params, r_params = _on_mesh(params), params
    z_state, r_state = tx.init(z_params), ref.init(r_params)
    z_step, r_step = _step(tx), _step(ref)
    for g in _grads(params):
        z_params, z_state = z_step(z_params, z_state, _on_mesh(g))
        r_params, r_state = r_step(r_params, r_state, g)
    assert float(z_state.b1) == float(r_state.b1)
    _close(optax.contrib.schedule_free_eval_params(z_state, z_params),
           optax.contrib.schedule_free_eval_params(r_state, r_params))


WRAPPERS = {
    "multi_steps": (lambda inner: optax.MultiSteps(inner, every_k_schedule=2), {}),
    "reduce_on_plateau": (lambda inner: optax.chain(inner, optax.contrib.reduce_on_plateau(patience=1, cooldown=1)),
                          {"value": jnp.float32(1.0)}),
    "mechanize": (lambda inner: optax.contrib.mechanize(inner), {}),
}


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_optax_wrappers_around_zero1(name):
    wrap, extra = WRAPPERS[name]
    tx, ref = wrap(_zero(optax.adam(0.1))), wrap(optax.adam(0.1))
    params = _params()
    z_params, r_params = _on_mesh(params), params
    z_state, r_state = tx.init(z_params), ref.init(r_params)
    z_step, r_step = _step(tx, **extra), _step(ref, **extra)
    for g in _grads(params, 5):
        z_params, z_state = z_step(z_params, z_state, _on_mesh(g))
        r_params, r_state = r_step(r_params, r_state, g)
    _close(z_params, r_params, rtol=1e-5, atol=1e-6)
