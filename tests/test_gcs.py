"""Checkpoints on Google Cloud Storage, against a real GCS protocol server (fake-gcs-server on loopback).

Every `gs://` operation is checked against the same work on a local disk (records and stored arrays equal, bit
for bit; restored states equal, bit for bit) and the restored states continue like plain optax on one device
fed the mean gradient (`tests.test_reshard.oracle`; for auto + master weights, `tests.test_master.reference`).
On top of that: the offline tool finishes a `gs://` destination the way Orbax does (its commit file last), so
a destination is complete or absent for Orbax's readers and `ZeroRestore` alike, also when a real `python -m
zero_optax.reshard` process is killed in the middle of writing; an existing destination is replaced only with
`--force`; schemes other than local paths and `gs://` are refused before anything is written.
"""

from __future__ import annotations

import functools
import itertools
import os
import subprocess
import sys
import time

import _gcs
import _zero_setup as zs
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from tests import test_checkpoint_auto as auto_test
from tests import test_reshard as R
from tests.test_auto import PARAMS, muon_recipe
from tests.test_master import bf16_grads, reference
from zero_optax.checkpoint import _paths, _record

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
_counter = itertools.count()


@pytest.fixture(scope="session")
def gcs():
    """One emulator for the session; the environment points every GCS client at it while it runs."""
    with _gcs.Emulator() as emulator:
        yield emulator


def fresh(gcs, what: str) -> str:
    """A new, empty `gs://` prefix."""
    return gcs.path(f"{what}-{next(_counter)}")


def key(path: str) -> str:
    """The object-name prefix inside the bucket of a `gs://bucket/...` path."""
    return str(path).split("/", 3)[3]


# ------------------------------------------------------------------------------------------------ the three setups


class Elementwise:
    """Flat AdamW or leaf-partition Muon, `tests.test_reshard`'s setup: 8 devices, 2 steps, then 2 more."""

    def __init__(self, kind: str):
        self.kind, self.n, self.m, self.steps = kind, 8, 3, R.STEPS_BEFORE

    def first_phase(self):
        """(step, params, state) after each step of the first phase."""
        tr = R.trainer(self.kind, self.n)
        p, s = R.params_np(), tr.init(R.params_np())
        for t in range(self.steps):
            p, s = tr.train(p, s, t, t + 1)
            yield t + 1, p, s

    def target(self, m: int):
        return R.trainer(self.kind, m).init(R.params_np())

    def finish(self, params, state, m: int) -> None:
        """Continues on m devices and compares with uninterrupted single-device optax."""
        p, s = R.trainer(self.kind, m).train(jax.device_get(params), state, self.steps,
                                             self.steps + R.STEPS_AFTER)
        R.assert_matches_oracle(self.kind, p, s)


@functools.cache
def _auto_trainer(n: int):
    return auto_test._trainer(n)  # pylint: disable=protected-access


class AutoMaster:
    """partition="auto" with float32 master copies (`tests.test_checkpoint_auto`): 4 devices, then 3."""

    kind = "auto"

    def __init__(self):
        self.n, self.m, self.steps = 4, 3, auto_test.K
        self.first = bf16_grads(PARAMS, self.n, self.steps)

    def first_phase(self):
        mesh, init, step = _auto_trainer(self.n)
        state = init(jax.device_put(PARAMS, NamedSharding(mesh, P())))
        params = jax.device_put(jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS), NamedSharding(mesh, P()))
        for t, g in enumerate(self.first):
            params, state = step(params, state, jax.device_put(g, NamedSharding(mesh, P("data"))))
            yield t + 1, params, state

    def target(self, m: int):
        mesh, init, _ = _auto_trainer(m)
        return init(jax.device_put(PARAMS, NamedSharding(mesh, P())))

    def finish(self, params, state, m: int) -> None:
        mesh, _, step = _auto_trainer(m)
        second = bf16_grads(PARAMS, m, self.steps)
        params, state = auto_test._train(mesh, step, jax.device_get(params), state, second)  # pylint: disable=protected-access
        ref_params, ref_state = reference(muon_recipe(), PARAMS, self.first + second)
        master = zo.master_params(state)
        for p, w, r in zip(jax.tree.leaves(params), jax.tree.leaves(master), jax.tree.leaves(ref_params)):
            np.testing.assert_allclose(np.asarray(w), np.asarray(r), rtol=5e-5, atol=1e-6)
            np.testing.assert_array_equal(np.asarray(p).view(np.uint16),
                                          np.asarray(w.astype(jnp.bfloat16)).view(np.uint16))
        for a, b in zip(jax.tree.leaves(zo.gather_state(state)), jax.tree.leaves(ref_state)):
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=5e-5, atol=1e-6)


SETUPS = {"flat": Elementwise("adamw"), "leaf": Elementwise("muon"), "auto": AutoMaster()}


