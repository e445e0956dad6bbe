"""Tests for the checkpoint handler (`zero_optax.checkpoint`): Orbax saving and restoring of zero1 states at the
saved layout."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import _zero_setup as zs
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

import zero_optax as zo
from zero_optax.checkpoint import _record, _store
from zero_optax.core import _names

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))

# (kind, chain): flat adamw behind reduce_gradients + clip (a tuple state with one zero1 state), leaf muon and
# leaf adafactor on their own.
CONFIGS = [("adamw", True), ("muon", False), ("adafactor", False)]


def _composite_save(p, s):
    return ocp.args.Composite(params=ocp.args.StandardSave(p), opt_state=zo.ZeroSave(s))


def _composite_restore(p, target):
    return ocp.args.Composite(params=ocp.args.StandardRestore(p), opt_state=zo.ZeroRestore(target))


def _files(directory) -> list[str]:
    return sorted(os.path.relpath(os.path.join(b, f), directory) for b, _, fs in os.walk(directory) for f in fs)


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("kind,chain", CONFIGS, ids=[k for k, _ in CONFIGS])
def test_round_trip_and_continue(tmp_path, kind, chain, asynchronous):
    tr = zs.trainer(kind, chain=chain)
    p0 = zs.params(tr.mesh)
    p, s = tr.train(p0, tr.init(p0), 0, 2)
    saved_params, saved_state = zs.host(p), zs.host(s)
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=asynchronous)
    with ocp.CheckpointManager(tmp_path, options=options) as mngr:
        mngr.save(2, args=_composite_save(p, s))
        # Training continues at once, with a step that donates the saved state, while the save may still be
        # running. (On CPU, Orbax's host copies are views of the device buffers, so JAX declines the donation
        # until they are written; on accelerators they are copies. Either way the saved values stay intact.)
        p_ref, s_ref = tr.train(p, s, 2, 4)
        s_ref_host = zs.host(s_ref)
        mngr.wait_until_finished()
        if jax.__version_info__ < (0, 11):  # JAX 0.11 on CPU keeps the donated buffers alive (seen on 0.11.2)
            tr.train(p_ref, s_ref, 4, 5)  # once written, the save holds no reference to any buffer
            assert all(x.is_deleted() for x in jax.tree.leaves(s_ref))
        assert mngr.latest_step() == 2
        for target in (tr.init(p0), tr.abstract(p0)):
            restored = mngr.restore(2, args=_composite_restore(p0, target))
            r = restored.opt_state
            assert jax.tree.structure(r) == jax.tree.structure(target)
            for state, t in zip(zo.layout._state.find_states(r), zo.layout._state.find_states(target)):
                assert state.layout is t.layout
            for x, t in zip(jax.tree.leaves(r), jax.tree.leaves(target)):
                assert x.sharding == t.sharding
            zs.assert_bit_equal(zs.host(r), saved_state)
            zs.assert_bit_equal(zs.host(restored.params), saved_params)
            p_new, s_new = tr.train(restored.params, r, 2, 4)
            zs.assert_bit_equal(p_new, p_ref)
            zs.assert_bit_equal(zs.host(s_new), s_ref_host)
        meta = mngr.item_metadata(2)["opt_state"]
    assert meta["format_version"] == _record.FORMAT_VERSION == 3
    assert meta["storage"] == "orbax"
    assert meta["states"][0]["partition"] == zs.PARTITION[kind]
    assert 2 in meta["states"][0]["clocks"].values()  # Two steps taken.
    # Orbax's own array storage: OCDBT data files and Orbax's metadata, no file per array or device. (How many
    # data files OCDBT writes depends on how its writes were batched, which varies with the machine's load: an
    # asynchronous save wrote 15 files alone and 21 beside another test process; so the names are checked.)
    item = tmp_path / "2" / "opt_state"
    assert {"_METADATA", "manifest.ocdbt", _names.RECORD_FILE} <= set(os.listdir(item))
    orbax_files = re.compile(r"_METADATA|_sharding|array_metadatas/process_\d+|commit_success\.txt|"
                             rf"{re.escape(_names.RECORD_FILE)}|(ocdbt\.process_\d+/)?(manifest\.ocdbt|d/[0-9a-f]+)")
    assert all(orbax_files.fullmatch(f) for f in _files(item)), _files(item)


def test_standalone_checkpointer_and_metadata(tmp_path):
    tr = zs.trainer("muon")
    p = zs.params(tr.mesh)
    p, s = tr.train(p, tr.init(p), 0, 1)
    expected = zs.host(s)
    handler = zo.ZeroCheckpointHandler()
    with ocp.Checkpointer(handler) as ckpt:
        ckpt.save(tmp_path / "x", args=zo.ZeroSave(s))
        meta = handler.metadata(tmp_path / "x")
        restored = ckpt.restore(tmp_path / "x", args=zo.ZeroRestore(tr.init(p)))
    zs.assert_bit_equal(zs.host(restored), expected)
    assert meta["format"] == _record.FORMAT
    assert meta["tree"] == "*"  # our own signature of the saved pytree: one zero1 state, at the root
    state = meta["states"][0]
    assert state["owners"] == list(s.layout.owners)
    assert state["clocks"] and set(state["clocks"].values()) == {1}
    shared = [f"0.entry{j:04d}" for j, e in enumerate(state["entries"]) if e["leaf"] is None]  # step counts ...
    assert [a["name"] for a in state["arrays"]] == shared + ["0.buffer_float32"]
    stored = {k.split("/")[0] for k in _store.ItemArrays(tmp_path / "x").stored_keys()}
    assert {a["name"] for a in state["arrays"]} == stored
    # Orbax reads the arrays as a plain pytree too: nothing but Orbax's format under the record.
    arrays = ocp.PyTreeCheckpointer().restore(tmp_path / "x")
    np.testing.assert_array_equal(arrays["0.buffer_float32"], np.asarray(s.buffers["float32"]))


def test_file_count_stays_small_with_many_leaves(tmp_path):
    """Orbax's OCDBT storage: a few files per process, whatever the number of leaves and devices.

    The number of OCDBT data files (`d/` and `ocdbt.process_0/d/`) is not asserted: TensorStore starts a new data
    file for every commit, and how many of the concurrent array writes one commit carries depends on timing (for
    the same 81 arrays: 4 to 11 data files on an idle machine, 47 files in all once on a loaded one). Everything
    else is fixed: the same few files for 2 leaves as for 40, no file per array or per device, the data in one
    process's database.
    """
    names = []
    for n_leaves in (2, 40):
        shapes = {f"w{i:02d}": (3, i + 1) for i in range(n_leaves)}
        tr = zs.trainer("adam")
        s = tr.init(zs.params(tr.mesh, shapes))
        with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
            ckpt.save(tmp_path / str(n_leaves), args=zo.ZeroSave(s))
        files = _files(tmp_path / str(n_leaves))
        data = [f for f in files if f.startswith(("d/", "ocdbt.process_0/d/"))]
        assert data and all(f.count("/") == f.startswith("ocdbt.") + 1 for f in data), data
        names.append(sorted(set(files) - set(data)))
    assert names[0] == names[1] and len(names[1]) < 15, names  # the old format: 8 * (1 + 2 * 40) files
    assert not any("entry" in f or "buffer" in f for f in names[1]), names[1]


def test_eval_shape_target_needs_the_concrete_mesh(tmp_path):
    tr = zs.trainer("adamw")
    p = zs.params(tr.mesh)
    s = tr.init(p)
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        ckpt.save(tmp_path / "x", args=zo.ZeroSave(s))
        target = jax.eval_shape(tr.init, p)
        with pytest.raises(zo.ZeroCheckpointError, match="abstract mesh.*jax.set_mesh"):
            ckpt.restore(tmp_path / "x", args=zo.ZeroRestore(target))
        with jax.set_mesh(tr.mesh):
            restored = ckpt.restore(tmp_path / "x", args=zo.ZeroRestore(target))
    zs.assert_bit_equal(restored, s)
    assert [x.sharding for x in jax.tree.leaves(restored)] == [x.sharding for x in jax.tree.leaves(s)]


def test_flax_optimizer_state_in_variables(tmp_path):
    """`nnx.Optimizer(model, tx).opt_state` holds the zero1 state's arrays in Variables; both ways work."""
    from flax.nnx.training.optimizer import OptArray, to_opt_state  # pylint: disable=import-outside-toplevel
    tr = zs.trainer("adamw", chain=True)
    p0 = zs.params(tr.mesh)
    _, s = tr.train(p0, tr.init(p0), 0, 1)
    opt_state = to_opt_state(s)  # what nnx.Optimizer keeps
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        ckpt.save(tmp_path / "x", args=zo.ZeroSave(opt_state))
        restored = ckpt.restore(tmp_path / "x", args=zo.ZeroRestore(target=to_opt_state(tr.init(p0))))
        abstract = ckpt.restore(tmp_path / "x", args=zo.ZeroRestore(target=to_opt_state(tr.abstract(p0))))
    for r in (restored, abstract):
        assert jax.tree.structure(r) == jax.tree.structure(opt_state)
        assert all(isinstance(v, OptArray) for v in jax.tree.leaves(r, is_leaf=lambda x: isinstance(x, OptArray)))
        zs.assert_bit_equal(zo.core._compat.pure(r), s)


