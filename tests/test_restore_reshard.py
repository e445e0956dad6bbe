"""Tests for `zo.ZeroRestore(target, reshard=True)`: restoring a checkpoint saved at N devices into M.

Two oracles: the unsharded state (every leaf's complete history per block, read from the arrays as
zero_optax._state documents them) must be the saved one, bit for bit, with zero padding; and the restored arrays
must equal `zo.reshard(src, dst, M)` followed by a plain restore, bit for bit.
"""

import os

import _zero_setup as zs
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from zero_optax.checkpoint import _arrays, _store

PAIRS = [(8, 3), (3, 8), (8, 1), (1, 5)]
KINDS = [("adamw", True), ("muon", False)]  # flat behind reduce_gradients + clip; leaf


def unsharded(state) -> dict:
    """Entry path -> its value without sharding: shared entries once (every row checked equal), a sliced leaf's
    history as one array per block (its padding checked zero), an owned leaf's from its owner's row."""
    layout = state.layout
    stored = dict(zip(_arrays.unowned_entries(layout), _arrays.state_values(state)))
    out = {}
    for j, e in enumerate(layout.entries):
        if e.leaf is None:
            rows = np.asarray(stored[j])
            assert all(r.tobytes() == rows[0].tobytes() for r in rows)
            out[e.path] = rows[0]
        elif layout.leaves[e.leaf].sliced:
            leaf = layout.leaves[e.leaf]
            flat = np.asarray(stored[j])
            width = leaf.group * leaf.slots
            blocks = [flat[b * width:(b + 1) * width] for b in range(leaf.blocks)]
            assert not any(np.asarray(b[leaf.size:], np.float64).any() for b in blocks), e.path  # zero padding
            out[e.path] = [b[:leaf.size].reshape(leaf.shape) for b in blocks]
        else:
            owner = layout.leaves[e.leaf].owner
            d, off = layout.state_packing.offsets[owner][j]
            out[e.path] = np.asarray(state.buffers[d])[owner, off:off + e.size].reshape(e.shape)
    return out


def assert_same_unsharded(a, b) -> None:
    x, y = unsharded(a), unsharded(b)
    assert list(x) == list(y)
    for path in x:
        u, v = (x[path], y[path]) if isinstance(x[path], list) else ([x[path]], [y[path]])
        assert len(u) == len(v), path
        for p, q in zip(u, v):
            assert p.dtype == q.dtype and p.shape == q.shape and p.tobytes() == q.tobytes(), path


def save(directory, state):
    with ocp.CheckpointManager(directory) as mngr:
        mngr.save(1, args=ocp.args.Composite(opt_state=zo.ZeroSave(state)))
        mngr.wait_until_finished()
    return os.path.join(directory, "1", "opt_state")


def restore(item, target, reshard):
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        return ckpt.restore(item, args=zo.ZeroRestore(target, reshard=reshard))


