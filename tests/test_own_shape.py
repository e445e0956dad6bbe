"""A device that holds a large leaf whole (a one-device ZeRO group) keeps its state in the leaf's own shape
(`Group.shape`), so XLA updates the donated parameter and moments in place; checked against plain optax on one
device, through checkpoints that change the world size, and on a tensor-parallel mesh."""

import math
import re

import _zero_setup as zs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import test_restore_reshard as rr

# "w" and "t" are over `_plan.FUSE_BYTES` (16 KiB), so each is a group of its own; "b" and "s" are fused.
SHAPES = {"w": (72, 64), "t": (3, 40, 40), "b": (13,), "s": ()}
BIG = ("['t']", "['w']")


def adamw():
    return optax.adamw(1e-2, weight_decay=0.1)  # its weight decay reads the parameters


def one_device_mesh():
    return jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])


def group_shapes(layout) -> dict:
    return {layout.leaves[g.first].path: g.shape for g in layout.groups}


def oracle(steps: list[tuple[int, int]], inner=None):
    """Plain optax (`adamw()` by default) on one device, fed `zs.grads_np(t, n)` averaged over its `n` devices, for
    each `(t, n)`."""
    inner = inner or adamw()
    params = zs.params_np(SHAPES)
    state = inner.init(params)
    for t, n in steps:
        g = {k: v.mean(0) for k, v in zs.grads_np(t, n, SHAPES).items()}
        u, state = inner.update(g, state, params)
        params = optax.apply_updates(params, u)
    return params, state


