"""Command line: convert a zero1 checkpoint item directory to another mesh (`zo.reshard`).

    python -m zero_optax.reshard SRC DST --world-size 4 [--owners auto|FILE.json] [--force]
    python -m zero_optax.reshard SRC DST --axis-sizes data=2,model=4 [--param-specs SPECS.json] [...]

Bad input exits with status 1 (2 for bad usage) and one line on stderr, and writes nothing. The module forwards
calls, so `zero_optax.reshard(...)` stays callable once importing this submodule has replaced the package attribute.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import sys
import types
from collections.abc import Sequence

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from zero_optax.checkpoint._offline import parse_axis_sizes
from zero_optax.checkpoint._offline import reshard as _reshard_fn

PROG = "python -m zero_optax.reshard"
LARGE_BYTES = 1 << 30
"""Checkpoints at least this large show progress even when stderr is not a terminal."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        self.exit(2, f"{PROG}: error: {message} (see --help)\n")


class _Progress:
    """Progress on stderr: a `rich` bar on a terminal; in a log, a line per 10% of a checkpoint of `LARGE_BYTES`."""

    def __init__(self, stream=None):
        self.console = Console(file=stream if stream is not None else sys.stderr, stderr=stream is None)
        self.bar: Progress | None = None
        self.task = None
        self.shown = -1

    def __call__(self, done: int, total: int) -> None:
        if total <= 0:
            return
        if self.console.is_terminal:
            if self.bar is None or self.task is None:  # (both set here)
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


def _json_file(arg: str, flag: str):
    """The JSON file a flag names, or a ValueError naming it."""
    try:
        with open(arg) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {flag} file {arg}: {e}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = _Parser(prog=PROG, description="Convert a zero_optax checkpoint item directory to another mesh.")
    parser.add_argument("src", help="the item directory to read (holds zero_record.json); local or gs://")
    parser.add_argument("dst", help="the item directory to write")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--world-size", type=int, help="the new number of devices along the ZeRO axes")
    target.add_argument("--axis-sizes", help="the target mesh, every axis: NAME=SIZE,... (data=2,model=4)")
    parser.add_argument("--param-specs", help="a JSON file of leaf path -> PartitionSpec ([null, \"model\"]) on the "
                        "target; needed only where the record lacks a leaf's placement or for a new axis")
    parser.add_argument("--owners", default="auto", help="'auto' (balanced) or a JSON file of leaf owners")
    parser.add_argument("--force", action="store_true", help="replace an existing DST")
    args = parser.parse_args(argv)
    # A fixed glibc mmap threshold (M_MMAP_THRESHOLD) lets freed 16 MiB chunk buffers return to the OS instead of
    # staying in per-thread arenas; this process is ours alone.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)
    bar = _Progress()
    try:
        _reshard_fn(args.src, args.dst, args.world_size,
                    axis_sizes=None if args.axis_sizes is None else parse_axis_sizes(args.axis_sizes),
                    param_specs=None if args.param_specs is None else _json_file(args.param_specs, "--param-specs"),
                    owners=None if args.owners == "auto" else _json_file(args.owners, "--owners"),
                    force=args.force, progress=bar)
        return 0
    except (ValueError, OSError) as e:  # ZeroError and StoreError are ValueErrors
        status, message = 1, "error: " + " ".join(str(e).split())
    except KeyboardInterrupt:
        left = (f"nothing was written to {os.path.abspath(args.dst)}." if "://" not in args.dst else
                f"{args.dst} holds no finished checkpoint (no reader takes it for one); run again with --force to "
                "replace what was written.")
        status, message = 130, f"interrupted; {left}"
    finally:
        bar.close()
    print(f"{PROG}: {message}", file=sys.stderr)
    return status


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return _reshard_fn(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
