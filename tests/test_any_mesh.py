"""Checkpoints between any two meshes: the data size and every tensor-parallel axis may change, 1-D to 2-D and
back, with `zo.ZeroRestore(target, reshard=True)` and with the offline `zo.reshard(..., axis_sizes=...)`.

Oracle: plain optax on one device fed, every step, the global mean gradient of the run (the mesh changing half
way), uninterrupted; and, bit for bit, the restore against the offline tool followed by a plain restore.
"""

import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from zero_optax.checkpoint import _regions

# Blocks that divide neither data size: w (5, 12) is (5, 6) x 30 elements on model=2 and (5, 3) x 15 on model=4.
SHAPES = {"w": (5, 12), "u": (8, 5), "v": (20,), "b": (7,), "s": ()}
TP = {"w": P(None, "model"), "u": P("model", None), "v": P("model"), "b": P(), "s": P()}
REPLICATED = {k: P() for k in SHAPES}
VECTORS_TP = dict(REPLICATED, v=P("model"))  # "auto" with Muon: matrices owned (replicated), vectors split
LABELS = {"w": "muon", "u": "muon", "v": "adam", "b": "adam", "s": "adam"}
MESHES = {"4x2": (4, 2), "2x4": (2, 4), "1x2": (1, 2), "2x2": (2, 2), "8": (8,), "2": (2,)}
K = 2  # micro-batches per optimizer step


def adamw():
    return optax.adamw(1e-2, weight_decay=0.1)


def recipe():
    return optax.partition({"muon": optax.contrib.muon(1e-2), "adam": adamw()}, LABELS)


# kind -> (inner, zero1 keywords, parameter specs, parameter dtype, tolerance)
KINDS = {
    "flat": (adamw, {}, TP, jnp.float32, 2e-5),
    "master": (adamw, {"master_dtype": jnp.float32}, TP, jnp.bfloat16, 1e-4),
    "leaf": (lambda: optax.contrib.muon(1e-2), {"partition": "leaf"}, REPLICATED, jnp.float32, 5e-5),
    "auto": (recipe, {"partition": "auto"}, VECTORS_TP, jnp.float32, 5e-5),
    "sharded_acc": (adamw, {"accumulate_steps": K}, TP, jnp.float32, 2e-5),
    "local_acc": (adamw, {"accumulate_steps": K, "accumulate": "local"}, TP, jnp.float32, 2e-5),
}


def mesh_of(name):
    shape = MESHES[name]
    return jax.make_mesh(shape, ("data", "model")[:len(shape)], devices=jax.devices()[:int(np.prod(shape))])


def on(mesh, specs):
    """`specs` on `mesh`: axes the mesh lacks dropped."""
    return {k: P(*(a if a in mesh.axis_names else None for a in s)) for k, s in specs.items()}


def params_np():
    rng = np.random.default_rng(0)
    return {k: (rng.standard_normal(s) * 0.5).astype(np.float32) for k, s in SHAPES.items()}


def grads_np(t, n):
    """Call `t`'s per-device gradients, `[n, *shape]` (float32 values that bf16 holds exactly)."""
    rng = np.random.default_rng(100 + t)
    g = {k: rng.standard_normal((n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    return {k: np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32)) for k, v in g.items()}


def compiled(tx, mesh, specs, g_specs, example, dtype=jnp.float32):
    """The jitted shard_map init and step (`update` on each device's gradient row, cast to `dtype`) of `tx`."""
    state_specs = zo.state_specs(tx, example, specs)

    def step(p, s, g):
        u, s = tx.update(jax.tree.map(lambda x: x[0].astype(dtype), g), s, p)
        return optax.apply_updates(p, u), s

    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=state_specs))
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, state_specs, g_specs),
                                 out_specs=(specs, state_specs)))
    return init, step


def placer(mesh, specs):
    return lambda tree: {k: jax.device_put(np.asarray(v), NamedSharding(mesh, specs[k])) for k, v in tree.items()}