def checkpointer():
    return ocp.Checkpointer(zo.ZeroCheckpointHandler())


def orbax_restore(item, target, reshard: bool = False):
    """Restores through Orbax's Checkpointer, which on `gs://` first requires the commit file."""
    with checkpointer() as c:
        return c.restore(item, args=zo.ZeroRestore(target, reshard=reshard))


def handler_restore(item, target, reshard: bool = False):
    """Restores through the handler alone (no Orbax path checks): what `ZeroRestore` itself accepts."""
    return zo.ZeroCheckpointHandler().restore(item, args=zo.ZeroRestore(target, reshard=reshard))


@functools.cache
def _final(name: str):
    *_, (t, p, s) = SETUPS[name].first_phase()
    return t, jax.device_get(p), s


@pytest.fixture(scope="module")
def items(gcs, tmp_path_factory):
    """Per setup: the state after the first phase saved synchronously at `gs://` and on a local disk."""
    root = tmp_path_factory.mktemp("items")
    out = {}
    for name in SETUPS:
        _, p, s = _final(name)
        local, remote = str(root / name), gcs.path(f"items/{name}")
        with checkpointer() as c:
            c.save(local, args=zo.ZeroSave(s))
            c.save(remote, args=zo.ZeroSave(s))
        out[name] = local, remote, p
    return out


# ------------------------------------------------------------------------------------------------ Orbax on gs://


def test_commit_file_is_orbaxs():
    from orbax.checkpoint._src.path import atomicity_types  # pylint: disable=import-outside-toplevel
    assert _paths.COMMIT_FILE == atomicity_types.COMMIT_SUCCESS_FILE


@pytest.mark.parametrize("name", SETUPS)
def test_checkpoint_manager_on_gs_equals_local_disk_and_continues(gcs, tmp_path, name):
    """Async saves every step with max_to_keep=1, restore at the saved world size and (reshard=True) at
    another, each bit-equal to the same on a local disk, each continuing like single-device optax."""
    setup = SETUPS[name]
    root = fresh(gcs, f"manager-{name}")
    options = ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True)
    with ocp.CheckpointManager(root, options=options) as remote, \
            ocp.CheckpointManager(tmp_path, options=options) as local:
        for t, p, s in setup.first_phase():
            for mngr in (remote, local):
                mngr.save(t, args=ocp.args.Composite(opt_state=zo.ZeroSave(s)))
        remote.wait_until_finished()
        local.wait_until_finished()
        t = setup.steps
        assert remote.all_steps() == local.all_steps() == [t]
        objects = gcs.objects(key(root) + "/")
        assert all(o.startswith(f"{key(root)}/{t}/") for o in objects), objects  # earlier steps deleted
        assert {f"{key(root)}/{t}/{_paths.COMMIT_FILE}", f"{key(root)}/{t}/opt_state/{_paths.COMMIT_FILE}",
                f"{key(root)}/{t}/opt_state/zero_record.json"} <= set(objects)
        R.assert_same_checkpoint(f"{root}/{t}/opt_state", tmp_path / str(t) / "opt_state")
        assert _record.read(f"{root}/{t}/opt_state")["storage"] == "orbax"
        for m, reshard in ((setup.n, False), (setup.m, True)):
            args = lambda: ocp.args.Composite(opt_state=zo.ZeroRestore(setup.target(m), reshard=reshard))  # noqa: E731
            got = remote.restore(t, args=args()).opt_state
            zs.assert_bit_equal(got, local.restore(t, args=args()).opt_state)
            setup.finish(p, got, m)


# ------------------------------------------------------------------------------------------------ offline reshard

ROUTES = ["gs->gs", "gs->local", "local->gs"]


def endpoints(gcs, tmp_path, items, name: str, route: str) -> tuple[str, str]:
    local, remote, _ = items[name]
    src = remote if route.startswith("gs") else local
    dst = fresh(gcs, f"out-{name}") + "/opt_state" if route.endswith("gs") else str(tmp_path / "out")
    return src, dst


@functools.cache
def local_oracle(root: str, name: str, local_src: str, m: int) -> str:
    """`zo.reshard` on a local disk: what every other route must produce."""
    dst = os.path.join(root, f"oracle-{name}-{m}")
    zo.reshard(local_src, dst, world_size=m)
    return dst


@pytest.fixture(scope="module")
def oracle_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("oracle"))


def assert_resharded(gcs, dst: str, name: str, items, oracle_root: str) -> None:
    """`dst` holds the local oracle's record and arrays; restored by Orbax, it equals the oracle's restore and
    continues like single-device optax."""
    setup = SETUPS[name]
    want = local_oracle(oracle_root, name, items[name][0], setup.m)
    R.assert_same_checkpoint(dst, want)
    if dst.startswith("gs://"):
        assert f"{key(dst)}/{_paths.COMMIT_FILE}" in gcs.objects(key(dst) + "/")
    target = setup.target(setup.m)
    got = orbax_restore(dst, target)
    zs.assert_bit_equal(got, orbax_restore(want, target))
    setup.finish(items[name][2], got, setup.m)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", SETUPS)
