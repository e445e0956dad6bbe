"""Checkpoint figures: files per checkpoint, save and restore time and peak host memory, offline resharding.

Every measurement runs in a subprocess of its own (`--phase`), on simulated CPU devices, so one phase's memory
never counts in another's. Peak memory is the process's high-water mark of resident memory (`VmHWM`), reset just
before the measured operation (`/proc/self/clear_refs`), and reported with the resident memory just before it:
their difference is what the operation added. The script uses only the public API that zero_optax 0.1 also has
(`zero1`, `ZeroSave`, `ZeroRestore`, `ZeroCheckpointHandler`, `python -m zero_optax.reshard`), so the same
command measures an older tree: put it first on the path with `--tree DIR`.

    python benchmarks/checkpoints.py files   [--tree DIR]        # 86-leaf flat AdamW, 64 devices: file count
    python benchmarks/checkpoints.py memory  [--tree DIR]        # >= 1 GB flat AdamW: save, restore, reshard

The >= 1 GB state is flat AdamW over 1-D leaves whose sizes divide neither 8 nor 3 (`SIZES`); its histories are
random (zero padding), its step count 5. `memory` saves it on 8 devices, restores it on 8, restores it on 3 with
`ZeroRestore(target, reshard=True)` (where the tree has it), and reshards it 8 -> 3 with the command line.
Restores use an abstract target (`jax.eval_shape`), so the restored state is the only state in memory; each
restore checks that every history's sum (float64, per shard) is the saved one.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [64 * 2**20 + 3, 32 * 2**20 + 1, 24 * 2**20 + 5, 10 * 2**20 + 7, 1001, 1]


# ------------------------------------------------------------------------------------------------ in the child


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _measure(fn):
    """(result, seconds, RSS before in MB, peak RSS during in MB) of `fn()`."""
    import gc  # pylint: disable=import-outside-toplevel
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _rss_kb("VmRSS")
    start = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - start
    return out, seconds, before / 1024, _rss_kb("VmHWM") / 1024


def _setup(n: int, sizes: list[int]):
    """zero1(adamw) flat on `n` devices over 1-D leaves of `sizes`: the mesh, the jitted init, abstract params."""
    import jax  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel
    from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
    from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

    import zero_optax as zo  # pylint: disable=import-outside-toplevel

    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    tx = zo.zero1(optax.adamw(1e-3, weight_decay=0.1), axis_name="data")
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))
    params = {f"w{i}": jax.ShapeDtypeStruct((s,) if s > 1 else (), jax.numpy.float32,
                                            sharding=NamedSharding(mesh, P())) for i, s in enumerate(sizes)}
    return mesh, init, params


def _abstract(mesh, init, params):
    import jax  # pylint: disable=import-outside-toplevel
    from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, x.sharding.spec)),
                        jax.eval_shape(init, params))


def _entry_sizes(state) -> list[int | None]:
    """Per array of the state's inner state (flat partition, either release): its leaf's size, or None (shared)."""
    layout = state.layout
    return [None if e.leaf is None else math.prod(layout.leaves[e.leaf].shape) for e in layout.entries]


def _random_state(mesh, init, params):
    """A state of zero1(adamw) with random histories (padding zero) and step count 5, built on the devices."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

    target = _abstract(mesh, init, params)
    leaves, treedef = jax.tree.flatten(target)
    sizes = _entry_sizes(jax.tree.unflatten(treedef, leaves))

    def fill(i, x, size):
        if size is None:
            return jnp.full(x.shape, 5, x.dtype)
        flat = jax.random.normal(jax.random.PRNGKey(i), (math.prod(x.shape),), x.dtype)
        return jnp.where(jnp.arange(flat.shape[0]) < size, flat, 0).reshape(x.shape)

    arrays = [jax.jit(lambda i=i, x=x, s=s: fill(i, x, s), out_shardings=x.sharding)()
              for i, (x, s) in enumerate(zip(leaves, sizes))]
    return jax.tree.unflatten(treedef, arrays)


def _sums(state) -> list[float]:
    """Per array of the inner state: the float64 sum of its values (padding is zero, so it survives resharding)."""
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    out = []
    for x, size in zip(jax.tree.leaves(state._inner), _entry_sizes(state)):
        if size is None:
            out.append(float(np.asarray(x.addressable_shards[0].data).reshape(-1)[0]))
        else:
            out.append(sum(float(np.asarray(s.data, np.float64).sum()) for s in x.addressable_shards))
    return out


def _dir_stats(directory: str) -> tuple[int, int]:
    files = [os.path.join(b, f) for b, _, fs in os.walk(directory) for f in fs]
    return len(files), sum(os.path.getsize(f) for f in files)


