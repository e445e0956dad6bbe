"""Tests for `zo.ZeroRestore(target, reshard=True)`: restoring a checkpoint saved at N devices into M.

The oracle is plain optax on one device, fed the mean gradient of every step the saved run took: the restored
state must hold its state, read straight from the restored arrays (`tests/_harness.py`: padding zero, shared
entries alike on every device); on 2-D meshes, laid out by hand in the test (each block flattened and padded).
The offline `zo.reshard` followed by a plain restore must hold the same.
"""

import functools
import json
import os
import shutil

import _zero_setup as zs
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
from zero_optax.checkpoint import _arrays, _store
from zero_optax.core import _names

PAIRS = [(8, 3), (3, 8), (8, 1), (1, 5)]
KINDS = [("adamw", True), ("muon", False)]  # flat behind reduce_gradients + clip; leaf
STEPS = 2
"""Steps the saved runs take."""
RTOL, ATOL = 5e-5, 1e-6


def optax_state(tx, params: dict, grads: list[dict]):
    """The state of plain optax `tx` on one device after one step per gradient of `grads`."""
    p = jax.tree.map(jnp.asarray, params)
    s, update = tx.init(p), jax.jit(tx.update)
    for g in grads:
        u, s = update(jax.tree.map(jnp.asarray, g), s, p)
        p = optax.apply_updates(p, u)
    return s


@functools.cache
def oracle(kind: str, chain: bool, n: int):
    """The inner optimizer's state after the saved run's steps on n devices (`zs.trainer`), from plain optax."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), zs.inner(kind)) if chain else zs.inner(kind)
    grads = [{k: g.mean(0) for k, g in zs.grads_np(t, n).items()} for t in range(STEPS)]
    s = optax_state(tx, zs.params_np(), grads)
    return s[1] if chain else s


def by_path(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def assert_holds(state, want) -> None:
    """A zero1 state on a 1-D mesh holds plain optax's state `want`: every entry read back from its arrays."""
    got, ref = h.full_state(state), by_path(want)
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    for path, x in ref.items():
        assert got[path].dtype == x.dtype, path
        np.testing.assert_allclose(got[path], x, rtol=RTOL, atol=ATOL, err_msg=path)


