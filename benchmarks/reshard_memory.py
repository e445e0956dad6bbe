"""Peak memory and time of `python -m zero_optax.reshard` on a >= 1 GB flat AdamW checkpoint, 8 -> 3 devices.

The checkpoint is saved by `ZeroSave` (Orbax's storage) from a state built on 8 simulated CPU devices: 1-D leaves
whose sizes divide neither 8 nor 3, random f32 histories (zero padding) and a step count. It is resharded 8 -> 3
by the command line in a subprocess, and the result is restored on 3 devices and checked (every history's sum).
The phases are those of `benchmarks/checkpoints.py`, which also measures saving and restoring.

    python benchmarks/reshard_memory.py [--dir /tmp/reshard_bench] [--tree DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoints


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/reshard_bench")
    parser.add_argument("--tree", help="a zero_optax source tree to measure instead of this one")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    saved = checkpoints._run("save", args.tree, args.dir, 8)  # pylint: disable=protected-access
    report = checkpoints._cli_reshard(args.tree, args.dir, 3)  # pylint: disable=protected-access
    checked = checkpoints._run("restore_resharded", args.tree, args.dir, 3)  # pylint: disable=protected-access
    report.update({"state_MB": saved["state_MB"], "checkpoint_disk_MB": saved["disk_MB"],
                   "reshard_added_over_import_MB": round(report["peak_MB"] - report["import_zero_optax_peak_MB"], 1),
                   "output_checked": checked["checked"]})
    print(json.dumps(report, indent=1))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
