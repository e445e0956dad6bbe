"""optax.lbfgs through zero1: its memory buffers `(memory_size, *param.shape)` are per-coordinate histories
stacked along a leading axis (written and read at an index every coordinate shares), and its inner products
(`optax.tree.vdot`, norms, inside `lax.scan`) are full reductions, which sliced leaves run as collectives. So
`"flat"` runs it exactly, and `"auto"` chooses that layout; both match plain optax on one device fed the same
gradients, the parameters and the gathered state."""

from __future__ import annotations

import functools
import math

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

STEPS = 4


def _params() -> dict:
    """Leaves whose sizes do not divide 8, a 0-d scalar among them."""
    return {"w": jnp.arange(15, dtype=jnp.float32).reshape(5, 3) / 15 - 0.5, "b": jnp.linspace(-1.0, 1.0, 3),
            "s": jnp.asarray(0.7, jnp.float32)}


def _lbfgs() -> optax.GradientTransformation:
    return optax.lbfgs(0.5, memory_size=3, linesearch=None)


def _assert_close(got, want, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Every leaf of `got` allclose to `want`'s (the same tree)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        assert np.shape(a) == np.shape(b), jax.tree_util.keystr(path)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("partition", ["auto", "flat"])
def test_lbfgs_mesh_bound_matches_optax(partition):
    mesh = h.mesh_of(8)
    tx = zo.zero1(_lbfgs(), axis_name="data", mesh=mesh, partition=partition)
    z_params, z_state, r_params, r_state = h.run_mesh_bound(tx, _lbfgs(), _params(), STEPS, mesh)
    _assert_close(z_params, r_params)
    _assert_close(zo.gather_state(z_state), r_state)
    assert not np.allclose(np.asarray(r_params["w"]), np.asarray(_params()["w"]))  # (the steps moved it)
    assert int(r_state[0].count) == STEPS


@pytest.mark.parametrize("partition", ["auto", "flat"])
@pytest.mark.parametrize("shape, tree", [((5, 3), True), ((16,), True), ((2, 4, 8), False)],
                         ids=["leaf_5x3", "leaf_16", "bare_2x4x8"])
def test_lbfgs_on_one_leaf_matches_optax(partition, shape, tree):
    """One leaf (in a dict, or a bare array, as optax's own sharding test passes it): its inner products still sum
    over every device's slice (a collective, as for several leaves), and the index normalisation of its memory reads
    (`(memory, *shape)` on the parameter, `(memory, slots)` on the slice) is the same program."""
    mesh = h.mesh_of(8)
    x = jnp.sin(jnp.arange(math.prod(shape), dtype=jnp.float32)).reshape(shape)
    params = {"w": x} if tree else x
    tx = zo.zero1(_lbfgs(), axis_name="data", mesh=mesh, partition=partition)
    z_params, z_state, r_params, r_state = h.run_mesh_bound(tx, _lbfgs(), params, STEPS, mesh)
    # (atol: values of order 1 summed over 8 slices, not in one dot; JAX 0.12 moves one near 0 by 1.2e-6)
    _assert_close(z_params, r_params, atol=1e-5)
    _assert_close(zo.gather_state(z_state), r_state, atol=1e-5)
    layout = zo.describe(z_state)
    assert set(layout.sharding) == {"sliced"} and layout.joint
    assert not np.allclose(np.asarray(jax.tree.leaves(r_params)[0]), np.asarray(x))  # (the steps moved it)


def test_auto_slices_every_leaf_and_the_memory_by_coordinate():
    """`"auto"` lays lbfgs out as `"flat"` does: every leaf sliced, one joint view (its reductions are global), and
    each memory buffer stored as this device's slots of every row, its leading memory axis whole."""
    tx = zo.zero1(_lbfgs(), axis_name="data", mesh=h.mesh_of(8), partition="auto")
    layout = zo.describe(tx.init(_params()))
    assert set(layout.sharding) == {"sliced"} and layout.joint
    memory = {e.path: e.shape for e in layout.entries if "memory" in e.path and e.leaf is not None}
    by_leaf = {leaf.path: leaf.slots for leaf in layout.leaves}
    assert memory["[0].diff_params_memory['w']"] == (3, by_leaf["['w']"])
    assert memory["[0].diff_updates_memory['s']"] == (3, by_leaf["['s']"])
    assert layout.state_bytes_per_device[0] < sum(np.prod(s) for s in memory.values()) * 4 * 8  # (sharded)


def test_lbfgs_inside_shard_map_matches_optax():
    """Inside `jax.shard_map` (no mesh=), each device's own gradients: zero1 reduces them to the global mean."""
    params, n = _params(), 8
    grads = h.gradient_sequence(params, n, STEPS)
    tx = zo.zero1(_lbfgs(), axis_name="data", partition="auto")
    z_params, z_state, _ = h.run_zero(tx, params, grads, n)
    r_params, r_state = h.run_oracle(_lbfgs(), params, grads)
    _assert_close(z_params, r_params)
    _assert_close(zo.gather_state(z_state), r_state)


def test_scatter_state_round_trips_the_memory():
    """`zo.scatter_state` cuts every row of a memory buffer as its leaf is cut; `zo.gather_state` joins them back,
    and a step from the scattered state is plain optax's step."""
    mesh = h.mesh_of(8)
    tx = zo.zero1(_lbfgs(), axis_name="data", mesh=mesh, partition="flat")
    _, z_state, r_params, r_state = h.run_mesh_bound(tx, _lbfgs(), _params(), 2, mesh)
    scattered = zo.scatter_state(tx, r_state, jax.device_put(r_params, NamedSharding(mesh, P())))
    _assert_close(zo.gather_state(scattered), r_state, rtol=0, atol=0)
    g = jax.tree.map(lambda x: jnp.cos(x) + 0.1, r_params)
    z_u, z_next = jax.jit(tx.update)(g, scattered, r_params)
    r_u, r_next = _lbfgs().update(g, r_state, r_params)
    _assert_close(z_u, r_u)
    _assert_close(zo.gather_state(z_next), r_next)


def _stacked_reader(read) -> optax.GradientTransformation:
    """A transformation keeping a `(2, *param.shape)` history per leaf, its update `read(history, g)`."""
    def init(params):
        return jax.tree.map(lambda p: jnp.zeros((2, *p.shape), p.dtype), params)

    def update(updates, state, params=None):
        del params
        state = jax.tree.map(lambda m, g: m.at[1].set(g), state, updates)
        return jax.tree.map(read, state, updates), state
    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("read", [
    lambda m, g: g + m[0] * m[1] + m.sum(0),  # leading index shared by all coordinates, a sum over the memory
    lambda m, g: g + jnp.broadcast_to(g, m.shape)[1],  # a copy per memory row
    # (a traced index, its arithmetic on constants reading a dimension: the value is the same on a slice)
    lambda m, g: g + lax.dynamic_index_in_dim(m, jnp.int32(1) + jnp.int32(0) * jnp.int32(m.shape[-1]), 0, False),
], ids=["index", "broadcast", "dynamic_index"])
@pytest.mark.parametrize("one_leaf", [False, True], ids=["leaves", "one_leaf"])
def test_stacked_history_reads_along_the_memory_axis_run_flat(read, one_leaf):
    mesh = h.mesh_of(8)
    params = {"w": _params()["w"]} if one_leaf else _params()
    tx = zo.zero1(_stacked_reader(read), axis_name="data", mesh=mesh, partition="flat")
    z_params, z_state, r_params, r_state = h.run_mesh_bound(tx, _stacked_reader(read), params, 2, mesh)
    _assert_close(z_params, r_params)
    _assert_close(zo.gather_state(z_state), r_state)


@pytest.mark.parametrize("read, why", [
    (lambda m, g: g + m.reshape(-1)[: g.size].reshape(g.shape), "reshapes a stacked history across its leading"),
    (lambda m, g: g + jnp.swapaxes(m, 0, -1).reshape(-1)[: g.size].reshape(g.shape) if g.ndim else g,
     "transposes a parameter-shaped value"),
    (lambda m, g: g + m[:, ..., :1].sum(0) if g.ndim else g, "slices a parameter-derived value along its coord"),
    (lambda m, g: g + jnp.sum(m, axis=-1, keepdims=True)[0] if g.ndim == 2 else g,
     "reduces a parameter-derived value over axes of sizes \\[3\\]"),
], ids=["flatten", "swap", "coordinate_slice", "coordinate_sum"])
def test_stacked_history_mixing_coordinates_is_refused(read, why):
    """Moving a history's values across its coordinates (not along its memory axis) stays refused."""
    tx = zo.zero1(_stacked_reader(read), axis_name="data", mesh=h.mesh_of(8), partition="flat")
    with pytest.raises(zo.ZeroCouplingError, match=f"partition=\"flat\".*{why}"):
        tx.init(_params())


def _shape_reader(in_scan: bool) -> optax.GradientTransformation:
    """Scales the update by its leaf's leading dimension, computed as integer arithmetic on constants (the kind the
    program signatures fold, as in an index normalised against a dimension), in a `scan`'s result if `in_scan`."""
    def size_of(g):
        n = lax.add(jnp.int32(g.shape[0]), 0)
        if in_scan:
            n, _ = lax.scan(lambda c, _: (lax.add(jnp.int32(g.shape[0]), 0), None), jnp.int32(0), length=1)
        return n.astype(g.dtype)

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda g: g * size_of(g), updates), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize("partition", ["auto", "flat"])
@pytest.mark.parametrize("in_scan", [False, True], ids=["direct", "scan"])
def test_shape_constants_folded_in_signatures_are_still_refused(partition, in_scan):
    """Folding constant index arithmetic keeps the values it computes in the signature: a dimension read that way
    still differs between the parameter and its slice, and is refused."""
    tx = zo.zero1(_shape_reader(in_scan), axis_name="data", mesh=h.mesh_of(8), partition=partition)
    with pytest.raises(zo.ZeroCouplingError, match="operations to the parameters but"):
        tx.init({"w": jnp.ones((16,))})


