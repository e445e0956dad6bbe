"""`zo.plan`: what a zero1 state and step cost on a mesh, before the devices exist: its `Layout`, bytes per device,
bytes each step moves per mesh axis, and the checkpoint's size. Everything is traced abstractly, on an
`AbstractMesh`; nothing is compiled, allocated or placed on a device."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zero_optax.analysis import _programs
from zero_optax.api import _bound
from zero_optax.api._zero1 import as_local, zero1
from zero_optax.checkpoint import _arrays, _record
from zero_optax.core import _compat
from zero_optax.core._errors import ZeroError
from zero_optax.layout import _keys, _specs
from zero_optax.layout._layout import Layout
from zero_optax.layout._state import find_states
from zero_optax.layout._stored import spec_axes
from zero_optax.step._wire import DEFAULT_BUCKET_BYTES

MEMORY_COLUMNS = {"zero1": "zero1", "replicated": "replicated optax", "gspmd": "GSPMD-sharded optax"}
"""The ways of running the optimizer `Plan.memory` compares, and their column titles."""


@dataclasses.dataclass(frozen=True)
class Footprint:
    """What one way of running the optimizer holds on each device during one step, in bytes; activations apart.

    Attributes:
      parameters: the parameters' shards on one device: whole where replicated over the data axes, cut by their
        specs over the others (tensor parallel).
      gradients: the gradients' shards, in the parameters' dtypes as `jax.grad` returns them (zero1 sums them in
        `reduce_dtype` bucket by bucket, inside `temporaries`).
      state: the optimizer state on one device: zero1's stored inner state (the padding of its packed buffers
        included); optax's whole state (replicated) or its shards (GSPMD-sharded).
      master: zero1's master copies (`master_dtype`); 0 for optax.
      accumulators: gradient accumulators (`accumulate_steps > 1`): zero1's; for optax those of
        `optax.MultiSteps`, a parameter tree in the parameters' dtypes, placed like the state.
      temporaries: zero1's bound on the buffers its step adds (see `zo.plan`); 0 for optax, whose temporaries
        only a compile knows.
      host: zero1 keeps its state in host memory (`offload=True`): state, master copies and accumulators are
        not in `total`.

    Examples:
      >>> Footprint(parameters=8, gradients=8, state=4, temporaries=2).total
      22
    """

    parameters: int
    gradients: int
    state: int
    master: int = 0
    accumulators: int = 0
    temporaries: int = 0
    host: bool = False

    @property
    def stored(self) -> int:
        """The optimizer's own arrays: state, master copies and accumulators."""
        return self.state + self.master + self.accumulators

    @property
    def total(self) -> int:
        """The device bytes of one step, activations apart: everything but what lives in host memory."""
        return self.parameters + self.gradients + self.temporaries + (0 if self.host else self.stored)

    def as_dict(self) -> dict[str, int | bool]:
        """The figures and `total`, as plain values."""
        return dataclasses.asdict(self) | {"total": self.total}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `zo.plan` found: the layout `init` would build and what the state and the step cost, per device.

    Attributes:
      layout: the `Layout` that `tx.init` builds on this mesh (`zo.describe(state)` of the real state).
      axis_sizes: the mesh, `{axis: size}`.
      stored_bytes: bytes of zero1 state every device holds (the shards of its arrays, padding included).
      state_bytes, master_bytes, accumulator_bytes: per device along the ZeRO axes, the bytes of its inner state,
        master copies and gradient accumulators (without padding).
      wire: per mesh axis (axes joined by `+` for a collective over several), bytes per device of each collective
        kind one `update` runs: the full tensor of each (the all-reduced buffer, the gathered result, the
        un-scattered operand), as in the compiled HLO.
      largest_collective: the largest buffer one collective of the step reads or writes, per device.
      checkpoint_bytes: the bytes of the arrays a checkpoint of the state stores (`zo.ZeroSave`), uncompressed.
      checkpoint_arrays: how many arrays it stores (zarr arrays in one OCDBT store, beside the record).
      record_bytes: the size of its record, `zero_record.json`, for a state whose step counts are zero.
      memory: per device, per step, a `Footprint` for each way of running the optimizer (`MEMORY_COLUMNS`):
        `"zero1"`, `"replicated"` (plain optax data parallel) and `"gspmd"` (optax's state leaves sharded over
        the ZeRO axes on their first divisible dimension, MaxText style).
      device_memory: the bytes of one device's memory the plan was asked about, or None.
      activation_bytes: the activations' bytes per device the verdicts add (0 unless given).
    """

    layout: Layout
    axis_sizes: dict[str, int]
    stored_bytes: int
    state_bytes: tuple[int, ...]
    master_bytes: tuple[int, ...]
    accumulator_bytes: tuple[int, ...]
    wire: dict[str, dict[str, int]]
    largest_collective: int
    checkpoint_bytes: int
    checkpoint_arrays: int
    record_bytes: int
    memory: dict[str, Footprint] = dataclasses.field(default_factory=dict)
    device_memory: int | None = None
    activation_bytes: int = 0

    def describe(self) -> Layout:
        """The layout, as `zo.describe(state)` returns it for the real state."""
        return self.layout

    @property
    def headroom(self) -> dict[str, int] | None:
        """Per column of `memory`, `device_memory` less its total and the activations (negative: over); None
        without `device_memory`."""
        if self.device_memory is None:
            return None
        return {k: self.device_memory - f.total - self.activation_bytes for k, f in self.memory.items()}

    @property
    def fits(self) -> dict[str, bool] | None:
        """Per column of `memory`, whether its total and the activations fit in `device_memory`; None without it."""
        headroom = self.headroom
        return None if headroom is None else {k: h >= 0 for k, h in headroom.items()}

    def as_dict(self) -> dict[str, Any]:
        """The figures (not the layout's leaves) as plain JSON values."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "layout"}
        out["memory"] = {k: f.as_dict() for k, f in self.memory.items()}
        layout = self.layout
        out.update(partition=layout.partition, axis_name=layout.axis_name, world_size=layout.world_size,
                   parameters=sum(math.prod(leaf.shape) * leaf.blocks for leaf in layout.leaves),
                   leaves=len(layout.leaves), owned_leaves=sum(not leaf.sliced for leaf in layout.leaves),
                   fits=self.fits, headroom=self.headroom)
        return json.loads(json.dumps(out))

    def figure_rows(self) -> list[tuple[str, str]]:
        """The layout's, the step's and the checkpoint's figures, as `(label, value)` rows."""
        d = self.as_dict()
        mesh = ", ".join(f"{a}={s}" for a, s in self.axis_sizes.items())
        rows = [("mesh", f"{mesh} (bytes per device, per step)"),
                ("zero1", f"partition={d['partition']} axis={d['axis_name']} ({d['world_size']} devices)"),
                ("parameters", f"{d['parameters']:,} in {d['leaves']} leaves ({d['owned_leaves']} owned whole)"),
                ("stored per device", _size(self.stored_bytes))]
        for name, values in (("inner state", self.state_bytes), ("master copies", self.master_bytes),
                             ("accumulators", self.accumulator_bytes)):
            if any(values):
                rows.append((f"{name} per device", _span(values)))
        for axes, kinds in self.wire.items():
            moved = ", ".join(f"{k} {_size(b)}" for k, b in kinds.items())
            rows.append((f"step moves over {axes}", f"{moved} (per device, per step)"))
        rows += [("largest collective buffer", f"{_size(self.largest_collective)} (per device)"),
                 ("checkpoint", f"{_size(self.checkpoint_bytes)} in {self.checkpoint_arrays} arrays, record "
                                f"{_size(self.record_bytes)}")]
        return rows

    def memory_rows(self) -> list[tuple[str, tuple[str, ...]]]:
        """The memory table: per row (parameters, gradients, ..., total, the verdict) one cell per column of
        `MEMORY_COLUMNS`, per device, per step."""
        cols = [self.memory[k] for k in MEMORY_COLUMNS]
        zero1_only = ("-",) * (len(cols) - 1)

        def row(label: str, name: str) -> tuple[str, tuple[str, ...]]:
            return label, tuple(_size(getattr(f, name)) + (" (host)" if f.host and name in _HOSTED else "")
                                for f in cols)

        rows = [row("parameters", "parameters"), row("gradients", "gradients"), row("optimizer state", "state"),
                row("master copies", "master"), row("accumulators", "accumulators"),
                ("step temporaries (bound)", (_size(cols[0].temporaries), *zero1_only))]
        if self.activation_bytes:
            rows.append(("activations (given)", (_size(self.activation_bytes),) * len(cols)))
        rows.append(("total", tuple(_size(f.total + self.activation_bytes) for f in cols)))
        if self.headroom is not None:
            rows.append((f"fits in {_capacity(self.device_memory or 0)}",
                         tuple(_verdict(self.headroom[k]) for k in MEMORY_COLUMNS)))
        return rows

    def summary(self) -> str:
        """The figures as a short text table, then the memory table (`memory_rows`)."""
        rows = self.figure_rows()
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        table = [("per device, per step", tuple(MEMORY_COLUMNS.values())), *self.memory_rows()]
        widths = [max(len(r[0]) for r in table)] + [max(len(r[1][c]) for r in table)
                                                     for c in range(len(MEMORY_COLUMNS))]
        lines.append("")
        for label, cells in table:
            lines.append("  ".join([f"{label:<{widths[0]}}"] + [f"{c:>{w}}" for c, w in zip(cells, widths[1:])]))
        lines.append(MEMORY_NOTE)
        return "\n".join(lines)


_HOSTED = frozenset({"state", "master", "accumulators"})

MEMORY_NOTE = ("Activations are not included unless given; optax's step temporaries are known only to a compile; "
               "zero1's are a bound on the buffers its step adds, not a measurement.")


def _size(n: int) -> str:
    """`n` bytes in decimal units (1 GB = 1e9 bytes)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} B"


def _span(values: tuple[int, ...]) -> str:
    """The range of per-device figures, one value where every device has the same."""
    low, high = min(values), max(values)
    return _size(low) if _size(low) == _size(high) else f"{_size(low)} to {_size(high)}"


def _capacity(n: int) -> str:
    """A device's memory: in decimal units, and in binary ones where it is a whole number of MiB."""
    if n % 2**20 or n % 10**6 == 0:
        return _size(n)
    unit, scale = ("GiB", 2**30) if n >= 2**30 else ("MiB", 2**20)
    return f"{n / scale:g} {unit} ({_size(n)})"


def _verdict(headroom: int) -> str:
    return f"yes, {_size(headroom)} free" if headroom >= 0 else f"no, {_size(-headroom)} over"


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(value: int | str | None, name: str) -> int | None:
    """A size in bytes: an int, or a string like `"80GB"` (decimal: kB, MB, GB, TB) or `"16GiB"` (binary: KiB,
    MiB, GiB, TiB); None stays None.

    Args:
      value: the size.
      name: what to call it in an error (`"device_memory"`, or a command line's `"--device-memory"`).

    Raises:
      ZeroError: `value` is no such size.

    Examples:
      >>> parse_bytes("80GB", "device_memory"), parse_bytes("16 GiB", "device_memory"), parse_bytes(512, "x")
      (80000000000, 17179869184, 512)
    """
    if value is None:
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0:
        return int(value)
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if match is None or match.group(2).lower() not in _UNITS:
        raise ZeroError(f"{name} must be a number of bytes or a size such as 80GB or 16GiB (decimal kB, MB, GB, TB "
                        f"or binary KiB, MiB, GiB, TiB), got {value!r}.")
    return round(float(match.group(1)) * _UNITS[match.group(2).lower()])


_ZERO1_OPTIONS = frozenset(inspect.signature(zero1).parameters) - {"inner", "mesh"}


def abstract_mesh(mesh: Any) -> AbstractMesh:
    """`mesh` (a `Mesh`, an `AbstractMesh` or a mapping of axis sizes) as an `AbstractMesh`."""
    if isinstance(mesh, AbstractMesh):
        return mesh
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh.abstract_mesh
    if isinstance(mesh, Mapping) and mesh and all(isinstance(a, str) and a for a in mesh) and all(
            isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 1 for s in mesh.values()):
        return AbstractMesh(tuple(int(s) for s in mesh.values()), tuple(mesh))
    raise ZeroError(f"`mesh` must be a jax.sharding.AbstractMesh, a Mesh, or a mapping of axis names to sizes such "
                    f"as {{'data': 64, 'model': 8}}, got {mesh!r}.")


def _structs(params: Any, mesh: AbstractMesh, param_specs: Any) -> tuple[Any, Any]:
    """The parameters as `ShapeDtypeStruct`s sharded over `mesh`, and their specs (given, else their shardings')."""
    params = _compat.as_arrays(_compat.pure(params), "zo.plan", abstract=True)
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    bad = [(path, x) for path, x in leaves if not hasattr(x, "shape") or not hasattr(x, "dtype")]
    if bad:
        path, x = bad[0]
        where = f" at {jax.tree_util.keystr(path)}" if path else ""
        raise ZeroError(f"`params` must hold arrays, jax.ShapeDtypeStructs, Python floats or None, got a "
                        f"{type(x).__name__}{where}.")
    specs = _bound.param_specs(params, mesh) if param_specs is None else param_specs
    specs = _specs.broadcast_specs(specs, params)
    structs = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=NamedSharding(mesh, s)),
                           params, specs)
    return structs, specs