def test_save_refuses_arrays_outside_zero_states(tmp_path):
    tr = zs.trainer("adamw")
    s = tr.init(zs.params(tr.mesh))
    with pytest.raises(zo.ZeroCheckpointError, match=r"leaf outside any zero1 state at `\[1\]`.*StandardSave"):
        zo.ZeroSave((s, jnp.zeros(3)))
    with pytest.raises(zo.ZeroCheckpointError, match="no zero1 state"):
        zo.ZeroSave(optax.adam(1e-3).init({"w": jnp.zeros(2)})[1:])
    with pytest.raises(zo.ZeroCheckpointError, match="leaf outside any zero1 state"):
        zo.ZeroSave(optax.adam(1e-3).init({"w": jnp.zeros(2)}))
    # Empty nodes around zero1 states are fine.
    zo.ZeroSave((optax.EmptyState(), None, optax.MaskedNode(), {"z": s}))


def test_handler_save_guards_against_missing_args_keyword(tmp_path):
    tr = zs.trainer("adamw")
    s = tr.init(zs.params(tr.mesh))
    handler = zo.ZeroCheckpointHandler()
    with pytest.raises(ValueError, match="args="):
        handler.save(tmp_path, zo.ZeroSave(s))
    with pytest.raises(ValueError, match="args="):
        handler.restore(tmp_path, zo.ZeroRestore(s))
    with pytest.raises(ValueError, match="ZeroSave"):
        handler.save(tmp_path)
    with pytest.raises(zo.ZeroCheckpointError, match="needs a target"):
        handler.restore(tmp_path)
    with pytest.raises(zo.ZeroCheckpointError, match="`reshard` must be True or False"):
        zo.ZeroRestore(s, reshard="yes")
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        mngr.save(0, args=ocp.args.Composite(opt_state=zo.ZeroSave(s)))
        mngr.wait_until_finished()
    with ocp.CheckpointManager(tmp_path / "m", item_handlers={"opt_state": zo.ZeroCheckpointHandler()}) as mngr:
        assert mngr.item_metadata(0)["opt_state"]["states"][0]["partition"] == "flat"
        with pytest.raises(zo.ZeroCheckpointError, match="needs a target"):
            mngr.restore(0)


