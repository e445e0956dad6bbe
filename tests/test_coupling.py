"""Tests for the static coordinate/leaf coupling analysis in `zero_optax._coupling`."""

import jax
import jax.numpy as jnp
import optax
import pytest

from zero_optax._coupling import find_coordinate_coupling, find_leaf_coupling

PARAMS = {"a": jnp.ones((4, 3)), "b": jnp.ones((5,)), "c": jnp.ones(())}
BIG = {"a": jnp.ones((4, 3)), "d": jnp.ones((130, 129))}  # adafactor factors dims >= 128.


def _update(tx):
    return lambda g, s, p: tx.update(g, s, p)


def _coord(tx, params=PARAMS):
    return find_coordinate_coupling(_update(tx), params, tx.init(params), params)


def _leaf(tx, params=PARAMS):
    labels = jax.tree_util.tree_unflatten(jax.tree.structure(params), range(len(jax.tree.leaves(params))))
    return find_leaf_coupling(_update(tx), params, tx.init(params), params, sources=(labels, None, labels))


ELEMENTWISE = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3),
    "adamw_masked": lambda: optax.adamw(1e-3, mask={"a": True, "b": False, "c": False}),
    "lion": lambda: optax.lion(1e-3),
    "sgd_nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "rmsprop": lambda: optax.rmsprop(1e-3),
    "adagrad": lambda: optax.adagrad(1e-3),
    "adabelief": lambda: optax.adabelief(1e-3),
    "warmup_cosine": lambda: optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)),
    "join_schedules": lambda: optax.adam(optax.join_schedules(
        [optax.constant_schedule(1e-3), optax.linear_schedule(1e-3, 0.0, 10), optax.constant_schedule(0.0)],
        [5, 15])),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-3), 3).gradient_transformation(),
    "masked": lambda: optax.masked(optax.adam(1e-3), {"a": True, "b": False, "c": True}),
    "partition": lambda: optax.partition(
        {"a": optax.adam(1e-3), "f": optax.set_to_zero()}, {"a": "a", "b": "f", "c": "a"}),
    "chain": lambda: optax.chain(optax.scale_by_adam(), optax.scale(-1e-3)),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise_optimizers_are_clean(name):
    tx = ELEMENTWISE[name]()
    assert _coord(tx) is None
    assert _leaf(tx) is None


@pytest.mark.parametrize("make, primitive, where", [
    (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), "reduce_sum", "clip_by_global_norm"),
    (lambda: optax.adafactor(1e-3), "reduce_sum", "factor"),
    (lambda: optax.contrib.muon(1e-3), "", "muon"),
    (lambda: optax.lamb(1e-3), "reduce_sum", "trust_ratio"),
    (lambda: optax.apply_if_finite(optax.adam(1e-3), 3), "reduce_and", "apply_if_finite"),
], ids=["clip_by_global_norm", "adafactor", "muon", "lamb", "apply_if_finite"])
def test_coordinate_coupling_is_flagged(make, primitive, where):
    msg = _coord(make(), BIG)
    assert msg is not None
    assert msg.startswith(f"`{primitive}") and where in msg, msg


def test_message_names_primitive_and_optax_location():
    msg = _coord(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))
    assert msg.startswith("`reduce_sum` at optax/"), msg
    assert "clip_by_global_norm.<locals>.update_fn" in msg


@pytest.mark.parametrize("make", [
    lambda: optax.contrib.muon(1e-3),
    lambda: optax.adafactor(1e-3),
    lambda: optax.lamb(1e-3),
    lambda: optax.adamw(1e-3),
], ids=["muon", "adafactor", "lamb", "adamw"])
def test_per_leaf_optimizers_have_no_leaf_coupling(make):
    assert _leaf(make(), BIG) is None


def test_global_norm_clipping_couples_leaves():
    msg = _leaf(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))
    assert msg is not None and "mixes parameter leaves" in msg, msg
    assert "clip_by_global_norm" in msg


def test_apply_if_finite_couples_leaves():
    assert _leaf(optax.apply_if_finite(optax.adam(1e-3), 3)) is not None


def test_leaf_sources_with_state_labels_and_structs():
    """Labels on the state too, abstract inputs, and None / MaskedNode in the args."""
    tx = optax.masked(optax.adam(1e-3), {"a": True, "b": False, "c": True})
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), PARAMS)
    state = jax.eval_shape(tx.init, structs)
    labels = {"a": 0, "b": 1, "c": 2}

    def state_label(path, _):
        keys = [getattr(k, "key", None) for k in path]
        return next((labels[k] for k in keys if k in labels), None)

    state_labels = jax.tree_util.tree_map_with_path(state_label, state)
    assert find_leaf_coupling(_update(tx), structs, state, structs, sources=(labels, state_labels, labels)) is None
    assert find_coordinate_coupling(_update(tx), structs, state, None) is None
    assert find_coordinate_coupling(lambda g, m, n: g, structs, optax.MaskedNode(), None) is None