def child(args) -> dict:
    import jax  # pylint: disable=import-outside-toplevel
    jax.config.update("jax_num_cpu_devices", args.devices)
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

    import zero_optax as zo  # pylint: disable=import-outside-toplevel

    out = {"phase": args.phase, "devices": args.devices, "zero_optax": zo.__file__}
    if args.phase == "files":
        import optax  # pylint: disable=import-outside-toplevel
        from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

        from benchmarks.model import gpt_params  # pylint: disable=import-outside-toplevel
        params = gpt_params(vocab=512, d_model=64, n_layers=7)
        del params["ln_f"]["bias"]  # 3 + 12 * 7 - 1 = 86 leaves
        mesh = jax.make_mesh((args.devices,), ("data",))
        tx = zo.zero1(optax.adamw(1e-3), axis_name="data")
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))(params)
        shutil.rmtree(args.dir, ignore_errors=True)
        with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
            _, seconds, _, _ = _measure(lambda: ckpt.save(os.path.join(args.dir, "item"), args=zo.ZeroSave(state)))
        files, nbytes = _dir_stats(args.dir)
        out.update(leaves=len(jax.tree.leaves(params)), arrays=len(jax.tree.leaves(state)), files=files,
                   bytes=nbytes, save_s=round(seconds, 2))
        return out
    mesh, init, params = _setup(args.devices, SIZES)
    item = os.path.join(args.dir, "item")
    if args.phase == "save":
        state = _random_state(mesh, init, params)
        state_mb = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
        with open(os.path.join(args.dir, "sums.json"), "w") as f:
            json.dump(_sums(state), f)
        shutil.rmtree(item, ignore_errors=True)
        with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
            _, seconds, before, peak = _measure(lambda: ckpt.save(item, args=zo.ZeroSave(state)))
        files, nbytes = _dir_stats(item)
        out.update(state_MB=round(state_mb, 1), files=files, disk_MB=round(nbytes / 2**20, 1))
    else:
        source = item if args.phase == "restore" else os.path.join(args.dir, "resharded")
        target = _abstract(mesh, init, params)
        extra = {"reshard": True} if args.reshard else {}
        with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
            state, seconds, before, peak = _measure(
                lambda: jax.block_until_ready(ckpt.restore(source, args=zo.ZeroRestore(target, **extra))))
        with open(os.path.join(args.dir, "sums.json")) as f:
            want = json.load(f)
        got = _sums(state)
        assert all(abs(a - b) <= 1e-9 * max(1.0, abs(b)) for a, b in zip(got, want)), (got, want)
        out.update(state_MB=round(sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20, 1), checked=True,
                   reshard=args.reshard)
    out.update(seconds=round(seconds, 2), rss_before_MB=round(before, 1), peak_MB=round(peak, 1),
               added_MB=round(peak - before, 1))
    return out


# ------------------------------------------------------------------------------------------------ the driver


_MEASURE = ("import resource, subprocess, sys, time; t = time.perf_counter(); subprocess.run(sys.argv[1:], "
            "check=True); print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def _env(tree: str | None) -> dict:
    path = os.pathsep.join(p for p in [tree or ROOT, ROOT, os.environ.get("PYTHONPATH", "")] if p)
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=path)


def _run(phase: str, tree: str | None, directory: str, devices: int, reshard: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", phase, "--dir", directory, "--devices",
           str(devices)] + (["--reshard"] if reshard else [])
    out = subprocess.run(cmd, env=_env(tree), check=True, stdout=subprocess.PIPE, text=True, cwd=tree or ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def _cli_reshard(tree: str | None, directory: str, m: int) -> dict:
    """`python -m zero_optax.reshard` as the only child of a small measuring process: (seconds, peak RSS)."""
    dst = os.path.join(directory, "resharded")
    shutil.rmtree(dst, ignore_errors=True)
    out = subprocess.run([sys.executable, "-c", _MEASURE, sys.executable, "-m", "zero_optax.reshard",
                          os.path.join(directory, "item"), dst, "--world-size", str(m)], env=_env(tree), check=True,
                         stdout=subprocess.PIPE, text=True, cwd=tree or ROOT).stdout.split()  # -m: cwd first
    base = subprocess.run([sys.executable, "-c", _MEASURE, sys.executable, "-c", "import zero_optax"],
                          env=_env(tree), check=True, stdout=subprocess.PIPE, text=True,
                          cwd=tree or ROOT).stdout.split()
    files, nbytes = _dir_stats(dst)
    return {"phase": "reshard_cli", "seconds": round(float(out[0]), 2), "peak_MB": round(int(out[1]) / 1024, 1),
            "import_zero_optax_peak_MB": round(int(base[1]) / 1024, 1), "files": files,
            "disk_MB": round(nbytes / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["files", "memory", "save", "restore", "restore_resharded"])
    parser.add_argument("--tree", help="a zero_optax source tree to measure instead of this one")
    parser.add_argument("--dir", default="/tmp/zero_optax_ckpt_bench")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--reshard", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.phase = args.what
        print(json.dumps(child(args)))
        return
    os.makedirs(args.dir, exist_ok=True)
    if args.what == "files":
        print(json.dumps(_run("files", args.tree, args.dir, 64)))
        return
    results = [_run("save", args.tree, args.dir, 8), _run("restore", args.tree, args.dir, 8)]
    try:
        results.append(_run("restore", args.tree, args.dir, 3, reshard=True))
    except subprocess.CalledProcessError:
        results.append({"phase": "restore", "devices": 3, "reshard": True, "supported": False})
    results.append(_cli_reshard(args.tree, args.dir, 3))
    results.append(_run("restore_resharded", args.tree, args.dir, 3))
    for r in results:
        print(json.dumps(r))
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
