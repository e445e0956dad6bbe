"""Subprocess for tests/test_checkpoint.py: saves step 1, then is killed (SIGKILL) in the middle of saving step 2.

Usage: python _checkpoint_worker.py CHECKPOINT_DIR MARKER_FILE

Trains zero1(adamw) on 8 simulated CPU devices, saves step 1 through an async CheckpointManager and waits for it,
then makes the record's write hang, starts saving step 2, and writes MARKER_FILE when the background commit of
step 2 reaches the record (beside Orbax's array writes). The test kills it after that; it never finishes on its
own within the test's timeout.
"""

import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import _zero_setup as zs
import orbax.checkpoint as ocp

import zero_optax as zo
from zero_optax.checkpoint import _record


def main(directory: str, marker: str) -> None:
    tr = zs.trainer("adamw", chain=True)
    p = zs.params(tr.mesh)
    s = tr.init(p)
    with ocp.CheckpointManager(directory) as mngr:
        p, s = tr.train(p, s, 0, 1)
        mngr.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(p), opt_state=zo.ZeroSave(s)))
        mngr.wait_until_finished()
        print("SAVED 1", flush=True)

        def slow_write(*args, **kwargs):  # the record, written by a commit future of the save
            with open(marker, "w") as f:
                f.write("writing step 2\n")
            time.sleep(600)

        _record.write = slow_write
        p, s = tr.train(p, s, 1, 2)
        mngr.save(2, args=ocp.args.Composite(params=ocp.args.StandardSave(p), opt_state=zo.ZeroSave(s)))
        print("SAVING 2", flush=True)
        mngr.wait_until_finished()
    print("UNEXPECTEDLY FINISHED", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