@functools.cache
def trainer(kind, mesh_name):
    """`(mesh, specs, init, step, place, place_grads)` of zero1 for `kind` on a mesh, compiled once per file."""
    inner, kw, specs, dtype, _ = KINDS[kind]
    mesh = mesh_of(mesh_name)
    specs = on(mesh, specs)
    g_specs = {k: P("data", *s) for k, s in specs.items()}
    place = placer(mesh, specs)
    init, step = compiled(zo.zero1(inner(), axis_name="data", **kw), mesh, specs, g_specs, place(params_np()), dtype)
    return mesh, specs, init, step, place, placer(mesh, g_specs)


def start(kind, mesh_name):
    _, _, init, _, place, _ = trainer(kind, mesh_name)
    dtype = KINDS[kind][3]
    params = place({k: v.astype(dtype) for k, v in params_np().items()})
    return params, init(place(params_np()) if dtype != jnp.float32 else params)


def train(kind, mesh_name, params, state, calls):
    """Runs update calls `calls` (global indices, for the gradients) on a mesh."""
    mesh, _, _, step, place, place_grads = trainer(kind, mesh_name)
    params = place(params)
    for t in calls:
        params, state = step(params, state, place_grads(grads_np(t, mesh.shape["data"])))
    return params, state


def oracle(kind, sizes):
    """Single-device optax fed the mean over every (device, micro-batch) pair of each optimizer step, where call
    `t` runs on `sizes[t]` data devices."""
    inner, kw, _, _, _ = KINDS[kind]
    k = kw.get("accumulate_steps", 1)
    tx = inner()
    params = params_np()
    state = tx.init(params)
    for first in range(0, len(sizes), k):
        calls = range(first, first + k)
        total = {name: sum(grads_np(t, sizes[t])[name].astype(np.float64).sum(0) for t in calls) for name in SHAPES}
        g = {name: (v / sum(sizes[t] for t in calls)).astype(np.float32) for name, v in total.items()}
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
    return params


def save(directory, state):
    ocp.Checkpointer(zo.ZeroCheckpointHandler()).save(directory, args=zo.ZeroSave(state))
    return directory


def restore(directory, target, reshard=True):
    return ocp.Checkpointer(zo.ZeroCheckpointHandler()).restore(directory, args=zo.ZeroRestore(target, reshard))


def assert_bitwise(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def axis_sizes(mesh_name):
    return dict(zip(("data", "model"), MESHES[mesh_name]))


def move(kind, a, b, tmp_path, first=2, then=2):
    """`first` update calls on mesh `a`, a checkpoint restored onto mesh `b` (checked bit for bit against the
    offline tool), `then` more calls there; the parameters against the uninterrupted single-device run."""
    params, state = start(kind, a)
    params, state = train(kind, a, params, state, range(first))
    item = save(tmp_path / "item", state)
    _, target = start(kind, b)
    restored = restore(item, target)
    zo.reshard(item, tmp_path / "offline", axis_sizes=axis_sizes(b), param_specs=KINDS[kind][2])
    # reshard=True: where "auto" slices a leaf on one mesh and owns it on the other, the offline output keeps
    # the saved choice (it cannot know the target's), and the restore moves the leaf.
    assert_bitwise(restored, restore(tmp_path / "offline", target))
    params, state = train(kind, b, params, restored, range(first, first + then))
    n_a, n_b = MESHES[a][0], MESHES[b][0]
    ref = oracle(kind, [n_a] * first + [n_b] * then)
    tol = KINDS[kind][4]
    for k in SHAPES:
        got = np.asarray(params[k], np.float32)
        if KINDS[kind][3] == jnp.bfloat16:  # bf16 parameters are the float32 master copy, rounded
            want = np.asarray(jnp.asarray(ref[k]).astype(jnp.bfloat16).astype(jnp.float32))
            np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2, err_msg=k)
        else:
            np.testing.assert_allclose(got, ref[k], rtol=tol, atol=tol / 10, err_msg=k)
    return state


@pytest.mark.parametrize(("a", "b"), [("4x2", "2x4"), ("4x2", "8"), ("8", "2x4"), ("2x4", "1x2")])
def test_flat_moves_between_tensor_parallel_sizes(a, b, tmp_path):
    move("flat", a, b, tmp_path)


@pytest.mark.parametrize(("kind", "a", "b"), [("master", "4x2", "2x4"), ("leaf", "4x2", "2x4"),
                                              ("leaf", "2x4", "8"), ("auto", "4x2", "2x4"),
                                              ("auto", "2x4", "8"), ("auto", "8", "2x2")])