def plan(inner: optax.GradientTransformation, params: Any, *, mesh: Any, param_specs: Any = None,
         device_memory: int | str | None = None, activation_bytes: int | str | None = None,
         **zero1_options: Any) -> Plan:
    """What `zero1(inner, **zero1_options)` costs on `mesh`, computed without devices, and whether it fits.

    The state is laid out as `init` lays it out and the step traced as `update` runs it inside `jax.shard_map`
    (per-device gradients reduced by zero1), both on an `AbstractMesh`: nothing is compiled, allocated or placed
    on a device, so a pod that is not there yet can be planned on a laptop.

    `plan.memory` holds, per device and per step, the parameters, gradients, optimizer state, master copies,
    accumulators and step temporaries of zero1, and beside them of plain optax replicated over the data axes and
    of optax with its state sharded GSPMD style (each state leaf cut over the ZeRO axes on its first dimension
    they divide, else replicated; a leaf that mirrors a parameter keeps that parameter's tensor-parallel spec).
    zero1's `temporaries` is a bound on the buffers its step adds, not a measurement: the largest buffer one
    collective reads or writes (`largest_collective`), one bucket packed or unpacked beside it (`bucket_bytes`,
    at most that buffer), this device's share of the summed gradients and of their updates (its slots of every
    sliced leaf and the leaves it owns, in the dtype they are summed in) and, with `offload=True`, one streamed
    chunk. It holds XLA:CPU's `compiled.memory_analysis()` temporaries of the float32 steps of
    `tests/test_plan_memory.py`; XLA:CPU computes bfloat16 in float32 copies, beyond it. The inner optimizer's own
    scratch (Muon's iterates) and a backend's scheduling are known only after `compile()`, as are optax's
    temporaries (left 0).

    Args:
      inner: the optax transformation zero1 would shard.
      params: the parameters' global shapes and dtypes: arrays or `jax.ShapeDtypeStruct`s (a Flax NNX state works);
        Python floats and None leaves as `init` takes them.
      mesh: the mesh, a `jax.sharding.AbstractMesh`, a `Mesh`, or a mapping of axis sizes (`{"data": 64,
        "model": 8}`).
      param_specs: the parameters' `PartitionSpec`s over `mesh` (a tree like `params` or a prefix of it); None
        reads them from the parameters' `NamedSharding`s, else replicated.
      device_memory: one device's memory, bytes or a string (`"80GB"`: 80e9 bytes, `"16GiB"`: 16 * 2**30): the
        plan then says whether each way of running fits (`plan.fits`) and by how much (`plan.headroom`).
      activation_bytes: the activations' bytes per device, the same forms; added to every total of the verdicts.
      **zero1_options: the options of `zero_optax.zero1` (`axis_name`, `partition`, `master_dtype`,
        `replica_axis`, `quantize`, `accumulate_steps`, `offload`, ...). `axis_name` may be left out on a mesh of
        one axis.

    Returns:
      A `Plan`: `plan.describe()` is the `Layout`, `plan.summary()` a table, `plan.as_dict()` the figures.

    Raises:
      ZeroError: a bad mesh, option or size; any error `zero1` raises for these arguments.
      ZeroStructureError: a parameter is a Python int or bool.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, zero_optax as zo
      >>> params = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
      >>> p = zo.plan(optax.adam(1e-3), params, mesh={"data": 256}, device_memory="16GiB")
      >>> p.stored_bytes  # mu and nu: 2 * 65536 float32 per device, and the step count
      524292
      >>> p.wire["data"]
      {'reduce-scatter': 67108864, 'all-gather': 67108864}
      >>> p.memory["zero1"].parameters, p.memory["replicated"].state, p.fits["zero1"]
      (67108864, 134217732, True)
    """
    limits = parse_bytes(device_memory, "device_memory"), parse_bytes(activation_bytes, "activation_bytes") or 0
    am = abstract_mesh(mesh)
    _check_options(zero1_options, am)
    tx = zero1(inner, **zero1_options)
    structs, specs = _structs(params, am, param_specs)
    local = _specs.traced_state(tx, structs, specs, am)
    layout = find_states(local)[0].layout
    state_specs = _specs.tree_specs(local)
    state = jax.tree.map(lambda x, spec: _global(x, spec, am), local, state_specs)
    stored = sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in jax.tree.leaves(local))
    wire, largest = _wire(tx, layout, state, state_specs, structs, specs, am, zero1_options.get("reduce", True))
    step = _Step(layout, int(stored), largest, zero1_options.get("bucket_bytes", DEFAULT_BUCKET_BYTES),
                 _sum_dtype(zero1_options))
    parts = _arrays.split(state, "The planned state")
    arrays = _arrays.stored_arrays(layout, 0)
    clocks = {layout.entries[j].path: np.zeros((), layout.entries[j].dtype).item()
              for j in _record.clock_entries(layout)}
    record = _record.new_record(parts.signature, [_record.state_record(layout, 0, clocks)], _record.STORAGE_ORBAX)
    return Plan(
        layout=layout, axis_sizes=dict(zip(am.axis_names, am.axis_sizes)), stored_bytes=int(stored),
        state_bytes=layout.state_bytes_per_device, master_bytes=layout.master_bytes_per_device,
        accumulator_bytes=layout.accumulator_bytes_per_device, wire=wire, largest_collective=largest,
        checkpoint_bytes=sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in arrays),
        checkpoint_arrays=len(arrays), record_bytes=len(json.dumps(record, indent=1, sort_keys=True).encode()),
        memory=_memory(inner, structs, specs, step, am), device_memory=limits[0], activation_bytes=limits[1])


