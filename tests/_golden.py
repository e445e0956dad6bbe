"""Writes the committed checkpoint of tests/test_golden.py: run it only when the format version changes.

    python tests/_golden.py            # rewrites tests/data/golden_v3/

On simulated CPU devices, trains zero1(adamw) (flat) and zero1(muon) (leaf) on 4 devices on the deterministic
setup of tests/_zero_setup.py for two steps, and a mesh-bound zero1(adam) on a (data=2, model=2) mesh whose `w` is
sharded over `model` (`mesh_bound`), and saves the three states as one item (`ZeroSave((flat, leaf, mesh))`)
with `ocp.Checkpointer(zo.ZeroCheckpointHandler())`, then stores every array of the saved item, by name, in
`expected.npz`: the values a restore must give back, whatever the release that reads them.

tests/data/golden_v2/ holds the flat and the leaf state as zero_optax 0.2 to 0.4 wrote them (record format 2);
this release reads it but no longer writes it.
"""

import os
import shutil
import sys

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
DIRECTORY = os.path.join(DATA, "golden_v3")
V2 = os.path.join(DATA, "golden_v2")
N = 4
MESH_SHAPES = {"w": (4, 6), "b": (3,)}


def mesh_bound(data: int = 2, model: int = 2):
    """The mesh-bound zero1(adam) on a (data, model) mesh and its parameters (`w` sharded over `model`)."""
    import _zero_setup as zs  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel
    from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
    from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

    import zero_optax as zo  # pylint: disable=import-outside-toplevel
    mesh = jax.make_mesh((data, model), ("data", "model"), devices=jax.devices()[:data * model])
    specs = {"w": P(None, "model"), "b": P()}
    params = {k: zs.global_array(v, NamedSharding(mesh, specs[k])) for k, v in zs.params_np(MESH_SHAPES).items()}
    return zo.zero1(optax.adam(1e-2), axis_name="data", mesh=mesh), params


def states():
    """The flat, the leaf and the mesh-bound state after two steps (the first two with their trainers, for tests)."""
    import _zero_setup as zs  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel
    out = []
    for kind in ("adamw", "muon"):
        tr = zs.trainer(kind, N)
        p = zs.params(tr.mesh)
        out.append((tr, tr.train(p, tr.init(p), 0, 2)[1]))
    tx, p = mesh_bound()
    s = tx.init(p)
    for t in range(2):
        g = {k: jax.device_put(np.asarray(v).mean(0), p[k].sharding)
             for k, v in zs.grads_np(t, 2, MESH_SHAPES).items()}
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
    return out + [(tx, s)]


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
