"""Benchmark entry point: ``python -m benchmarks.run [--quick] [--out DIR] ...`` from the repo root.

For each optimizer (AdamW, Muon) and variant (see ``benchmarks/variants.py``) it measures, on a
1-D "data" mesh of simulated CPU devices:

* compile time (``lower`` + ``compile`` of the step);
* collective bytes by kind in the optimized HLO and the wire volume (x parameter bytes);
* max per-device optimizer-state bytes and the ratio to the ideal ``replicated / N`` (for
  ``zero1_leaf`` and ``zero1_auto`` also to their bound ``sliced / N + max(owned / N, largest owned leaf)``,
  the best placement that keeps owned leaves whole, ``max(ideal, largest leaf's state)`` for ``zero1_leaf``);
* median step time over interleaved rounds (round-robin over variants) and the ratio to gspmd;
* a one-step agreement check: max |params - replicated variant's params| after one step;
* scaling over N = 1, 2, 4, 8 (sub-meshes of the first N devices): state bytes and step time.

Outputs a markdown table on stdout, ``<out>/results.json``, ``<out>/bytes_vs_n.png`` and
``<out>/step_time_vs_n.png``.
"""

# Must run before any JAX backend is initialised: N simulated CPU devices.
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ.get("BENCH_NUM_CPU_DEVICES", "8")))

import argparse
import gc
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from benchmarks.memory import (
    partition_bound_bytes,
    replicated_state_bytes,
    state_bytes_per_device,
)
from benchmarks.model import gpt_params, param_count, per_device_grads, tree_bytes
from benchmarks.variants import (
    VARIANTS,
    Variant,
    VariantUnavailable,
    gspmd_state_specs,
    make_mesh,
    optimizers,
)
from benchmarks.hlo import KINDS, collective_bytes, wire_volume

MB = 1024 * 1024
_SKIP_REPORTED: set[str] = set()


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line flags; ``--quick`` shrinks everything to a smoke test."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--mlp-ratio", type=int, default=4)
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds at the largest N")
    p.add_argument("--steps", type=int, default=5, help="max steps per timing sample")
    p.add_argument(
        "--sample-target-s",
        type=float,
        default=1.0,
        help="fewer steps per sample (down to 1) when a step is slower than target/steps",
    )
    p.add_argument("--scaling-ns", default="1,2,4,8", help="device counts for the scaling sweep")
    p.add_argument("--scaling-rounds", type=int, default=3)
    p.add_argument("--scaling-steps", type=int, default=3)
    p.add_argument("--optimizers", default="adamw,muon,muon_recipe")
    p.add_argument("--variants", default=",".join(v.name for v in VARIANTS))
    p.add_argument("--quick", action="store_true", help="tiny sizes and few rounds (smoke test)")
    p.add_argument("--out", default=os.path.join("benchmarks", "out"))
    args = p.parse_args(argv)
    if args.quick:
        args.vocab, args.d_model, args.layers = 512, 64, 2
        args.rounds, args.steps = 3, 2
        args.scaling_rounds, args.scaling_steps = 2, 2
        args.scaling_ns = "2,8"
    return args


# ----------------------------------------------------------------------------- measurement


def _block(tree: Any) -> None:
    jax.block_until_ready(tree)


def _max_abs_diff(a: Any, b: Any) -> float:
    diffs = jax.tree_util.tree_map(
        lambda x, y: float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))),
        a,
        b,
    )
    return max(jax.tree_util.tree_leaves(diffs), default=0.0)


def _describe_gspmd(tx: optax.GradientTransformation, params: Any, n: int) -> dict[str, Any]:
    """Which state leaves the gspmd variant shards, and how many bytes stay replicated."""
    abstract = jax.eval_shape(tx.init, params)
    specs = gspmd_state_specs(tx, params, n)
    flat_a = jax.tree_util.tree_leaves_with_path(abstract)
    flat_s = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    sharded, replicated = [], []
    for (path, a), spec in zip(flat_a, flat_s):
        nbytes = int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
        entry = {"path": jax.tree_util.keystr(path), "shape": list(a.shape), "bytes": nbytes, "spec": str(spec)}
        (sharded if spec != P() else replicated).append(entry)
    return {
        "sharded_leaves": len(sharded),
        "replicated_leaves": len(replicated),
        "sharded_bytes": sum(e["bytes"] for e in sharded),
        "replicated_bytes": sum(e["bytes"] for e in replicated),
        "replicated": replicated,
    }