def laid_out(blocks: list[np.ndarray], group: int) -> np.ndarray:
    """A sliced leaf's stored history, by hand: each block flattened and zero-padded to `group` devices of
    `ceil(size / group)` coordinates, one block after the other."""
    out = []
    for b in blocks:
        flat = np.asarray(b).reshape(-1)
        out += [flat, np.zeros(-(-flat.size // group) * group - flat.size, flat.dtype)]
    return np.concatenate(out)


def assert_holds_blocks(state, want, cuts: dict) -> None:
    """A zero1 state holds plain optax's state `want`, every sliced leaf's history laid out by hand:
    `cuts[leaf path] = (its blocks from the full value, ZeRO group size)`; shared entries in every row."""
    layout, stored, ref = zo.describe(state), h.stored_entries(state), by_path(want)
    assert {layout.entries[j].path for j in layout.inner_entries} == set(ref)
    for j in layout.inner_entries:
        e = layout.entries[j]
        if e.leaf is None:
            expected = np.broadcast_to(ref[e.path], stored[j].shape)
        else:
            blocks, group = cuts[layout.leaves[e.leaf].path]
            expected = laid_out(blocks(ref[e.path]), group)
        assert stored[j].dtype == expected.dtype, e.path
        np.testing.assert_allclose(stored[j], expected, rtol=RTOL, atol=ATOL, err_msg=e.path)


def save(directory, state):
    with ocp.CheckpointManager(directory) as mngr:
        mngr.save(1, args=ocp.args.Composite(opt_state=zo.ZeroSave(state)))
        mngr.wait_until_finished()
    return os.path.join(directory, "1", "opt_state")


def restore(item, target, reshard):
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        return ckpt.restore(item, args=zo.ZeroRestore(target, reshard=reshard))


def states(tree):
    return zo.layout._state.find_states(tree)


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
def test_restore_at_a_new_world_size_holds_the_optax_state(saved, tmp_path, kind, chain, n, m):
    item, _ = saved[kind, n]
    tr = zs.trainer(kind, m, chain)
    target = tr.abstract(zs.params(tr.mesh))
    got = restore(item, target, reshard=True)
    assert jax.tree.structure(got) == jax.tree.structure(target)
    for x, t in zip(jax.tree.leaves(got), jax.tree.leaves(target)):
        assert x.sharding == t.sharding and x.shape == t.shape and x.dtype == t.dtype
    assert states(got)[0].layout is states(target)[0].layout
    assert_holds(states(got)[0], oracle(kind, chain, n))
    zo.reshard(item, tmp_path / "dst", world_size=m)  # offline, then a plain restore
    assert_holds(states(restore(tmp_path / "dst", target, reshard=False))[0], oracle(kind, chain, n))


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
    item, _ = saved["muon", 8]
    tr = zs.trainer("muon", 3, owners=(2, 2, 0, 1))
    got = restore(item, tr.abstract(zs.params(tr.mesh)), reshard=True)
    assert got.layout.owners == (2, 2, 0, 1)
    assert_holds(got, oracle("muon", False, 8))
    with pytest.raises(zo.ZeroCheckpointError, match=r"leaf `\['a'\]` has owner device \d in the checkpoint, device 2"):
        restore(item, zs.trainer("muon", 8, owners=(2, 2, 0, 1)).init(zs.params(zs.mesh(8))), reshard=False)


# ------------------------------------------------------------------------------------------------ 2-D meshes


SHAPES_2D = {"w": (6, 8), "b": (5,)}
SPECS_2D = {"w": P(None, "model"), "b": P()}


def mesh_oracle(tr: zs.MeshTrainer, n: int) -> dict:
    """The state of plain Adam on one device after the first `STEPS` steps of `tr`, whose ZeRO axes have `n`
    devices: fed each leaf's gradient rows summed and divided by `n` (an expert block's rows come from the devices
    that hold it; zero1 divides by the whole ZeRO group)."""
    return optax_state(zs.inner("adam"), zs.params_np(tr.shapes),
                       [{k: g.sum(0) / n for k, g in tr.grads_np(t).items()} for t in range(STEPS)])


def columns(parts: int):
    """The blocks of a leaf sharded over its second dimension by an axis of size `parts`."""
    return lambda x: np.split(x, parts, axis=1)


def whole(x):
    return [x]


@pytest.fixture(scope="module")
def saved_2d(tmp_path_factory):
    tr = zs.MeshTrainer("adam", {"data": 4, "model": 2}, "data", SPECS_2D, SHAPES_2D)
    p = tr.params()
    _, s = tr.train(p, tr.init(p), 0, STEPS)
    return save(str(tmp_path_factory.mktemp("two_d")), s), s, mesh_oracle(tr, 4)


def test_2d_state_records_its_placement_and_restores_on_the_same_mesh(saved_2d):
    item, source, _ = saved_2d
    record = zo.ZeroCheckpointHandler().metadata(item)["states"][0]
    assert record["mesh_axes"] == [["model", 2]]
    w = next(x for x in record["leaves"] if x["path"] == "['w']")
    assert (w["shape"], w["axes"], w["blocks"], w["group"]) == ([6, 4], ["model"], 2, 4)
    assert (w["spec"], w["global_shape"]) == (None, None)  # its own shard_map, no `param_specs`: unknown
    assert [a["spec"] for a in record["arrays"] if a["entry"] == 2] == [[["model", "data"]]]
    tr = zs.MeshTrainer("adam", {"data": 4, "model": 2}, "data", SPECS_2D, SHAPES_2D)
    zs.assert_bit_equal(restore(item, tr.abstract(), reshard=False), source)


def test_2d_state_at_another_data_size(saved_2d, tmp_path):
    item, _, want = saved_2d
    tr = zs.MeshTrainer("adam", {"data": 2, "model": 2}, "data", SPECS_2D, SHAPES_2D)
    got = restore(item, tr.abstract(), reshard=True)
    assert got.layout.world_size == 2
    cuts = {"['w']": (columns(2), 2), "['b']": (whole, 2)}
    assert_holds_blocks(got, want, cuts)
    zo.reshard(item, tmp_path / "dst", world_size=2)
    assert_holds_blocks(restore(tmp_path / "dst", tr.abstract(), reshard=False), want, cuts)
    p = tr.params()
    tr.train(p, got, 2, 3)  # and it trains on
    records = zo.load_rank_records(item)
    assert [(r.rank, r.world_size) for r in records] == [(r, 4) for r in range(4)]
    assert sorted(records[0].params) == ["['b']", "['w']#block0", "['w']#block1"]
    w1 = np.concatenate([r.params["['w']#block1"].buffers["[0].mu['w']"] for r in records])
    np.testing.assert_allclose(w1[:24].reshape(6, 4), np.asarray(want[0].mu["w"])[:, 4:], rtol=RTOL, atol=ATOL)


def test_2d_state_at_another_model_size(saved_2d, tmp_path):
    """model=2 -> model=1: `w`'s two (6, 4) blocks become one (6, 8) block (tests/test_any_mesh.py trains on)."""
    item, _, want = saved_2d
    tr = zs.MeshTrainer("adam", {"data": 4, "model": 1}, "data", SPECS_2D, SHAPES_2D)
    cuts = {"['w']": (whole, 4), "['b']": (whole, 4)}
    assert_holds_blocks(restore(item, tr.abstract(), reshard=True), want, cuts)
    zo.reshard(item, tmp_path / "dst", axis_sizes={"data": 4, "model": 1}, param_specs=SPECS_2D)
    assert_holds_blocks(restore(tmp_path / "dst", tr.abstract(), reshard=False), want, cuts)


def test_expert_leaves(tmp_path):
    """Leaves sharded over a ZeRO axis: restore with reshard=True when their blocks stay; zo.reshard needs the size
    of each ZeRO axis (tests/test_any_mesh.py changes the expert size)."""
    specs, shapes = {"e": P("expert"), "w": P(None, "model"), "b": P()}, {"e": (4, 3), "w": (6, 8), "b": (5,)}
    tr = zs.MeshTrainer("adam", {"expert": 2, "data": 2, "model": 2}, ("expert", "data"), specs, shapes)
    p = tr.params()
    _, s = tr.train(p, tr.init(p), 0, STEPS)
    item, want = save(str(tmp_path / "ckpt"), s), mesh_oracle(tr, 4)
    small = zs.MeshTrainer("adam", {"expert": 2, "data": 1, "model": 2}, ("expert", "data"), specs, shapes)
    got = restore(item, small.abstract(), reshard=True)
    assert got.layout.world_size == 2
    assert_holds_blocks(got, want, {"['e']": (lambda x: np.split(x, 2), 1), "['w']": (columns(2), 2),
                                    "['b']": (whole, 2)})
    with pytest.raises(zo.ZeroCheckpointError, match=r"leaf `\['e'\]` is sharded over a ZeRO axis.*"
                                                     r"pass `axis_sizes`"):
        zo.reshard(item, tmp_path / "dst", world_size=2)
    assert not os.path.exists(tmp_path / "dst")
    records = zo.load_rank_records(item)
    assert [(r.rank, r.world_size) for r in records] == [(0, 4), (1, 4), (2, 4), (3, 4), (0, 2), (1, 2)]
    assert sorted(records[-1].params) == ["['e']#block0", "['e']#block1"]
    e0 = np.concatenate([r.params["['e']#block0"].buffers["[0].nu['e']"] for r in records[-2:]])
    np.testing.assert_allclose(e0.reshape(2, 3), np.asarray(want[0].nu["e"])[:2], rtol=RTOL, atol=ATOL)



def test_a_lone_leaf_is_restored_without_a_second_copy():
    """Restoring joins the entries' arrays into the groups' (`_arrays.rebuild`): a lone leaf kept 1-D stores its
    entries' arrays as they are, so a restore holds the state once (benchmarks/RESULTS.md, the 2-D restore); a
    group of small leaves is joined, and both come back exactly."""
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
    assert again._inner.histories[lone][0] is by_entry[layout.groups[lone].histories[0][0]]
    assert again.master[lone] is by_entry[layout.groups[lone].masters[0]]
    for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(state), strict=True):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------- recorded placement (record format 3): square blocks


SQUARE_SHAPES = {"w": (4, 8), "v": (8, 4), "b": (5,)}
SQUARE_SPECS = {"w": P(None, "model"), "v": P("model", None), "b": P()}
"""At model=2 both matrices have (4, 4) blocks, which cannot tell which dimension `model` cuts."""
SQUARE_CUTS = {"w": 1, "v": 0}
"""The dimension `model` cuts, by leaf: how the test lays out a block by hand."""


def square_grads() -> list[dict]:
    rng = np.random.default_rng(77)
    return [{k: rng.standard_normal(s).astype(np.float32) for k, s in SQUARE_SHAPES.items()} for _ in range(STEPS)]


def bound(kind: str, data: int, model: int, specs=SQUARE_SPECS):
    """A mesh-bound zero1 of `kind` on a (data, model) mesh, and the parameters laid out by `specs` on it."""
    mesh = jax.make_mesh((data, model), ("data", "model"), devices=jax.devices()[:data * model])
    tx = zo.zero1(zs.inner(kind), axis_name="data", partition=zs.PARTITION[kind], mesh=mesh)
    params = {k: zs.global_array(v, NamedSharding(mesh, specs[k])) for k, v in zs.params_np(SQUARE_SHAPES).items()}
    return tx, params


def assert_holds_square(state, want, model: int) -> None:
    """A mesh-bound state on a (data, model) mesh holds plain optax's state `want`: sliced histories laid out by
    hand block by block (`SQUARE_CUTS`), owned entries whole from the packed buffers, shared ones everywhere."""
    layout, ref = zo.describe(state), by_path(want)
    stored = h.stored_entries(state)
    buffers = {d: np.asarray(b) for d, b in state.buffers.items()}
    owned = {j: buffers[d][r, off:off + layout.entries[j].size].reshape(layout.entries[j].shape)
             for r in range(layout.world_size) for j in layout.rank_entries(r)
             for d, off in [layout.state_packing.offsets[r][j]]}
    for j in layout.inner_entries:
        e = layout.entries[j]
        if e.leaf is None:
            got, expected = stored[j], np.broadcast_to(ref[e.path], stored[j].shape)
        elif layout.leaves[e.leaf].sliced:
            leaf = layout.leaves[e.leaf]
            name = leaf.path[2:-2]
            blocks = np.split(ref[e.path], model, axis=SQUARE_CUTS[name]) if name in SQUARE_CUTS else [ref[e.path]]
            got, expected = stored[j], laid_out(blocks, leaf.group)
        else:
            got, expected = owned[j], ref[e.path]
        assert got.dtype == expected.dtype, e.path
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL, err_msg=e.path)


@pytest.fixture(scope="module")
def saved_square(tmp_path_factory):
    """Per kind (adam: sliced, muon: owned tensor-parallel), a checkpoint of a mesh-bound run on (data=4, model=2),
    the state, and plain optax's state after the same steps."""
    out = {}
    for kind in ("adam", "muon"):
        tx, p = bound(kind, 4, 2)
        s = tx.init(p)
        for g in square_grads():
            u, s = tx.update({k: jax.device_put(v, p[k].sharding) for k, v in g.items()}, s, p)
            p = optax.apply_updates(p, u)
        want = optax_state(zs.inner(kind), zs.params_np(SQUARE_SHAPES), square_grads())
        out[kind] = save(str(tmp_path_factory.mktemp(f"square_{kind}")), s), s, want
    return out


def _leaf_record(item, path: str) -> dict:
    return next(x for x in zo.ZeroCheckpointHandler().metadata(item)["states"][0]["leaves"] if x["path"] == path)


@pytest.mark.parametrize("kind", ["adam", "muon"])
@pytest.mark.parametrize("data,model", [(8, 1), (2, 4)])
def test_square_blocks_move_between_meshes_without_param_specs(saved_square, tmp_path, kind, data, model):
    """The record's placement tells which dimension `model` cuts: offline and at load time, no `param_specs`."""
    item, _, want = saved_square[kind]
    assert _leaf_record(item, "['w']")["spec"] == [[], ["model"]]
    assert _leaf_record(item, "['v']")["global_shape"] == [8, 4]
    tx, p = bound(kind, data, model)
    target = tx.init(p)
    zo.reshard(item, tmp_path / "dst", axis_sizes={"data": data, "model": model})
    offline = restore(tmp_path / "dst", target, reshard=False)
    assert_holds_square(offline, want, model)
    loaded = restore(item, target, reshard=True)
    zs.assert_bit_equal(loaded, offline)
    w = _leaf_record(tmp_path / "dst", "['w']")  # the placement carried forward for the new mesh
    assert (w["spec"], w["global_shape"], w["axes"]) == ([[], ["model"]], [4, 8], ["model"])
    u, _ = tx.update({k: jax.device_put(v, p[k].sharding) for k, v in square_grads()[0].items()}, loaded, p)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(u))  # and it trains on


