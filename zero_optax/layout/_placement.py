"""Whether a zero1 state's arrays are placed as its layout says: read from a concrete array's sharding, or from a
traced value's type on `Explicit` mesh axes (on `Auto` axes a trace does not say, and nothing is refused), or inside
`shard_map` from a value's varying-manual-axes type (a state passed with `in_specs=P()` is typed invariant)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zero_optax.core import _compat
from zero_optax.layout._specs import specs_of
from zero_optax.layout._state import ZeroState
from zero_optax.layout._stored import spec_axes

BODY_HELP = """\
The zero1 state's array `{path}` is the same on every device of `{axes}` (typed invariant) inside shard_map: the \
shard_map that calls update was given the state replicated (in_specs P()), so every device holds all of it, where \
zero1 expects its own part. Pass the state's specs as in_specs and out_specs: zo.state_specs(tx, params, \
mesh=mesh), P({axes!r}) for the whole state when the parameters are replicated."""

PLACEMENT_HELP = """\
The zero1 state's array `{path}` is {got}, but its layout stores it as {want} on the mesh{sizes}: a trainer \
placed the state {how}, so {cost}. Place the state as zero1 lays it out: pass zo.state_specs(tx, params, mesh=mesh) \
as the state's shardings, e.g. jax.jit(step, in_shardings=..., out_shardings=...) with \
jax.tree.map(lambda spec: NamedSharding(mesh, spec), zo.state_specs(tx, params, mesh=mesh)) for the state, or \
those specs as your trainer's abstract-state shardings; the state tx.init returns is placed that way already."""


def _dims(spec: Any, ndim: int) -> list[tuple[str, ...]]:
    """The mesh axes of each of `ndim` dimensions under `spec`."""
    entries = spec_axes(list(spec)[:ndim])
    return entries + [()] * (ndim - len(entries))


def _describe(sharding: Any, shape: tuple[int, ...]) -> str:
    """How `sharding` places an array of `shape`, in words."""
    if isinstance(sharding, NamedSharding):
        dims = _dims(sharding.spec, len(shape))
        return "replicated" if not any(dims) else f"sharded as {P(*[d or None for d in dims])}"
    return f"placed by a {type(sharding).__name__} (a {list(sharding.shard_shape(shape))} block per device)"


def _concrete(x: jax.Array, spec: P, mesh: Any, sizes: dict[str, int]) -> str | None:
    """How concrete `x` is placed, where that is not `spec` (on `mesh`, or by the block each device holds)."""
    sharding = x.sharding
    if mesh is not None:
        want = NamedSharding(mesh, spec, memory_kind=sharding.memory_kind)
        return None if sharding.is_equivalent_to(want, x.ndim) else _describe(sharding, x.shape)
    dims = _dims(spec, x.ndim)
    if any(a not in sizes for d in dims for a in d):
        return None  # (an axis whose size the layout does not record: cannot tell)
    block = tuple(n // math.prod(sizes[a] for a in d) for n, d in zip(x.shape, dims))
    return None if tuple(sharding.shard_shape(x.shape)) == block else _describe(sharding, x.shape)


def _traced(x: Any, spec: P) -> str | None:
    """How traced `x` is typed on the `Explicit` axes of its mesh, where that is not `spec`; None where the type
    says nothing (no mesh, `Auto` axes)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(sharding, NamedSharding) or mesh is None or mesh.empty:
        return None
    explicit = {a for a, t in zip(mesh.axis_names, getattr(mesh, "axis_types", ()))
                if t == jax.sharding.AxisType.Explicit}
    ndim = len(x.shape)
    want = [tuple(a for a in d if a in explicit) for d in _dims(spec, ndim)]
    got = [tuple(a for a in d if a in explicit) for d in _dims(sharding.spec, ndim)]
    return None if want == got else _describe(sharding, tuple(x.shape))


def misplaced(state: ZeroState, mesh: Any = None) -> str | None:
    """`PLACEMENT_HELP` for the first array of `state` not placed as its layout says (on `mesh`, if given; else by
    the block each device holds), or None where every array is, or where zero1 cannot tell."""
    layout = state.layout
    sizes = dict(mesh.shape) if mesh is not None else dict(layout.axis_sizes)
    if math.prod(sizes.get(a, 1) for a in layout.axes) == 1:
        return None  # (one device: nothing to shard)
    specs = jax.tree.leaves(specs_of(state))
    for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(state)[0], specs):
        if not isinstance(x, jax.Array):
            continue
        got = _traced(x, spec) if isinstance(x, jax.core.Tracer) else _concrete(x, spec, mesh, sizes)
        if got is not None:
            replicated = got == "replicated"
            return PLACEMENT_HELP.format(
                path=jax.tree_util.keystr(path), got=got, want=P(*[d or None for d in _dims(spec, len(x.shape))]),
                sizes=" (" + ", ".join(f"{a}={n}" for a, n in sizes.items()) + ")",
                how="replicated" if replicated else "on other axes than its layout's",
                cost=(f"every device would hold the whole state, {layout.world_size}x what zero1 keeps per device"
                      if replicated else "JAX would move the state between devices at every step"))
    return None


def misplaced_in_body(state: ZeroState) -> str | None:
    """`BODY_HELP` for the first stored array of `state` (not a shared field, which `optax.tree.set` may replace
    with a replicated value) that a `shard_map` body types invariant across the state's axes; None where every one
    varies, outside a `shard_map` binding its axes, on one device, or without varying-manual-axes types
    (`check_vma=False`)."""
    axes = state.layout.axes
    if not _compat.is_bound(axes) or _compat.axis_size(axes) == 1 or not _compat.vma_enabled(axes):
        return None
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        where = jax.tree_util.keystr(path)
        if isinstance(x, jax.Array) and not where.startswith("._inner.shared") and \
                not set(axes) <= _compat.varying_axes(x):
            return BODY_HELP.format(path=where, axes=axes[0] if len(axes) == 1 else axes)
    return None