def _check_options(zero1_options: dict[str, Any], mesh: AbstractMesh) -> None:
    """Refuses options zero1 lacks and mesh axes `mesh` lacks; fills in `axis_name` on a mesh of one axis."""
    unknown = sorted(set(zero1_options) - _ZERO1_OPTIONS)
    if unknown:
        raise ZeroError(f"zo.plan got {unknown}, which are no options of zero1 (mesh is plan's own argument); "
                        f"zero1's options are {sorted(_ZERO1_OPTIONS)}.")
    if "axis_name" not in zero1_options:
        if len(mesh.axis_names) != 1:
            raise ZeroError(f"The mesh has axes {tuple(mesh.axis_names)}: pass axis_name= (the data-parallel axis or "
                            "axes zero1 shards the state over).")
        zero1_options["axis_name"] = mesh.axis_names[0]
    for name in ("axis_name", "replica_axis"):
        value = zero1_options.get(name)
        missing = [a for a in (() if value is None else _compat.as_tuple(value)) if a not in mesh.axis_names]
        if missing:
            raise ZeroError(f"{name}={value!r} names {missing}, which are no axes of the mesh "
                            f"{tuple(mesh.axis_names)}.")


def _sum_dtype(zero1_options: Mapping[str, Any]) -> Any:
    """The dtype zero1 sums gradients in where the options set one (`reduce_dtype`, else `master_dtype`)."""
    for name in ("reduce_dtype", "master_dtype"):
        if zero1_options.get(name) is not None:
            return zero1_options[name]
    return None