def test_square_blocks_round_trip_exactly(saved_square, tmp_path):
    """(4, 2) -> (2, 4) -> (4, 2) offline gives back the saved state bit for bit."""
    for kind in ("adam", "muon"):
        item, source, _ = saved_square[kind]
        zo.reshard(item, tmp_path / kind / "a", axis_sizes={"data": 2, "model": 4})
        zo.reshard(tmp_path / kind / "a", tmp_path / kind / "b", axis_sizes={"data": 4, "model": 2})
        tx, p = bound(kind, 4, 2)
        zs.assert_bit_equal(restore(tmp_path / kind / "b", tx.init(p), reshard=False), source)


def test_a_spec_that_contradicts_the_record_is_refused(saved_square, tmp_path):
    item, _, _ = saved_square["adam"]
    swapped = {"w": P("model", None), "v": P("model", None), "b": P()}
    with pytest.raises(zo.ZeroCheckpointError, match=r"`param_specs` gives leaf `\['w'\]` the spec \('model', None\), "
                                                     r"which cuts `model` along dimension 0, but the checkpoint "
                                                     r"records that `model` cuts dimension 1"):
        zo.reshard(item, tmp_path / "dst", axis_sizes={"data": 8, "model": 1}, param_specs=swapped)
    assert not os.path.exists(tmp_path / "dst")
    tx, p = bound("adam", 4, 2, swapped)
    with pytest.raises(zo.ZeroCheckpointError, match=r"leaf `\['w'\]` is cut over `model` along dimension 1 in the "
                                                     r"checkpoint .* but along dimension 0 in the target"):
        restore(item, tx.init(p), reshard=True)


