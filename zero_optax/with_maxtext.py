"""MaxText's pre-training with zero1 as its optimizer, in one call (imports `maxtext`, Python >= 3.12).

`use_zero1()` makes MaxText (0.2.5, Flax NNX) train with its own optimizer wrapped by `zo.zero1`, bound to its mesh:
the optimizer state is 1/N per device over the data axis, and MaxText's loop, sharding rules and checkpointer run
unchanged. MaxText offers no hook for this, so it replaces three MaxText functions, each for one reason:

- `maxtext.optimizers.optimizers.get_optimizer` returns `zo.zero1(MaxText's optimizer, axis_name=..., mesh=mesh)`.
- `maxtext.utils.sharding.maybe_update_params_sharding_with_opt` keeps the parameters' own sharding when
  `shard_optimizer_over_data=true`: MaxText would shard them like Adam's `mu`, a tree a zero1 state does not hold
  (zero1 shards the state itself), and would raise.
- `maxtext.common.checkpointing.load_state_if_possible` restores a zero1 state saved at another
  `ici_data_parallelism`: its shapes depend on the device count, so its arrays are read at their saved shapes and
  laid out for the new run by `zo.relayout`. A checkpoint at this run's size, and every other item, restores as
  MaxText restores it.

    from maxtext.trainers.pre_train import train
    import zero_optax.with_maxtext

    zero_optax.with_maxtext.use_zero1()
    train.main(["train", "configs/base.yml", "ici_data_parallelism=8", ...])    # as you run MaxText

Importing `zero_optax` does not import this module; importing this module imports MaxText.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from maxtext.common import checkpointing  # pyright: ignore[reportMissingImports]  (an optional dependency)
from maxtext.optimizers import optimizers  # pyright: ignore[reportMissingImports]
from maxtext.utils import sharding  # pyright: ignore[reportMissingImports]

from zero_optax.api._transfer import relayout
from zero_optax.api._zero1 import zero1

_REPLACED = ((optimizers, "get_optimizer"), (sharding, "maybe_update_params_sharding_with_opt"),
             (checkpointing, "load_state_if_possible"))
"""The MaxText functions `use_zero1` replaces: MaxText looks each up in its module when it calls it."""


def use_zero1(axis_name: str = "data", **zero1_options: Any) -> _Patches:
    """Makes MaxText train with zero1: its own optimizer, the state sharded over `axis_name` of its mesh.

    Call it once before MaxText's training entry (`train.main`, `train.train_loop`). Calling it again changes the
    options and replaces nothing twice. It replaces three MaxText functions (see the module's docstring):
    `get_optimizer` returns `zo.zero1(MaxText's optimizer, axis_name=axis_name, mesh=mesh, **zero1_options)`;
    with `shard_optimizer_over_data=true` the parameters keep their own sharding; and MaxText's restore lays a zero1
    state saved at another data-parallel size out for the new run, exactly (keep the global batch).

    Args:
      axis_name: the mesh axis zero1 shards the state over: MaxText's data-parallel axis, `"data"`.
      **zero1_options: the other keyword arguments of `zo.zero1` (`master_dtype`, `reduce_dtype`, ...).

    Returns:
      The installed patches: `undo()` puts MaxText's functions back, and so does leaving a `with` block.

    Example:
      >>> from maxtext.optimizers import optimizers
      >>> import zero_optax.with_maxtext
      >>> maxtexts_own = optimizers.get_optimizer
      >>> with zero_optax.with_maxtext.use_zero1(axis_name="data"):   # or call it once before `train.main([...])`
      ...     optimizers.get_optimizer == maxtexts_own
      False
      >>> optimizers.get_optimizer == maxtexts_own
      True
    """
    global _installed
    if _installed is None:
        _installed = _Patches()
        _installed.install()
    _installed.axis_name, _installed.options = axis_name, dict(zero1_options)
    return _installed


class _Patches:
    """MaxText's three functions replaced for zero1 (`use_zero1`), with MaxText's own to put back."""

    def __init__(self) -> None:
        """Keeps MaxText's functions as they are now."""
        self.axis_name, self.options = "data", {}
        self.made: Any = None  # the last mesh-bound zero1 `get_optimizer` returned: the one a restore lays out for
        self.maxtexts: dict[str, Callable[..., Any]] = {name: getattr(module, name) for module, name in _REPLACED}

    def install(self) -> None:
        """Puts the replacements in MaxText's modules."""
        for module, name in _REPLACED:
            setattr(module, name, getattr(self, name))

    def undo(self) -> None:
        """Puts MaxText's own functions back; `use_zero1` installs afresh after this."""
        global _installed
        for module, name in _REPLACED:
            setattr(module, name, self.maxtexts[name])
        if _installed is self:
            _installed = None

    def __enter__(self) -> _Patches:
        """The patches, installed."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Undoes the patches."""
        self.undo()

    def get_optimizer(self, config: Any, learning_rate_schedule: Any, model: Any = None, mesh: Any = None) -> Any:
        """MaxText's optimizer, wrapped by zero1 over `axis_name` of `mesh`."""
        inner = self.maxtexts["get_optimizer"](config, learning_rate_schedule, model, mesh=mesh)
        tx = zero1(inner, axis_name=self.axis_name, mesh=mesh, **self.options)
        if mesh is not None:
            self.made = tx
        return tx

    def maybe_update_params_sharding_with_opt(self, config: Any, state_mesh_shardings: Any) -> Any:
        """MaxText's, with the parameters' own sharding kept: zero1 shards the optimizer state itself."""
        if getattr(config, "shard_optimizer_over_data", False):
            config = _KeepParamsSharding(config)
        return self.maxtexts["maybe_update_params_sharding_with_opt"](config, state_mesh_shardings)

    def load_state_if_possible(self, checkpoint_manager: Any, *args: Any, **kwargs: Any) -> Any:
        """MaxText's restore, laying out a zero1 state saved at another data-parallel size for this run."""
        load = self.maxtexts["load_state_if_possible"]
        if self.made is None or not hasattr(checkpoint_manager, "load_checkpointables"):
            return load(checkpoint_manager, *args, **kwargs)
        own = vars(checkpoint_manager).get("load_checkpointables")
        checkpoint_manager.load_checkpointables = functools.partial(
            _load_relaid, checkpoint_manager, checkpoint_manager.load_checkpointables, self.made)
        try:
            return load(checkpoint_manager, *args, **kwargs)
        finally:  # the manager as it was: its next restores are MaxText's own
            if own is None:
                del checkpoint_manager.load_checkpointables
            else:
                checkpoint_manager.load_checkpointables = own


_installed: _Patches | None = None


class _KeepParamsSharding:
    """A MaxText config as it is, but for `shard_optimizer_over_data`, false."""

    shard_optimizer_over_data = False

    def __init__(self, config: Any) -> None:
        """Reads every other setting from `config`."""
        self._config = config

    def __getattr__(self, name: str) -> Any:
        """`config`'s setting `name`."""
        return getattr(self._config, name)


def _load_relaid(manager: Any, manager_load: Callable[..., Any], tx: Any, step: int, abstract: Any) -> Any:
    """`manager_load(step, abstract)`, with a zero1 state saved at another size read at its saved shapes and laid
    out for `tx` by `zo.relayout`; unchanged where the saved optimizer state has the target's shapes."""
    items = abstract.get("items") if isinstance(abstract, Mapping) else None
    if not isinstance(items, Mapping) or "opt_state" not in items:
        return manager_load(step, abstract)
    target = items["opt_state"]
    saved = manager.checkpointables_metadata(step).metadata.get("items", {}).get("opt_state")
    at_saved = _at_saved_shapes(target, saved)
    if at_saved is None:
        return manager_load(step, abstract)
    restored = manager_load(step, {**abstract, "items": {**items, "opt_state": at_saved}})
    got = restored["items"]
    state = relayout(got["opt_state"], tx, got["params"]["params"])
    return {**restored, "items": {**got, "opt_state": _as_target(target, state)}}


def _at_saved_shapes(target: Any, saved: Any) -> Any:
    """`target` (a nested dict of abstract arrays) at `saved`'s shapes, replicated on its mesh; None where every
    shape is the target's, or `saved` is not a tree of that structure (MaxText's restore then runs as it is)."""
    flat, tree = jax.tree_util.tree_flatten_with_path(target)
    leaves = []
    for path, x in flat:
        node = saved
        for key in path:
            name = str(getattr(key, "key", key))
            node = node.get(name) if isinstance(node, Mapping) else None
        shape = getattr(node, "shape", None)
        if shape is None or not isinstance(getattr(x, "sharding", None), NamedSharding):
            return None
        leaves.append(jax.ShapeDtypeStruct(tuple(shape), x.dtype, sharding=NamedSharding(x.sharding.mesh, P())))
    if all(a.shape == x.shape for a, (_, x) in zip(leaves, flat)):
        return None
    return jax.tree.unflatten(tree, leaves)


def _as_target(target: Any, state: Any) -> Any:
    """`state`'s arrays in the nested dict `target` is (keys: attribute names, dict keys or indices, as strings)."""
    flat = {tuple(_name(k) for k in path): x for path, x in jax.tree_util.tree_flatten_with_path(state)[0]}
    paths, tree = jax.tree_util.tree_flatten_with_path(target)
    return jax.tree.unflatten(tree, [flat[tuple(_name(k) for k in path)] for path, _ in paths])


def _name(key: Any) -> str:
    """A key path entry as a string: an attribute name, a dict key or an index."""
    return str(getattr(key, "name", getattr(key, "key", getattr(key, "idx", key))))
