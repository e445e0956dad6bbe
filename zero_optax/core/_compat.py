"""Every difference between the JAX releases zero_optax supports (0.10.2 to 0.12), each behind one function.
Importing it sets NPROC where jaxlib's CPU client can deadlock (`widen_cpu_client_pool`)."""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import jaxlib.version
from jax import lax
from jax._src import config as _jax_config  # (`vma_enabled`: the flag shard_map sets)

from zero_optax.core._errors import ZeroAxisError, ZeroStructureError

Axes = str | Sequence[str]

SHARD_MAP_PATTERN = """\
zero1 runs inside jax.shard_map over the data axis, for example:

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))
    step = jax.jit(jax.shard_map(step_fn, mesh=mesh,
                                 in_specs=(P(), P("data"), P("data")),
                                 out_specs=(P(), P("data"))))

or, bound to a mesh, under plain jax.jit: zo.zero1(inner, axis_name="data", mesh=mesh)."""


def as_tuple(axes: str | Sequence[str]) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def is_bound(axes: Axes) -> bool:
    """Whether every axis in `axes` is bound by an enclosing `shard_map` (or `vmap`/`pmap`)."""
    try:
        for a in as_tuple(axes):
            lax.axis_size(a)
    except NameError:
        return False
    return True


def axis_size(axes: Axes, what: str = "zero1") -> int:
    """The static size of a bound mesh axis (or the product over a tuple of axes), or a `ZeroAxisError`."""
    sizes = []
    for a in as_tuple(axes):
        try:
            sizes.append(int(lax.axis_size(a)))
        except NameError:
            raise ZeroAxisError(
                f"{what} needs the mesh axis `{a}`, but no enclosing jax.shard_map binds it. Call it inside "
                f"jax.shard_map over a mesh with an axis named `{a}`, or pass the axis name your mesh uses.\n\n"
                f"{SHARD_MAP_PATTERN}") from None
    return math.prod(sizes)


def axis_sizes(axes: Axes) -> tuple[tuple[str, int], ...]:
    """`(name, size)` of each bound mesh axis of `axes`, or a `ZeroAxisError` (`axis_size`)."""
    return tuple((a, axis_size(a)) for a in as_tuple(axes))


def axis_index(axes: Axes) -> jax.Array:
    """This device's linear index along `axes` (row-major over a tuple); 0 for an empty tuple."""
    axes = as_tuple(axes)
    return lax.axis_index(_axis_arg(axes)) if axes else jnp.int32(0)


