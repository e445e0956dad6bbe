"""`zo.ZeroOptimizer` and `zo.ZeroTrainState`: Flax's `nnx.Optimizer` and `TrainState` stepping through
`zo.apply_gradients`, step by step against plain optax on one device fed the same global mean gradient, and
compiled to the step that all-gathers the new parameters instead of the updates."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h
from benchmarks.hlo import entry_traffic

N = 8
STEPS = 3
INNER = {"flat": lambda: optax.adamw(1e-2, weight_decay=0.1), "auto": lambda: optax.contrib.muon(1e-2),
         "plain": lambda: optax.adamw(1e-2, weight_decay=0.1)}


class Model(nnx.Module):
    """Kernels of 35 and 21 coordinates, biases of 7 and 3, a scalar: no size divides 8."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(5, 7, rngs=rngs)
        self.head = nnx.Linear(7, 3, rngs=rngs)
        self.scale = nnx.Param(jnp.asarray(0.7, jnp.float32))

    def __call__(self, x):
        return self.scale[...] * self.head(jnp.tanh(self.dense(x)))


def _tx(partition, mesh):
    inner = INNER[partition]()
    return inner if partition == "plain" else zo.zero1(inner, axis_name="data", mesh=mesh, partition=partition)


def _on_one_device(tree):
    return jax.device_put(jax.device_get(tree), jax.devices()[0])


