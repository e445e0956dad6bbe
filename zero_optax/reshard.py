"""Command line: convert a zero1 checkpoint item directory to another mesh.

    python -m zero_optax.reshard SRC DST --world-size 4 [--owners auto|FILE.json] [--force]
    python -m zero_optax.reshard SRC DST --axis-sizes data=2,model=4 [--param-specs SPECS.json] [...]

`--axis-sizes` gives every axis of the target mesh (the ZeRO axes included; an axis left out is not in it);
`--world-size` alone keeps the saved mesh's other axes. `SPECS.json` maps leaf paths to the parameters'
PartitionSpecs (`{"['w']": [null, "model"]}`), for leaves whose blocks alone do not tell which dimension a
resized axis cuts. The owners `FILE.json` holds the new owners of the leaf partition: one list of device indices (one per leaf, in tree-flatten
order) for a checkpoint with one leaf-partition state, or one item (a list or null) per zero1 state. Bad input
exits with status 1 (2 for bad usage) and one line on stderr, and writes nothing.

Importing this module keeps `zero_optax.reshard(...)` callable: the module object forwards calls to
`zero_optax.checkpoint._offline.reshard`, because importing a submodule replaces the package attribute of the same
name.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import types
from collections.abc import Sequence

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from zero_optax.checkpoint._offline import reshard as _reshard_fn
from zero_optax.checkpoint._offline_target import parse_axis_sizes

PROG = "python -m zero_optax.reshard"
LARGE_BYTES = 1 << 30
"""Checkpoints at least this large show progress even when stderr is not a terminal."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        self.exit(2, f"{PROG}: error: {message} (see --help)\n")


class _Progress:
    """Progress on stderr: a `rich` bar (bytes, speed, time left) on a terminal; in a log, one line per 10% for
    checkpoints of at least `LARGE_BYTES`; nothing otherwise."""

    def __init__(self, stream=None):
        self.console = Console(file=stream if stream is not None else sys.stderr, stderr=stream is None)
        self.bar: Progress | None = None
        self.task = None
        self.shown = -1

    def __call__(self, done: int, total: int) -> None:
        if total <= 0:
            return
        if self.console.is_terminal:
            if self.bar is None:
                self.bar = Progress(TextColumn("resharding"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                    TimeRemainingColumn(), console=self.console)
                self.bar.start()
                self.task = self.bar.add_task("reshard", total=total)
            self.bar.update(self.task, completed=done)
        elif total >= LARGE_BYTES and 100 * done // total // 10 != self.shown // 10:
            self.shown = 100 * done // total
            self.console.print(f"resharding: {self.shown}% ({done / 1e9:.2f}/{total / 1e9:.2f} GB)",
                               highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _fixed_mmap_threshold() -> None:
    """Lets freed chunk buffers return to the OS (glibc only; this process is ours alone).

    glibc raises its mmap threshold after a large block is freed, so TensorStore's 16 MiB chunk buffers then land
    in per-thread arenas and stay there; a fixed 1 MiB threshold keeps the peak near a few chunks.
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _json_file(arg: str, flag: str):
    try:
        with open(arg) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {flag} file {arg}: {e}") from None


def _owners(arg: str):
    return None if arg == "auto" else _json_file(arg, "--owners")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = _Parser(prog=PROG, description="Convert a zero_optax checkpoint item directory to another mesh.")
    parser.add_argument("src", help="the item directory to read (holds zero_record.json); local or gs://")
    parser.add_argument("dst", help="the item directory to write")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--world-size", type=int, help="the new number of devices along the ZeRO axes")
    target.add_argument("--axis-sizes", help="the target mesh, every axis: NAME=SIZE,... (data=2,model=4)")
    parser.add_argument("--param-specs", help="a JSON file of leaf path -> PartitionSpec ([null, \"model\"])")
    parser.add_argument("--owners", default="auto", help="'auto' (balanced) or a JSON file of leaf owners")
    parser.add_argument("--force", action="store_true", help="replace an existing DST")
    args = parser.parse_args(argv)
    bar = _Progress()
    _fixed_mmap_threshold()
    try:
        _reshard_fn(args.src, args.dst, args.world_size,
                    axis_sizes=None if args.axis_sizes is None else parse_axis_sizes(args.axis_sizes),
                    param_specs=None if args.param_specs is None else _json_file(args.param_specs, "--param-specs"),
                    owners=_owners(args.owners), force=args.force, progress=bar)
    except (ValueError, OSError) as e:  # ZeroError and StoreError are ValueErrors
        bar.close()
        message = " ".join(str(e).split())
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        bar.close()
        print(f"{PROG}: interrupted; {_interrupted(args.dst)}", file=sys.stderr)
        return 130
    bar.close()
    return 0


def _interrupted(dst: str) -> str:
    """What an interrupted run leaves at `dst`, for its last message."""
    if "://" not in dst:
        return f"nothing was written to {os.path.abspath(dst)}."
    return (f"{dst} holds no finished checkpoint (no reader takes it for one); run again with --force to replace "
            "what was written.")


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return _reshard_fn(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