@pytest.mark.parametrize("where,message", [
    ("s3://bucket/ckpt", r"the scheme `s3://` is not supported"),
    ("gs://Not_A_Bucket!/ckpt", "does not name a valid Google Cloud Storage bucket"),
    ("file/x", "is a file, not a directory"),
    ("file", "it is a file, not a directory"),
])
def test_save_refuses_an_impossible_location_at_once(tmp_path, where, message):
    """The refusal comes from `save` itself, before any background work (and leaves nothing behind)."""
    (tmp_path / "file").write_text("not a directory")
    tr = zs.trainer("adamw")
    s = tr.init(zs.params(tr.mesh))
    path = where if "://" in where else str(tmp_path / where)
    with pytest.raises(zo.ZeroCheckpointError, match=message):
        zo.ZeroCheckpointHandler().save(path, args=zo.ZeroSave(s))
    if where == "file/x":  # through an asynchronous Checkpointer, which creates directories in the background
        with ocp.AsyncCheckpointer(zo.ZeroCheckpointHandler()) as ckpt:
            with pytest.raises(zo.ZeroCheckpointError, match=message):
                ckpt.save(path, args=zo.ZeroSave(s))
    assert sorted(os.listdir(tmp_path)) == ["file"]


# ---------------------------------------------------------------------------------------------------------------
# Restore refuses mismatches and damage, and reads no array data when it does.


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Item directories of a flat zero1(adam) and a leaf zero1(muon) state saved on 8 devices, one step in."""
    root = tmp_path_factory.mktemp("saved")
    out = {}
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        for kind in ("adam", "muon"):
            tr = zs.trainer(kind)
            p = zs.params(tr.mesh)
            _, s = tr.train(p, tr.init(p), 0, 1)
            ckpt.save(root / kind, args=zo.ZeroSave(s))
            out[kind] = root / kind
    return out


@pytest.fixture
def reads(monkeypatch):
    """Counts array reads (ours and Orbax's); every test using it checks that a failed restore read none."""
    count = []
    read, orbax_read = _store.ItemArrays.read, zo.ZeroCheckpointHandler._orbax_read

    def counting(self, name, region):
        count.append(name)
        return read(self, name, region)

    def counting_orbax(self, directory, structs):
        count.extend(structs)
        return orbax_read(self, directory, structs)

    monkeypatch.setattr(_store.ItemArrays, "read", counting)
    monkeypatch.setattr(zo.ZeroCheckpointHandler, "_orbax_read", counting_orbax)
    return count


def _copy(saved, kind, tmp_path):
    dst = tmp_path / kind
    shutil.copytree(saved[kind], dst)
    return dst


def _restore(directory, target, reshard=False):
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        return ckpt.restore(directory, args=zo.ZeroRestore(target, reshard=reshard))


def _target(kind, n=8, shapes=zs.SHAPES, **kwargs):
    tr = zs.trainer(kind, n=n, **kwargs)
    return tr.init(zs.params(tr.mesh, shapes))


def test_restore_reads_every_array_once_when_valid(saved, reads):
    restored = _restore(saved["adam"], _target("adam"))
    shared = ["0.entry0000"]  # the step count, read first to check that every row agrees
    assert reads == shared + [a.name for a in zo.checkpoint._arrays.stored_arrays(restored.layout, 0)]
    assert len(jax.tree.leaves(restored)) == 3  # the step count, and mu and nu of the one group of 4 leaves


def _edit_record(directory, edit):
    path = directory / _names.RECORD_FILE
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))


