"""Orbax checkpointing of zero1 states: `ZeroCheckpointHandler`, `ZeroSave`, `ZeroRestore`.

Like `ocp.StandardCheckpointHandler`, the handler wraps Orbax's `PyTreeCheckpointHandler`, which saves the state's
arrays as one flat dict (each host its own shards); beside them the primary host writes the record (`_record`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Any

import jax
import jax.core
import orbax.checkpoint as ocp
from orbax.checkpoint import future

from zero_optax.checkpoint import _arrays, _paths, _record, _restore, _schema
from zero_optax.core._errors import ZeroCheckpointError
from zero_optax.layout import _placement


@dataclasses.dataclass(frozen=True)
class SavePlan:
    """Everything a save writes: array name -> the state's global array, and the JSON record."""

    arrays: dict[str, jax.Array]
    record: dict[str, Any]


def save_plan(tree: Any) -> SavePlan:
    """What saving `tree` writes; refuses arrays that are not live `jax.Array`s as their layouts describe them."""
    parts = _arrays.split(tree, "The saved state")
    arrays, states = {}, []
    for k, (path, state) in enumerate(parts.states):
        where = _arrays.where(k, path)
        layout = state.layout
        for d in {x.dtype for x in layout.leaves} | {e.dtype for e in layout.entries}:
            if d not in _schema.DTYPES:
                raise ZeroCheckpointError(f"{where} holds {d} arrays, which zero_optax checkpoints do not store "
                                          f"(they store {', '.join(sorted(_schema.DTYPES))}).")
        specs = _arrays.stored_arrays(layout, k)
        for value in jax.tree.leaves(state):
            if not isinstance(value, jax.Array) or isinstance(value, jax.core.Tracer):
                raise ZeroCheckpointError(f"{where} holds a {type(value).__name__}, not a jax.Array; save the state "
                                          "that zero1's init/update returned.")
            if value.is_deleted():
                raise ZeroCheckpointError(f"{where} holds an array that was deleted (donated to a later step?); "
                                          "save the state before passing it to a jitted function that donates it.")
        if (misplaced := _placement.misplaced(state)) is not None:
            raise ZeroCheckpointError(f"{where}: {misplaced}")
        values = _arrays.state_values(state)
        if len(values) != len(specs):
            raise ZeroCheckpointError(f"{where} has {len(values)} arrays but its layout describes {len(specs)}.")
        for spec, value in zip(specs, values):
            _arrays.check_value(f"{where}: array {spec.name}", spec, value)
            arrays[spec.name] = value
        states.append(_record.state_record(layout, k, _record.read_clocks(state)))
    return SavePlan(arrays, _record.new_record(parts.signature, states, _record.STORAGE_ORBAX))


