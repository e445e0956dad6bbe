"""ZeRO over the data axes on meshes with tensor-parallel axes, in shard_map and in the jit form, against
single-device optax on the global parameters fed the global mean gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests._models import gpt_params, tensor_parallel_specs

# Leaf shapes divide neither the data axis (4, or 2 x 2) nor, per block, anything: (5, 6) splits into (5, 3)
# blocks of 15 elements.
SHAPES = {"w_in": (5, 6), "w_out": (6, 5), "ln": (7,), "s": ()}
TP_SPECS = {"w_in": P(None, "model"), "w_out": P("model", None), "ln": P(), "s": P()}
REPLICATED = {k: P() for k in SHAPES}
MESHES = {
    "4x2": (("data", "model"), (4, 2), "data"),
    "2x2x2": (("replica", "data", "model"), (2, 2, 2), ("replica", "data")),
}
STEPS = 3


def make_mesh(name):
    axes, shape, zero_axes = MESHES[name]
    return jax.make_mesh(shape, axes), zero_axes


def params_np():
    rng = np.random.default_rng(0)
    return {k: (rng.standard_normal(s) * 0.5).astype(np.float32) for k, s in SHAPES.items()}


def grads_np(t: int, n_data: int):
    rng = np.random.default_rng(100 + t)
    return {k: rng.standard_normal((n_data, *s)).astype(np.float32) for k, s in SHAPES.items()}


def oracle(inner, steps, n_data):
    params = params_np()
    state = inner.init(params)
    for t in range(steps):
        g = {k: v.mean(0) for k, v in grads_np(t, n_data).items()}
        u, state = inner.update(g, state, params)
        params = optax.apply_updates(params, u)
    return params, state


def data_spec(zero_axes):
    return zero_axes if isinstance(zero_axes, str) else tuple(zero_axes)


def run_shard_map(tx, mesh, zero_axes, specs, steps=STEPS):
    n_data = int(np.prod([mesh.shape[a] for a in np.atleast_1d(zero_axes)]))
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params_np().items()}
    state_specs = zo.state_specs(tx, params, specs)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=state_specs))
    # Per-device gradients: stacked over the data axes, laid out like the parameters over the others.
    g_specs = {k: P(data_spec(zero_axes), *s) for k, s in specs.items()}

    def step(p, s, g):
        u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, state_specs, g_specs),
                                 out_specs=(specs, state_specs)))
    state = init(params)
    for t in range(steps):
        g = {k: jax.device_put(v, NamedSharding(mesh, g_specs[k])) for k, v in grads_np(t, n_data).items()}
        params, state = step(params, state, g)
    return params, state, n_data


def run_jit(inner, partition, mesh, zero_axes, specs, steps=STEPS):
    n_data = int(np.prod([mesh.shape[a] for a in np.atleast_1d(zero_axes)]))
    tx = zo.zero1(inner, axis_name=zero_axes, mesh=mesh, partition=partition)
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params_np().items()}
    state = tx.init(params)

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for t in range(steps):
        g = {k: jax.device_put(v.mean(0), NamedSharding(mesh, specs[k])) for k, v in grads_np(t, n_data).items()}
        params, state = step(params, state, g)
    return params, state, n_data


def assert_params(params, ref, rtol=2e-5, atol=1e-6):
    for k in SHAPES:
        np.testing.assert_allclose(np.asarray(params[k]), ref[k], rtol=rtol, atol=atol, err_msg=k)


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("form", ["shard_map", "jit"])
def test_adamw_flat_on_tensor_parallel_parameters(mesh_name, form):
    mesh, zero_axes = make_mesh(mesh_name)
    inner = lambda: optax.adamw(1e-2, weight_decay=0.1)
    if form == "shard_map":
        params, state, n_data = run_shard_map(zo.zero1(inner(), axis_name=zero_axes), mesh, zero_axes, TP_SPECS)
    else:
        params, state, n_data = run_jit(inner(), "flat", mesh, zero_axes, TP_SPECS)
    ref, _ = oracle(inner(), STEPS, n_data)
    assert_params(params, ref)
    layout = zo.describe(state)
    by_path = {leaf.path: leaf for leaf in layout.leaves}
    assert by_path["['w_in']"].axes == ("model",) and by_path["['w_in']"].blocks == 2
    assert by_path["['w_in']"].shape == (5, 3) and by_path["['ln']"].axes == ()
    # Every device holds 1/(data size) of its tensor-parallel block's state.
    for k, blocks in (("w_in", 2), ("ln", 1)):  # mu: the first history of the leaf's group
        i = layout.paths.index(f"['{k}']")
        g = next(g for g, group in enumerate(layout.groups) if i in group.leaves)
        mu = state._inner.histories[g][0]
        assert mu.shape == (blocks * n_data * layout.groups[g].size,)
        assert all(s.data.shape == (layout.groups[g].size,) for s in mu.addressable_shards)


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("form", ["shard_map", "jit"])
def test_muon_leaf_on_parameters_replicated_over_model(mesh_name, form):
    mesh, zero_axes = make_mesh(mesh_name)
    inner = lambda: optax.contrib.muon(1e-2)
    if form == "shard_map":
        tx = zo.zero1(inner(), axis_name=zero_axes, partition="leaf")
        params, _, n_data = run_shard_map(tx, mesh, zero_axes, REPLICATED)
    else:
        params, _, n_data = run_jit(inner(), "leaf", mesh, zero_axes, REPLICATED)
    ref, _ = oracle(inner(), STEPS, n_data)
    assert_params(params, ref, rtol=5e-5, atol=5e-6)


def test_muon_leaf_refuses_tensor_parallel_matrices():
    """Muon on a column-parallel block would orthogonalise the block, not the matrix: refused, with what to do."""
    mesh, zero_axes = make_mesh("4x2")
    tx = zo.zero1(optax.contrib.muon(1e-2), axis_name=zero_axes, partition="leaf")
    with pytest.raises(zo.ZeroCouplingError, match=r"(?s)`\['w_in'\]`.*sharded over\s+mesh axis `model`.*"
                                                    r"replicated over `model`"):
        run_shard_map(tx, mesh, zero_axes, TP_SPECS)


def test_without_vma_other_axes_are_refused():
    mesh, zero_axes = make_mesh("4x2")
    tx = zo.zero1(optax.adam(1e-2), axis_name=zero_axes)
    with pytest.raises(zo.ZeroAxisError, match="check_vma=True"):
        jax.shard_map(tx.init, mesh=mesh, in_specs=(TP_SPECS,), out_specs=P(), check_vma=False)(
            {k: jax.device_put(v, NamedSharding(mesh, TP_SPECS[k])) for k, v in params_np().items()})


def test_parameters_varying_over_the_data_axis_are_refused():
    mesh, _ = make_mesh("4x2")
    tx = zo.zero1(optax.adam(1e-2), axis_name="data")
    specs = dict(TP_SPECS, ln=P("data"))
    with pytest.raises(zo.ZeroStructureError, match=r"`\['ln'\]` differs between the devices of `data`"):
        jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=P())(
            {k: jax.device_put(np.zeros((8,) if k == "ln" else SHAPES[k], np.float32), NamedSharding(mesh, specs[k]))
             for k in SHAPES})


def test_state_specs_on_a_1d_mesh_are_data():
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    for partition in ("flat", "leaf"):
        tx = zo.zero1(optax.adam(1e-2), axis_name="data", partition=partition)
        specs = zo.state_specs(tx, params_np(), REPLICATED, mesh=mesh)
        assert set(jax.tree.leaves(specs)) == {P("data")}


def test_state_bytes_on_a_tensor_parallel_gpt_are_ideal():
    """AdamW: per-device state <= 1.01 x (full state / (data x model)) on a tensor-parallel GPT-shaped tree."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    params = gpt_params(2048, 256, 2)
    specs = tensor_parallel_specs(params)
    tx = zo.zero1(optax.adamw(1e-3), axis_name="data")
    state_specs = zo.state_specs(tx, params, specs, mesh=mesh)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=state_specs))(placed)
    per_device = {}
    for x in jax.tree.leaves(state):
        for s in x.addressable_shards:
            per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
    full = sum(x.nbytes for x in jax.tree.leaves(optax.adamw(1e-3).init(params)))
    assert max(per_device.values()) <= 1.01 * full / 8