def assert_close_trees(a, b, rtol=2e-5, atol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_one_device_keeps_large_leaves_in_their_shape_and_updates_them_in_place():
    m = one_device_mesh()
    tx = zo.zero1(adamw(), axis_name="data", mesh=m)
    params = zs.params(m, SHAPES)
    state = tx.init(params)
    layout = zo.describe(state)
    assert group_shapes(layout) == {"['b']": None, "['t']": (3, 40, 40), "['w']": (72, 64)}
    for g, group in enumerate(layout.groups):
        assert all(x.shape == group.part_shape for x in state._inner.histories[g])

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for t in range(3):
        params, state = step(params, state, {k: v.mean(0) for k, v in zs.grads_np(t, 1, SHAPES).items()})
    ref_params, ref_state = oracle([(0, 1), (1, 1), (2, 1)])
    assert_close_trees(params, ref_params)
    assert_close_trees(zo.gather_state(state), ref_state)
    # A donated step writes the parameters and moments where they are: no copy of any of them.
    g = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    hlo = jax.jit(step.__wrapped__, donate_argnums=(0, 1)).lower(params, state, g).compile().as_text()
    copied = [math.prod(int(d) for d in dims.split(",") if d)
              for dims in re.findall(r"= f32\[([\d,]*)\]\S* copy\(", hlo)]
    assert not [size for size in copied if size >= 4096], copied


def test_eight_devices_keep_the_one_dimensional_layout():
    """Where a leaf's coordinates are split over devices its state stays 1-D (rows of `size`)."""
    m = zs.mesh(8)
    state = zo.zero1(adamw(), axis_name="data", mesh=m).init(zs.params(m, SHAPES))
    assert set(group_shapes(zo.describe(state)).values()) == {None}


@pytest.mark.parametrize("n,m", [(1, 3), (3, 1)])
def test_checkpoints_move_between_one_device_and_several(tmp_path, n, m):
    """Two steps at n devices, saved, restored at m (load-time resharding), one more step: plain optax's result."""
    first = zs.Trainer(zs.make_tx("adamw"), zs.mesh(n))
    p, s = first.train(zs.params(first.mesh, SHAPES), first.init(zs.params(first.mesh, SHAPES)), 0, 2, SHAPES)
    item = rr.save(str(tmp_path / "ckpt"), s)
    second = zs.Trainer(zs.make_tx("adamw"), zs.mesh(m))
    p = jax.device_put(jax.tree.map(np.asarray, p), NamedSharding(second.mesh, P()))
    restored = rr.restore(item, second.abstract(p), reshard=True)
    shapes = group_shapes(zo.describe(restored))
    if m == 1:
        assert {k: shapes[k] for k in BIG} == {"['t']": (3, 40, 40), "['w']": (72, 64)}
    else:
        assert set(shapes.values()) == {None}
    assert_close_trees(zo.gather_state(restored), zo.gather_state(s), rtol=0, atol=0)  # nothing lost on the way
    p, s = second.train(p, restored, 2, 3, SHAPES)
    ref_params, ref_state = oracle([(0, n), (1, n), (2, m)], zs.inner("adamw"))
    assert_close_trees(p, ref_params)
    assert_close_trees(zo.gather_state(s), ref_state)


def test_master_copies_and_accumulation_in_the_leafs_shape():
    """bf16 parameters with float32 master copies, and two micro-batches per step against `optax.MultiSteps`."""
    m = one_device_mesh()
    params = {"w": (jnp.arange(96 * 64, dtype=jnp.float32).reshape(96, 64) / 6144 - 0.5).astype(jnp.bfloat16)}
    grads = [{"w": jnp.full((96, 64), 0.1 * (t + 1), jnp.bfloat16)} for t in range(4)]
    tx = zo.zero1(adamw(), axis_name="data", mesh=m, master_dtype=jnp.float32)
    state = tx.init(params)
    assert zo.describe(state).groups[0].shape == (96, 64) and state.master[0].shape == (96, 64)
    p = params
    for g in grads:
        u, state = jax.jit(tx.update)(g, state, p)
        p = optax.apply_updates(p, u)
    master = {"w": params["w"].astype(jnp.float32)}
    ref_state = adamw().init(master)
    for g in grads:
        u, ref_state = adamw().update({"w": g["w"].astype(jnp.float32)}, ref_state, master)
        master = optax.apply_updates(master, u)
    np.testing.assert_allclose(np.asarray(zo.master_params(state)["w"]), np.asarray(master["w"]), rtol=2e-5,
                               atol=1e-6)
    np.testing.assert_array_equal(np.asarray(p["w"]), np.asarray(master["w"].astype(jnp.bfloat16)))

    f32 = {"w": params["w"].astype(jnp.float32)}
    tx = zo.zero1(adamw(), axis_name="data", mesh=m, accumulate_steps=2)
    state, p = tx.init(f32), f32
    ref = optax.MultiSteps(adamw(), every_k_schedule=2)
    ref_state, q = ref.init(f32), f32
    for g in grads:
        g = {"w": g["w"].astype(jnp.float32)}
        u, state = jax.jit(tx.update)(g, state, p)
        p = optax.apply_updates(p, u)
        v, ref_state = ref.update(g, ref_state, q)
        q = optax.apply_updates(q, v)
    assert zo.describe(state).groups[0].shape == (96, 64)
    assert_close_trees(p, q)


def test_tensor_parallel_blocks_on_a_data_axis_of_one():
    """A (72, 128) matrix split over `model` (2) with a data axis of 1: each device keeps its (72, 64) block's
    state in that shape, and the parameters are plain optax's on the whole matrix (`gather_state` refuses
    tensor-parallel blocks; weight decay and the moments shape every step's parameters)."""
    mesh = jax.make_mesh((1, 2), ("data", "model"), devices=jax.devices()[:2])
    specs = {"w": P(None, "model"), "b": P()}
    values = {"w": np.linspace(-1, 1, 72 * 128, dtype=np.float32).reshape(72, 128), "b": np.ones(5, np.float32)}
    tx = zo.zero1(adamw(), axis_name="data", mesh=mesh)
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in values.items()}
    state = tx.init(params)
    layout = zo.describe(state)
    w = layout.paths.index("['w']")
    group = next(g for g in layout.groups if g.first == w)
    assert layout.leaves[w].blocks == 2 and group.shape == (72, 64)

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    ref_params, ref_state = values, adamw().init(values)
    mu = state._inner.histories[layout.groups.index(group)][0]
    assert mu.shape == (144, 64) and {s.data.shape for s in mu.addressable_shards} == {(72, 64)}  # block-major
    for t in range(3):
        g = {k: np.full(v.shape, 0.01 * (t + 1), np.float32) * np.sign(v - 0.1) for k, v in values.items()}
        params, state = step(params, state, {k: jax.device_put(x, NamedSharding(mesh, specs[k]))
                                             for k, x in g.items()})
        u, ref_state = adamw().update(g, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, u)
    assert_close_trees(params, ref_params)
