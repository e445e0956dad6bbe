"""zero1's `init` (and `update`, `zo.state_specs`, `zo.plan`) takes what optax's `init` takes, against plain optax:
`jax.ShapeDtypeStruct` leaves (a mesh-bound init gives the abstract state, a restore target for Orbax), `None`
leaves (skipped, as optax skips them) and Python floats (0-d arrays, as `jnp.zeros_like(3.0)` makes them). Python
ints and bools are refused with the leaf's key path: optax's state for one changes dtype at the first update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo

PARTITIONS = ("flat", "auto", "leaf")


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), ("data",))


def _params() -> dict:
    return {"w": jnp.arange(32.0).reshape(4, 8) / 32, "b": jnp.asarray(0.5)}


def _structs(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _types(tree) -> list:
    """Each leaf's shape, dtype and spec (one entry per dimension)."""
    def spec(x):
        s = tuple(x.sharding.spec)
        return s + (None,) * (len(x.shape) - len(s))
    return [(x.shape, jnp.dtype(x.dtype), spec(x)) for x in jax.tree.leaves(tree)]


def _assert_close(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


# --- jax.ShapeDtypeStruct leaves ---------------------------------------------------------------------------------

@pytest.mark.parametrize("partition", PARTITIONS)
def test_abstract_init_is_eval_shape_with_concrete_shardings(partition):
    mesh = _mesh()
    tx = zo.zero1(optax.adam(0.1), axis_name="data", mesh=mesh, partition=partition)
    abstract = tx.init(_structs(_params()))
    real = tx.init(_params())
    assert jax.tree.structure(abstract) == jax.tree.structure(real)  # the layout included
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    assert _types(abstract) == _types(jax.eval_shape(tx.init, _params())) == _types(real)
    assert [x.sharding for x in jax.tree.leaves(abstract)] == [x.sharding for x in jax.tree.leaves(real)]
    assert all(x.sharding.mesh is mesh for x in jax.tree.leaves(abstract))
    specs = zo.state_specs(tx, _structs(_params()))
    assert [x.sharding.spec for x in jax.tree.leaves(abstract)] == [
        P(*s, *[None] * (len(x.shape) - len(s))) for s, x in zip(jax.tree.leaves(specs), jax.tree.leaves(real))]


def test_bare_and_mixed_structs():
    tx = zo.zero1(optax.adam(0.1), axis_name="data", mesh=_mesh(), partition="auto")
    bare = tx.init(jax.ShapeDtypeStruct((2, 4, 8), jnp.float32))
    assert _types(bare) == _types(tx.init(jnp.zeros((2, 4, 8))))
    params = _params()
    mixed = tx.init({"w": params["w"], "b": jax.ShapeDtypeStruct((), jnp.float32)})  # one abstract leaf: abstract
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(mixed))
    assert _types(mixed) == _types(tx.init(params))


def test_a_struct_keeps_its_model_axis():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    tx = zo.zero1(optax.adam(0.1), axis_name="data", mesh=mesh, partition="auto")
    sharding = NamedSharding(mesh, P(None, "model"))
    abstract = tx.init({"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharding)})
    real = tx.init({"w": jax.device_put(jnp.ones((8, 4)), sharding)})
    assert _types(abstract) == _types(real)
    assert [x.sharding for x in jax.tree.leaves(abstract)] == [x.sharding for x in jax.tree.leaves(real)]
    assert any("model" in str(x.sharding.spec) for x in jax.tree.leaves(abstract))


def test_unbound_zero1_refuses_structs():
    tx = zo.zero1(optax.adam(0.1), axis_name="data")
    with pytest.raises(zo.ZeroStructureError, match=r"ShapeDtypeStruct at \['w'\].*mesh=mesh.*jax.eval_shape"):
        tx.init(_structs({"w": jnp.ones(3)}))
    # inside a shard_map, traced abstractly, it works
    specs = zo.state_specs(tx, {"w": jnp.ones(3)}, mesh=_mesh())
    init = jax.shard_map(tx.init, mesh=_mesh(), in_specs=P(), out_specs=specs)
    assert _types(jax.eval_shape(init, _structs({"w": jnp.ones(3)})))


def _trained(tx, params, steps: int = 2):
    state = tx.init(params)
    for i in range(steps):
        _, state = tx.update(jax.tree.map(lambda x, k=i + 1: x * k, params), state, params)
    return state


def test_abstract_state_restores_through_zero_checkpoint_handler(tmp_path):
    tx = zo.zero1(optax.adam(0.1), axis_name="data", mesh=_mesh(), partition="auto")
    state = _trained(tx, _params())
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, args=ocp.args.Composite(opt=zo.ZeroSave(state)))
        mngr.wait_until_finished()
        target = tx.init(_structs(_params()))
        restored = mngr.restore(1, args=ocp.args.Composite(opt=zo.ZeroRestore(target))).opt
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert [x.sharding for x in jax.tree.leaves(restored)] == [x.sharding for x in jax.tree.leaves(state)]
    _assert_close(restored, state)


def test_abstract_state_restores_through_standard_checkpointer(tmp_path):
    tx = zo.zero1(optax.adam(0.1), axis_name="data", mesh=_mesh(), partition="leaf")
    state = _trained(tx, _params())
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "state", state)
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "state", tx.init(_structs(_params())))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert [x.sharding for x in jax.tree.leaves(restored)] == [x.sharding for x in jax.tree.leaves(state)]
    _assert_close(restored, state)


