"""Checkpoints on an object store: save, restore and offline reshard of a >= 1 GB state on gs:// beside a local disk.

    python benchmarks/object_store.py [--dir /tmp/zero_optax_gcs_bench]

The object store is fake-gcs-server (the test emulator, `tests/_gcs.py`) on 127.0.0.1 with its in-memory
backend, so the figures show what zero_optax and its clients (TensorStore's gcs driver, gcsfs, Orbax) cost over
the GCS JSON API, not a real network or a real bucket. The state is `benchmarks/checkpoints.py`'s: flat AdamW
over 1-D leaves whose sizes divide neither 8 nor 3, random histories, 1040 MB on 8 devices. For each store, in
subprocesses of their own (so one phase's memory never counts in another's): save on 8 devices
(`ocp.Checkpointer`, synchronous), restore on 8, offline `python -m zero_optax.reshard SRC DST --world-size 3`,
and restore of its output on 3; each restore checks every history's float64 sum against the saved one.
Reported: seconds, the process's peak resident memory (and what the operation added to it), the objects (files)
and bytes written, and the emulator's resident memory after each phase (it holds every object in memory).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import checkpoints as ck  # noqa: E402  pylint: disable=wrong-import-position
from tests import _gcs  # noqa: E402  pylint: disable=wrong-import-position


def child(args) -> dict:
    import jax  # pylint: disable=import-outside-toplevel
    jax.config.update("jax_num_cpu_devices", args.devices)
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

    import zero_optax as zo  # pylint: disable=import-outside-toplevel

    mesh, init, params = ck._setup(args.devices, ck.SIZES)  # pylint: disable=protected-access
    out = {"phase": args.phase, "devices": args.devices, "item": args.item}
    sums = os.path.join(args.dir, "sums.json")
    if args.phase == "save":
        state = ck._random_state(mesh, init, params)  # pylint: disable=protected-access
        with open(sums, "w") as f:
            json.dump(ck._sums(state), f)  # pylint: disable=protected-access
        with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as c:
            _, seconds, before, peak = ck._measure(lambda: c.save(args.item, args=zo.ZeroSave(state)))  # pylint: disable=protected-access
        out["state_MB"] = round(sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20, 1)
    else:
        target = ck._abstract(mesh, init, params)  # pylint: disable=protected-access
        with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as c:
            state, seconds, before, peak = ck._measure(  # pylint: disable=protected-access
                lambda: jax.block_until_ready(c.restore(args.item, args=zo.ZeroRestore(target))))
        with open(sums) as f:
            want = json.load(f)
        got = ck._sums(state)  # pylint: disable=protected-access
        assert all(abs(a - b) <= 1e-9 * max(1.0, abs(b)) for a, b in zip(got, want)), (got, want)
        out["checked"] = True
    out.update(seconds=round(seconds, 2), rss_before_MB=round(before, 1), peak_MB=round(peak, 1),
               added_MB=round(peak - before, 1))
    return out


def _run(phase: str, directory: str, item: str, devices: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", phase, "--dir", directory, "--item", item,
           "--devices", str(devices)]
    out = subprocess.run(cmd, env=ck._env(None), check=True, stdout=subprocess.PIPE, text=True, cwd=ROOT).stdout  # pylint: disable=protected-access
    return json.loads(out.strip().splitlines()[-1])


def _cli(src: str, dst: str, m: int) -> dict:
    """`python -m zero_optax.reshard` as the only child of a small measuring process: seconds, peak RSS."""
    out = subprocess.run([sys.executable, "-c", ck._MEASURE, sys.executable, "-m", "zero_optax.reshard", src, dst,  # pylint: disable=protected-access
                          "--world-size", str(m)], env=ck._env(None), check=True, stdout=subprocess.PIPE,  # pylint: disable=protected-access
                         text=True, cwd=ROOT).stdout.split()
    return {"phase": "reshard_cli", "src": src, "dst": dst, "seconds": round(float(out[0]), 2),
            "peak_MB": round(int(out[1]) / 1024, 1)}


def _written(emulator: _gcs.Emulator, path: str) -> dict:
    if path.startswith("gs://"):
        prefix = path.split("/", 3)[3] + "/"
        sizes = emulator.sizes(prefix)
        return {"objects": len(sizes), "MB": round(sum(sizes.values()) / 2**20, 1)}
    files = [os.path.join(b, f) for b, _, fs in os.walk(path) for f in fs]
    return {"objects": len(files), "MB": round(sum(os.path.getsize(f) for f in files) / 2**20, 1)}


def _emulator_rss_mb(emulator: _gcs.Emulator) -> float:
    with open(f"/proc/{emulator.process.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/zero_optax_gcs_bench")
    parser.add_argument("--child", choices=["save", "restore"], help=argparse.SUPPRESS)
    parser.add_argument("--item", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=8, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.phase = args.child
        print(json.dumps(child(args)))
        return
    with _gcs.Emulator() as emulator:
        for store in ("local", "gs"):
            shutil.rmtree(args.dir, ignore_errors=True)
            os.makedirs(args.dir)
            base = os.path.join(args.dir, "ckpt") if store == "local" else emulator.path("bench")
            item, resharded = f"{base}/item", f"{base}/resharded"
            steps = [lambda: _run("save", args.dir, item, 8) | _written(emulator, item),
                     lambda: _run("restore", args.dir, item, 8),
                     lambda: _cli(item, resharded, 3) | _written(emulator, resharded),
                     lambda: _run("restore", args.dir, resharded, 3)]
            for step in steps:
                row = {"store": store} | step() | {"emulator_rss_MB": _emulator_rss_mb(emulator)}
                print(json.dumps(row), flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