class ZeroCheckpointHandler(ocp.AsyncCheckpointHandler):
    """An Orbax handler that saves and restores pytrees of zero1 states, validated, without pickling.

    Use it through `zo.ZeroSave` / `zo.ZeroRestore` in an `ocp.CheckpointManager` (`ocp.args.Composite`), or with
    `ocp.Checkpointer(zo.ZeroCheckpointHandler())`. Every process calls `save`. A restore loads into the layouts
    and shardings of a target state from `tx.init` on the restoring mesh (concrete or abstract), after checking
    that the checkpoint matches it.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, tempfile, orbax.checkpoint as ocp, zero_optax as zo
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = zo.zero1(optax.adam(1e-2), axis_name="data")
      >>> init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=jax.P(), out_specs=jax.P("data")))
      >>> state = init({"w": jnp.ones(3)})
      >>> path = tempfile.mkdtemp() + "/opt_state"
      >>> with ocp.Checkpointer(zo.ZeroCheckpointHandler()) as ckpt:
      ...     ckpt.save(path, args=zo.ZeroSave(state))
      ...     restored = ckpt.restore(path, args=zo.ZeroRestore(state))
      >>> zo.gather_state(restored)[0].mu["w"].tolist()
      [0.0, 0.0, 0.0]
    """

    def __init__(self, *, save_concurrent_gb: int = 96, restore_concurrent_gb: int = 96,
                 multiprocessing_options: ocp.options.MultiprocessingOptions = ocp.options.MultiprocessingOptions()):  # noqa: B008 (immutable)
        """Creates the handler.

        Args:
          save_concurrent_gb: how many GB Orbax's `PyTreeCheckpointHandler` may have in flight while saving.
          restore_concurrent_gb: the same while restoring.
          multiprocessing_options: see `orbax.checkpoint.options`; `primary_host` writes the record.
        """
        self._primary_host = multiprocessing_options.primary_host
        self._impl = ocp.PyTreeCheckpointHandler(
            save_concurrent_gb=save_concurrent_gb, restore_concurrent_gb=restore_concurrent_gb,
            multiprocessing_options=multiprocessing_options, use_ocdbt=True, use_zarr3=True)

    @classmethod
    def typestr(cls) -> str:
        """The name Orbax writes for this handler into a checkpoint's metadata, fixed whatever module holds it."""
        return "zero_optax._checkpoint.ZeroCheckpointHandler"  # part of the checkpoint format: never follows the code

    async def async_save(self, directory: Any, item: Any = None,
                         args: ZeroSave | None = None) -> list[future.Future] | None:
        """Starts saving `args` (a `ZeroSave`; `item` is deprecated) into the item directory `directory`.

        Returns:
          Commit futures; when they are done this process's part of the checkpoint (arrays and record) is written.

        Raises:
          ZeroCheckpointError: at once, for a location or a state that cannot be saved.
        """
        if isinstance(item, ocp.args.CheckpointArgs):
            raise ValueError("Make sure to specify kwarg name `args=` when providing `ZeroSave`.")
        if args is None:
            if item is None:
                raise ValueError("Pass the state to save as `args=zo.ZeroSave(state)`.")
            args = ZeroSave(item)
        path = _paths.as_path(directory)
        _paths.check_writable(path)
        plan = save_plan(args.item)
        futures = list(await self._impl.async_save(path, args=_record.pytree_save(plan.arrays, plan.record)) or [])
        if ocp.utils.is_primary_host(self._primary_host):
            async def write_record():
                _record.write(path, plan.record)

            futures.append(future.CommitFutureAwaitingContractedSignals(write_record(), name="zero_record"))
        return futures

    def save(self, directory: Any, item: Any = None, args: ZeroSave | None = None) -> None:
        """Saves synchronously, also from inside a running event loop (a notebook)."""
        async def run():
            for f in await self.async_save(directory, item, args) or []:
                f.result()

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(run())
            return
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, run()).result()

    def restore(self, directory: Any, item: Any = None, args: ZeroRestore | None = None) -> Any:
        """Restores into the structure, layouts and shardings of `args.target`, after validating everything.

        Raises:
          ZeroCheckpointError: naming the first difference between the checkpoint and the target, or the first
            missing or damaged part. Nothing is loaded in that case.
        """
        if isinstance(item, ocp.args.CheckpointArgs):
            raise ValueError("Make sure to specify kwarg name `args=` when providing `ZeroRestore`.")
        if args is None:
            args = ZeroRestore(item)
        if args.target is None:
            raise ZeroCheckpointError(
                "Restoring a zero1 state needs a target: pass `args=zo.ZeroRestore(target)` with a state from "
                "`tx.init` on the restoring mesh (concrete or from jax.eval_shape).")
        return _restore.restore(directory, args.target, args.reshard, self._orbax_read)

    def _orbax_read(self, directory: Any, structs: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
        restore_args = {name: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype)
                        for name, s in structs.items()}
        return self._impl.restore(directory, args=ocp.args.PyTreeRestore(item=structs, restore_args=restore_args))

    def metadata(self, directory: Any) -> dict[str, Any]:
        """The checkpoint's record (a dict, see `zero_optax.checkpoint._record`), after checking every field."""
        record = _record.read(directory)
        _schema.parse(record, str(_paths.as_path(directory)))
        return record

    def finalize(self, directory: Any) -> None:
        """Orbax's finalization: merges the per-process OCDBT databases into one."""
        self._impl.finalize(directory)

    def close(self) -> None:
        """Closes the wrapped Orbax handler."""
        self._impl.close()


@ocp.args.register_with_handler(ZeroCheckpointHandler, for_save=True)
@dataclasses.dataclass
class ZeroSave(ocp.args.CheckpointArgs):
    """Saves an optax state that contains zero1 states, with `ZeroCheckpointHandler`.

    Attributes:
      item: the optimizer state from a `tx` that is or contains `zo.zero1` (or `nnx.Optimizer(...).opt_state`).
        Every array leaf must belong to a zero1 state; save other arrays with `ocp.args.StandardSave`.

    Example:
      `mngr.save(step, args=ocp.args.Composite(opt_state=zo.ZeroSave(opt_state)))`; see `ZeroCheckpointHandler`.
    """

    item: Any

    def __post_init__(self):
        _arrays.split(self.item, "The saved state")


@ocp.args.register_with_handler(ZeroCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class ZeroRestore(ocp.args.CheckpointArgs):
    """Restores a state saved with `ZeroSave` into `target`.

    Attributes:
      target: a state of the same optimizer from `tx.init` on the restoring mesh, concrete or abstract
        (`jax.eval_shape`), possibly inside Flax Variables; the result has its structure, layouts and shardings.
        Required: the default None only lets Orbax's restore without arguments reach an explanation.
      reshard: allow a target on another mesh (data, tensor-parallel and expert axis sizes, owners): each host
        reads only what its devices hold, exactly as `zo.reshard` and a restore would give.

    Example:
      `mngr.restore(step, args=ocp.args.Composite(opt_state=zo.ZeroRestore(target, reshard=True)))`.
    """

    target: Any = None
    reshard: bool = False

    def __post_init__(self):
        if not isinstance(self.reshard, bool):
            raise ZeroCheckpointError(f"`reshard` must be True or False, got {self.reshard!r}.")
        if self.target is not None:
            _arrays.split(self.target, "The restore target")