def test_master_leaf_and_auto_move_between_meshes(kind, a, b, tmp_path):
    move(kind, a, b, tmp_path)


def test_master_copies_arrive_exactly(tmp_path):
    """The float32 master copy after the move is the single-device float32 run's parameters, to float32."""
    state = move("master", "2x4", "8", tmp_path)
    ref = oracle("master", [2, 2, 8, 8])
    for k, m in zo.master_params(state).items():
        np.testing.assert_allclose(np.asarray(m), ref[k], rtol=1e-4, atol=1e-5, err_msg=k)


@pytest.mark.parametrize(("a", "b"), [("4x2", "2x4"), ("2x4", "8")])
def test_sharded_accumulators_move_mid_cycle(a, b, tmp_path):
    """Saved after the first micro-batch of a cycle; the second runs on the new mesh."""
    move("sharded_acc", a, b, tmp_path, first=3, then=3)


def test_local_accumulators_move_at_a_cycle_boundary(tmp_path):
    move("local_acc", "4x2", "2x4", tmp_path, first=K, then=K)


def test_local_accumulators_mid_cycle_are_refused(tmp_path):
    params, state = start("local_acc", "4x2")
    _, state = train("local_acc", "4x2", params, state, range(1))
    item = save(tmp_path / "item", state)
    with pytest.raises(zo.ZeroCheckpointError, match=r"accumulate=\\?\"sharded\\?\""):
        restore(item, start("local_acc", "2x4")[1])


def test_there_and_back_is_the_saved_state_bit_for_bit(tmp_path):
    params, state = start("flat", "4x2")
    _, state = train("flat", "4x2", params, state, range(2))
    item = save(tmp_path / "item", state)
    zo.reshard(item, tmp_path / "wide", axis_sizes={"data": 2, "model": 4})
    zo.reshard(tmp_path / "wide", tmp_path / "flat", axis_sizes={"data": 8}, param_specs=TP)
    zo.reshard(tmp_path / "flat", tmp_path / "back", axis_sizes={"data": 4, "model": 2}, param_specs=TP)
    assert_bitwise(restore(tmp_path / "back", start("flat", "4x2")[1], reshard=False), state)


def test_the_command_line_takes_axis_sizes_and_specs(tmp_path):
    params, state = start("flat", "4x2")
    _, state = train("flat", "4x2", params, state, range(1))
    item = save(tmp_path / "item", state)
    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps({f"['{k}']": list(s) for k, s in TP.items()}))
    run = [sys.executable, "-m", "zero_optax.reshard", str(item)]
    done = subprocess.run(run + [str(tmp_path / "one"), "--axis-sizes", "data=8"], capture_output=True, text=True, check=False)
    assert done.returncode == 1 and "`['u']`" in done.stderr and "--param-specs" in done.stderr, done.stderr
    assert not (tmp_path / "one").exists()
    done = subprocess.run(run + [str(tmp_path / "one"), "--axis-sizes", "data=8", "--param-specs", str(specs)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    target = start("flat", "8")[1]
    assert_bitwise(restore(tmp_path / "one", target, reshard=False), restore(item, target))


def test_a_changed_parameter_shape_is_refused_with_what_differs(tmp_path):
    _, state = start("flat", "4x2")
    item = save(tmp_path / "item", state)
    mesh = mesh_of("2x4")
    tx = zo.zero1(adamw(), axis_name="data")
    specs = on(mesh, TP)
    other = dict(params_np(), w=np.zeros((5, 16), np.float32))
    placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in other.items()}
    target = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,),
                                   out_specs=zo.state_specs(tx, placed, specs)))(placed)
    with pytest.raises(zo.ZeroCheckpointError, match=r"`\['w'\]`.*\[5, 6\] per block over model=2 in the checkpoint "
                                                     r"but \[5, 4\] per block over model=4 in the target.*same model"):
        restore(item, target)


def test_a_changed_partition_is_refused_with_what_to_do(tmp_path):
    _, state = start("leaf", "4x2")
    item = save(tmp_path / "item", state)
    with pytest.raises(zo.ZeroCheckpointError, match=r"partition='leaf'.*partition='flat'.*gather_state"):
        restore(item, start("flat", "2x4")[1])