def _as_format_2(item, tmp_path):
    """A copy of `item` whose record is format 2's: no placement."""
    out = tmp_path / "v2"
    shutil.copytree(item, out)
    record = json.loads((out / _names.RECORD_FILE).read_text())
    record["format_version"] = 2
    for state in record["states"]:
        for leaf in state["leaves"]:
            del leaf["spec"], leaf["global_shape"]
    (out / _names.RECORD_FILE).write_text(json.dumps(record))
    return out


def test_a_format_2_record_still_needs_param_specs_for_square_blocks(saved_square, tmp_path):
    item, source, want = saved_square["adam"]
    old = _as_format_2(item, tmp_path)
    tx, p = bound("adam", 4, 2)
    zs.assert_bit_equal(restore(old, tx.init(p), reshard=False), source)
    with pytest.raises(zo.ZeroCheckpointError, match=r"leaf `\['v'\]` .* it could cut dimensions \[0, 1\]: pass "
                                                     r"`param_specs`"):
        zo.reshard(old, tmp_path / "dst", axis_sizes={"data": 8, "model": 1})
    zo.reshard(old, tmp_path / "dst", axis_sizes={"data": 8, "model": 1}, param_specs=SQUARE_SPECS)
    tx, p = bound("adam", 8, 1)
    assert_holds_square(restore(tmp_path / "dst", tx.init(p), reshard=False), want, 1)
    assert _leaf_record(tmp_path / "dst", "['v']")["spec"] == [["model"], []]  # what `param_specs` told


