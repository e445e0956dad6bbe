"""A zero1 state read as code reads an optax state: `len`, `state[i]`, iteration and unpacking, fields at every
level, each part of the inner state's own type, against plain optax's state on one device fed the same gradients;
shared fields read without a collective, writes into a read dict reaching the state, per-parameter reads refused
inside `shard_map`, and Flax's `nnx.Optimizer` state."""

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
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")


def _params():
    return {"w": jnp.linspace(-1.0, 1.0, 15).reshape(5, 3), "b": jnp.float32(2.0), "v": jnp.ones(13)}


def _grads(params, steps=3):
    return [jax.tree.map(lambda x, i=i: jnp.sin(x * (i + 1)) + 0.1, params) for i in range(steps)]


def _inner(partition="flat"):
    """A chain as trainers build it: a clip (by the global norm, which owners of whole leaves cannot compute), then
    Adam with an injected learning rate."""
    clip = optax.clip(1.0) if partition == "leaf" else optax.clip_by_global_norm(1.0)
    return optax.chain(clip, optax.inject_hyperparams(optax.adam)(learning_rate=0.1))


def _run(tx, params, grads, state=None):
    state = tx.init(params) if state is None else state
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=1e-6), a, b)


@pytest.mark.parametrize("partition", ["flat", "auto", "leaf"])
def test_a_chain_reads_as_optax_state(partition):
    params = _params()
    grads = _grads(params)
    _, ref = _run(_inner(partition), params, grads)
    _, state = _run(zo.zero1(_inner(partition), axis_name="data", mesh=MESH, partition=partition), params, grads)

    assert len(state) == len(ref) == 2
    assert [type(part) for part in state] == [type(part) for part in ref]
    clip, adam = state  # unpacking
    assert type(clip) is type(ref[0]) and type(adam) is type(ref[1])
    assert float(state[1].hyperparams["learning_rate"]) == pytest.approx(0.1)
    assert int(state[1].inner_state[0].count) == int(ref[1].inner_state[0].count) == 3
    assert type(state[1].inner_state[0]) is optax.ScaleByAdamState
    _close(state[1].inner_state[0].mu, ref[1].inner_state[0].mu)  # a per-parameter field, gathered
    # a whole part: optax's tree and values (its `hyperparams` a dict that writes through, a plain one once mapped)
    _close(jax.tree.map(jnp.asarray, state[1]), ref[1])
    assert jax.tree.structure(state[1].inner_state) == jax.tree.structure(ref[1].inner_state)
    assert float(optax.tree.get(state, "learning_rate")) == pytest.approx(0.1)
    replaced = state[1].inner_state[0]._replace(count=jnp.int32(7))
    assert type(replaced) is optax.ScaleByAdamState and int(replaced.count) == 7
    _close(replaced.nu, ref[1].inner_state[0].nu)


def test_the_trainer_loop_that_logs_the_learning_rate():
    """The read of the issue: `hyperparams` of the state, else of the first part that has them."""
    state = zo.zero1(_inner(), axis_name="data", mesh=MESH).init(_params())

    def learning_rate(opt_state):
        if hasattr(opt_state, "hyperparams"):
            return opt_state.hyperparams["learning_rate"]
        for part in opt_state:
            if isinstance(part, optax.EmptyState):
                continue
            if hasattr(part, "hyperparams"):
                return part.hyperparams["learning_rate"]
        return None
    assert float(learning_rate(state)) == pytest.approx(0.1)


def test_a_field_named_like_zero1s_own_reads_as_the_inner_ones():
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    params = _params()
    grads = _grads(params)
    _, ref = _run(inner, params, grads)
    _, state = _run(zo.zero1(inner, axis_name="data", mesh=MESH), params, grads)
    assert type(state.inner_state) is tuple and len(state.inner_state) == len(ref.inner_state)
    assert int(state.inner_state[0].count) == 3
    _close(state.inner_state[0].nu, ref.inner_state[0].nu)
    assert int(state.count) == int(ref.count)
    assert sorted(state.hyperparams) == sorted(ref.hyperparams)
    with pytest.raises(AttributeError, match="no attribute 'mu'"):
        state.mu  # noqa: B018  (Adam's mu is below inner_state here, as in optax's state)


def test_a_write_into_a_read_reaches_the_state():
    """`state.hyperparams["learning_rate"] = x` changes an optax state in place; it changes a zero1 state too."""
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    tx = zo.zero1(inner, axis_name="data", mesh=MESH)
    params = _params()
    grads = _grads(params)
    p, state = _run(tx, params, grads[:1])
    rp, ref = _run(inner, params, grads[:1])
    state.hyperparams["learning_rate"] = jnp.float32(0.5)
    ref.hyperparams["learning_rate"] = jnp.float32(0.5)
    assert float(state.hyperparams["learning_rate"]) == 0.5
    p, state = _run(tx, p, grads[1:], state)
    rp, ref = _run(inner, rp, grads[1:], ref)
    _close(p, rp)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.5)
    with pytest.raises(zo.ZeroStructureError, match="optax.tree.set"):
        state.hyperparams["momentum"] = 0.9  # not a field of Adam's
    with pytest.raises(zo.ZeroStructureError, match="optax.tree.set"):
        state.hyperparams.pop("learning_rate")


