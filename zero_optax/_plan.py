"""`zo.plan`: what a zero1 state and step cost on a mesh, before the devices exist: its `Layout`, bytes per device,
bytes each step moves per mesh axis, and the checkpoint's size. Everything is traced abstractly, on an
`AbstractMesh`; nothing is compiled, allocated or placed on a device."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
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
from zero_optax.layout import _specs
from zero_optax.layout._layout import Layout
from zero_optax.layout._state import find_states
from zero_optax.layout._stored import spec_axes


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

    def describe(self) -> Layout:
        """The layout, as `zo.describe(state)` returns it for the real state."""
        return self.layout

    def as_dict(self) -> dict[str, Any]:
        """The figures (not the layout's leaves) as plain JSON values."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "layout"}
        layout = self.layout
        out.update(partition=layout.partition, axis_name=layout.axis_name, world_size=layout.world_size,
                   parameters=sum(math.prod(leaf.shape) * leaf.blocks for leaf in layout.leaves),
                   leaves=len(layout.leaves), owned_leaves=sum(not leaf.sliced for leaf in layout.leaves))
        return json.loads(json.dumps(out))

    def summary(self) -> str:
        """The figures as a short text table."""
        d = self.as_dict()
        rows = [("mesh", ", ".join(f"{a}={s}" for a, s in self.axis_sizes.items())),
                ("zero1", f"partition={d['partition']} axis={d['axis_name']} ({d['world_size']} devices)"),
                ("parameters", f"{d['parameters']:,} in {d['leaves']} leaves ({d['owned_leaves']} owned whole)"),
                ("stored per device", _size(self.stored_bytes))]
        for name, values in (("inner state", self.state_bytes), ("master copies", self.master_bytes),
                             ("accumulators", self.accumulator_bytes)):
            if any(values):
                rows.append((f"{name} per device", f"{_size(min(values))} to {_size(max(values))}"))
        for axes, kinds in self.wire.items():
            rows.append((f"step moves over {axes}", ", ".join(f"{k} {_size(b)}" for k, b in kinds.items())))
        rows += [("largest collective buffer", _size(self.largest_collective)),
                 ("checkpoint", f"{_size(self.checkpoint_bytes)} in {self.checkpoint_arrays} arrays, record "
                                f"{_size(self.record_bytes)}")]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} B"


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
         **zero1_options: Any) -> Plan:
    """What `zero1(inner, **zero1_options)` costs on `mesh`, computed without devices.

    The state is laid out as `init` lays it out and the step traced as `update` runs it inside `jax.shard_map`
    (per-device gradients reduced by zero1), both on an `AbstractMesh`: nothing is compiled, allocated or placed
    on a device, so a pod that is not there yet can be planned on a laptop.

    Args:
      inner: the optax transformation zero1 would shard.
      params: the parameters' global shapes and dtypes: arrays or `jax.ShapeDtypeStruct`s (a Flax NNX state works);
        Python floats and None leaves as `init` takes them.
      mesh: the mesh, a `jax.sharding.AbstractMesh`, a `Mesh`, or a mapping of axis sizes (`{"data": 64,
        "model": 8}`).
      param_specs: the parameters' `PartitionSpec`s over `mesh` (a tree like `params` or a prefix of it); None
        reads them from the parameters' `NamedSharding`s, else replicated.
      **zero1_options: the options of `zero_optax.zero1` (`axis_name`, `partition`, `master_dtype`,
        `replica_axis`, `quantize`, `accumulate_steps`, `offload`, ...). `axis_name` may be left out on a mesh of
        one axis.

    Returns:
      A `Plan`: `plan.describe()` is the `Layout`, `plan.summary()` a table, `plan.as_dict()` the figures.

    Raises:
      ZeroError: a bad mesh or option; any error `zero1` raises for these arguments.
      ZeroStructureError: a parameter is a Python int or bool.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, zero_optax as zo
      >>> params = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
      >>> p = zo.plan(optax.adam(1e-3), params, mesh={"data": 256})
      >>> p.stored_bytes  # mu and nu: 2 * 65536 float32 per device, and the step count
      524292
      >>> p.wire["data"]
      {'reduce-scatter': 67108864, 'all-gather': 67108864}
    """
    unknown = sorted(set(zero1_options) - _ZERO1_OPTIONS)
    if unknown:
        raise ZeroError(f"zo.plan got {unknown}, which are no options of zero1 (mesh is plan's own argument); "
                        f"zero1's options are {sorted(_ZERO1_OPTIONS)}.")
    am = abstract_mesh(mesh)
    if "axis_name" not in zero1_options:
        if len(am.axis_names) != 1:
            raise ZeroError(f"The mesh has axes {tuple(am.axis_names)}: pass axis_name= (the data-parallel axis or "
                            "axes zero1 shards the state over).")
        zero1_options["axis_name"] = am.axis_names[0]
    tx = zero1(inner, **zero1_options)
    structs, specs = _structs(params, am, param_specs)
    local = _specs.traced_state(tx, structs, specs, am)
    layout = find_states(local)[0].layout
    state_specs = _specs.tree_specs(local)
    state = jax.tree.map(lambda x, spec: _global(x, spec, am), local, state_specs)
    stored = sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in jax.tree.leaves(local))
    wire, largest = _wire(tx, layout, state, state_specs, structs, specs, am, zero1_options.get("reduce", True))
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
        checkpoint_arrays=len(arrays), record_bytes=len(json.dumps(record, indent=1, sort_keys=True).encode()))


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