@pytest.mark.parametrize("leaf,edit,match", [
    (1, {"spec": [["model"], ["tensor"]]}, r"leaves\[1\]\.spec` names `tensor`, which is neither a ZeRO axis"),
    (1, {"spec": [["model"]]}, r"leaves\[1\]\.spec` is \[\[\"model\"\]\], which does not cut the 2 dimensions"),
    (1, {"spec": [["model"], ["model"]]}, r"leaves\[1\]\.spec` .* over the leaf's axes \[\"model\"\], each once"),
    (1, {"spec": [["model", "model"], []]}, r"leaves\[1\]\.spec\[0\]` repeats an axis name"),
    (1, {"spec": [[], "model"]}, r"leaves\[1\]\.spec\[1\]` is a str, not a list"),
    (0, {"spec": None, "global_shape": None}, r"leaves\[0\]\.spec` is null, but a leaf sharded over no other"),
    (1, {"spec": None}, r"leaves\[1\]\.global_shape` is \[8, 4\], but .* it must be null"),
    (1, {"global_shape": [4, 4]}, r"leaves\[1\]\.global_shape` is \[4, 4\], but the block \[4, 4\] cut as `spec` "
                                  r"says over the axis sizes \{\"model\": 2\} is \[8, 4\]"),
    (1, {"global_shape": [8, 4, 1]}, r"leaves\[1\]\.global_shape` is \[8, 4, 1\]"),
    (1, {"global_shape": None}, r"leaves\[1\]\.global_shape` is a NoneType, not a list"),
    (1, {"global_shape": ..., "spec": ...}, r"leaves\[1\]` lacks 'global_shape', 'spec'"),
])
def test_placement_fields_are_checked(saved_square, tmp_path, leaf, edit, match):
    item, _, _ = saved_square["adam"]
    bad = tmp_path / "bad"
    shutil.copytree(item, bad)
    record = json.loads((bad / _names.RECORD_FILE).read_text())
    x = record["states"][0]["leaves"][leaf]
    assert x["path"] == ["['b']", "['v']"][leaf]
    for k, v in edit.items():
        if v is ...:
            del x[k]
        else:
            x[k] = v
    (bad / _names.RECORD_FILE).write_text(json.dumps(record))
    with pytest.raises(zo.ZeroCheckpointError, match=match):
        zo.ZeroCheckpointHandler().metadata(bad)
    with pytest.raises(zo.ZeroCheckpointError, match=match):
        zo.reshard(bad, tmp_path / "dst", axis_sizes={"data": 8, "model": 1})


def test_format_2_fields_are_checked(saved_square, tmp_path):
    """A format-2 record has no placement; a tensor-parallel owned leaf's spec is its `dims`."""
    for kind, edit, match in [
            ("adam", lambda r: r.update(format_version=2),
             r"leaves\[0\]` has unknown fields \"global_shape\", \"spec\""),
            ("muon", lambda r: r["states"][0]["leaves"][1].update(spec=[[], ["model"]], global_shape=[4, 8]),
             r"leaves\[1\]\.spec` is \[\[\], \[\"model\"\]\], but the leaf's `dims` are \[\[\"model\"\], \[\]\]")]:
        item, _, _ = saved_square[kind]
        bad = tmp_path / kind
        shutil.copytree(item, bad)
        record = json.loads((bad / _names.RECORD_FILE).read_text())
        edit(record)
        (bad / _names.RECORD_FILE).write_text(json.dumps(record))
        with pytest.raises(zo.ZeroCheckpointError, match=match):
            zo.ZeroCheckpointHandler().metadata(bad)
