"""zero1 inside Kauldron: `kd.train.Trainer` with `zo.zero1(optax.adamw(...), mesh=kd.sharding.DEVICES_MESH)` trains
as with plain `optax.adamw`, holds 1/N of the state per device, and `zero_optax.with_kauldron.Checkpointer` resumes it
at another device count (8 -> 4 -> 8) as the uninterrupted run continues.

Skipped unless Kauldron is installed (Python >= 3.12). Set-up, from the repository root (about 3 minutes; Kauldron
pulls TensorFlow, grain and JAX 0.12):

    /root/.pyenv/versions/3.12.1/bin/python -m venv /root/venvs/kauldron
    /root/venvs/kauldron/bin/pip install --upgrade pip
    /root/venvs/kauldron/bin/pip install kauldron==1.4.4 pytest pytest-xdist    # zero_optax's dependencies come along
    PYTHONPATH=$PWD /root/venvs/kauldron/bin/python -m pytest -n 0 tests/integration/test_kauldron.py

Each device count is fixed when its process starts, so the runs happen in three processes of
`_kauldron_worker.py` (8, 4, then 8 devices): 35 to 80 s in all on 2 shared cores (30 s of CPU).
"""

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import zero_optax as zo

pytest.importorskip("kauldron")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_kauldron_worker.py")


def _work(tmp, devices, *runs):
    """Runs the worker on `devices` devices (with the suite's other XLA flags); its record of each run."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}",
               PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]))
    out = tmp / f"out{len(list(tmp.glob('out*')))}.json"
    done = subprocess.run([sys.executable, WORKER, str(out), *runs], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Kauldron's adamw and zero1 uninterrupted for 9 steps on 8 devices; zero1 to step 3 on 8, 6 on 4, 9 on 8;
    zero1 checkpointed by `kd.ckpts.Checkpointer` to step 3 on 8, then resumed on 4, by ours on 8, by its own on 8."""
    tmp = tmp_path_factory.mktemp("kauldron")
    adamw, zero1, first, kd_first = _work(tmp, 8, f"adamw:{tmp}/adamw:9", f"zero1:{tmp}/zero1:9",
                                          f"zero1:{tmp}/resumed:3", f"zero1-kd:{tmp}/kd:3")
    second, kd_other = _work(tmp, 4, f"zero1:{tmp}/resumed:6", f"zero1-kd:{tmp}/kd:6")
    third, kd_ours, kd_second = _work(tmp, 8, f"zero1:{tmp}/resumed:9", f"zero1:{tmp}/kd:9", f"zero1-kd:{tmp}/kd:6")
    return {"adamw": adamw, "zero1": zero1, "phases": (first, second, third), "dir": tmp / "resumed",
            "kd": (kd_first, kd_second), "kd_other": kd_other, "kd_ours": kd_ours}


def _sliced_bytes(params, devices):
    """adamw's state on one device of `devices` under zero1: ceil(count / N) coordinates of mu and of nu (float32)
    and its int32 step count."""
    return 2 * 4 * math.ceil(params / devices) + 4


def test_losses_and_parameters_equal_kauldrons_adamw(runs):
    adamw, zero1 = runs["adamw"], runs["zero1"]
    assert adamw["losses"].keys() == zero1["losses"].keys() and len(adamw["losses"]) == 10
    steps = sorted(adamw["losses"], key=int)
    np.testing.assert_allclose([zero1["losses"][s] for s in steps], [adamw["losses"][s] for s in steps], rtol=1e-6)
    np.testing.assert_allclose(zero1["params"], adamw["params"], rtol=1e-5, atol=1e-6)


def test_state_is_one_nth_per_device_from_init_to_the_end_and_after_restores(runs):
    params = len(runs["adamw"]["params"])
    assert runs["adamw"]["final"] == [4 + 2 * 4 * params] * 8  # Kauldron's adamw: the whole state on every device
    assert runs["zero1"]["init"] == runs["zero1"]["final"] == [_sliced_bytes(params, 8)] * 8
    first, second, third = runs["phases"]
    assert first["restored"] is None and first["final"] == [_sliced_bytes(params, 8)] * 8
    for phase, devices in ((second, 4), (third, 8)):
        assert phase["devices"] == devices
        for when in ("init", "restored", "final"):
            assert phase[when] == [_sliced_bytes(params, devices)] * devices, (devices, when)
        assert phase["alone_equal"]  # a TrainState restored alone (a continuous evaluator's) gets the same state


def test_resumed_at_4_then_8_devices_continues_as_the_uninterrupted_run(runs):
    first, second, third = runs["phases"]
    assert sorted(first["losses"], key=int) == ["0", "1", "2", "3"]
    assert sorted(second["losses"], key=int) == ["3", "4", "5", "6"]  # from the checkpoint of step 3
    assert sorted(third["losses"], key=int) == ["6", "7", "8", "9"]
    uninterrupted = runs["zero1"]["losses"]
    assert first["losses"] == {s: uninterrupted[s] for s in first["losses"]}  # the same programs: bit for bit
    for phase in (second, third):  # 4 devices sum in another order: float32 rounding
        steps = sorted(phase["losses"], key=int)
        np.testing.assert_allclose([phase["losses"][s] for s in steps], [uninterrupted[s] for s in steps],
                                   rtol=1e-6)
    np.testing.assert_allclose(third["params"], runs["zero1"]["params"], rtol=1e-5, atol=1e-6)
    assert sorted(p.name for p in runs["dir"].glob("checkpoints/ckpt_6/*") if p.is_dir()) == [
        "default", "ds_iter", "opt_state", "timer"]


def test_the_opt_state_item_is_one_the_offline_tools_read(runs, tmp_path):
    item = runs["dir"] / "checkpoints" / "ckpt_6" / "opt_state"  # saved on 4 devices
    assert [s["world_size"] for s in zo.ZeroCheckpointHandler().metadata(item)["states"]] == [4]
    zo.reshard(item, tmp_path / "moved", world_size=8)
    assert [s["world_size"] for s in zo.ZeroCheckpointHandler().metadata(tmp_path / "moved")["states"]] == [8]


def test_kauldrons_own_checkpointer_resumes_zero1_on_the_device_count_that_saved_it_only(runs):
    first, second = runs["kd"]
    uninterrupted = runs["zero1"]["losses"]
    assert first["losses"] == {s: uninterrupted[s] for s in first["losses"]}
    assert sorted(second["losses"], key=int) == ["3", "4", "5", "6"]
    assert second["losses"] == {s: uninterrupted[s] for s in second["losses"]}  # 8 -> 8: bit for bit
    assert second["restored"] == [_sliced_bytes(len(first["params"]), 8)] * 8
    assert "ValueError" in runs["kd_other"]["error"] and "stored shape" in runs["kd_other"]["error"]  # 8 -> 4
    assert runs["kd_ours"]["error"].startswith("ZeroCheckpointError") and "has no `opt_state` item" in runs[
        "kd_ours"]["error"]