def test_offline_reshard_between_gs_and_local(gcs, tmp_path, items, oracle_root, name, route):
    src, dst = endpoints(gcs, tmp_path, items, name, route)
    zo.reshard(src, dst, world_size=SETUPS[name].m)
    assert_resharded(gcs, dst, name, items, oracle_root)


def cli_env() -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu",
                PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))


def start(*args, script: list[str] | None = None) -> subprocess.Popen:
    """`python -m zero_optax.reshard ARGS` (or `python SCRIPT... ARGS`), with the emulator's environment."""
    command = [sys.executable, *(script or ["-m", "zero_optax.reshard"]), *map(str, args)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
                            cwd=REPO_ROOT)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    """Exit status, stdout and stderr, less TensorStore's log line about the emulator's test token."""
    out, err = proc.communicate(timeout=180)
    err = "".join(line for line in err.splitlines(keepends=True) if "Using GOOGLE_AUTH_TOKEN_FOR_TESTING" not in line)
    return proc.returncode, out, err


def test_command_line_between_gs_and_local(gcs, tmp_path, items, oracle_root):
    name = "leaf"
    runs = []
    for route in ROUTES:  # concurrently: each process spends seconds importing JAX
        src, dst = endpoints(gcs, tmp_path / route.replace(">", ""), items, name, route)
        runs.append((route, dst, start(src, dst, "--world-size", SETUPS[name].m)))
    for route, dst, proc in runs:
        assert finish(proc) == (0, "", ""), route
        assert_resharded(gcs, dst, name, items, oracle_root)


# ------------------------------------------------------------------------------------------------ complete or absent


def refused_by_every_reader(item: str, name: str = "leaf") -> None:
    """Neither Orbax's reader, nor ZeroRestore on its own, nor the offline tool takes `item` for a checkpoint."""
    target = SETUPS[name].target(SETUPS[name].m)
    with pytest.raises((ValueError, FileNotFoundError), match="incomplete checkpoint|not found"):
        orbax_restore(item, target)
    with pytest.raises(zo.ZeroCheckpointError, match="commit_success.txt is missing|no such directory"):
        handler_restore(item, target)
    with pytest.raises(zo.ZeroCheckpointError, match="commit_success.txt is missing|no such directory"):
        zo.reshard(item, str(item) + "-copy", world_size=2)


def test_a_gs_checkpoint_without_its_commit_file_is_refused(gcs):
    """What Orbax leaves on gs:// while saving, or after a killed save: everything but the commit files."""
    root = fresh(gcs, "uncommitted")
    with ocp.CheckpointManager(root) as mngr:
        mngr.save(1, args=ocp.args.Composite(opt_state=zo.ZeroSave(_final("leaf")[2])))
        mngr.wait_until_finished()
    item = f"{root}/1/opt_state"
    epath.Path(item, _paths.COMMIT_FILE).unlink()
    refused_by_every_reader(item)
    target = SETUPS["leaf"].target(SETUPS["leaf"].n)
    with ocp.CheckpointManager(root) as mngr:  # the step is still marked finished; the item is not
        assert mngr.all_steps() == [1]
        with pytest.raises(zo.ZeroCheckpointError, match="commit_success.txt is missing"):
            mngr.restore(1, args=ocp.args.Composite(opt_state=zo.ZeroRestore(target)))
    epath.Path(root, "1", _paths.COMMIT_FILE).unlink()
    with ocp.CheckpointManager(root) as mngr:
        assert mngr.all_steps() == []


def test_existing_destination_refused_unless_force(gcs, items, oracle_root):
    name = "leaf"
    _, remote, _ = items[name]
    dst = fresh(gcs, "force") + "/opt_state"
    zo.reshard(remote, dst, world_size=2)
    before = gcs.objects(key(dst) + "/")
    with pytest.raises(zo.ZeroCheckpointError, match="already exists; pass force=True"):
        zo.reshard(remote, dst, world_size=SETUPS[name].m)
    assert gcs.objects(key(dst) + "/") == before
    assert _record.read(dst)["states"][0]["world_size"] == 2
    zo.reshard(remote, dst, world_size=SETUPS[name].m, force=True)
    assert_resharded(gcs, dst, name, items, oracle_root)
    fixed = {f"{key(dst)}/{f}" for f in ("manifest.ocdbt", "zero_record.json", _paths.COMMIT_FILE)}
    assert set(gcs.objects(key(dst) + "/")) & set(before) <= fixed  # the old data files (random names) are gone
    for bad in (remote, remote.rsplit("/", 1)[0]):  # force would delete the source first
        with pytest.raises(zo.ZeroCheckpointError, match="must not be .* or lie inside or around it"):
            zo.reshard(remote, bad, world_size=2, force=True)
    assert orbax_restore(remote, SETUPS[name].target(SETUPS[name].n)) is not None


