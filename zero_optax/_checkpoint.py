"""Orbax checkpointing of ZeRO optimizer states: `ZeroCheckpointHandler`, `ZeroSave`, `ZeroRestore`.

The handler writes the item directory Orbax hands it (a temporary directory that Orbax renames once every
process has finished, so a checkpoint is either complete or absent)::

    <item>/zero_record.json        the versioned record (zero_optax._record), written by the primary process
    <item>/arrays/<i>.<name>/      one zarr array per stored array (zero_optax._store); every process writes
                                   the rows its devices hold

Saving copies this process's shards to host memory before `async_save` returns, so training may continue (and
donate the state's buffers) while a background thread writes the files. Restoring validates everything first
(record format and version, world size, owners, leaves, inner-state entries, tree structure, every array file's
metadata and size) and reads nothing unless all of it matches; arrays then load straight into the target's
shardings, one region per local device.

Example::

    import orbax.checkpoint as ocp
    import zero_optax as zo

    with ocp.CheckpointManager(path) as mngr:
      mngr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                              opt_state=zo.ZeroSave(opt_state)))
      restored = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(params),
                                                            opt_state=zo.ZeroRestore(target_opt_state)))
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from zero_optax import _record, _store
from zero_optax._errors import ZeroCheckpointError
from zero_optax._state import ZeroFlatState, ZeroLeafState

_MAX_WRITERS = 8


def _is_zero(x: Any) -> bool:
    return isinstance(x, (ZeroFlatState, ZeroLeafState))


def _split(tree: Any, what: str) -> tuple[list[tuple[str, Any]], Any]:
    """The zero1 states of `tree` with their key paths, and the treedef with each zero1 state as a leaf.

    Raises ZeroCheckpointError when `tree` has no zero1 state or has leaves outside zero1 states.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_zero)
    for path, leaf in flat:
        if not _is_zero(leaf):
            raise ZeroCheckpointError(
                f"{what} has a leaf outside any zero1 state at `{jax.tree_util.keystr(path)}` "
                f"({type(leaf).__name__}). ZeroSave/ZeroRestore handle only zero1 states (and empty nodes "
                "such as optax.EmptyState()); save other arrays with ocp.args.StandardSave as a separate item "
                "of ocp.args.Composite.")
    if not flat:
        raise ZeroCheckpointError(f"{what} contains no zero1 state (ZeroFlatState or ZeroLeafState).")
    return [(jax.tree_util.keystr(path) or "<root>", leaf) for path, leaf in flat], treedef


def _where(i: int, path: str) -> str:
    return f"zero1 state {i} (at `{path}`)"


def _array_dir(directory: Any, name: str) -> str:
    return os.path.join(os.fspath(directory), _record.ARRAYS_DIR, name)


def _host_copy(shard: jax.Shard) -> np.ndarray:
    """A host copy of a shard that owns its memory (CPU arrays alias the device buffer otherwise)."""
    data = np.asarray(shard.data)
    return np.array(data, copy=True) if shard.device.platform == "cpu" else data


@dataclasses.dataclass(frozen=True)
class _SavePlan:
    """Everything a save writes, already in host memory."""

    record: dict[str, Any]
    arrays: list[tuple[str, tuple[int, ...], str, list[tuple[Any, np.ndarray]]]]


