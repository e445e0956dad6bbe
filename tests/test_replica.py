"""`zero1(..., replica_axis=)`: the state sharded over `data` and replicated over `replica` (issue 32).

The oracle is plain optax on one device fed the mean (or the weighted mean) of every device's gradient over both
axes. Meshes: `(replica=2, data=4)`, and `(replica=2, data=2, model=2)` beside tensor parallelism.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import _harness as h
from tests import _zero_setup as zs
from benchmarks import hlo as _hlo
from zero_optax.core._errors import ZeroError, ZeroGradientError, ZeroStructureError

BOTH = ("replica", "data")


def mesh_2x4():
    return jax.make_mesh((2, 4), BOTH)


def run(tx, mesh, params, grads_seq, weights=None, one_call=False):
    """`tx` trained in `shard_map` over `mesh` on per-device gradients (`[devices, ...]`, sharded over both axes):
    the final parameters and state."""
    specs = zo.state_specs(tx, params, P(), mesh=mesh)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))

    def step(p, s, g, w):
        g = jax.tree.map(lambda x: x[0], g)
        kw = {} if weights is None else {"weight": w[0]}
        if one_call:
            return zo.apply_gradients(tx, g, s, p, **kw)
        u, s = tx.update(g, s, p, **kw)
        return optax.apply_updates(p, u), s

    rows = NamedSharding(mesh, P(BOTH))
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(BOTH), P(BOTH)), out_specs=(P(), specs)))
    p = jax.device_put(params, NamedSharding(mesh, P()))
    s = init(p)
    n = mesh.devices.size
    for t, g in enumerate(grads_seq):
        w = np.ones(n, np.float32) if weights is None else np.asarray(weights[t], np.float32)
        p, s = step(p, s, jax.device_put(g, rows), jax.device_put(w, rows))
    return p, s


@pytest.mark.parametrize("partition, inner", [
    ("flat", optax.adamw(1e-2, weight_decay=1e-3)),
    ("leaf", optax.adamw(1e-2)),
    ("auto", optax.contrib.muon(1e-2)),
])
def test_weighted_steps_match_optax_on_the_mean_over_both_axes(partition, inner):
    """Weights summed over both axes (the second step weighs nothing and is skipped on every replica)."""
    params = h.small_params()
    grads = h.gradient_sequence(params, 8, 3)
    weights = [np.arange(1, 9), np.zeros(8), np.array([3, 0, 1, 1, 2, 0, 5, 1])]
    tx = zo.zero1(inner, axis_name="data", replica_axis="replica", partition=partition)
    p, s = run(tx, mesh_2x4(), params, grads, weights)
    h.assert_matches(p, s, *h.run_oracle(inner, params, grads, weights))


@pytest.mark.parametrize("kw", [
    dict(partition="flat", master_dtype=jnp.float32),
    dict(partition="auto", accumulate_steps=2),
    dict(partition="flat", accumulate_steps=2, accumulate="local"),
    dict(partition="auto", offload=True),
], ids=["master", "accumulate-sharded", "accumulate-local", "offload"])
def test_master_accumulation_offload_match_optax(kw):
    params = h.small_params()
    steps = 4 if "accumulate_steps" in kw else 2
    grads = h.gradient_sequence(params, 8, steps)
    inner = optax.adamw(1e-2)
    tx = zo.zero1(inner, axis_name="data", replica_axis="replica", **kw)
    p, s = run(tx, mesh_2x4(), params, grads, one_call="accumulate_steps" not in kw)
    if "accumulate_steps" in kw:  # one optimizer step on the mean over both micro-batches of every device
        grads = [jax.tree.map(lambda a, b: jnp.concatenate([a, b]), grads[k], grads[k + 1]) for k in (0, 2)]
    ref_p, ref_s = h.run_oracle(inner, params, grads)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    if "accumulate_steps" not in kw:  # (an accumulating state holds the accumulators beside optax's)
        for a, b in zip(jax.tree.leaves(zo.gather_state(s)), jax.tree.leaves(ref_s)):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("partition", ["flat", "leaf", "auto"])
def test_mesh_bound_under_jit_matches_optax(partition):
    mesh = mesh_2x4()
    inner = optax.contrib.muon(1e-2) if partition != "flat" else optax.adamw(1e-2)
    tx = zo.zero1(inner, axis_name="data", replica_axis="replica", partition=partition, mesh=mesh)
    z_params, z_state, r_params, r_state = h.run_mesh_bound(tx, inner, h.small_params(), 3, mesh)
    h.assert_matches(z_params, z_state, r_params, r_state)
    for x in jax.tree.leaves(z_state):  # sharded over data, replicated over replica
        assert "replica" not in jax.tree.leaves(tuple(x.sharding.spec)), x.sharding.spec


def test_flax_optimizer_matches_optax():
    """`zo.ZeroOptimizer` (Flax NNX) on the (replica, data) mesh, step by step against plain optax fed the same
    global mean gradient."""
    from flax import nnx  # pylint: disable=import-outside-toplevel

    mesh = mesh_2x4()
    inner = optax.adamw(1e-2)
    model = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
    nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    optimizer = zo.ZeroOptimizer(model, zo.zero1(inner, axis_name="data", replica_axis="replica", mesh=mesh),
                                 wrt=nnx.Param)
    x = jax.device_put(jnp.linspace(-1, 1, 16 * 5).reshape(16, 5), NamedSharding(mesh, P(BOTH)))

    @nnx.jit
    def train_step(model, optimizer, x):
        grads = nnx.grad(lambda m: jnp.mean(jnp.sin(m(x))))(model)
        optimizer.update(model, grads)
        return nnx.as_pure(grads)

    params = jax.device_get(nnx.as_pure(nnx.state(model, nnx.Param)))
    ref_state = inner.init(params)
    for _ in range(3):
        grads = jax.device_get(train_step(model, optimizer, x))
        u, ref_state = inner.update(grads, ref_state, params)
        params = optax.apply_updates(params, u)
        got = jax.device_get(nnx.as_pure(nnx.state(model, nnx.Param)))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_beside_tensor_parallelism_on_a_3d_mesh():
    """(replica=2, data=2, model=2): the matrices sharded over `model`, flat AdamW and Muon owning them whole."""
    mesh = jax.make_mesh((2, 2, 2), ("replica", "data", "model"))
    shapes = {"w_in": (5, 6), "w_out": (6, 5), "ln": (7,), "s": ()}
    specs = {"w_in": P(None, "model"), "w_out": P("model", None), "ln": P(), "s": P()}
    rng = np.random.default_rng(0)
    params = {k: (rng.standard_normal(s) * 0.5).astype(np.float32) for k, s in shapes.items()}
    grads = [{k: rng.standard_normal((4, *s)).astype(np.float32) for k, s in shapes.items()} for _ in range(3)]
    for inner, partition in ((optax.adamw(1e-2), "flat"), (optax.contrib.muon(1e-2), "auto")):
        tx = zo.zero1(inner, axis_name="data", replica_axis="replica", partition=partition, param_specs=specs)
        placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
        s_specs = zo.state_specs(tx, placed, specs, mesh=mesh)
        g_specs = {k: P(BOTH, *specs[k]) for k in shapes}
        init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=s_specs))

        def step(p, s, g, tx=tx):
            u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
            return optax.apply_updates(p, u), s

        step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, s_specs, g_specs), out_specs=(specs, s_specs)))
        p, s = placed, init(placed)
        for g in grads:
            p, s = step(p, s, {k: jax.device_put(v, NamedSharding(mesh, g_specs[k])) for k, v in g.items()})
        ref_p, ref_s = params, inner.init(params)
        for g in grads:
            u, ref_s = inner.update({k: v.mean(0) for k, v in g.items()}, ref_s, ref_p)
            ref_p = optax.apply_updates(ref_p, u)
        for k in shapes:
            np.testing.assert_allclose(p[k], ref_p[k], rtol=2e-5, atol=1e-6, err_msg=f"{partition} {k}")


def test_replicas_stay_bit_identical_after_many_steps():
    """Every array of the state and the parameters: replica 1's shard equals replica 0's bit for bit."""
    tr = zs.ReplicaTrainer("adamw", partition="auto")
    p, s = tr.train(tr.params(), tr.init(tr.params()), 0, 40)
    devices = tr.mesh.devices  # [replica, data]
    for x in jax.tree.leaves((p, s)):
        shards = {d: np.asarray(sh.data) for sh in x.addressable_shards for d in [sh.device]}
        for k in range(devices.shape[1]):
            a, b = shards[devices[0, k]], shards[devices[1, k]]
            np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))
    want_p, _ = zs.oracle("adamw", 8, 0, 40)
    for k in want_p:
        np.testing.assert_allclose(p[k], want_p[k], rtol=1e-4, atol=1e-5)


def _axes_of(group, mesh) -> tuple[str, ...]:
    coords = {int(d.id): idx for idx, d in np.ndenumerate(mesh.devices)}
    pts = np.array([coords[g] for g in group])
    return tuple(a for k, a in enumerate(mesh.axis_names) if len(set(pts[:, k])) > 1)


@pytest.mark.parametrize("partition", ["flat", "leaf"])
def test_the_replica_axis_carries_only_each_devices_shard(partition):
    """From the compiled HLO of an AdamW step: over `replica` only the all-reduce of this device's part of the
    gradients (flat: its slots of every leaf, 1 / data of the parameter bytes; leaf: its row of the owner-packed
    buffer, what it owns), over `data` the reduce-scatter and the all-gather, nothing over both axes at once."""
    mesh = mesh_2x4()
    params = {"w": jnp.zeros((64, 50)), "b": jnp.zeros((13,))}
    tx = zo.zero1(optax.adamw(1e-2), axis_name="data", replica_axis="replica", bucket_bytes=0,
                  partition=partition)
    specs = zo.state_specs(tx, params, P(), mesh=mesh)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def step(p, s, g):
        u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
        return optax.apply_updates(p, u), s

    grads = jax.device_put(jax.tree.map(lambda x: jnp.zeros((8, *x.shape)), params), NamedSharding(mesh, P(BOTH)))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    compiled = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(BOTH)),
                                     out_specs=(P(), specs))).lower(params, state, grads).compile()
    by_axes: dict = {}
    for op in _hlo.collective_ops(compiled.as_text()):
        key = (op["kind"], _axes_of(op["replica_groups"][0], mesh))
        by_axes[key] = by_axes.get(key, 0) + op["bytes"] * op["multiplier"]
    if partition == "flat":
        shard = 4 * (-(-64 * 50 // 4) + -(-13 // 4))  # this device's float32 slots of both leaves
        assert by_axes == {("all-reduce", ("replica",)): shard, ("reduce-scatter", ("data",)): 4 * shard,
                           ("all-gather", ("data",)): 4 * shard}, by_axes
    else:  # the owners' rows: one owner holds `w` (3,200 coordinates), another `b`; rows are padded to the largest
        assert zo.describe(state).owners in ((0, 1), (1, 0))
        row = 4 * 64 * 50
        assert by_axes[("all-reduce", ("replica",))] == row, by_axes
        assert by_axes[("reduce-scatter", ("data",))] == 4 * row, by_axes
        assert not [k for k in by_axes if k[1] == BOTH], by_axes


def test_checkpoint_written_once_restores_at_other_replica_counts_and_data_sizes(tmp_path):
    """Saved on (replica=2, data=4): the record names the replica axis and its arrays are those of a data=4 state;
    restored as it is on (replica=1, data=4) and into a state without replicas, and resharded (at load time and
    offline) onto (replica=4, data=2); each continues as single-device optax does."""
    tr = zs.ReplicaTrainer("adamw", partition="auto")
    p, s = tr.train(tr.params(), tr.init(tr.params()), 0, 2)
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(2, args=ocp.args.Composite(opt_state=zo.ZeroSave(s)))
        mngr.wait_until_finished()
    record = zo.checkpoint._record.read(tmp_path / "ckpt" / "2" / "opt_state")
    assert record["states"][0]["replica_axes"] == [["replica", 2]]
    assert record["states"][0]["world_size"] == 4
    assert all("replica" not in sum(a["spec"], []) for a in record["states"][0]["arrays"])
    want_p, want_s = zs.oracle("adamw", 8, 0, 2)

    targets = {"1x4": (zs.ReplicaTrainer("adamw", 1, 4, partition="auto"), False),
               "4x2": (zs.ReplicaTrainer("adamw", 4, 2, partition="auto"), True)}
    for name, (target, reshard) in targets.items():
        with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
            restored = mngr.restore(2, args=ocp.args.Composite(
                opt_state=zo.ZeroRestore(target.init(target.params()), reshard=reshard))).opt_state
        assert zo.describe(restored).replica_sizes == (("replica", target.mesh.shape["replica"]),)
        got = zo.gather_state(restored)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want_s)):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6, err_msg=name)
        params = {k: zs.global_array(v, NamedSharding(target.mesh, P())) for k, v in want_p.items()}
        p2, s2 = target.train(params, restored, 2, 3)
        ref_p, _ = zs.oracle("adamw", target.devices, 2, 3, want_p, want_s)
        for k in ref_p:
            np.testing.assert_allclose(p2[k], ref_p[k], rtol=2e-5, atol=1e-6, err_msg=name)

    # Into a state without replica axes, on 4 devices.
    plain = zs.Trainer(zo.zero1(zs.inner("adamw"), axis_name="data", partition="auto"), zs.mesh(4))
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        restored = mngr.restore(2, args=ocp.args.Composite(
            opt_state=zo.ZeroRestore(plain.init(zs.params(plain.mesh))))).opt_state
    for a, b in zip(jax.tree.leaves(zo.gather_state(restored)), jax.tree.leaves(want_s)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    # Offline to data=2, then restored as it is on (replica=4, data=2).
    zo.reshard(tmp_path / "ckpt" / "2" / "opt_state", tmp_path / "offline" / "2" / "opt_state", world_size=2)
    target = targets["4x2"][0]
    with ocp.CheckpointManager(tmp_path / "offline") as mngr:
        restored = mngr.restore(2, args=ocp.args.Composite(
            opt_state=zo.ZeroRestore(target.init(target.params())))).opt_state
    for a, b in zip(jax.tree.leaves(zo.gather_state(restored)), jax.tree.leaves(want_s)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def _data_bytes(item) -> int:
    """The bytes of an Orbax item directory's array data files (OCDBT's `d/` files)."""
    return sum(f.stat().st_size for f in item.rglob("*") if f.is_file() and f.parent.name == "d")


def test_a_replicated_state_is_written_once(tmp_path):
    """AdamW state of a 256 x 256 matrix (random moments: 512 KiB that do not compress) saved from (replica=2,
    data=4) writes the bytes the same state saved from data=4 alone does, not twice them."""
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((256, 256)).astype(np.float32)}
    grads = {"w": rng.standard_normal((256, 256)).astype(np.float32)}
    sizes = {}
    for name, mesh, replica in (("replicated", mesh_2x4(), "replica"),
                                ("plain", jax.make_mesh((4,), ("data",), devices=jax.devices()[:4]), None)):
        tx = zo.zero1(optax.adam(1e-2), axis_name="data", replica_axis=replica, mesh=mesh)
        p = jax.device_put(params, NamedSharding(mesh, P()))
        _, state = jax.jit(tx.update)(jax.device_put(grads, NamedSharding(mesh, P())), tx.init(p), p)
        with ocp.CheckpointManager(tmp_path / name) as mngr:
            mngr.save(1, args=ocp.args.Composite(opt_state=zo.ZeroSave(state)))
            mngr.wait_until_finished()
        sizes[name] = _data_bytes(tmp_path / name / "1" / "opt_state")
    assert sizes["plain"] > 2 * 256 * 256 * 4 * 0.9, sizes
    assert abs(sizes["replicated"] - sizes["plain"]) < 0.05 * sizes["plain"], sizes


def test_refusals_name_the_fix():
    mesh = mesh_2x4()
    with pytest.raises(ZeroError, match="both name"):
        zo.zero1(optax.sgd(1.0), axis_name="data", replica_axis="data")
    with pytest.raises(ZeroError, match="replica_axis"):
        zo.zero1(optax.sgd(1.0), axis_name="data", replica_axis="pod", mesh=mesh)
    with pytest.raises(ZeroError, match="replica_axis"):
        zo.zero1(optax.sgd(1.0), axis_name="data", replica_axis=3)
    tx = zo.zero1(optax.sgd(1.0), axis_name="data", replica_axis="replica")
    params = {"w": jnp.ones(5)}
    specs = zo.state_specs(tx, params, P(), mesh=mesh)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

    def step(p, s, g):  # gradients per device over `data` only: autodiff has summed them over `replica`
        g = jax.tree.map(lambda x: jax.lax.psum(x[0], "replica"), g)
        return tx.update(g, s, p)

    params = jax.device_put(params, NamedSharding(mesh, P()))
    grads = jax.device_put({"w": jnp.ones((8, 5))}, NamedSharding(mesh, P(BOTH)))
    with pytest.raises(ZeroGradientError, match=r"as_local\(params, \('replica', 'data'\)\)"):
        jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(BOTH)), out_specs=(P(), specs)))(
            params, state, grads)
    with pytest.raises(ZeroStructureError, match="replica axis"):  # parameters differing between replicas
        jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P("replica"), out_specs=specs))(
            jax.device_put({"w": jnp.ones(10)}, NamedSharding(mesh, P("replica"))))
    other = jax.make_mesh((1, 4), BOTH, devices=jax.devices()[:4])  # a state of 2 replicas used with 1
    moved = jax.tree.map(lambda x: jax.device_put(np.asarray(x), NamedSharding(other, x.sharding.spec)), state)

    def update(p, s, g):
        return tx.update(jax.tree.map(lambda x: x[0], g), s, p)

    with pytest.raises(ZeroStructureError, match="replicated over {'replica': 2}"):
        jax.jit(jax.shard_map(update, mesh=other, in_specs=(P(), specs, P(BOTH)), out_specs=(P(), specs)))(
            {"w": jax.device_put(np.ones(5, np.float32), NamedSharding(other, P()))}, moved,
            jax.device_put({"w": jnp.ones((4, 5))}, NamedSharding(other, P(BOTH))))


def test_describe_and_specs_say_what_replicates():
    tr = zs.ReplicaTrainer("muon")
    state = tr.init(tr.params())
    layout = zo.describe(state)
    assert layout.replica_axes == ("replica",) and layout.replica_count == 2 and layout.world_size == 4
    assert "replicated over {'replica': 2}" in layout.summary()
    assert {spec for spec in jax.tree.leaves(tr.specs)} == {P("data")}
    plain = zo.gather_state(state)
    back = jax.jit(jax.shard_map(lambda p, s: zo.scatter_state(tr.tx, s, p), mesh=tr.mesh, in_specs=(P(), P()),
                                 out_specs=tr.specs))(tr.params(), plain)
    for a, b in zip(jax.tree.leaves(zo.gather_state(back)), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(a, b)