# ------------------------------------------------------------------------------------------------ expert axes
# zero1 over ("data", "expert"): the expert weights `e` are sharded over "expert" and sliced over "data" only.
EXPERT_SHAPES = {"e": (4, 3, 5), "d": (6, 7), "s": ()}
EXPERT_SPECS = {"e": P("expert"), "d": P(), "s": P()}


def expert_grads(t, n_data, world=8):
    """Per-device gradients: `e` `[n_data, 4, 3, 5]` (one row per data index, the expert blocks along "expert"),
    the others `[world, *shape]` (one row per device). Every device's tokens count alike, so the global mean
    gradient of an expert weight is its rows' sum over the `world` devices."""
    rng = np.random.default_rng(200 + t)
    return {k: rng.standard_normal(((n_data,) if k == "e" else (world,)) + s).astype(np.float32)
            for k, s in EXPERT_SHAPES.items()}


@functools.cache
def expert_trainer(shape):
    mesh = jax.make_mesh(shape, ("data", "expert"), devices=jax.devices()[:int(np.prod(shape))])
    g_specs = {k: P("data", "expert") if k == "e" else P(("data", "expert")) for k in EXPERT_SHAPES}
    place = placer(mesh, EXPERT_SPECS)
    init, step = compiled(zo.zero1(adamw(), axis_name=("data", "expert")), mesh, EXPERT_SPECS, g_specs,
                          place(expert_params()))
    return init, step, place, placer(mesh, g_specs)


def expert_params():
    rng = np.random.default_rng(1)
    return {k: (rng.standard_normal(s) * 0.5).astype(np.float32) for k, s in EXPERT_SHAPES.items()}


def expert_checkpoint(tmp_path):
    """Two steps on (data=2, expert=4), saved: the parameters and the item directory."""
    init, step, place, place_g = expert_trainer((2, 4))
    params = place(expert_params())
    state = init(params)
    for t in range(2):
        params, state = step(params, state, place_g(expert_grads(t, 2)))
    return params, save(tmp_path / "item", state)


def test_expert_parameters_move_between_expert_sizes(tmp_path):
    """(data=2, expert=4) -> (data=4, expert=2): the expert weights' blocks are cut anew, their data groups change."""
    params, item = expert_checkpoint(tmp_path)
    init2, step2, place2, place_g2 = expert_trainer((4, 2))
    target = init2(place2(expert_params()))
    restored = restore(item, target)
    zo.reshard(item, tmp_path / "offline", axis_sizes={"data": 4, "expert": 2}, param_specs=EXPERT_SPECS)
    assert_bitwise(restored, restore(tmp_path / "offline", target, reshard=False))
    params, state = place2(params), restored
    for t in range(2, 4):
        params, state = step2(params, state, place_g2(expert_grads(t, 4)))

    assert_expert_oracle(params, [(2, 4), (2, 4), (4, 2), (4, 2)])


def assert_expert_oracle(params, meshes):
    """The parameters against single-device AdamW fed, at step `t`, the global mean gradient on mesh
    `meshes[t]` (data, expert)."""
    tx, ref = adamw(), expert_params()
    ref_state = tx.init(ref)
    for t, (n, x) in enumerate(meshes):
        g = {k: (v.astype(np.float64).sum(0) / (n * x)).astype(np.float32)
             for k, v in expert_grads(t, n, n * x).items()}
        u, ref_state = tx.update(g, ref_state, ref)
        ref = optax.apply_updates(ref, u)
    for k in EXPERT_SHAPES:
        np.testing.assert_allclose(np.asarray(params[k]), ref[k], rtol=2e-5, atol=2e-6, err_msg=k)


