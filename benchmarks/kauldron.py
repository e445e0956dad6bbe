"""zero1 in Kauldron: optimizer bytes per device, losses against Kauldron's adamw, a run resumed 8 -> 4 -> 8 devices.

Runs the integration tests' trainer (`tests/integration/_kauldron_worker.py`: `kd.train.Trainer`, a 676-parameter
MLP, adamw 1e-2, batches of 16, 9 steps, checkpoints every 3) in a venv with Kauldron, at XLA's default
optimisation level, each device count in its own process, and prints one JSON report:

    PYTHONPATH=$PWD /root/venvs/kauldron/bin/python benchmarks/kauldron.py [--dir /tmp/kauldron_bench]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "integration", "_kauldron_worker.py")


def work(directory: str, devices: int, *runs: str) -> list[dict]:
    """The worker's record of `runs` on `devices` simulated CPU devices."""
    out = os.path.join(directory, f"out_{len(os.listdir(directory))}.json")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, WORKER, out, *runs], env=env, check=True, capture_output=True)
    with open(out) as f:
        return json.load(f)


def largest_difference(a: dict, b: dict) -> float:
    """The largest absolute difference between two records of the same steps."""
    return max(abs(a[k] - b[k]) for k in b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/kauldron_bench")
    directory = parser.parse_args().dir
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    adamw, zero1, first = work(directory, 8, f"adamw:{directory}/adamw:9", f"zero1:{directory}/zero1:9",
                               f"zero1:{directory}/resumed:3")
    (second,) = work(directory, 4, f"zero1:{directory}/resumed:6")
    (third,) = work(directory, 8, f"zero1:{directory}/resumed:9")
    resumed = {**first["losses"], **second["losses"], **third["losses"]}
    params = dict(enumerate(zero1["params"]))
    print(json.dumps({
        "parameters": len(zero1["params"]),
        "opt_state_bytes_per_device": {
            "adamw, 8 devices": max(adamw["final"]), "zero1, 8 devices": max(zero1["final"]),
            "zero1 resumed on 4: after restore, at the end": [max(second["restored"]), max(second["final"])],
            "zero1 resumed on 8: after restore, at the end": [max(third["restored"]), max(third["final"])]},
        "zero1 - adamw, largest |difference|": {
            "loss": largest_difference(zero1["losses"], adamw["losses"]),
            "params": largest_difference(params, dict(enumerate(adamw["params"])))},
        "resumed 8 -> 4 -> 8 - uninterrupted zero1, largest |difference|": {
            "loss": largest_difference(resumed, zero1["losses"]),
            "params": largest_difference(dict(enumerate(third["params"])), params)},
        "losses": {"adamw": adamw["losses"], "zero1": zero1["losses"], "resumed": resumed},
    }, indent=1))
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