def test_2d_checkpoint_continues_exactly_at_half_the_data_size(tmp_path):
    """Train on (data=4, model=2), checkpoint, zo.reshard to data=2, restore on (2, 2), train on: the result equals
    single-device optax fed each step's global mean gradient."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    inner = lambda: optax.adamw(1e-2, weight_decay=0.1)
    steps = 2

    def setup(shape):
        mesh = jax.make_mesh(shape, ("data", "model"), devices=jax.devices()[:int(np.prod(shape))])
        tx = zo.zero1(inner(), axis_name="data")
        params = {k: jax.device_put(v, NamedSharding(mesh, TP_SPECS[k])) for k, v in params_np().items()}
        specs = zo.state_specs(tx, params, TP_SPECS)
        g_specs = {k: P("data", *s) for k, s in TP_SPECS.items()}

        def step(p, s, g):
            u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
            return optax.apply_updates(p, u), s

        init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(TP_SPECS,), out_specs=specs))
        step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(TP_SPECS, specs, g_specs),
                                     out_specs=(TP_SPECS, specs)))
        place = lambda t: {k: jax.device_put(v, NamedSharding(mesh, g_specs[k])) for k, v in t.items()}
        return mesh, init, step, params, place

    _, init, step, params, place = setup((4, 2))
    state = init(params)
    for t in range(steps):
        params, state = step(params, state, place(grads_np(t, 4)))
    with ocp.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(steps, args=ocp.args.Composite(opt_state=zo.ZeroSave(state)))
        mngr.wait_until_finished()
    zo.reshard(tmp_path / "run" / str(steps) / "opt_state", tmp_path / "half", world_size=2)
    mesh2, init2, step2, _, place2 = setup((2, 2))
    target = init2({k: jax.device_put(v, NamedSharding(mesh2, TP_SPECS[k])) for k, v in params_np().items()})
    state = ocp.Checkpointer(zo.ZeroCheckpointHandler()).restore(tmp_path / "half", args=zo.ZeroRestore(target))
    params = {k: jax.device_put(np.asarray(v), NamedSharding(mesh2, TP_SPECS[k])) for k, v in params.items()}
    for t in range(steps, 2 * steps):
        params, state = step2(params, state, place2(grads_np(t, 2)))

    ref, ref_state = params_np(), inner().init(params_np())
    for t in range(2 * steps):
        g = {k: v.mean(0) for k, v in grads_np(t, 4 if t < steps else 2).items()}
        u, ref_state = inner().update(g, ref_state, ref)
        ref = optax.apply_updates(ref, u)
    assert_params(params, ref)


def test_offloaded_state_streams_on_a_tensor_parallel_mesh():
    """`offload=True` beside a model axis: the state stays in `pinned_host` and the result is optax's, for flat
    AdamW on tensor-parallel blocks (master weights, chunks of 32 bytes) and Muon owning whole leaves."""
    mesh, zero_axes = make_mesh("4x2")
    adamw = lambda: optax.adamw(1e-2, weight_decay=0.1)
    cases = [(zo.zero1(adamw(), axis_name=zero_axes, offload=True, bucket_bytes=32, master_dtype=jnp.float32),
              adamw(), TP_SPECS, {}),
             (zo.zero1(optax.contrib.muon(1e-2), axis_name=zero_axes, partition="leaf", offload=True,
                       bucket_bytes=64), optax.contrib.muon(1e-2), REPLICATED, {"rtol": 5e-5, "atol": 5e-6})]
    for tx, inner, specs, tol in cases:
        params, state, n_data = run_shard_map(tx, mesh, zero_axes, specs)
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state)} == {"pinned_host"}
        ref, _ = oracle(inner, STEPS, n_data)
        assert_params(params, ref, **tol)