def _plan_save(tree: Any) -> _SavePlan:
    """Validates `tree`, copies this process's shards to host memory, and builds the record."""
    states, treedef = _split(tree, "The saved state")
    records, arrays = [], []
    for i, (path, state) in enumerate(states):
        values = _record.state_arrays(state)
        specs = _record.array_names(state.layout, i)
        if len(values) != len(specs):
            raise ZeroCheckpointError(
                f"{_where(i, path)} has {len(values)} arrays but its layout describes {len(specs)}.")
        for spec, value in zip(specs, values):
            if not isinstance(value, jax.Array):
                raise ZeroCheckpointError(
                    f"{_where(i, path)}: array {spec['name']} is a {type(value).__name__}, not a jax.Array; "
                    "save the state that zero1's init/update returned.")
            if value.is_deleted():
                raise ZeroCheckpointError(
                    f"{_where(i, path)}: array {spec['name']} was deleted (donated to a later step?); save the "
                    "state before passing it to a jitted function that donates it.")
            if list(value.shape) != spec["shape"] or np.dtype(value.dtype).name != spec["dtype"]:
                raise ZeroCheckpointError(
                    f"{_where(i, path)}: array {spec['name']} is {list(value.shape)} {np.dtype(value.dtype).name} "
                    f"but its layout says {spec['shape']} {spec['dtype']}.")
        records.append(_record.layout_record(state.layout, i, _record.read_clocks(state)))
        shards = [[s for s in v.addressable_shards if s.replica_id == 0] for v in values]
        for group in shards:  # Start every device-to-host transfer before waiting for any.
            for s in group:
                s.data.copy_to_host_async()
        for spec, group in zip(specs, shards):
            regions = [(s.index, _host_copy(s)) for s in group]
            arrays.append((spec["name"], tuple(spec["shape"]), spec["dtype"], regions))
    return _SavePlan(_record.new_record(str(treedef), records), arrays)


def _write(directory: Any, plan: _SavePlan, primary: bool) -> None:
    """Writes this process's regions of every array, then (primary process) the record."""
    def write_one(item):
        name, shape, dtype, regions = item
        try:
            _store.write_regions(_array_dir(directory, name), shape, dtype, regions)
        except (ValueError, OSError) as e:  # StoreError and TensorStore's errors are ValueErrors.
            raise ZeroCheckpointError(f"cannot write array {name} to {os.fspath(directory)}: {e}") from e

    with concurrent.futures.ThreadPoolExecutor(min(_MAX_WRITERS, max(len(plan.arrays), 1))) as pool:
        for _ in pool.map(write_one, plan.arrays):
            pass
    if primary:
        _record.write_record(directory, plan.record)