def test_leaf_sources_must_match_args():
    with pytest.raises(ValueError):
        find_leaf_coupling(lambda x, y: x + y, jnp.ones(3), jnp.ones(3), sources=(0,))


X = jnp.ones((4, 3))


@pytest.mark.parametrize("fn", [
    lambda x: jnp.where(x > 0, x, 2 * x),
    lambda x: jnp.where(x.reshape(-1) > 0, 1.0, 0.0).reshape(4, 3),
    lambda x: x[None, :, :] * 2,
    lambda x: jnp.sum(x[:, :, None], axis=2),
    lambda x: jnp.transpose(x[:, None, :], (1, 0, 2)),
    lambda x: jax.jit(lambda y: jax.nn.relu(y) + jax.nn.sigmoid(y))(x),
    lambda x: jax.checkpoint(lambda y: jnp.sqrt(y * y + 1))(x),
    lambda x: jax.lax.fori_loop(0, 3, lambda i, y: y * 0.5 + 1.0, x),
    lambda x: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x))[1],
    lambda x: jax.lax.cond(jnp.ones(()) > 0, lambda y: y + 1, lambda y: y - 1, x),
    lambda x: x * jnp.sum(jnp.arange(3.0)),
], ids=["where", "reshape", "unit_broadcast", "unit_reduce", "unit_transpose", "jit_custom_jvp", "remat",
        "fori_loop", "while", "cond_untainted", "reduce_constant"])
def test_elementwise_constructs_are_clean(fn):
    assert find_coordinate_coupling(fn, X) is None


@pytest.mark.parametrize("fn, primitive", [
    (lambda x: x / jnp.max(x), "reduce_max"),
    (lambda x: x.T * 1, "transpose"),
    (lambda x: x @ jnp.ones((3, 3)), "dot_general"),
    (lambda x: x[::-1], "rev"),
    (lambda x: jnp.cumsum(x, axis=0), "cumsum"),
    (lambda x: jnp.broadcast_to(x[0], (4, 3)), ""),
    (lambda x: jax.lax.scan(lambda c, r: (c + r, c), jnp.zeros(3), x)[0], "scan"),
    (lambda x: jax.lax.cond(x[0, 0] > 0, lambda y: y, lambda y: -y, x), ""),
    (lambda x: jax.lax.while_loop(lambda y: y[0, 0] < 3, lambda y: y + 1, x), ""),
    (lambda x: jnp.sort(x, axis=0), "sort"),
], ids=["max", "transpose", "matmul", "rev", "cumsum", "broadcast", "scan_xs", "cond_pred", "while_pred", "sort"])
def test_coupling_constructs_are_flagged(fn, primitive):
    msg = find_coordinate_coupling(fn, X)
    assert msg is not None and msg.startswith(f"`{primitive}"), msg


def test_scalars_are_not_coordinate_sources():
    assert find_coordinate_coupling(lambda x, c: x * jnp.sum(c * jnp.ones(3)), X, jnp.ones(())) is None


def test_leaf_mode_rules():
    a, b = jnp.ones((4, 3)), jnp.ones((4, 3))
    assert find_leaf_coupling(lambda x, y: (x @ x.T, jnp.sum(y)), a, b, sources=(0, 1)) is None
    assert find_leaf_coupling(lambda x, y: x * y, a, b, sources=(0, None)) is None
    assert find_leaf_coupling(lambda x, y: x * y, a, b, sources=(0, 1)) is not None
    assert find_leaf_coupling(lambda x, y: jax.jit(lambda u, v: (u + 1, v * 2))(x, y), a, b, sources=(0, 1)) is None
    branchy = lambda x, y: jax.lax.cond(jnp.sum(x) > 0, lambda u: u, lambda u: -u, y)
    assert "branch predicate" in find_leaf_coupling(branchy, a, b, sources=(0, 1))
    assert find_leaf_coupling(branchy, a, b, sources=(0, None)) is None
    carry = lambda x, y: jax.lax.fori_loop(0, 3, lambda i, c: (c[1], c[0]), (x, y))
    assert find_leaf_coupling(lambda x, y: sum(jnp.sum(t) for t in carry(x, y)), a, b, sources=(0, None)) is None
    assert find_leaf_coupling(lambda x, y: carry(x, y)[0] * 1 + carry(x, y)[1], a, b, sources=(0, 1)) is not None
