"""`optax.inject_hyperparams` around a mesh-bound zero1 (issue 29), and inside one, against plain optax.

`optax.inject_hyperparams(factory)` calls `factory(learning_rate=<array>)` inside its own `init` and `update`, so
the zero1 that the factory builds closes over the hyperparameters: traced under `jax.jit`, concrete eagerly, and
under `jax.set_mesh` typed on a mesh with `Explicit` axes, which a `shard_map` body may not read from outside. A
mesh-bound zero1 passes such values into its `shard_map` as arguments (`zero_optax.api._bound._Hoisted`).

The oracle is plain optax on one device (no mesh), fed the same global gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h

N = 8
STEPS = 4
PARTITIONS = ["flat", "leaf", "auto"]
LEARNING_RATES = {
    "constant": lambda: 0.1,
    "schedule": lambda: optax.linear_schedule(0.1, 0.01, 10),
}


def gradients(params, steps: int = STEPS) -> list:
    """`steps` global gradients like `params` (the mean gradient a mesh-bound update receives)."""
    out = []
    for t in range(steps):
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(t), len(leaves))
        out.append(jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]))
    return out


def oracle(inner, params, grads_seq):
    """Plain optax on one device: the updates of every step."""
    device = jax.devices()[0]
    params = jax.device_put(params, device)
    state = inner.init(params)
    update = jax.jit(inner.update)
    out = []
    for g in grads_seq:
        u, state = update(jax.device_put(g, device), state, params)
        params = optax.apply_updates(params, u)
        out.append(u)
    return out


def assert_close(got, want, rtol=1e-6, atol=1e-7):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def run_jitted(tx, mesh, params, grads_seq):
    """`tx` under `jax.set_mesh(mesh)`: jitted init, then `len(grads_seq)` jitted steps (update + apply_updates).
    Returns the updates of every step, the final state and the compilations of the steps after the first."""
    params = jax.device_put(params, NamedSharding(mesh, P()))
    grads_seq = [jax.device_put(g, NamedSharding(mesh, P())) for g in grads_seq]

    @jax.jit
    def step(params, state, grads):
        u, state = tx.update(grads, state, params)
        return optax.apply_updates(params, u), state, u

    out = []
    with jax.set_mesh(mesh):
        state = jax.jit(tx.init)(params)
        params, state, u = step(params, state, grads_seq[0])
        out.append(u)
        with h.CompileCounter() as compiles:
            for g in grads_seq[1:]:
                params, state, u = step(params, state, g)
                out.append(u)
        jax.block_until_ready(out)
    return out, state, compiles.count


def factory(partition, mesh):
    def make(learning_rate):
        return zo.zero1(optax.adam(learning_rate), axis_name="data", mesh=mesh, partition=partition)
    return make


@pytest.mark.parametrize("lr", sorted(LEARNING_RATES))
@pytest.mark.parametrize("partition", PARTITIONS)
def test_inject_hyperparams_around_zero1_jitted(partition, lr):
    """The issue's case: every update builds a new zero1 around traced hyperparameters."""
    mesh = h.mesh_of(N)
    params = h.small_params()
    grads_seq = gradients(params)
    tx = optax.inject_hyperparams(factory(partition, mesh))(learning_rate=LEARNING_RATES[lr]())
    got, state, compiles = run_jitted(tx, mesh, params, grads_seq)
    want = oracle(optax.adam(LEARNING_RATES[lr]()), params, grads_seq)
    for u, w in zip(got, want):
        assert_close(u, w)
    assert compiles == 0  # the jitted step compiles once
    assert isinstance(state.inner_state, zo.ZeroState)
    assert zo.describe(state.inner_state).partition == partition
    if lr == "schedule":  # the learning rate the last step used: the schedule's at that step's count
        np.testing.assert_allclose(float(state.hyperparams["learning_rate"]),
                                   float(LEARNING_RATES[lr]()(STEPS - 1)), rtol=1e-6)


@pytest.mark.parametrize("partition", PARTITIONS)
def test_inject_hyperparams_around_zero1_eager(partition):
    """The same, eagerly: the hyperparameters are concrete arrays typed on the mesh."""
    mesh = h.mesh_of(N)
    params = jax.device_put(h.small_params(), NamedSharding(mesh, P()))
    grads_seq = gradients(params, 2)
    tx = optax.inject_hyperparams(factory(partition, mesh))(learning_rate=LEARNING_RATES["schedule"]())
    got = []
    with jax.set_mesh(mesh):
        state = tx.init(params)
        for g in grads_seq:
            u, state = tx.update(jax.device_put(g, NamedSharding(mesh, P())), state, params)
            params = optax.apply_updates(params, u)
            got.append(u)
    want = oracle(optax.adam(LEARNING_RATES["schedule"]()), h.small_params(), grads_seq)
    for u, w in zip(got, want):
        assert_close(u, w)


