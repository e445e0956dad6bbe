"""Tests for zero_optax._checkpoint: Orbax saving and restoring of zero1 states."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import _zero_setup as zs
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest

import zero_optax as zo
from zero_optax import _record, _store

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))

# (kind, chain): flat adamw behind reduce_gradients + clip (a tuple state with one zero1 state), leaf muon and
# leaf adafactor on their own.
CONFIGS = [("adamw", True), ("muon", False), ("adafactor", False)]


def _composite_save(p, s):
    return ocp.args.Composite(params=ocp.args.StandardSave(p), opt_state=zo.ZeroSave(s))


def _composite_restore(p, target):
    return ocp.args.Composite(params=ocp.args.StandardRestore(p), opt_state=zo.ZeroRestore(target))


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
        # Training continues at once and donates the saved state's buffers while the save may still be running.
        p_ref, s_ref = tr.train(p, s, 2, 4)
        if jax.__version_info__ < (0, 11):  # JAX 0.11 on CPU keeps the donated buffers alive (seen on 0.11.2)
            assert all(x.is_deleted() for x in jax.tree.leaves(s))
        mngr.wait_until_finished()
        assert mngr.latest_step() == 2
        for target in (tr.init(p0), tr.abstract(p0)):
            restored = mngr.restore(2, args=_composite_restore(p0, target))
            r = restored.opt_state
            assert jax.tree.structure(r) == jax.tree.structure(target)
            for state, t in zip(zo._zero1.find_states(r), zo._zero1.find_states(target)):
                assert state.layout is t.layout
            for x, t in zip(jax.tree.leaves(r), jax.tree.leaves(target)):
                assert x.sharding == t.sharding
            zs.assert_bit_equal(zs.host(r), saved_state)
            zs.assert_bit_equal(zs.host(restored.params), saved_params)
            p_new, s_new = tr.train(restored.params, r, 2, 4)
            zs.assert_bit_equal(p_new, p_ref)
            zs.assert_bit_equal(s_new, s_ref)
        meta = mngr.item_metadata(2)["opt_state"]
    assert meta["format_version"] == _record.FORMAT_VERSION
    assert meta["states"][0]["partition"] == zs.PARTITION[kind]
    assert 2 in meta["states"][0]["clocks"].values()  # Two steps taken.


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
    assert meta["tree"] == str(jax.tree.structure(s, is_leaf=lambda x: isinstance(x, zo.ZeroLeafState)))
    state = meta["states"][0]
    assert state["owners"] == list(s.layout.owners)
    assert state["clocks"] and set(state["clocks"].values()) == {1}
    assert sorted(os.listdir(tmp_path / "x" / "arrays")) == sorted(a["name"] for a in state["arrays"])


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
    assert restored.inner_state[0].mu["a"].sharding == s.inner_state[0].mu["a"].sharding


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
    with ocp.CheckpointManager(tmp_path / "m") as mngr:
        mngr.save(0, args=ocp.args.Composite(opt_state=zo.ZeroSave(s)))
        mngr.wait_until_finished()
    with ocp.CheckpointManager(tmp_path / "m", item_handlers={"opt_state": zo.ZeroCheckpointHandler()}) as mngr:
        assert mngr.item_metadata(0)["opt_state"]["states"][0]["partition"] == "flat"
        with pytest.raises(zo.ZeroCheckpointError, match="needs a target"):
            mngr.restore(0)


# ---------------------------------------------------------------------------------------------------------------
# Restore refuses mismatches and damage, and reads nothing when it does.


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Item directories of a flat zero1(adam) and a leaf zero1(muon) state saved on 8 devices."""
    root = tmp_path_factory.mktemp("saved")
    out = {}
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        for kind in ("adam", "muon"):
            tr = zs.trainer(kind)
            ckpt.save(root / kind, args=zo.ZeroSave(tr.init(zs.params(tr.mesh))))
            out[kind] = root / kind
    return out


@pytest.fixture
def reads(monkeypatch):
    """Counts array reads; every test using it checks that a failed restore read no array."""
    count = []
    read_to_jax = _store.read_to_jax

    def counting(*args, **kwargs):
        count.append(args[0])
        return read_to_jax(*args, **kwargs)

    monkeypatch.setattr(_store, "read_to_jax", counting)
    return count


def _copy(saved, kind, tmp_path):
    dst = tmp_path / kind
    shutil.copytree(saved[kind], dst)
    return dst


def _restore(directory, target):
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        return ckpt.restore(directory, args=zo.ZeroRestore(target))


def _target(kind, n=8, shapes=zs.SHAPES, **kwargs):
    tr = zs.trainer(kind, n=n, **kwargs)
    return tr.init(zs.params(tr.mesh, shapes))


def test_restore_reads_every_array_once_when_valid(saved, reads):
    restored = _restore(saved["adam"], _target("adam"))
    assert len(reads) == len(jax.tree.leaves(restored)) == 9


def _edit_record(directory, edit):
    path = directory / _record.RECORD_FILE
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))


def test_future_format_version(saved, reads, tmp_path):
    d = _copy(saved, "adam", tmp_path)
    _edit_record(d, lambda r: r.update(format_version=2))
    with pytest.raises(zo.ZeroCheckpointError, match="record format version 2.*reads version 1.*Upgrade"):
        _restore(d, _target("adam"))
    assert not reads