def test_reading_changes_nothing_stored():
    tx = zo.zero1(_inner(), axis_name="data", mesh=MESH)
    state = tx.init(_params())
    before = jax.tree.leaves(state)
    for part in state:
        jax.tree.leaves(part)
    _ = state[1].inner_state[0].mu, state.count if hasattr(state, "count") else None
    after = jax.tree.leaves(state)
    assert len(before) == len(after) and all(a is b for a, b in zip(before, after))


def test_shared_fields_read_under_jit_without_a_collective():
    tx = zo.zero1(_inner(), axis_name="data", mesh=MESH)
    state = tx.init(_params())
    read = jax.jit(lambda s: (s[1].hyperparams["learning_rate"], s[1].count, s[1].inner_state[0].count))
    hlo = read.lower(state).compile().as_text()
    assert not [c for c in COLLECTIVES if c in hlo], hlo
    lr, count, adam_count = read(state)
    assert float(lr) == pytest.approx(0.1) and int(count) == 0 and int(adam_count) == 0
    # a read of a per-parameter field under jit gathers it (and only then)
    mu = jax.jit(lambda s: s[1].inner_state[0].mu)(state)
    assert mu["w"].shape == (5, 3) and mu["w"].sharding.is_fully_replicated


def test_inside_shard_map_shared_fields_read_and_per_parameter_ones_are_refused():
    params = jax.device_put(_params(), NamedSharding(MESH, P()))

    def body(params):
        state = zo.zero1(_inner(), axis_name="data").init(params)
        mu = state[1].inner_state[0].mu  # in a part: markers, refused where used
        with pytest.raises(zo.ZeroStructureError, match="zo.gather_state"):
            jnp.asarray(mu["w"])
        adam = zo.zero1(optax.scale_by_adam(), axis_name="data").init(params)
        with pytest.raises(zo.ZeroStructureError, match=r"`\.mu\['b'\]` is per-parameter.*zo.gather_state"):
            adam.mu  # noqa: B018  (the read of the field itself)
        return state[1].hyperparams["learning_rate"], adam.count

    lr, count = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P(), out_specs=P()))(params)
    assert float(lr) == pytest.approx(0.1) and int(count) == 0


@pytest.mark.parametrize("partition", ["flat", "leaf"])
def test_nnx_optimizer_state_reads_as_optax_state(partition):
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(5, 3, rngs=rngs)

    def loss(model, x):
        return jnp.mean(model.linear(x) ** 2)

    x = jax.device_put(jnp.linspace(-1.0, 1.0, 40).reshape(8, 5), NamedSharding(MESH, P("data")))
    optimizers = []
    for tx in (_inner(partition), zo.zero1(_inner(partition), axis_name="data", mesh=MESH, partition=partition)):
        model = Model(nnx.Rngs(0))
        nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(MESH, P())))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, x):
            optimizer.update(model, nnx.grad(loss)(model, x))

        for _ in range(2):
            step(model, optimizer, x)
        optimizers.append(optimizer)
    ref, got = (o.opt_state for o in optimizers)
    assert len(got) == 2 and isinstance(got[0], optax.EmptyState)
    assert float(got[1].hyperparams["learning_rate"]) == pytest.approx(0.1)
    assert int(got[1].inner_state[0].count) == 2
    want = jax.tree.leaves(nnx.as_pure(ref[1].inner_state[0].mu))
    got_mu = jax.tree.leaves(got[1].inner_state[0].mu)
    assert len(got_mu) == len(want) == 2
    _close(got_mu, want)
    with pytest.raises(zo.ZeroStructureError, match="optax.tree.set"):
        got[1].hyperparams["learning_rate"] = 0.5  # a read of Variables is a copy: refused, never dropped


def test_a_state_saved_by_0_5_relays_out():
    """zero_optax 0.5 kept the stored inner state under `inner_state`: a checkpoint's nested dict of it still
    relays out."""
    tx = zo.zero1(optax.adam(0.1), axis_name="data", mesh=MESH)
    params = _params()
    _, state = _run(tx, params, _grads(params, 2))
    saved = jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]
    old = {}
    for path, value in saved:
        names = ["inner_state" if getattr(k, "name", None) == "_inner" else str(getattr(k, "name", getattr(
            k, "key", getattr(k, "idx", k)))) for k in path]
        node = old
        for name in names[:-1]:
            node = node.setdefault(name, {})
        node[names[-1]] = value
    moved = zo.relayout(old, zo.zero1(optax.adam(0.1), axis_name="data", mesh=h.mesh_of(4)), params)
    _close(zo.gather_state(moved), zo.gather_state(state))
