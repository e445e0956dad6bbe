"""Committed checkpoints restore to the values stored beside them: tests/data/golden_v3 (made by tests/_golden.py,
record format 3) and tests/data/golden_v2 (written by zero_optax 0.2 to 0.4, record format 2); and this release
still writes golden_v3's record for them: a format change cannot go unnoticed. A format-3 record read by
zero_optax 0.4 gives 0.4's own error.

If a test here fails after a deliberate format change, bump `zero_optax._record.FORMAT_VERSION`, say what old
checkpoints need, keep the old golden directory, and write the new one with `python tests/_golden.py`.
"""

import json
import os
import shutil
import subprocess
import sys
import tarfile

import _golden
import _zero_setup as zs
import numpy as np
import orbax.checkpoint as ocp
import pytest

import zero_optax as zo
from tests import _harness as h
from zero_optax.checkpoint import _arrays, _handler
from zero_optax.core import _names

ITEM = os.path.join(_golden.V2, "item")
ITEM_V3 = os.path.join(_golden.DIRECTORY, "item")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELEASE_0_4 = "b9e62ba"
"""zero_optax 0.4.0, the last release that writes record format 2."""


def targets(n: int):
    return tuple(zs.trainer(kind, n).abstract(zs.params(zs.mesh(n))) for kind in ("adamw", "muon"))


def targets_v3():
    tx, params = _golden.mesh_bound()
    return targets(_golden.N) + (tx.init(params),)


def restore(target, reshard=False, item=ITEM):
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        return ckpt.restore(item, args=zo.ZeroRestore(target, reshard=reshard))


def assert_same_state(a, b) -> None:
    """Two zero1 states hold the same inner state, bit for bit, read back from their arrays (padding zero)."""
    x, y = h.full_state(a), h.full_state(b)
    assert sorted(x) == sorted(y)
    for path, value in x.items():
        assert value.dtype == y[path].dtype and value.shape == y[path].shape, path
        assert value.tobytes() == y[path].tobytes(), path


@pytest.fixture(scope="module")
def restored():
    return restore(targets(_golden.N))


@pytest.fixture(scope="module")
def restored_v3():
    return restore(targets_v3(), item=ITEM_V3)


def assert_stored_values(states, directory) -> None:
    expected = np.load(os.path.join(directory, "expected.npz"))
    got = {a.name: np.asarray(v) for k, s in enumerate(states)
           for a, v in zip(_arrays.stored_arrays(s.layout, k), _arrays.state_values(s))}
    assert sorted(got) == sorted(expected.files)
    for name, value in got.items():
        assert value.dtype == expected[name].dtype and value.shape == expected[name].shape, name
        assert value.tobytes() == expected[name].tobytes(), name


def test_restores_to_the_stored_values(restored, restored_v3):
    assert_stored_values(restored, _golden.V2)
    assert_stored_values(restored_v3, _golden.DIRECTORY)


def test_this_release_writes_the_same_record(restored_v3):
    with open(os.path.join(ITEM_V3, _names.RECORD_FILE)) as f:
        committed = json.load(f)
    written = _handler.save_plan(restored_v3).record
    for record in (committed, written):
        record.pop("zero_optax_version")
    assert written == committed
    assert committed["format_version"] == 3
    w = next(x for x in committed["states"][2]["leaves"] if x["path"] == "['w']")
    assert (w["shape"], w["spec"], w["global_shape"]) == ([4, 3], [[], ["model"]], [4, 6])


def test_restores_at_another_world_size(restored, tmp_path):
    for n in (3, 8):
        for a, b in zip(restore(targets(n), reshard=True), restored):
            assert_same_state(a, b)
    zo.reshard(ITEM, tmp_path / "two", world_size=2)
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        for a, b in zip(ckpt.restore(tmp_path / "two", args=zo.ZeroRestore(targets(2))), restored):
            assert_same_state(a, b)
        # The offline output (TensorStore's storage) restores at yet another world size too.
        for a, b in zip(ckpt.restore(tmp_path / "two", args=zo.ZeroRestore(targets(3), reshard=True)), restored):
            assert_same_state(a, b)


def test_format_3_on_another_mesh(restored_v3):
    """The mesh-bound state moves from (data=2, model=2) to (data=4, model=1) by its recorded placement: `w`'s two
    blocks, read from the stored values by hand, side by side."""
    tx, params = _golden.mesh_bound(4, 1)
    got = restore(targets(3) + (tx.init(params),), reshard=True, item=ITEM_V3)
    for a, b in zip(got[:2], restored_v3[:2]):
        assert_same_state(a, b)
    whole, layout = h.full_state(got[2]), restored_v3[2].layout
    expected = np.load(os.path.join(_golden.DIRECTORY, "expected.npz"))
    entries = [(j, e) for j, e in enumerate(layout.entries) if e.leaf is not None and e.path.endswith("['w']")]
    assert len(entries) == 2  # mu and nu
    for j, e in entries:
        blocks = expected[f"2.entry{j:04d}"].reshape(2, 2 * 6)[:, :12].reshape(2, 4, 3)
        assert whole[e.path].tobytes() == np.concatenate(list(blocks), axis=1).tobytes(), e.path


def test_zero_optax_0_4_refuses_a_format_3_record_with_its_own_error(restored_v3, tmp_path):
    """zero_optax 0.4's reader (its package from the repository's history) on a checkpoint this release writes."""
    if shutil.which("git") is None or subprocess.run(["git", "-C", REPO_ROOT, "cat-file", "-e", RELEASE_0_4],
                                                     capture_output=True).returncode:
        pytest.skip(f"the repository has no git history holding zero_optax 0.4 ({RELEASE_0_4}) to read with")
    archive = subprocess.run(["git", "-C", REPO_ROOT, "archive", RELEASE_0_4, "zero_optax"], capture_output=True,
                             check=True).stdout
    old = tmp_path / "zero_optax_0_4"
    old.mkdir()
    (tmp_path / "release.tar").write_bytes(archive)
    with tarfile.open(tmp_path / "release.tar") as tar:
        tar.extractall(old, filter="data")
    item = tmp_path / "ckpt"
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        ckpt.save(item, args=zo.ZeroSave(restored_v3))
    read = ("import sys, zero_optax as zo; assert zo.__version__ == '0.4.0', zo.__file__; "
            "zo.ZeroCheckpointHandler().metadata(sys.argv[1])")
    env = dict(os.environ, PYTHONPATH=str(old))
    done = subprocess.run([sys.executable, "-c", read, str(item)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert done.returncode != 0
    assert (f"{item}/{_names.RECORD_FILE} has record format version 3; this zero_optax (0.4.0) reads version 2 "
            "only. Upgrade zero_optax to read newer checkpoints.") in done.stderr, done.stderr[-2000:]
    assert "ZeroCheckpointError" in done.stderr
