"""Command line: what a zero1 state, step and checkpoint cost on a mesh, computed without devices (`zo.plan`), and
whether they fit in a device's memory beside plain and GSPMD-sharded optax.

    python -m zero_optax.plan --params-from MODULE:FACTORY --mesh data=64,model=8 [--axis-name data]
        [--optimizer adamw] [--partition flat|leaf|auto] [--master-dtype float32] [--device-memory 80GB]
        [--activation-bytes 20GiB] [--json]
    python -m zero_optax.plan --params-from SHAPES.json --mesh data=256

`--params-from` names a factory (`package.module:function` or `path/to/file.py:function`) that builds a Flax NNX
model, or returns a tree of arrays; it runs under `nnx.eval_shape` with the mesh as the abstract mesh, so nothing is
allocated and `nnx.with_partitioning` annotations become the parameters' specs. Or it names a JSON file of shapes:
nested objects whose leaves are `{"shape": [...], "dtype": "bfloat16", "spec": [null, "model"]}` (dtype defaults to
float32, spec to replicated). Every figure is per device and per step; `--device-memory` (`80GB` is 80e9 bytes,
`16GiB` 16 * 2**30) adds whether each way of running fits, with `--activation-bytes` added to each. Bad input exits
with status 1 (2 for bad usage) and one line on stderr naming the flag. The module forwards calls, so
`zero_optax.plan(...)` stays callable once importing this submodule has replaced the attribute.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import pathlib
import re
import sys
import types
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P
from rich.console import Console
from rich.table import Table

from zero_optax._plan import MEMORY_COLUMNS, MEMORY_NOTE, Plan, abstract_mesh, parse_bytes
from zero_optax._plan import plan as _plan_fn
from zero_optax.checkpoint._offline import parse_axis_sizes

PROG = "python -m zero_optax.plan"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + message
        self.exit(2, f"{PROG}: error: {message} (see --help)\n")


def _is_shape(x: Any) -> bool:
    return isinstance(x, dict) and "shape" in x


def _from_json(path: str) -> tuple[Any, Any]:
    """The parameters (`ShapeDtypeStruct`s) and their specs described by a JSON file of shapes."""
    try:
        tree = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read --params-from file {path}: {e}") from None

    def struct(x):
        if not isinstance(x["shape"], list) or not all(isinstance(d, int) and d >= 0 for d in x["shape"]):
            raise ValueError(f"{path}: a shape must be a list of sizes, got {x['shape']!r}")
        return jax.ShapeDtypeStruct(tuple(x["shape"]), x.get("dtype", "float32"))

    def spec(x):
        entries = x.get("spec") or []
        return P(*[tuple(e) if isinstance(e, list) else e for e in entries])

    if not isinstance(tree, dict) or not jax.tree.leaves(tree, is_leaf=_is_shape):
        raise ValueError(f"{path} holds no parameter: give nested objects whose leaves are {{\"shape\": [...]}}")
    return jax.tree.map(struct, tree, is_leaf=_is_shape), jax.tree.map(spec, tree, is_leaf=_is_shape)


def _factory(name: str):
    """The object `module:attr` (or `path/to/file.py:attr`) names."""
    where, _, attr = name.rpartition(":")
    if not where or not attr:
        raise ValueError(f"--params-from {name!r}: give MODULE:FACTORY, FILE.py:FACTORY or a .json file of shapes")
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(pathlib.Path(where).stem, where)
        if spec is None or spec.loader is None or not pathlib.Path(where).is_file():
            raise ValueError(f"--params-from: no such file {where}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ValueError(f"--params-from: cannot import {where}: {e}") from None
    if not hasattr(module, attr):
        raise ValueError(f"--params-from: {where} has no {attr!r}")
    return getattr(module, attr)


def load_params(source: str, mesh) -> tuple[Any, Any]:
    """The parameters `--params-from` describes, as `ShapeDtypeStruct`s, and their specs (None: their shardings)."""
    if source.endswith(".json"):
        return _from_json(source)
    from flax import nnx

    factory = _factory(source)
    with jax.sharding.use_abstract_mesh(mesh):
        out = nnx.eval_shape(factory if callable(factory) else lambda: factory)
    if isinstance(out, nnx.Module):
        out = nnx.to_pure_dict(nnx.state(out, nnx.Param))
    return out, None


def _optimizer(name: str) -> optax.GradientTransformation:
    """`optax.<name>` or `optax.contrib.<name>`, built with a learning rate (which costs nothing)."""
    make = getattr(optax, name, None) or getattr(optax.contrib, name, None)
    tx = make(learning_rate=1e-3) if callable(make) else None
    if not isinstance(tx, optax.GradientTransformation):
        raise ValueError(f"--optimizer {name!r} is no optimizer of optax or optax.contrib")
    return tx


def _figures(p: Plan) -> Table:
    """The layout's, the step's and the checkpoint's figures (`Plan.figure_rows`)."""
    table = Table(title="zero1 plan", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in p.figure_rows():
        table.add_row(key, value)
    return table


def _memory(p: Plan) -> Table:
    """Per device, per step, zero1 beside replicated and GSPMD-sharded optax (`Plan.memory_rows`)."""
    mesh = ", ".join(f"{a}={s}" for a, s in p.axis_sizes.items())
    table = Table(title=f"memory per device, per step ({mesh})", caption=MEMORY_NOTE)
    table.add_column("per device, per step", style="bold")
    for title in MEMORY_COLUMNS.values():
        table.add_column(title, justify="right")
    for label, cells in p.memory_rows():
        table.add_row(label, *cells)
    return table


_FLAGS = {"axis_name": "--axis-name", "replica_axis": "--replica-axis", "master_dtype": "--master-dtype",
          "accumulate_steps": "--accumulate-steps", "partition": "--partition",
          "device_memory": "--device-memory", "activation_bytes": "--activation-bytes"}
_OPTION = re.compile(r"`?\b(" + "|".join(_FLAGS) + r")\b`?(=?)")


def flag_names(message: str) -> str:
    """`message` with the options of `zo.plan` it names (`axis_name=`, `` `master_dtype` ``) named as flags.

    Examples:
      >>> flag_names("The mesh has axes ('data', 'model'): pass axis_name= (the data-parallel axis).")
      "The mesh has axes ('data', 'model'): pass --axis-name (the data-parallel axis)."
    """
    return _OPTION.sub(lambda m: _FLAGS[m[1]] + (" " if m[2] else ""), message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Plan a zero1 state, step and checkpoint on a mesh, without devices: "
                                            "bytes per device, per step, beside plain and GSPMD-sharded optax.")
    parser.add_argument("--params-from", required=True,
                        help="MODULE:FACTORY or FILE.py:FACTORY (a Flax NNX model or a tree of arrays), or a JSON "
                             "file of shapes")
    parser.add_argument("--mesh", required=True, help="the mesh, every axis: NAME=SIZE,... (data=64,model=8)")
    parser.add_argument("--axis-name", help="the axis (or comma-separated axes) zero1 shards the state over; "
                                            "default: the mesh's only axis")
    parser.add_argument("--optimizer", default="adamw", help="an optax or optax.contrib optimizer (default adamw)")
    parser.add_argument("--partition", default="flat", choices=("flat", "leaf", "auto"))
    parser.add_argument("--master-dtype", help="keep master copies in this dtype (float32)")
    parser.add_argument("--replica-axis", help="axes the state is replicated over (comma-separated)")
    parser.add_argument("--accumulate-steps", type=int, default=1)
    parser.add_argument("--device-memory", help="one device's memory (80GB = 80e9 bytes, 16GiB = 16 * 2**30): say "
                                                "whether each way of running fits")
    parser.add_argument("--activation-bytes", help="the activations per device (the same forms), added to each "
                                                   "total; default: not counted")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser


def _options(args: argparse.Namespace, mesh: Any) -> dict[str, Any]:
    """The keyword arguments of `zo.plan` the flags give, checked so that an error names its flag."""
    if not args.axis_name and len(mesh.axis_names) != 1:
        raise ValueError(f"the mesh has axes {tuple(mesh.axis_names)}: pass --axis-name (the data-parallel axis "
                         "or comma-separated axes zero1 shards the state over)")
    options: dict[str, Any] = {"partition": args.partition, "accumulate_steps": args.accumulate_steps,
                               "device_memory": parse_bytes(args.device_memory, "--device-memory"),
                               "activation_bytes": parse_bytes(args.activation_bytes, "--activation-bytes")}
    for name, value in (("axis_name", args.axis_name), ("replica_axis", args.replica_axis)):
        if value:
            options[name] = value if "," not in value else tuple(value.split(","))
    if args.master_dtype:
        try:
            options["master_dtype"] = jnp.dtype(args.master_dtype)
        except TypeError:
            raise ValueError(f"--master-dtype {args.master_dtype!r} is no dtype (float32, bfloat16, ...)") from None
    return options


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        mesh = abstract_mesh(parse_axis_sizes(args.mesh, "--mesh"))
        options = _options(args, mesh)
        params, specs = load_params(args.params_from, mesh)
        result = _plan_fn(_optimizer(args.optimizer), params, mesh=mesh, param_specs=specs, **options)
    except (ValueError, TypeError, OSError) as e:  # ZeroError is a ValueError
        print(f"{PROG}: error: {flag_names(' '.join(str(e).split()))}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.as_dict(), indent=1))
    else:
        console = Console() if sys.stdout.isatty() else Console(width=160)
        console.print(_figures(result))
        console.print(_memory(result))
    return 0


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return _plan_fn(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
