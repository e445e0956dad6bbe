"""Gradient semantics inside shard_map: never guessed. Per-device gradients are reduced, invariant ones are refused
unless `reduce=False` says they are the global mean; low-precision weighted means divide in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h

PARAMS = {"w": jnp.linspace(-1, 1, 15).reshape(5, 3), "b": jnp.asarray(0.1), "v": jnp.linspace(0, 1, 7)}


def local_loss(p, xb, yb):
    """This device's mean squared error (a scale-sensitive loss: sgd(1.0) shows any factor of N)."""
    pred = xb @ p["w"] + p["b"] + jnp.sum(p["v"] ** 2)
    return jnp.mean((pred - yb) ** 2)


def data(n: int):
    x = jax.random.normal(jax.random.key(1), (n * 4, 5))
    y = jax.random.normal(jax.random.key(2), (n * 4, 3))
    return x, y


def oracle(inner, x, y, steps: int, n: int):
    """Plain optax on one device fed the global mean gradient (the mean of the devices' local mean losses)."""
    params, state = PARAMS, inner.init(PARAMS)
    xs, ys = np.split(np.asarray(x), n), np.split(np.asarray(y), n)
    for _ in range(steps):
        g = jax.grad(lambda q: sum(local_loss(q, a, b) for a, b in zip(xs, ys)) / n)(params)
        u, state = inner.update(g, state, params)
        params = optax.apply_updates(params, u)
    return params


def run(tx, n: int, make_grads, steps: int = 3):
    mesh = h.mesh_of(n)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))

    def step(p, s, xb, yb):
        u, s = tx.update(make_grads(p, xb, yb), s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data")),
                                 out_specs=(P(), P("data"))))
    x, y = data(n)
    shard = NamedSharding(mesh, P("data"))
    p = jax.device_put(PARAMS, NamedSharding(mesh, P()))
    s = init(p)
    for _ in range(steps):
        p, s = step(p, s, jax.device_put(x, shard), jax.device_put(y, shard))
    return p


def tutorial_grads(p, xb, yb):
    """The jax.shard_map tutorial's data-parallel pattern: grad of the pmean'd loss, already the global MEAN."""
    return jax.grad(lambda q: lax.pmean(local_loss(q, xb, yb), "data"))(p)


def local_grads(p, xb, yb):
    """Per-device gradients: differentiate with respect to zo.as_local(params)."""
    return jax.grad(local_loss)(zo.as_local(p, "data"), xb, yb)


def summed_grads(p, xb, yb):
    """grad of a local loss with respect to replicated parameters: autodiff psums, an invariant SUM."""
    return jax.grad(local_loss)(p, xb, yb)


def assert_close(a, b):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=2e-5, atol=1e-6), a, b)


@pytest.mark.parametrize("partition", ["flat", "leaf"])
@pytest.mark.parametrize("make", [tutorial_grads, summed_grads], ids=["pmean_loss", "local_loss_replicated"])
def test_invariant_gradients_are_refused_with_both_fixes(partition, make):
    for reduce in (True, "psum", "psum_scatter"):
        tx = zo.zero1(optax.sgd(1.0), axis_name="data", partition=partition, reduce=reduce)
        with pytest.raises(zo.ZeroGradientError, match=r"(?s)typed invariant.*zo\.as_local\(params, 'data'\).*"
                                                        r"reduce=False"):
            run(tx, 4, make, steps=1)


@pytest.mark.parametrize("partition", ["flat", "leaf"])
def test_tutorial_pattern_is_exact_with_reduce_false(partition):
    n = 4
    tx = zo.zero1(optax.sgd(1.0), axis_name="data", partition=partition, reduce=False)
    assert_close(run(tx, n, tutorial_grads), oracle(optax.sgd(1.0), *data(n), 3, n))