@pytest.mark.parametrize("partition", ["flat", "auto"])
def test_inject_hyperparams_around_zero1_of_an_optimizer_whose_init_reads_the_hyperparameter(partition):
    """optax.contrib.dog's init combines its hyperparameter with the parameters, which zero1 hands it sliced: the
    hoisted hyperparameter and the sliced parameters meet in one operation inside zero1's `shard_map`."""
    mesh = h.mesh_of(N)
    params = h.small_params()
    grads_seq = gradients(params)

    def make(learning_rate):
        return zo.zero1(optax.contrib.dog(learning_rate), axis_name="data", mesh=mesh, partition=partition)
    tx = optax.inject_hyperparams(make)(learning_rate=1.0)
    got, _, _ = run_jitted(tx, mesh, params, grads_seq)
    want = oracle(optax.contrib.dog(1.0), params, grads_seq)
    for u, w in zip(got, want):
        assert_close(u, w, rtol=1e-5, atol=1e-6)


def test_zero1_over_a_hyperparameter_array_typed_on_the_mesh():
    """A zero1 built once around an array typed on the mesh (not through inject_hyperparams), eager and jitted."""
    mesh = h.mesh_of(N)
    params = h.small_params()
    grads_seq = gradients(params, 3)
    with jax.set_mesh(mesh):
        lr = jnp.asarray(0.05, jnp.float32)  # typed on the mesh: f32[]{Explicit: data}
    tx = zo.zero1(optax.adam(lr), axis_name="data", mesh=mesh, partition="auto")
    got, _, compiles = run_jitted(tx, mesh, params, grads_seq)
    want = oracle(optax.adam(0.05), params, grads_seq)
    for u, w in zip(got, want):
        assert_close(u, w)
    assert compiles == 0
    with jax.set_mesh(mesh):
        placed = jax.device_put(params, NamedSharding(mesh, P()))
        u, _ = tx.update(jax.device_put(grads_seq[0], NamedSharding(mesh, P())), tx.init(placed), placed)
    assert_close(u, want[0])


def test_inject_hyperparams_around_zero1_on_an_auto_mesh():
    """On a mesh with `Auto` axes the hyperparameters need no hoisting (JAX reshards them): it still agrees."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:N])
    params = h.small_params()
    grads_seq = gradients(params, 3)
    tx = optax.inject_hyperparams(factory("flat", mesh))(learning_rate=LEARNING_RATES["schedule"]())
    got, _, compiles = run_jitted(tx, mesh, params, grads_seq)
    want = oracle(optax.adam(LEARNING_RATES["schedule"]()), params, grads_seq)
    for u, w in zip(got, want):
        assert_close(u, w)
    assert compiles == 0


def test_inject_hyperparams_around_zero1_accumulating():
    """With gradient accumulation the accumulating transformation's own inner one reads the hoisted values."""
    mesh = h.mesh_of(N)
    params = h.small_params()
    micro = gradients(params, 4)

    def make(learning_rate):
        return zo.zero1(optax.adam(learning_rate), axis_name="data", mesh=mesh, accumulate_steps=2)

    tx = optax.inject_hyperparams(make)(learning_rate=0.1)
    got, _, compiles = run_jitted(tx, mesh, params, micro)
    mean = [jax.tree.map(lambda a, b: (a + b) / 2, micro[0], micro[1]),
            jax.tree.map(lambda a, b: (a + b) / 2, micro[2], micro[3])]
    want = oracle(optax.adam(0.1), params, mean)
    assert_close(got[1], want[0])
    assert_close(got[3], want[1])
    for u in (got[0], got[2]):  # a non-final micro-batch: zero updates
        assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(u))
    assert compiles == 0


@pytest.mark.parametrize("partition", PARTITIONS)
def test_inject_hyperparams_inside_zero1(partition):
    """`inject_hyperparams` as zero1's inner transformation (no factory call inside zero1): unchanged."""
    mesh = h.mesh_of(N)
    params = h.small_params()
    grads_seq = gradients(params)

    def inner():
        return optax.inject_hyperparams(optax.adam)(learning_rate=LEARNING_RATES["schedule"]())

    tx = zo.zero1(inner(), axis_name="data", mesh=mesh, partition=partition)
    got, _, compiles = run_jitted(tx, mesh, params, grads_seq)
    # The oracle is the same inner transformation on one device: it injects b1, b2 and eps as float32 arrays too,
    # and differs from `optax.adam` itself by about 7e-6 relative.
    want = oracle(inner(), params, grads_seq)
    for u, w in zip(got, want):
        assert_close(u, w)
    assert compiles == 0