def states(tree):
    return zo.transform._state.find_states(tree)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Item directories of two-step runs, one per (kind, N), and their states."""
    root = tmp_path_factory.mktemp("saved")
    out = {}
    for kind, chain in KINDS:
        for n in sorted({n for n, _ in PAIRS}):
            tr = zs.trainer(kind, n, chain)
            p0 = zs.params(tr.mesh)
            _, s = tr.train(p0, tr.init(p0), 0, 2)
            out[kind, n] = save(str(root / f"{kind}{n}"), s), s
    return out


@pytest.mark.parametrize("kind,chain", KINDS, ids=[k for k, _ in KINDS])
@pytest.mark.parametrize("n,m", PAIRS)
def test_restore_at_a_new_world_size_equals_reshard_then_restore(saved, tmp_path, kind, chain, n, m):
    item, source = saved[kind, n]
    tr = zs.trainer(kind, m, chain)
    target = tr.abstract(zs.params(tr.mesh))
    got = restore(item, target, reshard=True)
    assert jax.tree.structure(got) == jax.tree.structure(target)
    for x, t in zip(jax.tree.leaves(got), jax.tree.leaves(target)):
        assert x.sharding == t.sharding and x.shape == t.shape and x.dtype == t.dtype
    assert states(got)[0].layout is states(target)[0].layout
    assert_same_unsharded(states(got)[0], states(source)[0])  # the oracle: nothing lost, padding zero
    zo.reshard(item, tmp_path / "dst", world_size=m)
    zs.assert_bit_equal(got, restore(tmp_path / "dst", target, reshard=False))


def test_reads_one_contiguous_range_per_device_and_block(saved, monkeypatch):
    item, _ = saved["adamw", 8]
    calls = []
    read = _store.ItemArrays.read
    monkeypatch.setattr(_store.ItemArrays, "read", lambda self, name, region: calls.append((name, region)) or
                        read(self, name, region))
    tr = zs.trainer("adamw", 3, True)
    got = states(restore(item, tr.abstract(zs.params(tr.mesh)), reshard=True))[0]
    layout = got.layout
    assert calls[0] == ("0.entry0000", ((0, 8),))  # the step count: every saved row, to check they agree
    for j in _arrays.unowned_entries(layout)[1:]:  # the histories: 15, 1, 7 and 16 coordinates, 3 devices
        leaf = layout.leaves[layout.entries[j].leaf]
        saved_end = 8 * -(-leaf.size // 8)  # the device holding a block's end also reads the saved padding
        want = [(t * leaf.slots, saved_end if (t + 1) * leaf.slots >= leaf.size else (t + 1) * leaf.slots)
                for t in range(3) if t * leaf.slots < leaf.size]
        assert [r[0] for name, r in calls if name == f"0.entry{j:04d}"] == want


def test_restore_with_other_owners(saved):
    item, source = saved["muon", 8]
    tr = zs.trainer("muon", 3, owners=(2, 2, 0, 1))
    got = restore(item, tr.abstract(zs.params(tr.mesh)), reshard=True)
    assert got.layout.owners == (2, 2, 0, 1)
    assert_same_unsharded(got, source)
    with pytest.raises(zo.ZeroCheckpointError, match=r"owners\[0\] is \d in the checkpoint but 2"):
        restore(item, zs.trainer("muon", 8, owners=(2, 2, 0, 1)).init(zs.params(zs.mesh(8))), reshard=False)


# ------------------------------------------------------------------------------------------------ 2-D meshes


SHAPES_2D = {"w": (6, 8), "b": (5,)}
SPECS_2D = {"w": P(None, "model"), "b": P()}


@pytest.fixture(scope="module")
def saved_2d(tmp_path_factory):
    tr = zs.MeshTrainer("adam", {"data": 4, "model": 2}, "data", SPECS_2D, SHAPES_2D)
    p = tr.params()
    _, s = tr.train(p, tr.init(p), 0, 2)
    return save(str(tmp_path_factory.mktemp("two_d")), s), s


def test_2d_state_records_its_placement_and_restores_on_the_same_mesh(saved_2d):
    item, source = saved_2d
    record = zo.ZeroCheckpointHandler().metadata(item)["states"][0]
    assert record["mesh_axes"] == [["model", 2]]
    w = next(x for x in record["leaves"] if x["path"] == "['w']")
    assert (w["shape"], w["axes"], w["blocks"], w["group"]) == ([6, 4], ["model"], 2, 4)
    assert [a["spec"] for a in record["arrays"] if a["entry"] == 2] == [[["model", "data"]]]
    tr = zs.MeshTrainer("adam", {"data": 4, "model": 2}, "data", SPECS_2D, SHAPES_2D)
    zs.assert_bit_equal(restore(item, tr.abstract(), reshard=False), source)


def test_2d_state_at_another_data_size(saved_2d, tmp_path):
    item, source = saved_2d
    tr = zs.MeshTrainer("adam", {"data": 2, "model": 2}, "data", SPECS_2D, SHAPES_2D)
    got = restore(item, tr.abstract(), reshard=True)
    assert got.layout.world_size == 2
    assert_same_unsharded(got, source)
    zo.reshard(item, tmp_path / "dst", world_size=2)
    zs.assert_bit_equal(got, restore(tmp_path / "dst", tr.abstract(), reshard=False))
    p = tr.params()
    tr.train(p, got, 2, 3)  # and it trains on
    records = zo.load_rank_records(item)
    assert [(r.rank, r.world_size) for r in records] == [(r, 4) for r in range(4)]
    assert sorted(records[0].params) == ["['b']", "['w']#block0", "['w']#block1"]
    w1 = np.concatenate([r.params["['w']#block1"].buffers["[0].mu['w']"] for r in records])
    np.testing.assert_array_equal(w1[:24].reshape(6, 4), unsharded(source)["[0].mu['w']"][1])


def test_2d_state_at_another_model_size(saved_2d, tmp_path):
    """model=2 -> model=1: `w`'s two (6, 4) blocks become one (6, 8) block (tests/test_any_mesh.py trains on)."""
    item, source = saved_2d
    tr = zs.MeshTrainer("adam", {"data": 4, "model": 1}, "data", SPECS_2D, SHAPES_2D)
    got = restore(item, tr.abstract(), reshard=True)
    before, after = unsharded(source), unsharded(got)
    for path in before:
        if "['w']" in path:
            np.testing.assert_array_equal(np.concatenate(before[path], axis=1), after[path][0])
    zo.reshard(item, tmp_path / "dst", axis_sizes={"data": 4, "model": 1}, param_specs=SPECS_2D)
    zs.assert_bit_equal(got, restore(tmp_path / "dst", tr.abstract(), reshard=False))