@dataclasses.dataclass(frozen=True)
class _Step:
    """What zero1's footprint needs of the traced state and step."""

    layout: Layout
    stored: int
    largest: int
    bucket_bytes: int
    sum_dtype: Any = None

    def share(self) -> int:
        """The most bytes of summed gradients one device updates: its slots of every sliced leaf and the leaves it
        owns whole, in the dtype they are summed in (`reduce_dtype`, else `master_dtype`, else their own)."""
        leaves, world = self.layout.leaves, self.layout.world_size

        def nbytes(leaf: Any, count: int) -> int:
            return count * np.dtype(self.sum_dtype if self.sum_dtype is not None else leaf.dtype).itemsize

        owned = [sum(nbytes(leaf, leaf.size) for leaf in leaves if leaf.owner == r) for r in range(world)]
        return sum(nbytes(leaf, leaf.slots) for leaf in leaves if leaf.sliced) + max(owned, default=0)

    def temporaries(self) -> int:
        """The bound of `zo.plan`'s docstring: the largest collective buffer and one bucket beside it, this device's
        summed gradients and their updates and, offloaded, one streamed chunk."""
        chunk = min(self.bucket_bytes, self.stored) if self.layout.memory_kind != "device" else 0
        return self.largest + min(self.bucket_bytes, self.largest) + 2 * self.share() + chunk


