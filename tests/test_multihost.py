"""Checkpoints written and read by a real two-process `jax.distributed` job (4 CPU devices each, loopback only)."""

import json
import os
import socket
import subprocess
import sys
import time

import _multihost_worker as worker
import _zero_setup as zs
import jax
import numpy as np
import orbax.checkpoint as ocp

import zero_optax as zo
from zero_optax.core import _names

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_job(phase: str, directory, logs) -> None:
    """Runs both processes of one phase to completion, killing both if either fails or time runs out."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
               PYTHONPATH=os.pathsep.join([REPO_ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
    port = _free_port()
    files = [open(logs / f"{phase}.{i}.log", "w") for i in range(2)]
    procs = []
    try:
        for i in range(2):
            procs.append(subprocess.Popen(
                [sys.executable, os.path.join(TESTS, "_multihost_worker.py"), str(port), str(i), phase,
                 str(directory)], env=env, stdout=files[i], stderr=subprocess.STDOUT))
        deadline = time.monotonic() + TIMEOUT
        while any(p.poll() is None for p in procs):
            failed = any(p.returncode not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait(timeout=30)
        for f in files:
            f.close()
    output = "\n".join(f"--- process {i} ---\n" + (logs / f"{phase}.{i}.log").read_text()[-4000:] for i in range(2))
    assert [p.returncode for p in procs] == [0, 0], output


def test_two_processes_save_then_two_processes_restore_and_continue(tmp_path):
    directory = tmp_path / "ckpt"
    _run_job("train", directory, tmp_path)
    for kind, _ in worker.KINDS:
        record = (directory / kind / str(worker.SPLIT) / "opt_state" / _names.RECORD_FILE)
        assert record.exists(), sorted(os.listdir(directory / kind))
    _run_job("resume", directory, tmp_path)

    # The same schedule without interruption in this process, on 8 devices of one host. Gloo sums in another
    # order than the in-process CPU collectives, so results agree to rounding, not bit for bit.
    for kind, chain in worker.KINDS:
        tr = zs.trainer(kind, chain=chain)
        p0 = zs.params(tr.mesh)
        p_split, s_split = tr.train(p0, tr.init(p0), 0, worker.SPLIT)
        expected = zs.host(s_split)
        # The checkpoint the two processes wrote restores here too (same world size, one host).
        with ocp.CheckpointManager(directory / kind) as mngr:
            restored = mngr.restore(worker.SPLIT, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(p0), opt_state=zo.ZeroRestore(tr.abstract(p0))))
        assert jax.tree.structure(restored.opt_state) == jax.tree.structure(s_split)
        for x, y in zip(zs.host(restored.opt_state), expected):
            np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7, err_msg=kind)
        p, _ = tr.train(p_split, s_split, worker.SPLIT, worker.TOTAL)
        final = np.load(directory / kind / "final.npz")
        assert sorted(final.files) == sorted(p)
        for k, v in p.items():
            np.testing.assert_allclose(final[k], np.asarray(v), rtol=1e-6, atol=1e-7, err_msg=f"{kind} {k}")


def test_two_processes_restore_a_three_device_checkpoint_with_reshard(tmp_path):
    """Saved on 3 devices of this process, restored with reshard=True on 8 devices of two processes: each process
    reads only the coordinates its own devices hold (one read per device and block), and training goes on."""
    directory = tmp_path / "ckpt"
    finals = {}
    for kind, chain in worker.KINDS:
        tr3, tr8 = zs.trainer(kind, 3, chain), zs.trainer(kind, 8, chain)
        p3 = zs.params(tr3.mesh)
        p, s = tr3.train(p3, tr3.init(p3), 0, worker.SPLIT)
        with ocp.CheckpointManager(directory / f"{kind}3") as mngr:
            mngr.save(worker.SPLIT, args=ocp.args.Composite(params=ocp.args.StandardSave(p),
                                                            opt_state=zo.ZeroSave(s)))
            mngr.wait_until_finished()
            p8 = zs.params(tr8.mesh)
            restored = mngr.restore(worker.SPLIT, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(p8), opt_state=zo.ZeroRestore(tr8.init(p8), reshard=True)))
        finals[kind] = tr8.train(restored.params, restored.opt_state, worker.SPLIT, worker.TOTAL)[0]
    _run_job("reshard", directory, tmp_path)
    for kind, _ in worker.KINDS:
        final = np.load(directory / f"{kind}3" / "final.npz")
        for k, v in finals[kind].items():
            np.testing.assert_allclose(final[k], np.asarray(v), rtol=1e-6, atol=1e-7, err_msg=f"{kind} {k}")
        logs = [json.loads((directory / f"{kind}3" / f"reads.{i}.json").read_text()) for i in range(2)]
        for name in logs[0]["ranges"]:
            starts = [[tuple(r[0]) for n, r in log["reads"] if n == name] for log in logs]
            assert starts[0], (kind, name)  # process 0's devices hold the first coordinates
            for i, log in enumerate(logs):  # every read starts where one of this process's devices starts
                assert {a for a, _ in starts[i]} <= {lo for lo, _ in log["ranges"][name]}, (kind, i, name, starts)
                assert len(starts[i]) == len(set(starts[i])), (kind, i, name, starts)  # one read per device


def test_two_processes_as_two_replicas_match_optax_and_their_checkpoint_restores_in_one(tmp_path):
    """`replica_axis` across the processes (gloo between them, each holding one replica of the data=4 state):
    the parameters equal single-device optax fed the mean over all 8 devices, and the checkpoint the two
    processes wrote (each array once) restores in this process, on (replica=2, data=4) and on data=4 alone."""
    directory = tmp_path / "ckpt"
    _run_job("replica", directory, tmp_path)
    want_p, want_s = zs.oracle("adamw", 8, 0, worker.TOTAL)
    final = np.load(directory / "replica" / "final.npz")
    for k, v in want_p.items():
        np.testing.assert_allclose(final[k], v, rtol=2e-5, atol=1e-6, err_msg=k)
    for tr in (zs.ReplicaTrainer("adamw", partition="auto"), zs.ReplicaTrainer("adamw", 1, 4, partition="auto")):
        with ocp.CheckpointManager(directory / "replica") as mngr:
            restored = mngr.restore(worker.TOTAL, args=ocp.args.Composite(
                opt_state=zo.ZeroRestore(tr.init(tr.params())))).opt_state
        for x, y in zip(jax.tree.leaves(zo.gather_state(restored)), jax.tree.leaves(want_s)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=1e-6)
