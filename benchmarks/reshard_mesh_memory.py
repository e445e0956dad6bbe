"""Peak memory and time of resharding a >= 1 GB flat AdamW checkpoint to another tensor-parallel size.

The state is saved by `ZeroSave` on a `(data=4, model=2)` mesh of 8 simulated CPU devices: matrices sharded over
`"model"` by columns (`P(None, "model")`), whose blocks' sizes divide neither data size, with random f32
histories (zero padding) and a step count. It is moved to `(data=2, model=4)`, where every block is cut anew:

* offline: `python -m zero_optax.reshard SRC DST --axis-sizes data=2,model=4`, in a subprocess measured from
  outside, the result restored on `(2, 4)` and checked;
* at load time: `zo.ZeroRestore(target, reshard=True)` on `(2, 4)`, measured in its own process.

Each check compares every history's float64 sum with the saved one (padding is zero, so the sums survive the
re-cut; `tests/test_any_mesh.py` checks the coordinates themselves). Phases run as in `benchmarks/checkpoints.py`.

    python benchmarks/reshard_mesh_memory.py [--dir /tmp/reshard_mesh_bench]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoints

SHAPES = [(8191, 8192), (8195, 4096), (4101, 8192), (2053, 4096), (1001, 4)]
"""Column-parallel matrices: 1089 MiB of AdamW state in all."""
MESHES = {"save": (4, 2), "restore": (2, 4), "restore_resharded": (2, 4)}


def _setup(shape):
    import jax  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel
    from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
    from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

    import zero_optax as zo  # pylint: disable=import-outside-toplevel

    mesh = jax.make_mesh(shape, ("data", "model"))
    tx = zo.zero1(optax.adamw(1e-3, weight_decay=0.1), axis_name="data")
    specs = {f"w{i}": P(None, "model") for i in range(len(SHAPES))}
    params = {f"w{i}": jax.ShapeDtypeStruct(s, jax.numpy.float32, sharding=NamedSharding(mesh, specs[f"w{i}"]))
              for i, s in enumerate(SHAPES)}
    state_specs = zo.state_specs(tx, params, specs, mesh=mesh)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=state_specs))
    abstract = jax.eval_shape(init, params)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
                          abstract, state_specs)
    return target


def _padding(state):
    """Per stored array (`zero_optax.checkpoint._arrays` order): None (shared), or (block width, block size)."""
    from zero_optax.checkpoint import _arrays  # pylint: disable=import-outside-toplevel
    layout = state.layout
    out = []
    for a in _arrays.stored_arrays(layout, 0):
        leaf = layout.leaves[layout.entries[a.entry].leaf] if layout.entries[a.entry].leaf is not None else None
        out.append(None if leaf is None else (leaf.group * leaf.slots, leaf.size))
    return out


def _random_state(target):
    """A state with random histories (padding zero) and step count 5, built array by array on the devices."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    from zero_optax.checkpoint import _arrays  # pylint: disable=import-outside-toplevel

    def fill(i, x, pad):
        if pad is None:
            return jnp.full(x.shape, 5, x.dtype)
        width, size = pad
        flat = jax.random.normal(jax.random.PRNGKey(i), (math.prod(x.shape),), x.dtype)
        return jnp.where(jnp.arange(flat.shape[0]) % width < size, flat, 0).reshape(x.shape)

    structs = _arrays.target_structs(target)
    arrays = [jax.jit(lambda i=i, x=x, p=p: fill(i, x, p), out_shardings=x.sharding)()
              for i, (x, p) in enumerate(zip(structs, _padding(target), strict=True))]
    return _arrays.rebuild(target, arrays)


def _sums(state) -> list[float]:
    """Per stored array: the float64 sum of its values (padding is zero, so it survives the re-cut)."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    from zero_optax.checkpoint import _arrays  # pylint: disable=import-outside-toplevel
    out = []
    for x, pad in zip(_arrays.state_values(state), _padding(state), strict=True):
        if pad is None:
            out.append(float(np.asarray(x.addressable_shards[0].data).reshape(-1)[0]))
        else:
            out.append(sum(float(np.asarray(s.data, np.float64).sum()) for s in x.addressable_shards))
    return out


def child(phase: str, directory: str) -> dict:
    import jax  # pylint: disable=import-outside-toplevel
    jax.config.update("jax_num_cpu_devices", 8)
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

    import zero_optax as zo  # pylint: disable=import-outside-toplevel

    target = _setup(MESHES[phase])
    item = os.path.join(directory, "item")
    out = {"phase": phase, "mesh": MESHES[phase]}
    with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
        if phase == "save":
            state = _random_state(target)
            with open(os.path.join(directory, "sums.json"), "w") as f:
                json.dump(_sums(state), f)
            _, seconds, before, peak = checkpoints._measure(lambda: ckpt.save(item, args=zo.ZeroSave(state)))
        else:
            source = item if phase == "restore" else os.path.join(directory, "resharded")
            state, seconds, before, peak = checkpoints._measure(lambda: jax.block_until_ready(
                ckpt.restore(source, args=zo.ZeroRestore(target, reshard=True))))
            with open(os.path.join(directory, "sums.json")) as f:
                want = json.load(f)
            got = _sums(state)
            assert all(abs(a - b) <= 1e-9 * max(1.0, abs(b)) for a, b in zip(got, want)), (got, want)
            out["checked"] = True
    out.update(state_MB=round(sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20, 1), seconds=round(seconds, 2),
               rss_before_MB=round(before, 1), peak_MB=round(peak, 1), added_MB=round(peak - before, 1))
    return out


def _run(phase: str, directory: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", phase, "--dir", directory]
    out = subprocess.run(cmd, env=checkpoints._env(None), check=True, stdout=subprocess.PIPE, text=True,
                         cwd=checkpoints.ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def _cli(directory: str) -> dict:
    dst = os.path.join(directory, "resharded")
    out = subprocess.run([sys.executable, "-c", checkpoints._MEASURE, sys.executable, "-m", "zero_optax.reshard",
                          os.path.join(directory, "item"), dst, "--axis-sizes", "data=2,model=4"],
                         env=checkpoints._env(None), check=True, stdout=subprocess.PIPE, text=True,
                         cwd=checkpoints.ROOT).stdout.split()
    base = subprocess.run([sys.executable, "-c", checkpoints._MEASURE, sys.executable, "-c", "import zero_optax"],
                          env=checkpoints._env(None), check=True, stdout=subprocess.PIPE, text=True,
                          cwd=checkpoints.ROOT).stdout.split()
    return {"phase": "reshard_cli --axis-sizes data=2,model=4", "seconds": round(float(out[0]), 2),
            "peak_MB": round(int(out[1]) / 1024, 1), "import_zero_optax_peak_MB": round(int(base[1]) / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/reshard_mesh_bench")
    parser.add_argument("--child", choices=sorted(MESHES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dir)))
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    for result in (_run("save", args.dir), _run("restore", args.dir), _cli(args.dir),
                   _run("restore_resharded", args.dir)):
        print(json.dumps(result))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