def _memory(inner: optax.GradientTransformation, structs: Any, specs: Any, step: _Step, mesh: AbstractMesh
            ) -> dict[str, Footprint]:
    """Per device, per step: zero1's `Footprint`, plain optax's replicated and optax's GSPMD-sharded."""
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    layout = step.layout
    params = tree_bytes(structs, specs, sizes)
    master = max(layout.master_bytes_per_device, default=0)
    accumulators = max(layout.accumulator_bytes_per_device, default=0)
    out = {"zero1": Footprint(params, params, step.stored - master - accumulators, master, accumulators,
                              step.temporaries(), layout.memory_kind != "device")}
    plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), structs)
    optax_state = jax.eval_shape(inner.init, plain)
    for name, axes in (("replicated", ()), ("gspmd", layout.axes)):
        state = tree_bytes(optax_state, optax_state_specs(optax_state, plain, specs, axes, sizes), sizes)
        acc_specs = jax.tree.map(functools.partial(_cut_like, axes=axes, sizes=sizes), plain, specs)
        acc = tree_bytes(plain, acc_specs, sizes) if layout.accumulate_steps > 1 else 0
        out[name] = Footprint(params, params, state, accumulators=acc)
    return out


def _cut_like(x: Any, spec: P, axes: tuple[str, ...], sizes: Mapping[str, int]) -> P:
    return _cut(np.shape(x), spec, axes, sizes)