class ZeroCheckpointHandler(ocp.AsyncCheckpointHandler):
    """An Orbax handler that saves and restores pytrees of zero1 states, validated, without pickling.

    Use it through `ocp.args.Composite(..., opt_state=zo.ZeroSave(state))` in an `ocp.CheckpointManager`, or on
    its own with `ocp.Checkpointer(zo.ZeroCheckpointHandler())` / `ocp.AsyncCheckpointer(...)`. Every process
    calls `save`; each writes the rows its devices hold and the primary process writes the record. A restore
    loads into the shardings and layouts of a target state from `tx.init` on the restoring mesh (concrete or
    `jax.eval_shape` abstract), after checking that the checkpoint matches it exactly; a different world size
    needs `zero_optax.reshard` first.
    """

    def __init__(
        self,
        *,
        multiprocessing_options: ocp.options.MultiprocessingOptions = ocp.options.MultiprocessingOptions(),
    ):
        """Creates the handler.

        Args:
          multiprocessing_options: see `orbax.checkpoint.options`; `primary_host` writes the record.
        """
        self._primary_host = multiprocessing_options.primary_host

    def _start_save(self, directory: Any, item: Any, args: ZeroSave | None) -> list[ocp.future.Future]:
        if isinstance(item, ocp.args.CheckpointArgs):
            raise ValueError("Make sure to specify kwarg name `args=` when providing `ZeroSave`.")
        if args is None:
            if item is None:
                raise ValueError("Pass the state to save as `args=zo.ZeroSave(state)`.")
            args = ZeroSave(item)
        plan = _plan_save(args.item)
        primary = ocp.utils.is_primary_host(self._primary_host)

        async def commit():
            _write(directory, plan, primary)

        return [ocp.future.CommitFutureAwaitingContractedSignals(commit(), name="zero_optax_save")]

    async def async_save(
        self,
        directory: Any,
        item: Any = None,
        args: ZeroSave | None = None,
    ) -> list[ocp.future.Future] | None:
        """Copies this process's shards to host memory and returns futures that write them.

        Args:
          directory: the item directory (Orbax's temporary directory; it may be created in the background, which
            the returned futures wait for).
          item: deprecated; use `args`.
          args: `ZeroSave`.

        Returns:
          Commit futures; when they are done this process's part of the checkpoint is on disk.
        """
        return self._start_save(directory, item, args)

    def save(self, directory: Any, item: Any = None, args: ZeroSave | None = None) -> None:
        """Saves synchronously."""
        for f in self._start_save(directory, item, args):
            f.result()

    def restore(self, directory: Any, item: Any = None, args: ZeroRestore | None = None) -> Any:
        """Restores into the structure, layouts and shardings of `args.target`, after validating everything.

        Raises:
          ZeroCheckpointError: naming the first difference between the checkpoint and the target, or the first
            missing or damaged file. Nothing is loaded in that case.
        """
        if isinstance(item, ocp.args.CheckpointArgs):
            raise ValueError("Make sure to specify kwarg name `args=` when providing `ZeroRestore`.")
        if args is None:
            args = ZeroRestore(item)
        if args.target is None:
            raise ZeroCheckpointError(
                "Restoring a zero1 state needs a target: pass `args=zo.ZeroRestore(target)` with a state from "
                "`tx.init` on the restoring mesh (concrete or from jax.eval_shape).")
        directory = os.fspath(directory)
        record = _record.read_record(directory)
        states, treedef = _split(args.target, "The restore target")
        plan = _plan_restore(directory, record, states, str(treedef))
        restored = []
        for (path, state), items in zip(states, plan):
            arrays = []
            for name, shape, dtype, sharding in items:
                try:
                    arrays.append(_store.read_to_jax(_array_dir(directory, name), shape, dtype, sharding))
                except (ValueError, OSError) as e:  # StoreError and TensorStore's errors are ValueErrors.
                    raise ZeroCheckpointError(f"cannot read array {name} of {directory}: {e}") from e
            restored.append(_rebuild(state, arrays))
        return jax.tree.unflatten(treedef, restored)

    def metadata(self, directory: Any) -> dict[str, Any]:
        """The checkpoint's record (a dict, see `zero_optax._record`), after checking its format and version."""
        return _record.read_record(directory)

    def finalize(self, directory: Any) -> None:
        """Nothing to do: the record is written by the primary process as part of its save."""
        del directory

    def close(self) -> None:
        """Nothing to release: saves hold no resources beyond their futures."""


def _plan_restore(directory: str, record: dict[str, Any], states: list[tuple[str, Any]], tree: str):
    """Checks the record and every array file against the target; returns what to read for each state."""
    saved = record.get("states")
    if not isinstance(saved, list) or not all(isinstance(s, dict) for s in saved):
        raise ZeroCheckpointError(f"{directory}: the record has no valid `states` list; the checkpoint is damaged.")
    if len(saved) != len(states):
        raise ZeroCheckpointError(
            f"{directory} holds {len(saved)} zero1 states but the target has {len(states)} (checkpoint tree "
            f"{record.get('tree')!r}, target tree {tree!r}).")
    plans = []
    for i, ((path, state), rec) in enumerate(zip(states, saved)):
        where = _where(i, path)
        target = _record.layout_record(state.layout, i)
        try:
            difference = _record.first_difference(rec, target, where)
        except (KeyError, TypeError) as e:
            raise ZeroCheckpointError(f"{directory}: the record of {where} is damaged ({e!r}).") from None
        if difference is not None:
            raise ZeroCheckpointError(difference)
        values = _record.state_arrays(state)
        items = []
        for spec, value in zip(target["arrays"], values):
            shape, dtype = tuple(spec["shape"]), spec["dtype"]
            if tuple(value.shape) != shape or np.dtype(value.dtype).name != dtype:
                raise ZeroCheckpointError(
                    f"{where}: the target's array {spec['name']} is {list(value.shape)} "
                    f"{np.dtype(value.dtype).name} but its layout says {list(shape)} {dtype}.")
            sharding = _concrete_sharding(getattr(value, "sharding", None), f"{where}: the target's array "
                                          f"{spec['name']}")
            items.append((spec["name"], shape, dtype, sharding))
        plans.append(items)
    if record.get("tree") != tree:
        raise ZeroCheckpointError(
            f"{directory}: the saved pytree is {record.get('tree')!r} but the target is {tree!r} (zero1 states "
            "shown as *).")
    for items in plans:
        for name, shape, dtype, _ in items:
            try:
                _store.validate_array(_array_dir(directory, name), shape, dtype)
            except _store.StoreError as e:
                raise ZeroCheckpointError(
                    f"{directory} is incomplete or damaged: array {name}: {e}. Nothing was loaded.") from None
    return plans


