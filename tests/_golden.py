"""Writes the committed checkpoint of tests/test_golden.py: run it only when the format version changes.

    python tests/_golden.py            # rewrites tests/data/golden_v2/

On 4 simulated CPU devices, trains zero1(adamw) (flat) and zero1(muon) (leaf) on the deterministic setup of
tests/_zero_setup.py for two steps and saves both states as one item (`ZeroSave((flat, leaf))`) with
`ocp.Checkpointer(zo.ZeroCheckpointHandler())`, then stores every array of the saved item, by name, in
`expected.npz`: the values a restore must give back, whatever the release that reads them.
"""

import os
import shutil
import sys

DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "golden_v2")
N = 4


def states():
    """The flat and the leaf state after two steps (the targets' trainers, for tests)."""
    import _zero_setup as zs  # pylint: disable=import-outside-toplevel
    out = []
    for kind in ("adamw", "muon"):
        tr = zs.trainer(kind, N)
        p = zs.params(tr.mesh)
        out.append((tr, tr.train(p, tr.init(p), 0, 2)[1]))
    return out


def main() -> None:
    import jax  # pylint: disable=import-outside-toplevel
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np  # pylint: disable=import-outside-toplevel
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

    import zero_optax as zo  # pylint: disable=import-outside-toplevel
    from zero_optax.checkpoint import _arrays  # pylint: disable=import-outside-toplevel

    shutil.rmtree(DIRECTORY, ignore_errors=True)
    os.makedirs(DIRECTORY)
    saved = tuple(s for _, s in states())
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        ckpt.save(os.path.join(DIRECTORY, "item"), args=zo.ZeroSave(saved))
    marker = os.path.join(DIRECTORY, "item", "commit_success.txt")  # names this machine's path; not needed
    if os.path.exists(marker):
        os.remove(marker)
    expected = {a.name: np.asarray(v) for k, s in enumerate(saved)
                for a, v in zip(_arrays.stored_arrays(s.layout, k), _arrays.state_values(s))}
    np.savez(os.path.join(DIRECTORY, "expected.npz"), **expected)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