def optax_state_specs(state: Any, params: Any, param_specs: Any, axes: tuple[str, ...], sizes: Mapping[str, int]
                      ) -> Any:
    """The `PartitionSpec` of each leaf of optax's `state` for `params`: the spec of the parameter it mirrors (the
    longest tail of its key path that is a parameter's, of that parameter's shape), else replicated; then, with
    `axes`, cut over them on its first dimension they divide that no axis cuts (GSPMD-sharded optax, MaxText
    style), else kept.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> params = {"w": jax.ShapeDtypeStruct((4, 6), jnp.float32)}
      >>> state = jax.eval_shape(optax.adam(1e-3).init, params)
      >>> specs = optax_state_specs(state, params, {"w": P(None, "model")}, ("data",), {"data": 4, "model": 2})
      >>> specs[0].mu == {"w": P("data", "model")}, specs[0].count == P()
      (True, True)
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    by_path = {jax.tree_util.keystr(path): (np.shape(x), s)
               for (path, x), s in zip(leaves, treedef.flatten_up_to(param_specs))}

    def spec_of(path: tuple[Any, ...], x: Any) -> P:
        shape = np.shape(x)
        for k in range(len(path) + 1):
            hit = by_path.get(jax.tree_util.keystr(path[k:]))
            if hit is not None and hit[0] == shape:
                return _cut(shape, hit[1], axes, sizes)
        return _cut(shape, P(), axes, sizes)

    return jax.tree_util.tree_map_with_path(spec_of, state)


def _cut(shape: tuple[int, ...], spec: P, axes: tuple[str, ...], sizes: Mapping[str, int]) -> P:
    """`spec`, its first dimension of `shape` that no axis cuts and `axes` divide cut over `axes` (none: `spec`)."""
    cuts = spec_axes(spec) + [()] * (len(shape) - len(spec))
    n = math.prod(sizes[a] for a in axes)
    if not axes or any(a in cut for cut in cuts for a in axes):
        return spec
    for i, d in enumerate(shape):
        if not cuts[i] and d >= n and d % n == 0:
            entries = [*spec, *[None] * (len(shape) - len(spec))]
            entries[i] = axes[0] if len(axes) == 1 else tuple(axes)
            while entries and entries[-1] is None:
                entries.pop()
            return P(*entries)
    return spec


def tree_bytes(tree: Any, specs: Any, sizes: Mapping[str, int] | None = None) -> int:
    """The bytes one device holds of the arrays of `tree` (shapes and dtypes) placed by `specs` over a mesh of axis
    `sizes`: per leaf, its shard (a dimension of size `d` cut over `n` devices holds `ceil(d / n)`).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> tree_bytes({"w": jax.ShapeDtypeStruct((8, 6), jnp.float32)}, {"w": P("data")}, {"data": 4})
      48
    """
    sizes = sizes or {}
    leaves, treedef = jax.tree.flatten(tree)
    total = 0
    for x, spec in zip(leaves, treedef.flatten_up_to(specs)):
        x = _key_data(x)
        cuts = spec_axes(spec) + [()] * (len(x.shape) - len(spec))
        shard = [-(-d // math.prod(sizes[a] for a in cut)) for d, cut in zip(x.shape, cuts)]
        total += math.prod(shard) * np.dtype(x.dtype).itemsize
    return total


def _key_data(x: Any) -> Any:
    """A typed PRNG key array's key data (as zero1 stores it); any other array as it is."""
    return jax.eval_shape(_keys.to_data, jax.ShapeDtypeStruct(x.shape, x.dtype)) if _keys.is_key(x) else x