def test_reshard_explicit_leads_to_a_state_and_a_checkpoint(tmp_path):
    """The README's example: the expert weights' blocks live in data-parallel groups of their own (2 devices per
    block, the dense leaves on all 8); migrated per parameter to (data=1, expert=4), built into a state, saved,
    restored and trained on, as single-device optax."""
    params, item = expert_checkpoint(tmp_path)

    records = zo.load_rank_records(item)
    dense = [i for i, r in enumerate(records) if r.world_size == 8]
    experts = [i for i, r in enumerate(records) if r.world_size == 2]
    migrations = [zo.Migration(p, t, 4, sources=dense, target=("dense", t)) for p in ("['d']", "['s']")
                  for t in range(4)]
    migrations += [zo.Migration(f"['e']#block{b}", 0, 1, sources=experts, target=("expert", b)) for b in range(4)]
    moved = zo.reshard_explicit(records, migrations)
    init4, step4, place4, place_g4 = expert_trainer((1, 4))
    target = init4(place4(expert_params()))
    built = zo.state_from_rank_records(target, moved)
    assert_bitwise(built, restore(item, target))  # what ZeroRestore(target, reshard=True) gives
    state = restore(save(tmp_path / "moved", built), target, reshard=False)
    params = place4(params)
    for t in range(2, 4):
        params, state = step4(params, state, place_g4(expert_grads(t, 1, 4)))
    assert_expert_oracle(params, [(2, 4), (2, 4), (1, 4), (1, 4)])


def test_state_from_rank_records_names_a_missing_block(tmp_path):
    init, _, place, _ = expert_trainer((2, 4))
    records = zo.load_rank_records(save(tmp_path / "item", init(place(expert_params()))))
    dense = [r for r in records if r.world_size == 8]
    with pytest.raises(zo.ZeroCheckpointError, match=r"no records of rank 0 in a group of 2 hold `\['e'\]#block0`"):
        zo.state_from_rank_records(init(place(expert_params())), dense)


def test_a_leaf_auto_owns_on_the_target_needs_reshard_true(tmp_path):
    _, state = start("auto", "2x4")
    item = save(tmp_path / "item", state)
    with pytest.raises(zo.ZeroCheckpointError, match=r"leaf `\['v'\]` is sliced .* in the checkpoint but owned .* "
                                                     r"in the target.*ZeroRestore\(target, reshard=True\)"):
        restore(item, start("auto", "2")[1], reshard=False)


def test_blocks_recut_reads_dimensions_and_refuses_what_it_cannot_tell():
    square = _regions.Blocks((4, 4), (("expert", 2), ("model", 2)))
    quarter = _regions.Blocks((2, 2), (("expert", 4), ("model", 4)))
    with pytest.raises(zo.ZeroCheckpointError, match=r"axes \['expert', 'model'\] could cut dimensions \[0, 1\] or "
                                                     r"\[1, 0\].*param_specs"):
        _regions.recut(square, quarter, "`w`")
    cut = _regions.recut(square, quarter, "`w`", spec=P("expert", "model"))
    assert cut.dims == (("expert", 0), ("model", 1))
    # target block (expert 3, model 1): rows 6-8, cols 2-4 of the logical array, the lower right quarter of saved
    # block (expert 1, model 0)
    assert cut.sources(3 * 4 + 1, ((0, 2), (0, 2))) == [(1 * 2 + 0, ((2, 4), (2, 4)), ((0, 2), (0, 2)))]
    with pytest.raises(zo.ZeroCheckpointError, match=r"is \[5, 3\] per block over model=2 in the checkpoint but "
                                                     r"\[5, 2\] per block over model=4 in the target"):
        _regions.recut(_regions.Blocks((5, 3), (("model", 2),)), _regions.Blocks((5, 2), (("model", 4),)), "`w`")


def test_the_offline_tool_names_the_leaf_it_cannot_cut(tmp_path):
    _, state = start("flat", "4x2")
    item = save(tmp_path / "item", state)
    with pytest.raises(zo.ZeroCheckpointError, match=r"leaf `\['w'\]` \(\[5, 6\] per block over model=2\) is to be "
                                                     r"cut over `model` of size 1.*param_specs"):
        zo.reshard(item, tmp_path / "out", axis_sizes={"data": 8}, param_specs={"['u']": P("model", None)})
    with pytest.raises(zo.ZeroCheckpointError, match=r"`axis_sizes` must give the size of every ZeRO axis.*\['data'\]"):
        zo.reshard(item, tmp_path / "out", axis_sizes={"model": 8})
    assert not (tmp_path / "out").exists()
