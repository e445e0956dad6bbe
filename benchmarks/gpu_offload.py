"""Offloaded optimizer state against on-device zero1 and plain optax: device peak memory and step time.

    python -m benchmarks.gpu_offload                                   # 1 B float32 params, one GPU
    JAX_PLATFORMS=cpu python -m benchmarks.gpu_offload --params 1e6    # CPU smoke test

The model keeps float32 master parameters in the optimizer (``master_dtype=jnp.float32``) and bfloat16 compute
copies as the parameters, so the device holds 2 B/param of parameters, 2 B/param of gradients, and with
``offload=True`` only the optimizer state in flight. Variants (each on a 1-device mesh, donated buffers):

* ``offload``: ``zo.zero1(optax.adamw, master_dtype=float32, offload=True)``: 12 B/param (mu, nu, master) in
  ``pinned_host`` memory, moved to the device and back every step.
* ``zero1``: the same without offload (12 B/param on the device).
* ``optax``: ``optax.adamw`` on float32 parameters (4 + 4 + 8 B/param on the device).

For each: peak device bytes (``device.memory_stats()["peak_bytes_in_use"]``, where the backend reports it; CPU
reports none), the median step time, and for ``offload`` its floor ``bytes moved / host-device bandwidth``
(24 B/param: the 12 B of state in and out), with the bandwidth measured here by timing ``jax.device_put`` of a
large array between ``pinned_host`` and ``device`` in both directions.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zero_optax as zo
from benchmarks.gpu_adamw import time_calls

STATE_BYTES_PER_PARAM = 12  # mu, nu and the master copy in float32
AXIS = "data"


def shapes_for(n_params: int, n_leaves: int = 16) -> list[tuple[int, int]]:
    """`n_leaves` 2-D leaves totalling about `n_params`."""
    per = max(1, n_params // n_leaves)
    cols = 8192 if per >= 8192 * 64 else max(1, min(256, per))
    return [(max(1, per // cols), cols)] * n_leaves


def median_seconds(fn: Callable[[], Any], steps: int, warmup: int) -> float:
    """Median seconds of `fn()` (which blocks) after `warmup` calls (`benchmarks.gpu_adamw.time_calls`)."""
    return statistics.median(time_calls(fn, steps, warmup))


def peak_bytes(device) -> int | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats else int(stats.get("peak_bytes_in_use", 0))


def copy_bandwidth(mesh, n_elems: int, steps: int, warmup: int) -> dict[str, float]:
    """Bytes per second of `device_put` between `pinned_host` and `device` memory, each direction."""
    device = NamedSharding(mesh, P(), memory_kind="device")
    host = NamedSharding(mesh, P(), memory_kind="pinned_host")
    x = jax.device_put(jnp.zeros((n_elems,), jnp.float32), device)
    h = jax.device_put(x, host)
    nbytes = n_elems * 4
    to_host = median_seconds(lambda: jax.device_put(x, host).block_until_ready(), steps, warmup)
    to_device = median_seconds(lambda: jax.device_put(h, device).block_until_ready(), steps, warmup)
    return {"host_to_device": nbytes / to_device, "device_to_host": nbytes / to_host}


def run(variant: str, mesh, shapes: list, steps: int, warmup: int, bucket_bytes: int) -> dict[str, Any]:
    repl = NamedSharding(mesh, P())
    dtype = jnp.float32 if variant == "optax" else jnp.bfloat16
    key = jax.random.key(0)
    params = [jax.device_put(jax.random.normal(jax.random.fold_in(key, i), s, dtype) * 0.02, repl)
              for i, s in enumerate(shapes)]
    grads = [jax.device_put(jnp.full(s, 1e-3, dtype), repl) for s in shapes]
    adamw = optax.adamw(1e-4, weight_decay=0.1)
    if variant == "optax":
        tx = adamw
    else:
        tx = zo.zero1(adamw, axis_name=AXIS, mesh=mesh, master_dtype=jnp.float32, offload=variant == "offload",
                      bucket_bytes=bucket_bytes)
    state = tx.init(params)

    @jax.jit
    def step(params, grads, state):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step.__wrapped__, donate_argnums=(0, 2))
    box = {"p": params, "s": state}

    def one() -> None:
        box["p"], box["s"] = step(box["p"], grads, box["s"])
        jax.block_until_ready(box["p"])

    seconds = median_seconds(one, steps, warmup)
    kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(box["s"])})
    return {"variant": variant, "step_ms": seconds * 1e3, "state_memory": kinds,
            "peak_device_bytes": peak_bytes(mesh.devices.flat[0])}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_offload", description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=1e9, help="approximate parameter count")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bucket-bytes", type=int, default=64 << 20)
    p.add_argument("--variants", default="offload,zero1,optax", help="run each in a fresh process for clean peaks")
    args = p.parse_args(argv)
    mesh = jax.make_mesh((1,), (AXIS,), devices=jax.devices()[:1])
    shapes = shapes_for(int(args.params))
    n = sum(int(np.prod(s)) for s in shapes)
    bw = copy_bandwidth(mesh, min(n, 1 << 28), args.steps, args.warmup)
    floor_s = STATE_BYTES_PER_PARAM * n / bw["host_to_device"] + STATE_BYTES_PER_PARAM * n / bw["device_to_host"]
    out = {"device": str(jax.devices()[0]), "params": n, "bandwidth_bytes_per_s": bw,
           "offload_floor_ms": floor_s * 1e3, "bucket_bytes": args.bucket_bytes, "results": []}
    for variant in args.variants.split(","):
        r = run(variant, mesh, shapes, args.steps, args.warmup, args.bucket_bytes)
        if variant == "offload":
            r["x_floor"] = r["step_ms"] / out["offload_floor_ms"]
        out["results"].append(r)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
