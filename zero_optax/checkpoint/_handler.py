"""Orbax checkpointing of zero1 states: `ZeroCheckpointHandler`, `ZeroSave`, `ZeroRestore`.

The handler wraps Orbax's `PyTreeCheckpointHandler` the way `ocp.StandardCheckpointHandler` does: the state's arrays
are saved by Orbax's own serialization as one flat dict `{name: jax.Array}` (zarr3 arrays in OCDBT databases, a few
files per process, merged by `finalize`), each host writing only the shards it holds, on any path Orbax accepts
(local or `gs://`). Beside them, the primary host writes the versioned record (`zero_record.json`, see
`zero_optax.checkpoint._record`) that says what every array is. Orbax writes the item into a temporary directory
that it renames once every host has finished, so a checkpoint is complete or absent.

Restoring checks the record field by field and against the target before reading any array, then loads into the
target's layouts and shardings (`zero_optax.checkpoint._restore`); with `reshard=True` the target may have another
world size or tensor-parallel and expert axis sizes, and each host reads only the regions its devices need.

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

import asyncio
import concurrent.futures
import dataclasses
from typing import Any

import jax
import orbax.checkpoint as ocp

from zero_optax.checkpoint import _paths, _record, _restore, _save, _schema, _shapes, _tree
from zero_optax.core._errors import ZeroCheckpointError

TYPESTR = "zero_optax._checkpoint.ZeroCheckpointHandler"
"""What `ZeroCheckpointHandler.typestr()` returns: part of the checkpoint format, so it never follows the code."""


def _run_sync(coro) -> Any:
    """Runs a coroutine to completion, also from inside a running event loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class ZeroCheckpointHandler(ocp.AsyncCheckpointHandler):
    """An Orbax handler that saves and restores pytrees of zero1 states, validated, without pickling.

    Use it through `ocp.args.Composite(..., opt_state=zo.ZeroSave(state))` in an `ocp.CheckpointManager`, or on
    its own with `ocp.Checkpointer(zo.ZeroCheckpointHandler())` / `ocp.AsyncCheckpointer(...)`. Every process
    calls `save`; Orbax writes each process's shards and the primary host writes the record. A restore loads
    into the layouts and shardings of a target state from `tx.init` on the restoring mesh (concrete, or abstract
    from `jax.eval_shape`), after checking that the checkpoint matches it; `zo.ZeroRestore(target,
    reshard=True)` also restores a checkpoint saved on another mesh.

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

    def __init__(
        self,
        *,
        save_concurrent_gb: int = 96,
        restore_concurrent_gb: int = 96,
        multiprocessing_options: ocp.options.MultiprocessingOptions = ocp.options.MultiprocessingOptions(),
    ):
        """Creates the handler.

        Args:
          save_concurrent_gb: passed to Orbax's `PyTreeCheckpointHandler`: how many GB may be in flight while
            saving.
          restore_concurrent_gb: the same for a restore that Orbax reads.
          multiprocessing_options: see `orbax.checkpoint.options`; `primary_host` writes the record.
        """
        self._primary_host = multiprocessing_options.primary_host
        self._impl = ocp.PyTreeCheckpointHandler(
            save_concurrent_gb=save_concurrent_gb,
            restore_concurrent_gb=restore_concurrent_gb,
            multiprocessing_options=multiprocessing_options,
            use_ocdbt=True,
            use_zarr3=True,
        )

    @classmethod
    def typestr(cls) -> str:
        """The name Orbax writes for this handler into a checkpoint's metadata (`item_handlers`).

        Fixed at the handler's 0.2.0 home, `zero_optax._checkpoint`, so checkpoints keep their metadata when the
        module moves (Orbax's default is the class's current module path).
        """
        return TYPESTR

    async def async_save(
        self,
        directory: Any,
        item: Any = None,
        args: ZeroSave | None = None,
    ) -> list[ocp.future.Future] | None:
        """Starts saving: checks the location and the state, hands the arrays to Orbax (which copies this
        process's shards to host memory before returning) and returns the futures that write them and the
        record.

        Args:
          directory: the item directory (Orbax's temporary directory, which may be created in the background;
            the futures wait for it).
          item: deprecated; use `args`.
          args: `ZeroSave`.

        Returns:
          Commit futures; when they are done this process's part of the checkpoint is written.

        Raises:
          ZeroCheckpointError: at once, for a location that cannot hold a checkpoint (an unsupported scheme, a
            parent that is a file) or a state that cannot be saved.
        """
        if isinstance(item, ocp.args.CheckpointArgs):
            raise ValueError("Make sure to specify kwarg name `args=` when providing `ZeroSave`.")
        if args is None:
            if item is None:
                raise ValueError("Pass the state to save as `args=zo.ZeroSave(state)`.")
            args = ZeroSave(item)
        path = _paths.as_path(directory)
        _paths.check_writable(path)
        plan = _save.plan(args.item)
        futures = list(await self._impl.async_save(path, args=_shapes.pytree_save(plan.arrays, plan.record)) or [])
        if ocp.utils.is_primary_host(self._primary_host):
            async def write_record():
                _record.write(path, plan.record)

            futures.append(ocp.future.CommitFutureAwaitingContractedSignals(write_record(), name="zero_record"))
        return futures

    def save(self, directory: Any, item: Any = None, args: ZeroSave | None = None) -> None:
        """Saves synchronously."""
        async def run():
            for f in await self.async_save(directory, item, args) or []:
                f.result()

        _run_sync(run())

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
        """The checkpoint's record (a dict, see `zero_optax.checkpoint._record`), after checking every field.

        The arrays' own Orbax metadata is `ocp.PyTreeCheckpointHandler().metadata(directory)`.
        """
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
      item: the optimizer state, e.g. `opt_state` from `tx.init`/`tx.update` where `tx` is or contains
        `zero_optax.zero1` (or Flax's `nnx.Optimizer(...).opt_state`). Every array leaf must belong to a zero1
        state; save other arrays with `ocp.args.StandardSave`.
    """

    item: Any

    def __post_init__(self):
        _tree.split(self.item, "The saved state")


@ocp.args.register_with_handler(ZeroCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class ZeroRestore(ocp.args.CheckpointArgs):
    """Restores a state saved with `ZeroSave` into `target`.

    Attributes:
      target: a state of the same optimizer from `tx.init` on the restoring mesh, concrete or abstract
        (`jax.eval_shape`, or `jax.ShapeDtypeStruct`s with `sharding`), possibly inside Flax Variables. The
        restored state has its structure, layouts and shardings. Required; it defaults to None only so that
        Orbax's restore without arguments reaches the handler and gets an explanation.
      reshard: allow a target on another mesh (data, tensor-parallel and expert axis sizes; or with other
        owners) than the checkpoint's: each host then reads only the coordinates and owned leaves its devices
        hold, exactly as `zero_optax.reshard` followed by a restore would give them.
    """

    target: Any = None
    reshard: bool = False

    def __post_init__(self):
        if not isinstance(self.reshard, bool):
            raise ZeroCheckpointError(f"`reshard` must be True or False, got {self.reshard!r}.")
        if self.target is not None:
            _tree.split(self.target, "The restore target")