def manual_axes() -> dict[str, int]:
    """The mesh axes an enclosing `shard_map` makes manual, with their sizes (empty outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return {a: int(mesh.shape[a]) for a in mesh.axis_names if a in mesh.manual_axes}


def vma_enabled(axes: Axes) -> bool:
    """Whether values carry varying-manual-axes types (shard_map's `check_vma=True`, the default).

    Read from the flag `shard_map` sets while it traces, where this JAX has it: asking the type of an
    `axis_index`, the public way, writes an equation into the program at every call."""
    axes = as_tuple(axes)
    flag = getattr(_jax_config, "_check_vma", None)
    if flag is None:
        return all(a in varying_axes(lax.axis_index(a)) for a in axes)
    return bool(flag.value) and set(axes) <= set(jax.sharding.get_abstract_mesh().manual_axes)


def varying_axes(x) -> frozenset:
    """The mesh axes `x` is typed as varying across (empty when `check_vma=False`)."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)  # None outside shard_map
    return frozenset(manual.varying) if manual is not None else frozenset()


def pvary(x, axes: Axes):
    """Marks a pytree of values as varying across `axes` (a no-op for axes they already vary across)."""
    axes = as_tuple(axes)
    if not axes or not vma_enabled(axes):
        return x

    def one(v):
        missing = tuple(a for a in axes if a not in varying_axes(v))
        return lax.pcast(v, missing, to="varying") if missing else v
    return jax.tree.map(one, x)


def _axis_arg(axes: Sequence[str]):
    return axes[0] if len(axes) == 1 else tuple(axes)


def psum_scatter(x: jax.Array, axes: Axes) -> jax.Array:
    """Reduce-scatters `x` along its leading dimension over `axes` (tiled: this device keeps its block)."""
    return lax.psum_scatter(x, _axis_arg(as_tuple(axes)), scatter_dimension=0, tiled=True)


def all_gather_invariant(x: jax.Array, axes: Axes, *, tiled: bool = False) -> jax.Array:
    """Gathers `x` from every device of `axes` (a new leading axis, or concatenated with `tiled`), typed invariant
    (a plain `lax.all_gather` is typed varying, which `out_specs=P()` rejects)."""
    axes = as_tuple(axes)
    if not vma_enabled(axes):
        return lax.all_gather(x, _axis_arg(axes), tiled=tiled)
    return lax.all_gather(pvary(x, axes), _axis_arg(axes), tiled=tiled, to="invarying")


def _explicit_only(sharding) -> bool:
    """Whether every mesh axis `sharding`'s spec names is `Explicit` (what `jax.reshard` accepts)."""
    types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
    named = [a for entry in sharding.spec for a in ((entry,) if isinstance(entry, str) else (entry or ()))]
    return all(types[a] == jax.sharding.AxisType.Explicit for a in named)


def reshard(x, sharding):
    """`x` moved to `sharding`, inside or outside `jax.jit`, on any mesh (`jax.reshard` refuses `Auto` axes). An
    array is put on a concrete mesh directly: `jax.reshard` of one compiles a program per shape."""
    concrete = isinstance(getattr(sharding, "mesh", None), jax.sharding.Mesh)
    if _explicit_only(sharding) and (isinstance(x, jax.core.Tracer) or not concrete):
        return jax.reshard(x, sharding)
    if isinstance(x, jax.core.Tracer):
        return lax.with_sharding_constraint(x, sharding)
    return jax.device_put(x, sharding)


_PLACEHOLDER = getattr(importlib.import_module("optax.tree_utils._state_utils"), "_ParamsPlaceholder", ())


def is_params_placeholder(params) -> bool:
    """Whether `params` is the stand-in `optax.tree_map_params` passes to `init` (a private optax class)."""
    return bool(_PLACEHOLDER) and isinstance(params, _PLACEHOLDER)


def has_variables(tree) -> bool:
    """Whether `tree` holds Flax `nnx.Variable`s (as the state `nnx.Optimizer` passes to `init` does)."""
    nnx = sys.modules.get("flax.nnx")
    if tree is None or nnx is None:
        return False
    def is_var(x) -> bool:
        return isinstance(x, nnx.Variable)

    return any(is_var(x) for x in jax.tree.leaves(tree, is_leaf=is_var))


def pure(tree):
    """`tree` with Flax `nnx.Variable` wrappers replaced by their values (`nnx.Optimizer`'s `init` receives them)."""
    if not has_variables(tree):
        return tree
    nnx = sys.modules["flax.nnx"]
    return jax.tree.map(lambda x: pure(x.get_value()) if isinstance(x, nnx.Variable) else x, tree,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))


def is_struct(x: Any) -> bool:
    """Whether `x` is a `jax.ShapeDtypeStruct` (an abstract array: a shape, a dtype, maybe a sharding)."""
    return isinstance(x, jax.ShapeDtypeStruct)


_PYTHON_SCALARS = (bool, int, float, complex)
"""Python's number types (exactly: a NumPy scalar, a subclass, keeps its dtype as it does today)."""


def _scalar_array(x: float | complex, abstract: bool) -> jax.Array | jax.ShapeDtypeStruct:
    """A Python float or complex as the 0-d array JAX makes of it (weakly typed), or its `ShapeDtypeStruct`."""
    if abstract:
        return jax.ShapeDtypeStruct((), jnp.result_type(x), weak_type=True)
    return jnp.asarray(x)