@pytest.mark.parametrize("version,message", [
    (4, r"record format version 4; this zero_optax .* reads versions 2 and 3 only. Upgrade"),
    (1, r"record format version 1; .* reads versions 2 and 3 only. Checkpoints of zero_optax 0.1 \(version 1\)"),
    ("2", r"record format version \"2\"; .* The record is damaged"),
])
def test_other_format_versions(saved, reads, tmp_path, version, message):
    d = _copy(saved, "adam", tmp_path)
    _edit_record(d, lambda r: r.update(format_version=version))
    with pytest.raises(zo.ZeroCheckpointError, match=message):
        _restore(d, _target("adam"))
    with pytest.raises(zo.ZeroCheckpointError, match=message):
        _restore(d, _target("adam", n=4), reshard=True)
    assert not reads


def test_corrupt_json(saved, reads, tmp_path):
    d = _copy(saved, "adam", tmp_path)
    text = (d / _names.RECORD_FILE).read_text()
    (d / _names.RECORD_FILE).write_text(text[: len(text) // 2])
    with pytest.raises(zo.ZeroCheckpointError, match="is not valid JSON.*damaged"):
        _restore(d, _target("adam"))
    assert not reads


def test_damaged_record_fields(saved, reads, tmp_path):
    d = _copy(saved, "adam", tmp_path)
    _edit_record(d, lambda r: r["states"][0].pop("leaves"))
    with pytest.raises(zo.ZeroCheckpointError, match=r"`states\[0\]` lacks 'leaves'"):
        _restore(d, _target("adam"))
    _edit_record(d, lambda r: r.update(states={}))
    with pytest.raises(zo.ZeroCheckpointError, match=r"`states` is a dict, not a list"):
        _restore(d, _target("adam"))
    assert not reads


def test_not_a_checkpoint(reads, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(zo.ZeroCheckpointError, match="is not a zero_optax checkpoint: zero_record.json is missing"):
        _restore(tmp_path / "empty", _target("adam"))
    with pytest.raises(zo.ZeroCheckpointError, match="is not a zero_optax checkpoint: no such directory"):
        zo.ZeroCheckpointHandler().restore(tmp_path / "nowhere", args=zo.ZeroRestore(_target("adam")))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / _names.RECORD_FILE).write_text('{"format": "something else"}')
    with pytest.raises(zo.ZeroCheckpointError, match="is not a zero_optax record"):
        _restore(tmp_path / "other", _target("adam"))
    assert not reads


def test_world_size_change_names_reshard(saved, reads):
    with pytest.raises(zo.ZeroCheckpointError,
                       match=r"saved with world size 8, but the target state has 4 devices. Restore it with "
                             r"zo.ZeroRestore\(target, reshard=True\).*zo\.reshard\(src, dst, world_size=4\)"):
        _restore(saved["adam"], _target("adam", n=4))
    assert not reads


def test_world_size_change_through_checkpoint_manager(saved, reads, tmp_path):
    tr = zs.trainer("adam")
    p = zs.params(tr.mesh)
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(0, args=_composite_save(p, tr.init(p)))
        mngr.wait_until_finished()
        small = zs.trainer("adam", n=4)
        p4 = zs.params(small.mesh)
        with pytest.raises(zo.ZeroCheckpointError, match="reshard=True"):
            mngr.restore(0, args=_composite_restore(p4, small.init(p4)))
    assert not reads


def test_different_owners(saved, reads):
    owners = tuple(reversed(saved_owners := _record.read(saved["muon"])["states"][0]["owners"]))
    assert list(owners) != saved_owners
    with pytest.raises(zo.ZeroCheckpointError,
                       match=r"zero1 state 0 \(at `<root>`\) differs from the checkpoint: leaf `\['a'\]` has owner "
                             r"device \d+ in the checkpoint, device \d+ in the target.*reshard=True"):
        _restore(saved["muon"], _target("muon", owners=owners))
    assert not reads


def test_different_shapes(saved, reads):
    shapes = dict(zs.SHAPES, c=(9,))
    with pytest.raises(zo.ZeroCheckpointError, match=r"leaf `\['c'\]` has shape \(7,\) in the checkpoint, \(9,\) "
                                                     r"in the target"):
        _restore(saved["adam"], _target("adam", shapes=shapes))
    with pytest.raises(zo.ZeroCheckpointError, match=r"leaf `\['c'\]` is \[7\] \(whole\) in the checkpoint but \[9\] "
                                                     r"\(whole\) in the target.*shape changed.*same model"):
        _restore(saved["adam"], _target("adam", shapes=shapes), reshard=True)
    assert not reads


def test_adam_record_into_lion_target(saved, reads):
    with pytest.raises(zo.ZeroCheckpointError, match=r"the inner optimizer's state is ScaleByAdamState in the "
                                                     r"checkpoint, ScaleByLionState in the target"):
        _restore(saved["adam"], _target("lion"))
    assert not reads


def test_flat_record_into_leaf_target(saved, reads):
    for reshard in (False, True):
        with pytest.raises(zo.ZeroCheckpointError, match="saved with partition='flat', but the target uses "
                                                         "partition='leaf'.*gather_state"):
            _restore(saved["adam"], _target("muon"), reshard=reshard)
    assert not reads


def test_adam_record_into_adabelief_target(saved, reads):
    """Same entry paths, shapes and dtypes: only the inner state's type names tell Adam from AdaBelief."""
    tr = zs.trainer("adam")
    tx = zo.zero1(optax.adabelief(1e-2), axis_name="data")
    target = jax.jit(jax.shard_map(tx.init, mesh=tr.mesh, in_specs=jax.P(), out_specs=jax.P("data")))(
        zs.params(tr.mesh))
    with pytest.raises(zo.ZeroCheckpointError, match=r"the inner optimizer's state is ScaleByAdamState in the "
                       r"checkpoint, ScaleByBeliefState in the target"):
        _restore(saved["adam"], target, reshard=True)
    assert not reads


def test_different_tree_around_the_zero_state(saved, reads):
    with pytest.raises(zo.ZeroCheckpointError, match=r"the saved pytree is `\*` but the target is .*EmptyState"):
        _restore(saved["adam"], _target("adam", chain=True))
    assert not reads


def _database(directory):
    return ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": str(directory) + "/"}}).result()


def test_deleted_chunk(saved, reads, tmp_path):
    d = _copy(saved, "adam", tmp_path)
    del _database(d)[b"0.entry0001/c/3"]
    with pytest.raises(zo.ZeroCheckpointError, match=r"incomplete or damaged: array 0.entry0001: 1 chunks are "
                                                     r"missing \(first: 0.entry0001/c/3\). Nothing was loaded"):
        _restore(d, _target("adam"))
    assert not reads


def test_missing_array_metadata(saved, reads, tmp_path):
    d = _copy(saved, "muon", tmp_path)
    del _database(d)[b"0.buffer_float32/zarr.json"]
    with pytest.raises(zo.ZeroCheckpointError, match="array 0.buffer_float32: cannot open it"):
        _restore(d, _target("muon"))
    assert not reads


def test_missing_database(saved, reads, tmp_path):
    d = _copy(saved, "adam", tmp_path)
    (d / "manifest.ocdbt").unlink()
    with pytest.raises(zo.ZeroCheckpointError, match="incomplete or damaged"):
        _restore(d, _target("adam"))
    assert not reads


@pytest.mark.parametrize("reshard", [False, True])
def test_truncated_data_file(saved, tmp_path, reshard):
    """Damage that only reading finds is still a ZeroCheckpointError, never values."""
    d = _copy(saved, "adam", tmp_path)
    data = max((d / "d").iterdir(), key=lambda f: f.stat().st_size)  # the data files of the arrays
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(zo.ZeroCheckpointError):
        _restore(d, _target("adam", n=8 if not reshard else 3), reshard=reshard)


@pytest.mark.parametrize("kind", ["adam", "muon"])
def test_shared_entries_that_differ_between_devices_are_refused(saved, reads, tmp_path, kind):
    d = _copy(saved, kind, tmp_path)
    store = ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": {"driver": "file",
                                                                                 "path": str(d) + "/"},
                                                     "path": "0.entry0000/"}}).result()
    store[5].write(np.int32(7)).result()
    with pytest.raises(zo.ZeroCheckpointError, match=r"shared entry `.*count` of state 0 differs between source "
                                                     r"rows: row 0 holds 1, row 5 holds 7"):
        _restore(d, _target(kind))
    assert reads == ["0.entry0000"]  # read to check it, nothing else