def _concrete_sharding(sharding: Any, what: str) -> jax.sharding.Sharding:
    """The target sharding to load into; a NamedSharding over an AbstractMesh (what `jax.eval_shape` gives)
    is made concrete with the mesh set by `jax.set_mesh`."""
    if not isinstance(sharding, jax.sharding.Sharding):
        raise ZeroCheckpointError(
            f"{what} has no sharding; use the state from `tx.init` on the restoring mesh, or abstract leaves "
            "jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding).")
    if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(sharding.mesh, jax.sharding.AbstractMesh):
        mesh = jax.sharding.get_mesh()
        if mesh.empty or mesh.abstract_mesh != sharding.mesh:
            raise ZeroCheckpointError(
                f"{what} is sharded over an abstract mesh ({sharding.mesh}), which names no devices. Restore "
                "inside `with jax.set_mesh(mesh):` with the concrete mesh, or give the target leaves "
                "NamedSharding(mesh, spec).")
        return jax.sharding.NamedSharding(mesh, sharding.spec)
    return sharding


def _rebuild(target: Any, arrays: list[jax.Array]) -> Any:
    """A state like `target` (same layout object) holding `arrays`, in `_record.state_arrays` order."""
    if isinstance(target, ZeroFlatState):
        inner = jax.tree.unflatten(jax.tree.structure(target.inner_state), arrays)
        return ZeroFlatState(inner, target.layout)
    return ZeroLeafState(dict(zip(target.layout.state_packing.sizes, arrays)), target.layout)


@ocp.args.register_with_handler(ZeroCheckpointHandler, for_save=True)
@dataclasses.dataclass
class ZeroSave(ocp.args.CheckpointArgs):
    """Saves an optax state that contains zero1 states, with `ZeroCheckpointHandler`.

    Attributes:
      item: the optimizer state, e.g. `opt_state` from `tx.init`/`tx.update` where `tx` is or contains
        `zero_optax.zero1`. Every array leaf must belong to a zero1 state; save other arrays with
        `ocp.args.StandardSave`.
    """

    item: Any

    def __post_init__(self):
        _split(self.item, "The saved state")


@ocp.args.register_with_handler(ZeroCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class ZeroRestore(ocp.args.CheckpointArgs):
    """Restores a state saved with `ZeroSave` into `target`.

    Attributes:
      target: a state of the same optimizer from `tx.init` on the restoring mesh, concrete or abstract
        (`jax.eval_shape`, or `jax.ShapeDtypeStruct`s with `sharding`). The restored state has its layouts and
        shardings. Required; it defaults to None only so that Orbax's restore without arguments reaches the
        handler and gets an explanation.
    """

    target: Any = None

    def __post_init__(self):
        if self.target is not None:
            _split(self.target, "The restore target")
