"""Peak memory of `python -m zero_optax.reshard` on a synthetic flat Adam checkpoint of >= 1 GB.

The checkpoint is built directly with numpy + `zero_optax._store` + `zero_optax._record` (no training, no
devices): 8 rows, leaves whose sizes divide neither 8 nor 3, a scalar, f32 `mu`/`nu` histories and a shared
int32 step count. It is resharded 8 -> 3 in a subprocess; the report compares that subprocess's peak RSS with the
checkpoint size and the largest single history, and checks every output coordinate.

    python benchmarks/reshard_memory.py [--dir /tmp/reshard_bench] [--scale 1.0] [--keep]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The driver imports neither jax nor zero_optax: a child's peak RSS includes its parent's at the moment of
# fork/vfork + exec on Linux, so building and checking run in children of their own (the --phase argument).
sys.path.insert(0, ROOT)

BASE_SIZES = [64 * 2**20 + 3, 32 * 2**20 + 1, 24 * 2**20 + 5, 10 * 2**20 + 7, 1001, 1]


def value(entry: int, start: int, stop: int) -> np.ndarray:
    """The synthetic history of coordinates [start, stop) of entry `entry` (exact in float32)."""
    return ((np.arange(start, stop, dtype=np.int64) % 1000003) + entry * 1_000_000).astype(np.float32)


def layout(sizes: list[int], n: int):
    from zero_optax._layout import FLAT, Layout, ParamLeaf, StateEntry  # pylint: disable=import-outside-toplevel
    leaves = tuple(ParamLeaf(f"['w{i}']", (s,) if s > 1 else (), "float32", -(-s // n)) for i, s in enumerate(sizes))
    entries = [StateEntry("[0].count", None, (), "int32")]
    for name in ("mu", "nu"):
        entries += [StateEntry(f"[0].{name}['w{i}']", i, (x.slots,), "float32") for i, x in enumerate(leaves)]
    return Layout(FLAT, "data", n, leaves, tuple(entries), None)


def build(directory: str, sizes: list[int], n: int) -> int:
    from zero_optax import _record, _store  # pylint: disable=import-outside-toplevel
    lay = layout(sizes, n)
    os.makedirs(os.path.join(directory, _record.ARRAYS_DIR))
    total = 0
    for j, e in enumerate(lay.entries):
        path = os.path.join(directory, _record.ARRAYS_DIR, f"0.entry{j:04d}")
        if e.leaf is None:
            _store.write_array(path, np.full((n,), 5, np.int32))
            total += 4 * n
            continue
        size, slots = lay.leaves[e.leaf].size, e.shape[0]
        for r in range(n):  # one row in memory at a time
            row = np.zeros(slots, np.float32)
            lo, hi = min(r * slots, size), min((r + 1) * slots, size)
            row[:hi - lo] = value(j, lo, hi)
            _store.write_regions(path, (n, slots), "float32", [((r,), row)])
        total += 4 * n * slots
    state = _record.layout_record(lay, 0, {"[0].count": 5})
    _record.write_record(directory, _record.new_record("PyTreeDef(*)", [state]))
    return total


def check(directory: str, sizes: list[int], m: int) -> None:
    from zero_optax import _record, _store  # pylint: disable=import-outside-toplevel
    lay = layout(sizes, m)
    rec = _record.read_record(directory)["states"][0]
    assert rec["world_size"] == m and rec["arrays"] == _record.array_names(lay, 0), "record mismatch"
    for j, e in enumerate(lay.entries):
        path = os.path.join(directory, _record.ARRAYS_DIR, f"0.entry{j:04d}")
        if e.leaf is None:
            assert (_store.read(path) == 5).all()
            continue
        size, slots = lay.leaves[e.leaf].size, e.shape[0]
        for t in range(m):
            lo, hi = min(t * slots, size), min((t + 1) * slots, size)
            row = _store.read(path, t)
            assert np.array_equal(row[:hi - lo], value(j, lo, hi)) and not row[hi - lo:].any(), (j, t)


_MEASURE = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def disk_bytes(directory: str) -> int:
    """Bytes of the chunk files of a checkpoint (not the `.zarray` metadata or the record)."""
    return sum(os.path.getsize(os.path.join(b, f)) for b, _, fs in os.walk(os.path.join(directory, "arrays"))
               for f in fs if not f.startswith("."))


def child_rss_mb(args: list[str]) -> tuple[float, float]:
    """Runs `python *args` as the only child of a small measuring process; returns (peak RSS in MB, seconds).

    The measuring process reports `resource.getrusage(RUSAGE_CHILDREN).ru_maxrss` (KiB on Linux); it imports
    nothing large, because on Linux a child's peak includes its parent's resident set at fork/vfork + exec.
    """
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _MEASURE, sys.executable, *args], cwd=ROOT, check=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE, text=True).stdout
    return int(out.split()[-1]) / 1024, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/reshard_bench")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the leaf sizes")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--phase", choices=["build", "check"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [max(1, int(s * args.scale)) if s > 1001 else s for s in BASE_SIZES]
    src, dst = os.path.join(args.dir, "src8"), os.path.join(args.dir, "dst3")
    if args.phase == "build":
        build(src, sizes, 8)
        return
    if args.phase == "check":
        check(dst, sizes, 3)
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    me = [os.path.abspath(__file__), "--dir", args.dir, "--scale", str(args.scale)]
    build_mb, built = child_rss_mb([*me, "--phase", "build"])
    nbytes = disk_bytes(src)
    largest_entry = 4 * max(sizes)
    logical = 8 * 4 + 2 * sum(4 * 8 * -(-x // 8) for x in sizes)
    base_mb, _ = child_rss_mb(["-c", "import zero_optax"])
    peak_mb, seconds = child_rss_mb(["-m", "zero_optax.reshard", src, dst, "--world-size", "3"])
    child_rss_mb([*me, "--phase", "check"])
    report = {
        "checkpoint_MB (array data)": round(logical / 2**20, 1),
        "checkpoint_MB (on disk)": round(nbytes / 2**20, 1),
        "resharded_MB (on disk)": round(disk_bytes(dst) / 2**20, 1),
        "largest_leaf_history_MB (one entry)": round(largest_entry / 2**20, 1),
        "largest_leaf_complete_history_MB (mu+nu)": round(2 * largest_entry / 2**20, 1),
        "largest_target_row_MB": round(4 * math.ceil(max(sizes) / 3) / 2**20, 1),
        "chunk_MB (at most)": 16.0,
        "import_zero_optax_peak_rss_MB": round(base_mb, 1),
        "reshard_peak_rss_MB (RUSAGE_CHILDREN ru_maxrss)": round(peak_mb, 1),
        "reshard_peak_minus_import_MB": round(peak_mb - base_mb, 1),
        "reshard_seconds": round(seconds, 2),
        "reshard_MB_per_s": round(nbytes / 2**20 / seconds, 1),
        "build_seconds": round(built, 2),
        "build_peak_rss_MB": round(build_mb, 1),
        "output_checked": True,
    }
    print(json.dumps(report, indent=1))
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