# --- None leaves -------------------------------------------------------------------------------------------------

def _frozen(w: jax.Array) -> dict:
    return {"frozen": None, "w": w}


@pytest.mark.parametrize("partition", PARTITIONS)
def test_none_leaves_mesh_bound(partition):
    tx = zo.zero1(optax.adam(0.1), axis_name="data", mesh=_mesh(), partition=partition)
    ref = optax.adam(0.1)
    params = _frozen(jnp.arange(4.0))
    state, ref_state = tx.init(params), ref.init(params)
    for i in range(3):
        grads = _frozen(jnp.arange(4.0) * (i + 1))
        updates, state = tx.update(grads, state, params)
        ref_updates, ref_state = ref.update(grads, ref_state, params)
        assert updates["frozen"] is None
        _assert_close(updates, ref_updates)
    _assert_close(zo.gather_state(state), ref_state)
    assert zo.plan(optax.adam(0.1), params, mesh=_mesh(), partition=partition).layout == state.layout


def test_none_leaves_inside_shard_map():
    mesh = _mesh()
    tx = zo.zero1(optax.adam(0.1), axis_name="data", partition="auto")
    ref = optax.adam(0.1)
    params = _frozen(jnp.arange(4.0))
    specs = zo.state_specs(tx, params, mesh=mesh)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

    def local(grads, state, params):  # each device's gradient: the reduced one is their mean, the gradient itself
        return tx.update(zo.as_local(grads, "data"), state, params)

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P()), out_specs=(P(), specs)))
    state, ref_state = init(params), ref.init(params)
    for i in range(3):
        grads = _frozen(jnp.arange(4.0) * (i + 1))
        updates, state = step(grads, state, params)
        ref_updates, ref_state = ref.update(grads, ref_state, params)
        assert updates["frozen"] is None
        _assert_close(updates, ref_updates)


# --- Python scalars ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("partition", PARTITIONS)
def test_python_floats_are_taken_as_optax_takes_them(partition):
    tx = zo.zero1(optax.adam(0.1), axis_name="data", mesh=_mesh(), partition=partition)
    ref = optax.adam(0.1)
    params = {"w": jnp.arange(4.0), "s": 3.0}
    state, ref_state = tx.init(params), ref.init(params)
    assert [x.dtype for x in jax.tree.leaves(zo.gather_state(state))] == [
        x.dtype for x in jax.tree.leaves(ref_state)]
    for i in range(3):
        grads = {"w": jnp.arange(4.0) * (i + 1), "s": 0.5 * (i + 1)}
        updates, state = tx.update(grads, state, params)
        ref_updates, ref_state = ref.update(grads, ref_state, params)
        _assert_close(updates, ref_updates)
    assert tx.init(3.0).layout.leaves[0].shape == ()
    assert zo.plan(optax.adam(0.1), params, mesh=_mesh(), partition=partition).layout == state.layout
    assert jax.tree.structure(zo.state_specs(tx, params)) == jax.tree.structure(state)


@pytest.mark.parametrize("value", [3, True], ids=["int", "bool"])
def test_python_ints_are_refused_by_key_path(value):
    tx = zo.zero1(optax.adam(0.1), axis_name="data", mesh=_mesh())
    params = {"w": jnp.ones(4), "n": value}
    message = r"Python (int|bool) .* at \['n'\].*jnp.asarray\(.*None"
    for call in (lambda: tx.init(params), lambda: zo.state_specs(tx, params),
                 lambda: zo.plan(optax.adam(0.1), params, mesh=_mesh())):
        with pytest.raises(zo.ZeroStructureError, match=message):
            call()


def test_zero_dimensional_arrays_still_work():
    tx = zo.zero1(optax.adam(0.1), axis_name="data", mesh=_mesh())
    state = tx.init({"w": jnp.ones(4), "n": jnp.asarray(3)})
    assert [x.dtype for x in jax.tree.leaves(zo.gather_state(state))] == [
        x.dtype for x in jax.tree.leaves(optax.adam(0.1).init({"w": jnp.ones(4), "n": jnp.asarray(3)}))]
