"""`state_specs`: the `PartitionSpec`s of a zero1 state, for `shard_map`'s `out_specs` on any mesh."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zero_optax.core import _compat
from zero_optax.core._errors import ZeroError
from zero_optax.layout import _handle, _inner_state
from zero_optax.layout._layout import Layout
from zero_optax.layout._state import SlicedState, ZeroState, is_state
from zero_optax.layout._stored import ParamLeaf

DECLARED: contextvars.ContextVar = contextvars.ContextVar("zero_optax_param_specs", default=None)
"""The parameters' `PartitionSpec`s that `declared_specs` declares, or None."""


@contextlib.contextmanager
def declared_specs(specs: Any):
    """While active, `init` reads the parameters' `PartitionSpec`s, which a `shard_map` body cannot know, here."""
    token = DECLARED.set(specs)
    try:
        yield
    finally:
        DECLARED.reset(token)


def context_mesh() -> Any:
    """The mesh of the `jax.set_mesh` context, or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def _spec(axes: tuple[str, ...]) -> P:
    return P(axes[0] if len(axes) == 1 else axes) if axes else P()


def history_spec(layout: Layout, leaf: ParamLeaf) -> P:
    """A sliced leaf's 1-D history: block-major over the leaf's own axes, then its ZeRO axes."""
    return _spec(layout.history_axes(leaf))


def specs_of(state: ZeroState) -> ZeroState:
    """`state` with every array replaced by its `PartitionSpec`."""
    layout = state.layout
    groups = [history_spec(layout, layout.leaves[g.first]) for g in layout.groups]
    # (a state whose leaves are specs, where its fields' annotations say arrays)
    histories: Any = tuple(tuple(spec for _ in h) for spec, h in zip(groups, state._inner.histories))
    inner = SlicedState(_inner_state.tree(layout, [_spec(layout.axes) for _ in layout.shared_entries]), histories)
    buffers: dict[str, Any] = {d: _spec(layout.axes) for d in state.buffers}
    master = None if state.master is None else tuple(groups)
    local = None if state.local is None else jax.tree_util.tree_unflatten(
        layout.treedef, [_spec(layout.local_axes(leaf)) for leaf in layout.leaves])
    return ZeroState(inner, buffers, master, layout, local)


def tree_specs(tree: Any) -> Any:
    """Specs for an optax state that may hold zero1 states: theirs, and `P()` for anything else."""
    return jax.tree.map(lambda x: specs_of(x) if is_state(x) else P(), tree, is_leaf=is_state)


def _find_mesh(tx, params):
    """`tx`'s mesh, the context's or the parameters'."""
    owner = _handle.find(tx)
    if owner is not None and owner.mesh is not None:
        return owner.mesh
    if (context := context_mesh()) is not None:
        return context
    for x in jax.tree.leaves(params):
        if isinstance(getattr(x, "sharding", None), NamedSharding):
            return x.sharding.mesh
    raise ZeroError(
        "zo.state_specs needs the mesh to know the axis sizes: pass mesh=..., bind the transformation to one "
        "(zero1(..., mesh=mesh)), call it under `with jax.set_mesh(mesh):`, or pass parameters that carry "
        "NamedShardings.")


def _is_spec(x) -> bool:
    return isinstance(x, P) or x is None


def _is_partition_spec(x) -> bool:
    return isinstance(x, P)


def broadcast_specs(specs: Any, tree: Any) -> Any:
    """`specs` (a tree prefix of `tree` with `PartitionSpec` or None leaves) as a tree like `tree`."""
    try:
        expanded = jax.tree.map(lambda spec, sub: jax.tree.map(lambda _: P() if spec is None else spec, sub),
                                specs, tree, is_leaf=_is_spec)
    except ValueError as e:
        raise ZeroError(f"The parameter specs do not match the parameters' structure: {e}") from None
    # (a None of `tree`, a leaf optax skips, maps to None, which holds no spec)
    return jax.tree.unflatten(jax.tree.structure(tree), jax.tree.leaves(expanded, is_leaf=_is_partition_spec))


def traced_state(tx, params, param_specs, mesh, declare: Any = None):
    """`tx.init(params)` inside `shard_map` over `mesh`, traced abstractly, declaring `declare` or `param_specs`."""
    abstract_mesh = getattr(mesh, "abstract_mesh", mesh)
    params = _compat.pure(params)
    specs = broadcast_specs(param_specs, params)
    structs = jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                sharding=NamedSharding(abstract_mesh, spec)),
                           params, specs)
    captured = []

    def capture(p):
        captured.append(tx.init(p))
        return ()

    with declared_specs(param_specs if declare is None else declare):
        jax.eval_shape(jax.shard_map(capture, mesh=abstract_mesh, in_specs=(param_specs,), out_specs=()), structs)
    return captured[0]


def state_specs(tx: Any, params: Any, param_specs: Any = None, *, mesh: jax.sharding.Mesh | None = None) -> Any:
    """The `PartitionSpec`s of `tx.init(params)`'s state inside `shard_map`, to pass as its `out_specs`.

    State outside zero1 is replicated, `P()`.

    Args:
      tx: the transformation (`zero_optax.zero1(...)`, or a chain holding one).
      params: the parameters (global arrays, or `jax.ShapeDtypeStruct`s of their global shapes; Python floats and
        None leaves as `init` takes them).
      param_specs: their `PartitionSpec`s, a tree like `params` (or a prefix of it); None means replicated.
      mesh: the mesh; defaults to the one `tx` is bound to, the `jax.set_mesh` context, or the parameters'
        `NamedSharding`s.

    Returns:
      A tree like the state whose leaves are `PartitionSpec`s.

    Raises:
      ZeroError: no mesh is found, or `param_specs` does not match the parameters' structure.
      ZeroStructureError: a parameter is a Python int or bool.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, zero_optax as zo
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = zo.zero1(optax.adam(1e-2), axis_name="data")
      >>> specs = zo.state_specs(tx, {"w": jnp.ones(3)}, {"w": P()}, mesh=mesh)
      >>> jax.tree.leaves(specs)
      [P('data',), P('data',), P('data',)]
    """
    params = _compat.as_arrays(_compat.pure(params), "zo.state_specs", abstract=True)
    mesh = _find_mesh(tx, params) if mesh is None else mesh
    return tree_specs(traced_state(tx, params, P() if param_specs is None else param_specs, mesh))
