"""Tests for the messages of a restore into a target that differs from the checkpoint: each names the differing
leaves and inner-state entries by path, both sides' values in words, and the fix, and shows no record as JSON."""

import hashlib
import os

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest

import zero_optax as zo
from zero_optax.checkpoint import _differences

SHAPES = {"a": (16, 4), "b": (3,)}
JSON_MARKERS = ('{"', '": ')


def _state(inner: optax.GradientTransformation, shapes: dict, n: int = 8, dtype=jnp.float32):
    """The state of a mesh-bound zero1(inner) on `n` devices, for parameters of `shapes`."""
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    tx = zo.zero1(inner, axis_name="data", mesh=mesh)
    replicated = jax.NamedSharding(mesh, jax.P())
    return tx.init({k: jax.device_put(jnp.ones(s, dtype), replicated) for k, s in shapes.items()})


def _snapshot(directory) -> dict[str, str]:
    """Every file under `directory` with the digest of its bytes."""
    out = {}
    for base, _, files in os.walk(directory):
        for f in files:
            path = os.path.join(base, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, directory)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint manager's directory holding step 0: zero1(adam) on 8 devices, as `opt_state`."""
    root = tmp_path_factory.mktemp("errors")
    with ocp.CheckpointManager(root) as mngr:
        mngr.save(0, args=ocp.args.Composite(opt_state=zo.ZeroSave(_state(optax.adam(1e-2), SHAPES))))
        mngr.wait_until_finished()
    return root


def _refusal(root, target, reshard: bool = False) -> str:
    """The message of the restore of step 0 into `target`, checked to change nothing on disk."""
    before = _snapshot(root)
    with ocp.CheckpointManager(root) as mngr, pytest.raises(zo.ZeroCheckpointError) as info:
        mngr.restore(0, args=ocp.args.Composite(opt_state=zo.ZeroRestore(target, reshard=reshard)))
    assert isinstance(info.value, ValueError)
    assert _snapshot(root) == before
    message = str(info.value)
    for marker in JSON_MARKERS:
        assert marker not in message, message
    return message


@pytest.mark.parametrize("reshard", [False, True], ids=["plain", "reshard"])
def test_changed_shape_names_leaf_and_both_shapes(saved, reshard):
    message = _refusal(saved, _state(optax.adam(1e-2), dict(SHAPES, a=(32, 4))), reshard)
    assert "['b']" not in message
    if reshard:  # the re-cut finds that no logical shape fits both (`_regions.recuts`)
        assert "leaf `['a']` is [16, 4] (whole) in the checkpoint but [32, 4] (whole) in the target" in message
        assert "restore into a target built from the same model" in message
    else:
        assert "leaf `['a']` has shape (16, 4) in the checkpoint, (32, 4) in the target" in message
        assert "model, optimizer and zero1 settings that saved the checkpoint" in message


@pytest.mark.parametrize("reshard", [False, True], ids=["plain", "reshard"])
def test_added_leaf_is_named(saved, reshard):
    message = _refusal(saved, _state(optax.adam(1e-2), dict(SHAPES, c=(5,))), reshard)
    assert "the target has leaf `['c']`, which the checkpoint lacks" in message
    assert "`['a']`" not in message and "[0].mu" not in message  # the new leaf's entries follow from it


@pytest.mark.parametrize("reshard", [False, True], ids=["plain", "reshard"])
def test_missing_leaf_is_named(saved, reshard):
    message = _refusal(saved, _state(optax.adam(1e-2), {"a": SHAPES["a"]}), reshard)
    assert "the checkpoint has leaf `['b']`, which the target lacks" in message


@pytest.mark.parametrize("reshard", [False, True], ids=["plain", "reshard"])
def test_other_optimizer_names_entries_and_fix(saved, reshard):
    message = _refusal(saved, _state(optax.sgd(1e-2, momentum=0.9), SHAPES), reshard)
    assert "the inner optimizer's state is ScaleByAdamState in the checkpoint, TraceState in the target" in message
    assert "`[0].nu['a']`" in message and "which the target lacks" in message
    assert "`[0].trace['a']`" in message and "which the checkpoint lacks" in message
    assert "Restore into a target built from the model, optimizer" in message


def test_other_dtype_names_leaf_and_both_dtypes(saved):
    message = _refusal(saved, _state(optax.adam(1e-2), SHAPES, dtype=jnp.bfloat16))
    assert "leaf `['a']` has dtype float32 in the checkpoint, bfloat16 in the target" in message
    assert "[0].mu" not in message  # the entries' dtypes follow the leaf's


def test_other_device_count_names_reshard(saved):
    message = _refusal(saved, _state(optax.adam(1e-2), SHAPES, n=4))
    assert "saved with world size 8, but the target state has 4 devices" in message
    assert "zo.ZeroRestore(target, reshard=True)" in message
    assert "python -m zero_optax.reshard" in message


def test_many_differences_are_counted():
    leaves = [{"path": f"['p{i}']", "shape": [i + 1], "dtype": "float32"} for i in range(14)]
    grown = [dict(x, shape=[x["shape"][0] + 1]) for x in leaves]
    message = _differences.describe({"leaves": leaves}, {"leaves": grown}, "state 0", ("leaves",))
    assert message.count("has shape") == _differences.MAX_LISTED
    assert "; and 4 more differences." in message


def test_many_added_leaves_are_counted():
    leaves = [{"path": f"['p{i:02d}']", "shape": [2], "dtype": "float32"} for i in range(13)]
    message = _differences.describe({"leaves": leaves[:1]}, {"leaves": leaves}, "state 0", ("leaves",))
    assert "the target has leaves `['p01']`, " in message
    assert "`['p10']` and 2 more, which the checkpoint lacks" in message


def test_layout_only_difference_names_reshard():
    leaf = {"path": "['a']", "shape": [4], "dtype": "float32", "owner": 0, "slots": 4}
    message = _differences.describe({"leaves": [leaf], "owners": [0]}, {"leaves": [dict(leaf, owner=2)],
                                    "owners": [2]}, "state 0", ("owners", "leaves"))
    assert message == ("state 0 differs from the checkpoint: leaf `['a']` has owner device 0 in the checkpoint, "
                       f"device 2 in the target. {_differences.LAYOUT_FIX}")


def test_equal_records_have_no_difference():
    record = {"leaves": [{"path": "['a']", "shape": [4]}], "state_tree": "*"}
    assert _differences.describe(record, dict(record), "state 0", ("leaves", "state_tree")) is None