def test_recorded_clock_must_match_the_arrays(saved, reads, tmp_path):
    d = _copy(saved, "adam", tmp_path)
    _edit_record(d, lambda r: r["states"][0]["clocks"].update({"[0].count": 5}))
    with pytest.raises(zo.ZeroCheckpointError, match=r"the record says shared entry `\[0\].count` of state 0 is 5, "
                                                     r"but the arrays hold 1"):
        _restore(d, _target("adam"))


# ---------------------------------------------------------------------------------------------------------------
# A process killed in the middle of a save leaves the previous checkpoint as the latest one.


def test_kill_during_save_keeps_previous_step(tmp_path):
    directory, marker = tmp_path / "ckpt", tmp_path / "writing"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
               PYTHONPATH=os.pathsep.join([REPO_ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen([sys.executable, os.path.join(TESTS, "_checkpoint_worker.py"), str(directory),
                               str(marker)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not marker.exists():
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()
            time.sleep(0.05)
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=30)
        log.close()
    output = (tmp_path / "worker.log").read_text()
    assert "SAVED 1" in output and "FINISHED" not in output, output
    assert any(name.startswith("2.") and "tmp" in name for name in os.listdir(directory)), os.listdir(directory)

    tr = zs.trainer("adamw", chain=True)
    p0 = zs.params(tr.mesh)
    p, s = tr.train(p0, tr.init(p0), 0, 1)
    with ocp.CheckpointManager(directory) as mngr:
        assert mngr.latest_step() == 1
        assert mngr.all_steps() == [1]
        restored = mngr.restore(1, args=_composite_restore(p0, tr.abstract(p0)))
    zs.assert_bit_equal(restored.opt_state, s)
    zs.assert_bit_equal(restored.params, p)
