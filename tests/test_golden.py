"""A checkpoint written by this release (tests/data/golden_v2, made by tests/_golden.py) restores to the values
stored beside it, and this release still writes the same record for them: a format change cannot go unnoticed.

If a test here fails after a deliberate format change, bump `zero_optax._record.FORMAT_VERSION`, say what old
checkpoints need, and regenerate the data with `python tests/_golden.py`.
"""

import json
import os

import _golden
import _zero_setup as zs
import numpy as np
import orbax.checkpoint as ocp
import pytest

import zero_optax as zo
from tests import _harness as h
from zero_optax.checkpoint import _arrays, _handler
from zero_optax.core import _names

ITEM = os.path.join(_golden.DIRECTORY, "item")


def targets(n: int):
    return tuple(zs.trainer(kind, n).abstract(zs.params(zs.mesh(n))) for kind in ("adamw", "muon"))


def restore(target, reshard=False):
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        return ckpt.restore(ITEM, args=zo.ZeroRestore(target, reshard=reshard))


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


def test_restores_to_the_stored_values(restored):
    expected = np.load(os.path.join(_golden.DIRECTORY, "expected.npz"))
    got = {a.name: np.asarray(v) for k, s in enumerate(restored)
           for a, v in zip(_arrays.stored_arrays(s.layout, k), _arrays.state_values(s))}
    assert sorted(got) == sorted(expected.files)
    for name, value in got.items():
        assert value.dtype == expected[name].dtype and value.shape == expected[name].shape, name
        assert value.tobytes() == expected[name].tobytes(), name


def test_this_release_writes_the_same_record(restored):
    with open(os.path.join(ITEM, _names.RECORD_FILE)) as f:
        committed = json.load(f)
    written = _handler.save_plan(restored).record
    for record in (committed, written):
        record.pop("zero_optax_version")
    assert written == committed


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