def _assert_close(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def _assert_state_matches(tx_state, ref_state, partition):
    plain = tx_state if partition == "plain" else zo.gather_state(tx_state)
    _assert_close(plain, ref_state)


@pytest.mark.parametrize("partition", ["flat", "auto", "plain"])
def test_zero_optimizer_matches_optax_step_by_step(partition):
    mesh = h.mesh_of(N)
    x = jax.device_put(jnp.linspace(-1, 1, 16 * 5).reshape(16, 5), NamedSharding(mesh, P("data")))
    y = jax.device_put(jnp.cos(jnp.arange(16 * 3.0)).reshape(16, 3), NamedSharding(mesh, P("data")))
    model = Model(nnx.Rngs(0))
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    optimizer = zo.ZeroOptimizer(model, _tx(partition, mesh), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return nnx.as_pure(grads)  # the global mean gradient, for the oracle

    ref = INNER[partition]()
    ref_params = _on_one_device(nnx.as_pure(nnx.state(model, nnx.Param)))
    ref_state, ref_update = ref.init(ref_params), jax.jit(ref.update)
    compiles = 0
    for _ in range(STEPS):
        with h.CompileCounter() as counter:
            grads = train_step(model, optimizer, x, y)
        compiles += counter.count
        updates, ref_state = ref_update(_on_one_device(grads), ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        _assert_close(nnx.as_pure(nnx.state(model, nnx.Param)), ref_params)
    _assert_state_matches(nnx.as_pure(optimizer.opt_state), ref_state, partition)
    assert int(optimizer.step[...]) == STEPS and optimizer.step[...].dtype == jnp.uint32
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if partition != "plain":  # the step counter starts on the mesh: one compilation (plain optax's count does not)
        assert compiles == 1, compiles


def _params():
    """Sizes 35, 7, 15, 13 and a scalar: none divides 8."""
    return {"dense": {"w": jnp.arange(35, dtype=jnp.float32).reshape(5, 7) / 35 - 0.5, "b": jnp.linspace(-1, 1, 7)},
            "head": jnp.eye(3, 5) + 0.05, "scale": jnp.asarray(0.7, jnp.float32),
            "vec": jnp.full((13,), 0.3, jnp.float32)}  # no weak type, which the first step would change


@pytest.mark.parametrize("partition", ["flat", "auto", "plain"])
def test_zero_train_state_matches_optax_step_by_step(partition):
    mesh = h.mesh_of(N)
    params = _params()
    state = zo.ZeroTrainState.create(apply_fn=None, params=jax.device_put(params, NamedSharding(mesh, P())),
                                     tx=_tx(partition, mesh))
    step = jax.jit(lambda state, grads: state.apply_gradients(grads=grads))
    ref = INNER[partition]()
    ref_params, ref_state, ref_update = params, ref.init(params), jax.jit(ref.update)
    compiles = 0
    for g in h.gradient_sequence(params, N, steps=STEPS):
        mean = h.reduced(g)  # the global mean gradient, fed to both
        with h.CompileCounter() as counter:
            state = step(state, jax.device_put(mean, NamedSharding(mesh, P())))
        compiles += counter.count
        updates, ref_state = ref_update(mean, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        _assert_close(state.params, ref_params)
    _assert_state_matches(state.opt_state, ref_state, partition)
    assert type(state) is zo.ZeroTrainState and int(state.step) == STEPS
    if partition != "plain":  # the step counter starts on the mesh: one compilation
        assert compiles == 1, compiles


def _written(lowered) -> int:
    return sum(k["written"] for k in entry_traffic(lowered.compile().as_text()).values())


def test_compiled_steps_gather_the_new_parameters():
    """With one all-gather per leaf (sizes dividing 8) the gathered new parameters are the step's output, so the
    compiled Flax step writes about one parameter's bytes less per device than `nnx.Optimizer` and `TrainState`,
    whose `optax.apply_updates` is a full-size pass over the gathered updates."""
    mesh = h.mesh_of(N)
    tx = zo.zero1(optax.adamw(1e-2), axis_name="data", mesh=mesh, bucket_bytes=0)
    replicated = NamedSharding(mesh, P())

    def nnx_step(cls):
        model = nnx.Linear(64, 48, rngs=nnx.Rngs(0))  # a kernel of 3072 coordinates, a bias of 48
        nnx.update(model, jax.device_put(nnx.state(model), replicated))
        optimizer = cls(model, tx, wrt=nnx.Param)
        grads = nnx.state(model, nnx.Param)
        return nnx.jit(lambda m, o, g: o.update(m, g)).lower(model, optimizer, grads)

    params = jax.device_put({"w": jnp.ones((64, 48)), "b": jnp.ones((48,))}, replicated)  # the same sizes
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))

    def train_state_step(cls):
        state = cls.create(apply_fn=None, params=params, tx=tx)
        return jax.jit(lambda s, g: s.apply_gradients(grads=g)).lower(state, params)

    for plain, fast, step in ((nnx.Optimizer, zo.ZeroOptimizer, nnx_step),
                              (train_state.TrainState, zo.ZeroTrainState, train_state_step)):
        saved = _written(step(plain)) - _written(step(fast))
        assert saved >= 0.8 * nbytes, (fast.__name__, saved, nbytes)


def test_nnx_optimizer_state_carries_the_layouts_shardings():
    """Given Flax Variables, a mesh-bound zero1's `init` returns Variables annotated with the layout's specs, so
    Flax's `nnx.get_partition_spec` (what trainers built on Flax derive the state's shardings from) reads
    `zo.state_specs`; plain arrays in, plain arrays out. (`nnx.Optimizer` steps as before: the tests above.)"""
    mesh = h.mesh_of(N)
    model = Model(nnx.Rngs(0))
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    tx = zo.zero1(optax.adamw(1e-2), axis_name="data", mesh=mesh)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    expected = zo.state_specs(tx, params, mesh=mesh)
    annotated = nnx.as_pure(nnx.get_partition_spec(optimizer.opt_state))
    assert jax.tree.structure(annotated) == jax.tree.structure(expected)
    assert jax.tree.leaves(annotated) == jax.tree.leaves(expected) and set(jax.tree.leaves(expected)) == {P("data")}
    assert [x.sharding.spec for x in jax.tree.leaves(optimizer.opt_state)] == jax.tree.leaves(expected)
    plain = tx.init(params)
    is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    assert not any(is_variable(x) for x in jax.tree.leaves(plain, is_leaf=is_variable))
    _assert_close(zo.gather_state(nnx.as_pure(optimizer.opt_state)), zo.gather_state(plain))