def run_config(
    n: int,
    opt_name: str,
    tx: optax.GradientTransformation,
    params: Any,
    variants: Sequence[Variant],
    rounds: int,
    steps: int,
    sample_target_s: float,
) -> list[dict[str, Any]]:
    """Build, compile, check and time every variant for one (N, optimizer); one record each."""
    mesh = make_mesh(n)
    pbytes = tree_bytes(params)
    repl_bytes = replicated_state_bytes(tx, params)
    ideal = repl_bytes / n
    grads = per_device_grads(params, mesh)

    live: dict[str, dict[str, Any]] = {}
    records: dict[str, dict[str, Any]] = {}
    reference = None
    for v in variants:
        rec: dict[str, Any] = {"optimizer": opt_name, "variant": v.name, "n": n, "status": "ok"}
        records[v.name] = rec
        try:
            built = v.build(tx, mesh, params)
            p = jax.device_put(params, built.param_sharding)  # fresh buffers: the step donates them
            s = built.init(p)
            _block(s)
            t0 = time.perf_counter()
            compiled = built.step.lower(p, grads, s).compile()
            rec["compile_s"] = time.perf_counter() - t0
            by_kind = collective_bytes(compiled)
            rec["collective_bytes"] = by_kind
            rec["wire_volume"] = wire_volume(by_kind, pbytes)
            per_dev = state_bytes_per_device(s)
            rec["state_bytes_max"] = max(per_dev.values()) if per_dev else 0
            rec["state_bytes_min"] = min(per_dev.values()) if per_dev else 0
            rec["state_bytes_ideal"] = ideal
            rec["state_ratio_ideal"] = rec["state_bytes_max"] / ideal
            if v.name in ("zero1_leaf", "zero1_auto"):
                import zero_optax as zo  # pylint: disable=import-outside-toplevel

                layout = zo.describe(s)
                rec["leaf_bound_bytes"] = partition_bound_bytes(layout)
                rec["state_ratio_leaf_bound"] = rec["state_bytes_max"] / rec["leaf_bound_bytes"]
                rec["owned_leaves"] = sum(not leaf.sliced for leaf in layout.leaves)
            if v.name == "gspmd":
                rec["gspmd_state"] = _describe_gspmd(tx, params, n)
            # Step 1 from identical params/grads: agreement with plain data parallelism.
            p, s = compiled(p, grads, s)
            _block((p, s))
            if v.name == "replicated":
                reference = jax.tree_util.tree_map(np.asarray, p)
            elif reference is not None:
                rec["max_abs_diff_vs_replicated"] = _max_abs_diff(p, reference)
            # Step 2 (warm): pick how many steps make one timing sample.
            t0 = time.perf_counter()
            p, s = compiled(p, grads, s)
            _block((p, s))
            warm = time.perf_counter() - t0
            rec["steps_per_sample"] = max(1, min(steps, int(sample_target_s / max(warm, 1e-9))))
            rec["step_s_samples"] = []
            live[v.name] = {"compiled": compiled, "p": p, "s": s}
        except VariantUnavailable as e:
            rec.update(status="skipped", reason=str(e))
            if v.name not in _SKIP_REPORTED:
                print(f"{v.name}: skipped: {e}", file=sys.stderr, flush=True)
                _SKIP_REPORTED.add(v.name)
        except Exception as e:  # a half-written zero1 must not take the baselines down with it
            if not v.zero1:
                raise
            reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            # zero_optax's own errors are deliberate refusals (e.g. flat slices cannot run Muon).
            deliberate = type(e).__module__.startswith("zero_optax")
            rec.update(status="n/a" if deliberate else "error", reason=reason)
            key = f"{v.name}/{opt_name}"
            if key not in _SKIP_REPORTED:
                _SKIP_REPORTED.add(key)
                print(f"{v.name} [{opt_name}]: {rec['status']}: {reason}", file=sys.stderr, flush=True)
                if not deliberate:
                    traceback.print_exc(limit=4, file=sys.stderr)

    # Interleaved timing: round-robin over variants, rotating the starting variant each round.
    names = list(live)
    for r in range(rounds):
        for name in names[r % max(len(names), 1) :] + names[: r % max(len(names), 1)]:
            st, rec = live[name], records[name]
            k = rec["steps_per_sample"]
            c, p, s = st["compiled"], st["p"], st["s"]
            t0 = time.perf_counter()
            for _ in range(k):
                p, s = c(p, grads, s)
            _block((p, s))
            rec["step_s_samples"].append((time.perf_counter() - t0) / k)
            st["p"], st["s"] = p, s

    for name in names:
        rec = records[name]
        rec["step_s_median"] = statistics.median(rec["step_s_samples"])
    gs = records.get("gspmd", {}).get("step_s_median")
    for name in names:
        if gs:
            records[name]["step_ratio_gspmd"] = records[name]["step_s_median"] / gs
    del live, grads, reference
    gc.collect()
    return [records[v.name] for v in variants]