# A real command-line process, paused at one point of its writing and killed there (SIGKILL: no cleanup).
KILL_POINTS = ["data", "record", "retracted"]


def pause_script(point: str) -> list[str]:
    return [os.path.join(TESTS, "_reshard_pause.py"), point]


def wait_paused(proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    line = proc.stdout.readline()
    assert line == "PAUSED\n" and time.monotonic() < deadline, (line, proc.poll(), proc.stderr.read())


def test_reshard_killed_midway_leaves_no_checkpoint(gcs, tmp_path, items, oracle_root):
    name = "leaf"
    local, remote, _ = items[name]
    m = SETUPS[name].m
    cases = []
    for point, route in [("data", "gs"), ("record", "gs"), ("retracted", "gs"), ("data", "local")]:
        dst = fresh(gcs, f"killed-{point}") + "/opt_state" if route == "gs" else str(tmp_path / "killed")
        force = point == "retracted"
        if force:  # a finished checkpoint is there: replacing it must not leave it half-replaced
            zo.reshard(remote, dst, world_size=2)
        args = (remote, dst, "--world-size", m) + (("--force",) if force else ())
        cases.append((point, route, dst, start(*args, script=pause_script(point))))
    plain_dst = fresh(gcs, "killed-plain") + "/opt_state"
    plain = start(remote, plain_dst, "--world-size", m)
    for point, route, dst, proc in cases:
        wait_paused(proc)
        proc.kill()
        proc.wait(timeout=60)
        proc.stdout.close()
        proc.stderr.close()
        if route == "gs":
            written = gcs.objects(key(dst) + "/")
            if point == "data":
                assert written and f"{key(dst)}/zero_record.json" not in written  # arrays half-written
            if point == "record":
                assert f"{key(dst)}/zero_record.json" in written  # only the commit file is missing
            assert f"{key(dst)}/{_paths.COMMIT_FILE}" not in written
        else:
            assert not os.path.exists(dst)
        refused_by_every_reader(dst, name)
    # Killed at whatever moment it had reached: complete for every reader, or absent for every reader.
    while not gcs.objects(key(plain_dst) + "/") and plain.poll() is None:
        time.sleep(0.002)
    plain.kill()
    plain.communicate(timeout=60)
    if f"{key(plain_dst)}/{_paths.COMMIT_FILE}" in gcs.objects(key(plain_dst) + "/"):
        assert_resharded(gcs, plain_dst, name, items, oracle_root)
    else:
        refused_by_every_reader(plain_dst, name)
    # What a killed run leaves is an existing destination: refused without --force, replaced with it.
    dst = cases[0][2]
    code, out, err = finish(start(remote, dst, "--world-size", m))
    assert code == 1 and "already exists; pass force=True (--force)" in err and err.count("\n") == 1
    assert finish(start(remote, dst, "--world-size", m, "--force")) == (0, "", "")
    assert_resharded(gcs, dst, name, items, oracle_root)


# ------------------------------------------------------------------------------------------------ other schemes


@pytest.mark.parametrize("scheme", ["s3", "az", "memory", "file"])
def test_other_schemes_refused_before_anything_is_written(gcs, tmp_path, items, scheme):
    local, remote, _ = items["flat"]
    bad = f"{scheme}://some-bucket/run/opt_state"
    before, local_before = gcs.objects(), sorted(os.listdir(tmp_path))
    message = rf"the scheme `{scheme}://` is not supported.*on a local file system .* or at gs://bucket/path"
    for src, dst in ((remote, bad), (bad, fresh(gcs, "never")), (local, bad), (bad, str(tmp_path / "never"))):
        with pytest.raises(zo.ZeroCheckpointError, match=message):
            zo.reshard(src, dst, world_size=2)
    with pytest.raises(zo.ZeroCheckpointError, match=message):
        zo.ZeroCheckpointHandler().save(bad, args=zo.ZeroSave(_final("flat")[2]))
    with pytest.raises(zo.ZeroCheckpointError, match=message):
        handler_restore(bad, SETUPS["flat"].target(8))
    assert gcs.objects() == before and sorted(os.listdir(tmp_path)) == local_before


def test_command_line_refuses_other_schemes(gcs, tmp_path, items):
    _, remote, _ = items["flat"]
    before = gcs.objects()
    code, out, err = finish(start(remote, "s3://some-bucket/out", "--world-size", 2))
    assert code == 1 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert "the scheme `s3://` is not supported" in err and "gs://" in err
    assert gcs.objects() == before
