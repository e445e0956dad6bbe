"""`python -m zero_optax.reshard`, paused at one point of its writing until it is killed (for tests/test_gcs.py).

    python tests/_reshard_pause.py POINT SRC DST --world-size M [--force]

POINT is where the process prints `PAUSED` and sleeps (the test then kills it with SIGKILL, so nothing is cleaned
up): `data` (every array created, some of their data committed, more to come), `record` (the record written, the
commit file not yet), `retracted` (with --force: the old destination deleted, nothing new written yet).
"""

import importlib
import sys
import time

from zero_optax.checkpoint import _paths, _record, _store

cli = importlib.import_module("zero_optax.reshard")  # the module (`zero_optax.reshard` is also the function)


def _pause():
    print("PAUSED", flush=True)
    time.sleep(3600)


def _after(module, name, when=lambda: True):
    original = getattr(module, name)

    def wrapped(*args, **kwargs):
        out = original(*args, **kwargs)
        if when():
            _pause()
        return out

    setattr(module, name, wrapped)


if __name__ == "__main__":
    point = sys.argv.pop(1)
    if point == "data":
        writes = []
        original_write = _store.ItemWriter.write

        def write(self, name, region, data):
            original_write(self, name, region, data)
            self.commit()  # one transaction per region, so that the pause falls between two committed ones
            writes.append(name)
            if len(writes) == 2:
                _pause()

        _store.ItemWriter.write = write
    elif point == "record":
        _after(_record, "write")
    elif point == "retracted":
        _after(_paths, "retract")
    else:
        raise SystemExit(f"unknown pause point {point!r}")
    sys.exit(cli.main(sys.argv[1:]))
