"""One-device AdamW step against the memory-bandwidth floor: ``zero_optax.zero1`` vs plain optax.

    python -m benchmarks.gpu_adamw                      # ~1.07 B float32 params, one accelerator
    JAX_PLATFORMS=cpu python -m benchmarks.gpu_adamw --params 1e6   # CPU smoke test

An AdamW step is memory bound. Per parameter it must at least read and write the parameter
(8 B), read the gradient (4 B), and read and write both moments (8 + 8 B): 28 bytes. With the
device's copy bandwidth ``bw`` (measured here with a jitted ``x + 1`` over a large array, counted
as 2 x its bytes), the floor is ``28 * params / bw``. Each variant's median step time (after
warmup, donated params and state) is reported against that floor. On a 1-device mesh zero1 has
nothing to communicate, so this isolates its local overhead (flattening, slicing, padding, copies).

Standalone: imports only jax, optax, numpy and (if present) zero_optax; sets no device options.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

BYTES_PER_PARAM = 28  # params r+w 8, grads r 4, mu r+w 8, nu r+w 8 (float32)
AXIS = "data"


def leaf_shapes(n_params: int, n_leaves: int = 16) -> list[tuple[int, int]]:
    """A few large 2-D leaves totalling about ``n_params`` (8192 columns when big enough)."""
    per = max(1, n_params // n_leaves)
    cols = 8192 if per >= 8192 * 64 else max(1, min(256, per))
    rows = max(1, per // cols)
    return [(rows, cols)] * n_leaves


def random_tree(shapes: Sequence[tuple[int, ...]], seed: int, scale: float, lead: tuple[int, ...] = ()) -> list[jax.Array]:
    """Random float32 leaves generated on the default device (one jit per leaf keeps peaks low)."""
    key = jax.random.PRNGKey(seed)
    out = []
    for i, shape in enumerate(shapes):
        k = jax.random.fold_in(key, i)
        make = jax.jit(lambda k, s=lead + tuple(shape): scale * jax.random.normal(k, s, jnp.float32))
        out.append(make(k))
    jax.block_until_ready(out)
    return out


def time_calls(fn: Callable[[], Any], steps: int, warmup: int) -> list[float]:
    """Seconds per call of ``fn`` (which must block), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def copy_bandwidth(n_elems: int, steps: int, warmup: int) -> float:
    """Bytes/s of a jitted elementwise ``x + 1`` over ``n_elems`` float32 (read + write)."""
    x = jnp.zeros((n_elems,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)
    t = statistics.median(time_calls(lambda: f(x).block_until_ready(), steps, warmup))
    return 2 * 4 * n_elems / t


def _step(tx: optax.GradientTransformation) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
    def step(params: Any, grads: Any, state: Any) -> tuple[Any, Any]:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def run_optax(tx: optax.GradientTransformation, shapes: list, grads: list, steps: int, warmup: int) -> float:
    """Median step seconds of plain ``optax`` jitted with donated params and state."""
    params = random_tree(shapes, seed=0, scale=0.02)
    state = jax.jit(tx.init)(params)
    step = jax.jit(_step(tx), donate_argnums=(0, 2))
    box = [params, state]

    def one() -> None:
        box[0], box[1] = step(box[0], grads, box[1])
        jax.block_until_ready(box)

    t = statistics.median(time_calls(one, steps, warmup))
    return t


def run_zero1(tx: optax.GradientTransformation, shapes: list, grads: list, steps: int, warmup: int, **kw: Any) -> float:
    """Median step seconds of ``zo.zero1(tx, axis_name="data", **kw)`` under shard_map on a 1-device mesh."""
    import zero_optax as zo

    ztx = zo.zero1(tx, axis_name=AXIS, **kw)
    mesh = Mesh(np.array(jax.devices()[:1]), (AXIS,))
    rep, dat = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    params = jax.device_put(random_tree(shapes, seed=0, scale=0.02), rep)
    # This device's local gradient with the leading device axis (size 1) that P("data") splits.
    local = [jax.device_put(g.reshape((1, *g.shape)), dat) for g in grads]

    def step(params: Any, grads: Any, state: Any) -> tuple[Any, Any]:
        updates, state = ztx.update([g[0] for g in grads], state, params)
        return optax.apply_updates(params, updates), state

    init = jax.jit(jax.shard_map(ztx.init, mesh=mesh, in_specs=P(), out_specs=P(AXIS)))
    sm = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)), out_specs=(P(), P(AXIS)))
    jstep = jax.jit(sm, donate_argnums=(0, 2))
    box = [params, init(params)]

    def one() -> None:
        box[0], box[1] = jstep(box[0], local, box[1])
        jax.block_until_ready(box)

    t = statistics.median(time_calls(one, steps, warmup))
    return t


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_adamw", description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=1.07e9, help="approximate float32 parameter count")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default="optax,zero1,zero1_leaf")
    args = p.parse_args(argv)

    dev = jax.devices()[0]
    shapes = leaf_shapes(int(args.params))
    n = int(sum(np.prod(s) for s in shapes))
    tx = optax.adamw(3e-4, weight_decay=0.1)
    print(f"device: {dev.platform} {getattr(dev, 'device_kind', '')}; jax {jax.__version__}, optax {optax.__version__}")
    print(f"params: {n:,} float32 in {len(shapes)} leaves of {shapes[0]} ({n * 4 / 1e9:.2f} GB)", flush=True)

    bw = copy_bandwidth(n, args.steps, args.warmup)
    floor = BYTES_PER_PARAM * n / bw
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s -> floor {BYTES_PER_PARAM} B/param = {floor * 1e3:.2f} ms", flush=True)

    grads = random_tree(shapes, seed=1, scale=1e-2)
    runners: dict[str, Callable[[], float]] = {
        "optax": lambda: run_optax(tx, shapes, grads, args.steps, args.warmup),
        "zero1": lambda: run_zero1(tx, shapes, grads, args.steps, args.warmup),
        "zero1_leaf": lambda: run_zero1(tx, shapes, grads, args.steps, args.warmup, partition="leaf"),
    }
    rows: list[tuple[str, float | None, str]] = []
    for name in args.variants.split(","):
        try:
            t = runners[name]()
            rows.append((name, t, ""))
        except (ImportError, AttributeError) as e:
            rows.append((name, None, f"skipped: {type(e).__name__}: {e}"))
        print(f"  {name}: done", file=sys.stderr, flush=True)

    print(f"\n| variant | median step ms | effective GB/s ({BYTES_PER_PARAM} B/param) | x floor |")
    print("|---|---|---|---|")
    print(f"| floor ({bw / 1e9:.0f} GB/s copy) | {floor * 1e3:.2f} | {bw / 1e9:.0f} | 1.00 |")
    out = {"device": str(dev), "params": n, "copy_bandwidth": bw, "floor_s": floor, "rows": {}}
    for name, t, note in rows:
        if t is None:
            print(f"| {name} | {note} | | |")
            continue
        print(f"| {name} | {t * 1e3:.2f} | {BYTES_PER_PARAM * n / t / 1e9:.0f} | {t / floor:.2f} |")
        out["rows"][name] = t
    return out


if __name__ == "__main__":
    main()
