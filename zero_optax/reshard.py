"""Command line: convert a zero1 checkpoint item directory to another world size.

    python -m zero_optax.reshard SRC DST --world-size 4 [--owners auto|FILE.json] [--force]

`FILE.json` holds the new owners of the leaf partition: one list of device indices (one per leaf, in tree-flatten
order) for a checkpoint with one leaf-partition state, or one item (a list or null) per zero1 state. Bad input
exits with status 1 (2 for bad usage) and one line on stderr, and writes nothing.

Importing this module keeps `zero_optax.reshard(...)` callable: the module object forwards calls to
`zero_optax._reshard.reshard`, because importing a submodule replaces the package attribute of the same name.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
import types
from collections.abc import Sequence

from zero_optax._reshard import reshard as _reshard_fn

PROG = "python -m zero_optax.reshard"
LARGE_BYTES = 1 << 30
"""Checkpoints at least this large show progress even when stderr is not a terminal."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        self.exit(2, f"{PROG}: error: {message} (see --help)\n")


class _Bar:
    """A text progress bar on stderr: redrawn in place on a terminal, a line per 10% otherwise."""

    def __init__(self, stream=sys.stderr):
        self.stream, self.tty, self.shown, self.last = stream, stream.isatty(), -1, 0.0
        self.active = False

    def __call__(self, done: int, total: int) -> None:
        if not (self.tty or total >= LARGE_BYTES) or total <= 0:
            return
        pct = 100 * done // total
        now = time.monotonic()
        if self.tty and (pct != self.shown and (now - self.last > 0.1 or pct == 100)):
            bar = "#" * (pct // 4) + "." * (25 - pct // 4)
            self.stream.write(f"\rresharding [{bar}] {pct:3d}% {done / 1e9:.2f}/{total / 1e9:.2f} GB")
            self.shown, self.last, self.active = pct, now, True
        elif not self.tty and pct // 10 != self.shown // 10:
            self.stream.write(f"resharding: {pct}% ({done / 1e9:.2f}/{total / 1e9:.2f} GB)\n")
            self.shown = pct
        self.stream.flush()

    def close(self) -> None:
        if self.active:
            self.stream.write("\n")
            self.active = False


def _fixed_mmap_threshold() -> None:
    """Lets freed chunk buffers return to the OS (glibc only; this process is ours alone).

    glibc raises its mmap threshold after a large block is freed, so TensorStore's 16 MiB chunk buffers then land
    in per-thread arenas and stay there; a fixed 1 MiB threshold keeps the peak near a few chunks.
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _owners(arg: str):
    if arg == "auto":
        return None
    try:
        with open(arg) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read --owners file {arg}: {e}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = _Parser(prog=PROG, description="Convert a zero_optax checkpoint item directory to another world size.")
    parser.add_argument("src", help="the item directory to read (holds zero_record.json)")
    parser.add_argument("dst", help="the item directory to write")
    parser.add_argument("--world-size", type=int, required=True, help="the new number of devices")
    parser.add_argument("--owners", default="auto", help="'auto' (balanced) or a JSON file of leaf owners")
    parser.add_argument("--force", action="store_true", help="replace an existing DST")
    args = parser.parse_args(argv)
    bar = _Bar()
    _fixed_mmap_threshold()
    try:
        _reshard_fn(args.src, args.dst, args.world_size, owners=_owners(args.owners), force=args.force,
                    progress=bar)
    except (ValueError, OSError) as e:  # ZeroError and StoreError are ValueErrors
        bar.close()
        message = " ".join(str(e).split())
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        bar.close()
        print(f"{PROG}: interrupted; nothing was written to {os.path.abspath(args.dst)}.", file=sys.stderr)
        return 130
    bar.close()
    return 0


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return _reshard_fn(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
