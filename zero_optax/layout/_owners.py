"""Whole-leaf ownership: which device updates which parameter leaf."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
import optax

from zero_optax.core._errors import OwnersError
from zero_optax.layout._attribution import discover_entries


def _greedy(costs: Sequence[int], world_size: int) -> list[int]:
    """Each cost, largest first, to the least-loaded device; ties to the lower index."""
    load = [0] * world_size
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    return owners


def owners_for_entries(entries, owned: Sequence[bool], world_size: int) -> list[int | None]:
    """Balanced owners of the `owned` leaves by the bytes of their state entries; None for the others."""
    costs = [0] * len(owned)
    for e in entries:
        if e.leaf is not None:
            costs[e.leaf] += e.nbytes
    which = [i for i, o in enumerate(owned) if o]
    chosen = dict(zip(which, _greedy([costs[i] for i in which], world_size)))
    return [chosen.get(i) for i in range(len(owned))]


def balanced_owners(params, world_size: int, *, inner: optax.GradientTransformation | None = None) -> list[int]:
    """Assigns every parameter leaf to one device, balancing optimizer-state bytes.

    Leaves go largest first to the least-loaded device, ties to the lower index.

    Args:
      params: the parameter pytree (arrays or `jax.ShapeDtypeStruct`s).
      world_size: number of devices on the data axis.
      inner: optional inner optimizer; if given, a leaf costs its optimizer-state bytes under `inner`, else its
        parameter bytes.

    Returns:
      One device index per leaf, in tree-flatten order.

    Raises:
      OwnersError: `world_size` is not a positive int.

    Examples:
      >>> import jax.numpy as jnp, zero_optax as zo
      >>> zo.balanced_owners({"a": jnp.zeros((4, 4)), "b": jnp.zeros(3), "c": jnp.zeros(8)}, world_size=2)
      [0, 1, 1]
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise OwnersError(f"`world_size` must be a positive int, got {world_size!r}.")
    if inner is None:
        return _greedy([int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)],
                       world_size)
    # traced abstractly, nothing allocated
    structs, treedef = jax.tree.flatten(jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params))
    entries = discover_entries(optax.with_extra_args_support(inner).init, treedef, structs)[0]
    return owners_for_entries(entries, [True] * len(structs), world_size)


def check_owners(owners: Sequence[int], n_leaves: int, world_size: int, paths: Sequence[str]) -> tuple[int, ...]:
    """`owners` as a tuple after checking its length and range."""
    owners = tuple(owners)
    if len(owners) != n_leaves:
        raise OwnersError(
            f"`owners` has {len(owners)} entries, but the parameters have {n_leaves} trainable leaves; give one "
            "device index per leaf in tree-flatten order (zero_optax.balanced_owners(params, world_size) builds one).")
    for i, r in enumerate(owners):
        if not isinstance(r, (int, np.integer)) or not 0 <= r < world_size:
            raise OwnersError(
                f"`owners[{i}]` (leaf `{paths[i]}`) is {r!r}, but device indices must be ints in [0, {world_size}).")
    return tuple(int(r) for r in owners)