def as_arrays(tree: Any, what: str, abstract: bool = False) -> Any:
    """`tree` with its Python floats and complex numbers as 0-d arrays (`ShapeDtypeStruct`s with `abstract`), as
    optax takes them (`jnp.zeros_like(3.0)`); None leaves stay, as optax skips them.

    Args:
      tree: parameters or gradients, as `what` (say `"zero1's init"`) received them.
      what: the function that received them, for the message.
      abstract: give the floats as `jax.ShapeDtypeStruct`s (nothing allocated).

    Raises:
      ZeroStructureError: a leaf is a Python int or bool. optax's state for one changes dtype at the first update
        (an int moment becomes a float), which whole-leaf owners store in the dtype of `init`.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not any(type(x) in _PYTHON_SCALARS for _, x in leaves):
        return tree
    for path, x in leaves:
        if type(x) in (int, bool):
            where = f"at {jax.tree_util.keystr(path)}" if path else "(the whole tree)"
            raise ZeroStructureError(
                f"{what} got the Python {type(x).__name__} {x!r} {where}. zero1 takes arrays and Python floats: "
                f"pass jnp.asarray({float(x)!r}) for a trainable value, or keep non-trainable values out of the "
                f"parameters (or set them to None, which optax skips).")
    return jax.tree.unflatten(treedef, [_scalar_array(x, abstract) if type(x) in _PYTHON_SCALARS else x
                                        for _, x in leaves])


def annotated(tree, specs, mesh):
    """`tree`'s arrays as Flax `nnx.Variable`s whose `out_sharding` metadata is their `PartitionSpec` in `specs` (a
    tree like `tree`) on `mesh`: the annotation Flax (`nnx.get_partition_spec`) and trainers built on it read."""
    nnx = sys.modules["flax.nnx"]
    return jax.tree.map(lambda x, spec: nnx.Variable(x, out_sharding=spec, mesh=mesh, eager_sharding=False),
                        tree, specs)


def replicate(x: jax.Array) -> jax.Array:
    """`x` replicated over its mesh, so that it can be sliced freely; unchanged without a mesh sharding."""
    sharding = jax.typeof(x).sharding
    if not isinstance(sharding, jax.sharding.NamedSharding) or sharding.mesh.empty:
        sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or all(s is None for s in sharding.spec):
        return x
    return reshard(x, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))


def scan_counts(eqn) -> tuple[int, int]:
    """How many of a `scan` equation's operands are constants and carries (JAX >= 0.11 keeps them in `ft_in`)."""
    params = eqn.params
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].update(list(range(len(eqn.invars)))).unpack()
    return len(list(consts)), len(list(carry))


CALLS = {"jit": "jaxpr", "closed_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr"}
"""Primitives that call one program on their operands, by the parameter that holds it."""


def jaxpr_parts(program: Any) -> tuple[Any, Sequence[Any]]:
    """A program's jaxpr and constants (a ClosedJaxpr's, JAX 0.12's self-contained Jaxpr's, or none)."""
    return (program.jaxpr, program.consts) if hasattr(program, "consts") else (program, ())


def widen_cpu_client_pool() -> int | None:
    """Sets NPROC=2N for N CPU devices on fewer than 2N cores, where jaxlib < 0.12's CPU client could deadlock a
    collective (its last execution never getting a thread); returns the value set, else None. XLA reads NPROC when
    the CPU backend starts; a user's own NPROC or PORTABLE_NPROC is kept."""
    if jaxlib.version.__version_info__ >= (0, 12) or os.environ.get("NPROC") or os.environ.get("PORTABLE_NPROC"):
        return None
    platforms = getattr(jax.config, "jax_platforms", None) or os.environ.get("JAX_PLATFORMS", "")
    if platforms and "cpu" not in platforms.replace(" ", "").split(","):
        return None
    n = jax.config.jax_num_cpu_devices  # the CPU device count the backend will start with
    if n < 1:
        found = re.findall(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
        n = int(found[-1]) if found else 1
    threads = 2 * int(n)
    try:
        cores = len(os.sched_getaffinity(0))  # the CPUs this process may run on, which XLA sizes its pools by
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if threads < 4 or threads <= cores:
        return None
    os.environ["NPROC"] = str(threads)
    return threads


widen_cpu_client_pool()
