"""The JAX primitives zero_optax needs whose name or home moved between JAX releases, each behind one function."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from zero_optax._errors import ZeroAxisError

SHARD_MAP_PATTERN = """\
zero1 runs inside jax.shard_map over the data axis, for example:

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P("data")))
    step = jax.jit(jax.shard_map(step_fn, mesh=mesh,
                                 in_specs=(P(), P("data"), P("data")),
                                 out_specs=(P(), P("data"))))"""


def axis_size(axis_name: str, what: str = "zero1") -> int:
    """The static size of a bound mesh axis, or a `ZeroAxisError` that shows the shard_map pattern."""
    try:
        return int(lax.axis_size(axis_name))
    except NameError:
        raise ZeroAxisError(
            f"{what} needs the mesh axis `{axis_name}`, but no enclosing jax.shard_map binds it. "
            f"Call it inside jax.shard_map over a mesh with an axis named `{axis_name}`, or pass the "
            f"axis name your mesh uses.\n\n{SHARD_MAP_PATTERN}") from None


def _varying_axes(x) -> frozenset:
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # JAX >= 0.10
    if manual is not None:
        return manual.varying
    return getattr(aval, "vma", frozenset())


def vma_enabled(axis_name: str) -> bool:
    """Whether values carry varying-manual-axes types (shard_map's `check_vma=True`, the default)."""
    return axis_name in _varying_axes(lax.axis_index(axis_name))


def is_varying(x: jax.Array, axis_name: str) -> bool:
    """Whether `x` is typed as varying across `axis_name` (always False when `check_vma=False`)."""
    return axis_name in _varying_axes(x)


def pvary(x, axis_name: str):
    """Marks a pytree of invariant values as varying across `axis_name` (a no-op if already varying)."""
    def one(v):
        if is_varying(v, axis_name) or not vma_enabled(axis_name):
            return v
        if hasattr(lax, "pcast"):
            return lax.pcast(v, axis_name, to="varying")
        return lax.pvary(v, axis_name)  # JAX < 0.8
    return jax.tree.map(one, x)


def all_gather_invariant(x: jax.Array, axis_name: str) -> jax.Array:
    """Gathers `x` from every device along a new leading axis; the result is invariant across the axis.

    `lax.all_gather` types its output as varying, which an `out_specs=P()` result rejects. JAX ships an
    invariant all-gather under a private name; without it, a masked psum gives the same value at twice the
    traffic.
    """
    if not vma_enabled(axis_name):
        return lax.all_gather(x, axis_name)
    try:
        from jax._src.lax.parallel import all_gather_invariant as gather  # pylint: disable=g-import-not-at-top
    except ImportError:  # pragma: no cover - depends on the JAX release
        gather = None
    if gather is not None:
        return gather(pvary(x, axis_name), axis_name)
    n = axis_size(axis_name)
    onehot = jnp.arange(n) == lax.axis_index(axis_name)
    placed = jnp.where(onehot.reshape((n,) + (1,) * x.ndim), x[None], jnp.zeros_like(x)[None])
    return lax.psum(placed, axis_name)