def test_corrupt_json(saved, reads, tmp_path):
    d = _copy(saved, "adam", tmp_path)
    text = (d / _record.RECORD_FILE).read_text()
    (d / _record.RECORD_FILE).write_text(text[: len(text) // 2])
    with pytest.raises(zo.ZeroCheckpointError, match="is not valid JSON.*damaged"):
        _restore(d, _target("adam"))
    assert not reads


def test_damaged_record_fields(saved, reads, tmp_path):
    d = _copy(saved, "adam", tmp_path)
    _edit_record(d, lambda r: r["states"][0].pop("leaves"))
    with pytest.raises(zo.ZeroCheckpointError, match="leaves"):
        _restore(d, _target("adam"))
    _edit_record(d, lambda r: r.update(states={}))
    with pytest.raises(zo.ZeroCheckpointError, match="no valid `states`"):
        _restore(d, _target("adam"))
    assert not reads


def test_not_a_checkpoint(reads, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(zo.ZeroCheckpointError, match="is not a zero_optax checkpoint: zero_record.json is missing"):
        _restore(tmp_path / "empty", _target("adam"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / _record.RECORD_FILE).write_text('{"format": "something else"}')
    with pytest.raises(zo.ZeroCheckpointError, match="is not a zero_optax record"):
        _restore(tmp_path / "other", _target("adam"))
    assert not reads


def test_world_size_change_names_reshard(saved, reads):
    with pytest.raises(zo.ZeroCheckpointError,
                       match=r"saved with world size 8, but the target state has 4 devices.*zero_optax\.reshard"):
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
        with pytest.raises(zo.ZeroCheckpointError, match="reshard"):
            mngr.restore(0, args=_composite_restore(p4, small.init(p4)))
    assert not reads


def test_different_owners(saved, reads):
    owners = tuple(reversed(saved_owners := _record.read_record(saved["muon"])["states"][0]["owners"]))
    assert list(owners) != saved_owners
    with pytest.raises(zo.ZeroCheckpointError,
                       match=r"zero1 state 0 \(at `<root>`\): owners\[\d+\] is \d+ in the checkpoint but \d+ in the"):
        _restore(saved["muon"], _target("muon", owners=owners))
    assert not reads


def test_different_shapes(saved, reads):
    shapes = dict(zs.SHAPES, c=(9,))
    with pytest.raises(zo.ZeroCheckpointError, match=r"leaves\[2\] is .*\"shape\": \[7\].* in the checkpoint but"
                                                     r" .*\"shape\": \[9\].* in the target"):
        _restore(saved["adam"], _target("adam", shapes=shapes))
    assert not reads


def test_adam_record_into_lion_target(saved, reads):
    with pytest.raises(zo.ZeroCheckpointError, match=r"state_tree is .*ScaleByAdamState.* in the checkpoint but .*ScaleByLionState.* in the target"):
        _restore(saved["adam"], _target("lion"))
    assert not reads


def test_flat_record_into_leaf_target(saved, reads):
    with pytest.raises(zo.ZeroCheckpointError, match="partition is \"flat\" in the checkpoint but \"leaf\""):
        _restore(saved["adam"], _target("muon"))
    assert not reads


def test_adam_record_into_adabelief_target(saved, reads):
    """Same entry paths, shapes and dtypes: only the inner state's type names tell Adam from AdaBelief."""
    tr = zs.trainer("adam")
    tx = zo.zero1(optax.adabelief(1e-2), axis_name="data")
    target = jax.jit(jax.shard_map(tx.init, mesh=tr.mesh, in_specs=jax.P(), out_specs=jax.P("data")))(
        zs.params(tr.mesh))
    with pytest.raises(zo.ZeroCheckpointError, match=r"state_tree is .*ScaleByAdamState.* in the checkpoint but "
                       r".*ScaleByBeliefState.* in the target"):
        _restore(saved["adam"], target)
    assert not reads


def test_different_tree_around_the_zero_state(saved, reads):
    with pytest.raises(zo.ZeroCheckpointError, match=r"the saved pytree is .* but the target is .*EmptyState"):
        _restore(saved["adam"], _target("adam", chain=True))
    assert not reads


def _chunk(directory, array="0.entry0001", chunk="3.0"):
    path = directory / _record.ARRAYS_DIR / array / chunk
    assert path.exists()
    return path


def test_deleted_chunk_file(saved, reads, tmp_path):
    d = _copy(saved, "adam", tmp_path)
    _chunk(d).unlink()
    with pytest.raises(zo.ZeroCheckpointError, match=r"incomplete or damaged: array 0.entry0001: missing chunk file"
                                                     r" .*0.entry0001/3.0. Nothing was loaded"):
        _restore(d, _target("adam"))
    assert not reads


def test_truncated_chunk_file(saved, reads, tmp_path):
    d = _copy(saved, "muon", tmp_path)
    path = _chunk(d, "0.buffer_float32", "5.0")
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(zo.ZeroCheckpointError, match=r"array 0.buffer_float32: truncated chunk file .*5.0"):
        _restore(d, _target("muon"))
    assert not reads


def test_missing_array_metadata(saved, reads, tmp_path):
    d = _copy(saved, "adam", tmp_path)
    (d / _record.ARRAYS_DIR / "0.entry0008" / ".zarray").unlink()
    with pytest.raises(zo.ZeroCheckpointError, match="array 0.entry0008: cannot read array metadata"):
        _restore(d, _target("adam"))
    assert not reads


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