def test_lbfgs_under_leaf_is_refused():
    """Its inner products sum over every leaf: owners of whole leaves cannot split them."""
    tx = zo.zero1(_lbfgs(), axis_name="data", mesh=h.mesh_of(8), partition="leaf")
    with pytest.raises(zo.ZeroCouplingError, match="mixes parameter leaves"):
        tx.init(_params())


def test_lbfgs_with_its_default_linesearch_is_refused():
    """optax.lbfgs's zoom linesearch evaluates `value_fn` on whole trial parameters inside a `while_loop`; zero1
    hands the inner update coordinate slices (or owned leaves), on which no device holds a trial point: refused."""
    def loss(p):
        return sum(jnp.sum((x - 0.25) ** 2) for x in jax.tree.leaves(p))
    inner = optax.lbfgs()
    bound = optax.GradientTransformationExtraArgs(inner.init, functools.partial(inner.update, value_fn=loss))
    for partition in ("auto", "flat"):
        tx = zo.zero1(bound, axis_name="data", mesh=h.mesh_of(8), partition=partition)
        params = _params()
        with pytest.raises(zo.ZeroError):
            state = tx.init(params)
            value, grad = jax.value_and_grad(loss)(params)
            tx.update(grad, state, params, value=value, grad=grad)


def test_checkpoint_restores_on_its_mesh_and_moves_by_relayout(tmp_path):
    """Saved and restored on its own mesh, the state holds the same values; restoring it re-cut at another world
    size is refused by name (a re-cut of stacked rows is not written yet), while `zo.relayout` moves it exactly."""
    import orbax.checkpoint as ocp

    params = _params()
    mesh = h.mesh_of(8)
    tx = zo.zero1(_lbfgs(), axis_name="data", mesh=mesh, partition="auto")
    _, state, _, r_state = h.run_mesh_bound(tx, _lbfgs(), params, 2, mesh)
    with ocp.CheckpointManager(tmp_path / "saved") as mngr:
        mngr.save(1, args=ocp.args.Composite(opt_state=zo.ZeroSave(state)))
        mngr.wait_until_finished()
    item = tmp_path / "saved" / "1" / "opt_state"
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        restored = ckpt.restore(item, args=zo.ZeroRestore(tx.init(params)))
        _assert_close(zo.gather_state(restored), zo.gather_state(state), rtol=0, atol=0)
        _assert_close(zo.gather_state(restored), r_state)
        other = zo.zero1(_lbfgs(), axis_name="data", mesh=h.mesh_of(3), partition="auto")
        with pytest.raises(zo.ZeroCheckpointError, match="stacked along leading axes"):
            ckpt.restore(item, args=zo.ZeroRestore(other.init(params), reshard=True))
    moved = zo.relayout(jax.device_get(state), other, params)
    _assert_close(zo.gather_state(moved), zo.gather_state(state), rtol=0, atol=0)