def _global(block: Any, spec: P, mesh: AbstractMesh) -> jax.ShapeDtypeStruct:
    """The global array of a `shard_map` output whose blocks are `block`, laid out by `spec` over `mesh`."""
    cuts = spec_axes(spec)
    cuts += [()] * (len(block.shape) - len(cuts))
    shape = tuple(n * math.prod(mesh.shape[a] for a in cut) for n, cut in zip(block.shape, cuts))
    return jax.ShapeDtypeStruct(shape, block.dtype, sharding=NamedSharding(mesh, spec))


def _wire(tx, layout: Layout, state, state_specs, structs, specs, mesh: AbstractMesh, reduce
          ) -> tuple[dict[str, dict[str, int]], int]:
    """Bytes per device per axis and collective kind of one `update` inside `shard_map`, and the largest."""
    def step(grads, state, params):
        if reduce is not False:
            grads = as_local(grads, layout.replica_axes + layout.axes)
        return tx.update(grads, state, params)

    program = jax.make_jaxpr(jax.shard_map(step, mesh=mesh, in_specs=(specs, state_specs, specs),
                                           out_specs=(specs, state_specs)))(structs, state, structs)
    out: dict[str, dict[str, int]] = {}
    largest = 0
    for c in _programs.collectives(program):
        if c.nbytes == 0 or math.prod(mesh.shape[a] for a in c.axes) == 1:
            continue
        kinds = out.setdefault("+".join(c.axes), {})
        kinds[c.kind] = kinds.get(c.kind, 0) + c.nbytes * c.times
        largest = max(largest, c.nbytes)
    return out, largest