def test_expert_leaves(tmp_path):
    """Leaves sharded over a ZeRO axis: restore with reshard=True when their blocks stay; zo.reshard needs the size
    of each ZeRO axis (tests/test_any_mesh.py changes the expert size)."""
    specs, shapes = {"e": P("expert"), "w": P(None, "model"), "b": P()}, {"e": (4, 3), "w": (6, 8), "b": (5,)}
    tr = zs.MeshTrainer("adam", {"expert": 2, "data": 2, "model": 2}, ("expert", "data"), specs, shapes)
    p = tr.params()
    _, s = tr.train(p, tr.init(p), 0, 2)
    item = save(str(tmp_path / "ckpt"), s)
    small = zs.MeshTrainer("adam", {"expert": 2, "data": 1, "model": 2}, ("expert", "data"), specs, shapes)
    got = restore(item, small.abstract(), reshard=True)
    assert got.layout.world_size == 2
    assert_same_unsharded(got, s)
    with pytest.raises(zo.ZeroCheckpointError, match=r"leaf `\['e'\]` is sharded over a ZeRO axis.*"
                                                     r"pass `axis_sizes`"):
        zo.reshard(item, tmp_path / "dst", world_size=2)
    assert not os.path.exists(tmp_path / "dst")
    records = zo.load_rank_records(item)
    assert [(r.rank, r.world_size) for r in records] == [(0, 4), (1, 4), (2, 4), (3, 4), (0, 2), (1, 2)]
    assert sorted(records[-1].params) == ["['e']#block0", "['e']#block1"]
    e0 = np.concatenate([r.params["['e']#block0"].buffers["[0].nu['e']"] for r in records[-2:]])
    np.testing.assert_array_equal(e0.reshape(2, 3), unsharded(s)["[0].nu['e']"][0])


def test_a_lone_leaf_is_restored_without_a_second_copy():
    """Restoring joins the entries' arrays into the groups' (`_arrays.rebuild`): a lone leaf kept 1-D stores its
    entries' arrays as they are, so a restore holds the state once (benchmarks/RESULTS.md, the 2-D restore); a
    group of small leaves is joined, and both come back exactly."""
    import optax
    from jax.sharding import NamedSharding

    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    specs = {"big": P(None, "model"), "a": P(), "b": P()}
    params = {k: jax.device_put(np.arange(np.prod(s), dtype=np.float32).reshape(s) / 7, NamedSharding(mesh, specs[k]))
              for k, s in {"big": (130, 200), "a": (5,), "b": (3,)}.items()}
    state = zo.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh, master_dtype=np.float32).init(params)
    layout = state.layout
    assert sorted(len(g.leaves) for g in layout.groups) == [1, 2] and all(g.shape is None for g in layout.groups)
    values = _arrays.state_values(state)
    again = _arrays.rebuild(state, values)
    by_entry = dict(zip(_arrays.unowned_entries(layout), values))
    lone = next(g for g, group in enumerate(layout.groups) if len(group.leaves) == 1)
    assert again.inner_state.histories[lone][0] is by_entry[layout.groups[lone].histories[0][0]]
    assert again.master[lone] is by_entry[layout.groups[lone].masters[0]]
    for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(state), strict=True):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