# ----------------------------------------------------------------------------- reporting


def _fmt(x: Any, spec: str = ".2f", scale: float = 1.0) -> str:
    return "-" if x is None else format(x / scale, spec)


def main_table(records: list[dict[str, Any]]) -> str:
    """Markdown table of the largest-N results."""
    head = (
        "| optimizer | variant | compile s | all-reduce MB | all-gather MB | reduce-scatter MB "
        "| other coll. MB | wire (x P) | state MB/dev | x ideal | x leaf bound | step ms | x gspmd "
        "| max abs diff vs repl |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        if r["status"] != "ok":
            lines.append(f"| {r['optimizer']} | {r['variant']} | {r['status']}: {r.get('reason', '')[:80]} |")
            continue
        b = r["collective_bytes"]
        other = b["all-to-all"] + b["collective-permute"]
        lines.append(
            "| "
            + " | ".join(
                [
                    r["optimizer"],
                    r["variant"],
                    _fmt(r["compile_s"]),
                    _fmt(b["all-reduce"], ".2f", MB),
                    _fmt(b["all-gather"], ".2f", MB),
                    _fmt(b["reduce-scatter"], ".2f", MB),
                    _fmt(other, ".2f", MB),
                    _fmt(r["wire_volume"]),
                    _fmt(r["state_bytes_max"], ".2f", MB),
                    _fmt(r["state_ratio_ideal"]),
                    _fmt(r.get("state_ratio_leaf_bound")),
                    _fmt(r["step_s_median"], ".1f", 1e-3),
                    _fmt(r.get("step_ratio_gspmd")),
                    _fmt(r.get("max_abs_diff_vs_replicated"), ".1e"),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def scaling_table(records: list[dict[str, Any]], ns: list[int]) -> str:
    """Markdown table: per (optimizer, variant), ``state MB/dev / step ms`` for each N."""
    head = "| optimizer | variant | " + " | ".join(f"N={n}: MB/dev, ms" for n in ns) + " |"
    lines = [head, "|" + "---|" * (len(ns) + 2)]
    keys = list(dict.fromkeys((r["optimizer"], r["variant"]) for r in records))
    for opt, var in keys:
        cells = []
        for n in ns:
            r = next((x for x in records if (x["optimizer"], x["variant"], x["n"]) == (opt, var, n)), None)
            if r is None or r["status"] != "ok":
                cells.append("-" if r is None else r["status"])
            else:
                cells.append(f"{r['state_bytes_max'] / MB:.2f}, {r['step_s_median'] * 1e3:.1f}")
        lines.append(f"| {opt} | {var} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def make_plots(records: list[dict[str, Any]], ns: list[int], opt_names: list[str], out: str) -> list[str]:
    """``bytes_vs_n.png`` and ``step_time_vs_n.png`` (one panel per optimizer)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    palette = matplotlib.colormaps["tab20"]  # more variants than the 10 default colours, one each
    colors = {v.name: palette(i % palette.N) for i, v in enumerate(VARIANTS)}  # same colour per variant everywhere
    platform = jax.devices()[0].platform
    paths = []
    for fname, key, ylabel, scale in (
        ("bytes_vs_n.png", "state_bytes_max", "max optimizer-state MB per device", MB),
        ("step_time_vs_n.png", "step_s_median", "median step time (ms)", 1e-3),
    ):
        fig, axes = plt.subplots(1, len(opt_names), figsize=(6 * len(opt_names), 4.5), squeeze=False)
        for ax, opt in zip(axes[0], opt_names):
            rows = [r for r in records if r["optimizer"] == opt and r["status"] == "ok"]
            for var in dict.fromkeys(r["variant"] for r in rows):
                pts = sorted((r["n"], r[key] / scale) for r in rows if r["variant"] == var)
                ax.plot(
                    [x for x, _ in pts], [y for _, y in pts], marker="o", label=var, color=colors.get(var)
                )
            if key == "state_bytes_max" and rows:
                ideal = sorted({(r["n"], r["state_bytes_ideal"] / MB) for r in rows})
                ax.plot([x for x, _ in ideal], [y for _, y in ideal], "k--", label="ideal (replicated/N)")
            ax.set_yscale("log")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns, [str(n) for n in ns])
            ax.set_xlabel("data-parallel devices N")
            ax.set_ylabel(ylabel)
            ax.set_title(opt)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(
            f"{len(jax.devices())} simulated {platform} devices sharing {os.cpu_count()} cores"
            if platform == "cpu"
            else f"{platform} devices",
            fontsize=9,
        )
        fig.tight_layout()
        path = os.path.join(out, fname)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the results dict also written to ``<out>/results.json``."""
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    n_dev = len(jax.devices())
    ns = sorted({int(x) for x in args.scaling_ns.split(",") if int(x) <= n_dev} | {n_dev})
    opts = {k: v for k, v in optimizers().items() if k in args.optimizers.split(",")}
    wanted = args.variants.split(",")
    variants = [v for v in VARIANTS if v.name in wanted]
    params = jax.tree_util.tree_map(
        np.asarray, gpt_params(args.vocab, args.d_model, args.layers, args.mlp_ratio)
    )
    pbytes = tree_bytes(params)
    print(
        f"# zero_optax benchmarks: {n_dev} x {jax.devices()[0].platform} devices, "
        f"jax {jax.__version__}, optax {optax.__version__}",
        flush=True,
    )
    print(
        f"model: vocab={args.vocab} d_model={args.d_model} layers={args.layers} "
        f"-> {param_count(params):,} params, {pbytes / MB:.2f} MB",
        flush=True,
    )
    for name, tx in opts.items():
        print(f"{name}: replicated state {replicated_state_bytes(tx, params) / MB:.2f} MB", flush=True)

    records: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for n in sorted(ns, reverse=True):  # largest N first: it is the headline table
        main_n = n == n_dev
        for name, tx in opts.items():
            t0 = time.perf_counter()
            recs = run_config(
                n,
                name,
                tx,
                params,
                variants,
                rounds=args.rounds if main_n else args.scaling_rounds,
                steps=args.steps if main_n else args.scaling_steps,
                sample_target_s=args.sample_target_s,
            )
            records.extend(recs)
            print(f"  [N={n} {name}: {time.perf_counter() - t0:.1f}s]", file=sys.stderr, flush=True)

    headline = [r for r in records if r["n"] == n_dev]
    print(f"\n## N = {n_dev} (wire volume in units of the parameter bytes; plain DP = 2.0)\n")
    print(main_table(headline))
    print("\n## Scaling (max state MB per device, median step ms)\n")
    print(scaling_table(records, ns))
    for r in headline:
        if r["variant"] == "gspmd" and r["status"] == "ok":
            g = r["gspmd_state"]
            repl = ", ".join(f"{e['path']} {tuple(e['shape'])}" for e in g["replicated"][:6])
            print(
                f"\ngspmd/{r['optimizer']}: {g['sharded_leaves']} state leaves sharded "
                f"({g['sharded_bytes'] / MB:.2f} MB), {g['replicated_leaves']} replicated "
                f"({g['replicated_bytes']} B): {repl}"
            )

    plots = make_plots(records, ns, list(opts), args.out)
    result = {
        "config": vars(args),
        "devices": n_dev,
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "optax": optax.__version__,
        "param_count": param_count(params),
        "param_bytes": pbytes,
        "replicated_state_bytes": {k: replicated_state_bytes(tx, params) for k, tx in opts.items()},
        "collective_kinds": list(KINDS),
        "ns": ns,
        "records": records,
        "wall_s": time.perf_counter() - t_start,
    }
    path = os.path.join(args.out, "results.json")
    with open(path, "w") as f:
        json.dump(_jsonable(result), f, indent=1)
    print(f"\nwrote {path}, {', '.join(plots)} ({result['wall_s']:.0f}s)")
    return result


if __name__ == "__main__":
    main()