@pytest.mark.parametrize("partition", ["flat", "leaf"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_as_local_pattern_is_exact_for_sgd(partition, n):
    for reduce in (True, "psum"):
        tx = zo.zero1(optax.sgd(1.0), axis_name="data", partition=partition, reduce=reduce)
        assert_close(run(tx, n, local_grads), oracle(optax.sgd(1.0), *data(n), 3, n))


def test_reduce_false_refuses_per_device_gradients():
    tx = zo.zero1(optax.sgd(1.0), axis_name="data", reduce=False)
    with pytest.raises(zo.ZeroGradientError, match=r"(?s)reduce=False.*differs between the devices of `data`"):
        run(tx, 4, local_grads, steps=1)


def test_weight_is_refused_with_invariant_gradients_and_with_reduce_false():
    mesh = h.mesh_of(4)
    for reduce, make, error in ((True, summed_grads, zo.ZeroGradientError), (False, tutorial_grads, zo.WeightError)):
        tx = zo.zero1(optax.sgd(1.0), axis_name="data", reduce=reduce)
        init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))

        def step(p, s, xb, yb, make=make, tx=tx):
            return tx.update(make(p, xb, yb), s, p, weight=xb.shape[0])

        step = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data")),
                             out_specs=(P(), P("data")))
        x, y = jax.device_put(data(4), NamedSharding(mesh, P("data")))
        with pytest.raises(error):
            step(PARAMS, init(PARAMS), x, y)


def test_reduce_gradients_refuses_invariant_gradients():
    tx = optax.chain(zo.reduce_gradients("data"), optax.clip_by_global_norm(1.0),
                     zo.zero1(optax.sgd(1.0), axis_name="data", reduce=False))
    with pytest.raises(zo.ZeroGradientError, match=r"zo\.reduce_gradients got gradients"):
        run(tx, 4, tutorial_grads, steps=1)
    n = 4
    ref = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    assert_close(run(tx, n, local_grads), oracle(ref, *data(n), 3, n))


def test_without_vma_gradients_are_taken_as_per_device():
    """check_vma=False carries no varying/invariant types: gradients are what `reduce` says (per-device here)."""
    n = 4
    mesh = h.mesh_of(n)
    tx = zo.zero1(optax.sgd(1.0), axis_name="data")
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data"), check_vma=False))

    def step(p, s, xb, yb):
        u, s = tx.update(jax.grad(local_loss)(p, xb, yb), s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data")),
                                 out_specs=(P(), P("data")), check_vma=False))
    x, y = data(n)
    p, s = PARAMS, init(PARAMS)
    for _ in range(3):
        p, s = step(p, s, *jax.device_put((x, y), NamedSharding(mesh, P("data"))))
    assert_close(p, oracle(optax.sgd(1.0), x, y, 3, n))


@pytest.mark.parametrize("dtype, eps", [(jnp.float16, 2.0 ** -11), (jnp.bfloat16, 2.0 ** -8)])
@pytest.mark.parametrize("partition", ["flat", "leaf"])
def test_low_precision_weighted_mean_divides_in_float32(dtype, eps, partition):
    """f16 gradients (loss sums) whose global weight exceeds 65504 give finite, correct updates."""
    n = 4
    weights = [np.array([20000.0, 30000.0, 15000.0, 25000.0])]  # global weight 90000 > float16 max
    params = {"w": jnp.zeros((5, 3), dtype), "b": jnp.zeros((), dtype)}
    rng = np.random.default_rng(0)
    # Per-device loss-sum gradients of the size a weight of 2e4 tokens gives (|g| ~ 2e4 * 1e-2).
    grads = [{"w": jnp.asarray(rng.normal(size=(n, 5, 3)) * 200.0, dtype),
              "b": jnp.asarray(rng.normal(size=(n,)) * 200.0, dtype)}]
    tx = zo.zero1(optax.sgd(1.0), axis_name="data", partition=partition)
    zp, _, _ = h.run_zero(tx, params, grads, n, weights)
    for name in params:
        g = np.asarray(grads[0][name], np.float64)
        want = -g.sum(0) / weights[0].sum()  # float64 reference of the weighted mean
        got = np.asarray(zp[name], np.float64)
        assert np.all(np.isfinite(got)), name
        # psum in the dtype rounds n times; the division and the cast round once more.
        np.testing.assert_allclose(got, want, rtol=(n + 2) * eps, atol=(n + 2) * eps * np.abs(want).max())
