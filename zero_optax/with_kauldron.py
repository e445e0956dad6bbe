"""Kauldron's checkpointer for zero1 states: resumes at any data-parallel size (imports `kauldron`, Python >= 3.12).

`kd.ckpts.Checkpointer` saves the whole `TrainState` as one Orbax pytree and restores each array into the new run's
sharding, so a zero1 state, whose layout depends on the device count, only comes back on the mesh that saved it.
`Checkpointer` here takes the same arguments and saves the same items, except that the optimizer state travels as an
item of its own, `opt_state`, through `zo.ZeroCheckpointHandler`, and is restored with
`zo.ZeroRestore(target, reshard=True)`: on the mesh that saved it or on any other.

    trainer = kd.train.Trainer(
        optimizer=zo.zero1(optax.adamw(1e-3), axis_name="devices", mesh=kd.sharding.DEVICES_MESH),
        checkpointer=zero_optax.with_kauldron.Checkpointer(save_interval_steps=1000),
        ...)

Importing `zero_optax` does not import this module; importing this module imports Kauldron.
"""

from __future__ import annotations

import typing
from typing import Any

import jax
from etils import epath
from kauldron import kd  # pyright: ignore[reportMissingImports]  (an optional dependency)
from kauldron.checkpoints.checkpointer import CHECKPOINT_FOLDER_NAME  # pyright: ignore[reportMissingImports]
from kauldron.train import checkpoint_state  # pyright: ignore[reportMissingImports]

from zero_optax.checkpoint._handler import ZeroCheckpointHandler, ZeroRestore, ZeroSave
from zero_optax.core._errors import ZeroCheckpointError


class _ZeroCheckpointFields(typing.NamedTuple):
    """The items of a training checkpoint: Kauldron's three, the train state without its optimizer state apart."""

    train_state: Any
    opt_state: Any
    timer: Any
    ds_iter: Any


class _ZeroCheckpointState(_ZeroCheckpointFields, kd.ckpts.items.TopLevelCheckpointItem):
    """Kauldron's `CheckpointState` with the optimizer state as an item of its own."""

    DEFAULT_ITEM = "train_state"  # where Kauldron's own checkpoints keep the train state


class _ZeroTrainFields(typing.NamedTuple):
    """The items of a train state alone (an evaluator's): the state without its optimizer state, and that state."""

    train_state: Any
    opt_state: Any


class _ZeroTrainState(_ZeroTrainFields, kd.ckpts.items.TopLevelCheckpointItem):
    """A `kd.train.TrainState` with the optimizer state as an item of its own."""

    DEFAULT_ITEM = "train_state"


class _OptState(kd.ckpts.items.CheckpointItem):
    """The optimizer state as a checkpoint item, saved and restored by `zo.ZeroCheckpointHandler`."""

    def __init__(self, state: Any):
        """Wraps `state`, the state to save or the (abstract) target to restore into."""
        self.state = state

    def __kd_ocp_handlers__(self) -> ZeroCheckpointHandler:
        """The handler for `ocp.CheckpointManager(item_handlers=)`."""
        return ZeroCheckpointHandler()

    def __kd_ocp_save_args__(self) -> ZeroSave:
        """The arguments of a save."""
        return ZeroSave(self.state)

    def __kd_ocp_restore_args__(self) -> ZeroRestore:
        """The arguments of a restore: onto the target's mesh, whatever mesh saved it."""
        return ZeroRestore(self.state, reshard=True)


class Checkpointer(kd.ckpts.Checkpointer):
    """`kd.ckpts.Checkpointer` whose checkpoints of zero1 states resume at any data-parallel size.

    Takes the arguments of `kd.ckpts.Checkpointer` and saves when it does. The optimizer state is saved by
    `zo.ZeroCheckpointHandler` as the item `opt_state` (every array in it must belong to a zero1 state) and
    restored into the zero1 state that the new run's `Trainer` initialized, on its mesh, whatever device count
    saved it. The rest are Kauldron's items: the train state (without its optimizer state, in the default item,
    where Kauldron's partial loaders read the parameters), the timer and the data iterator. A `TrainState` alone
    (a continuous evaluator's) is split alike; other states are saved and restored as `kd.ckpts.Checkpointer` does.

    Example:
      `kd.train.Trainer(optimizer=zo.zero1(optax.adamw(1e-3), axis_name="devices",
      mesh=kd.sharding.DEVICES_MESH), checkpointer=zero_optax.with_kauldron.Checkpointer(save_interval_steps=500), ...)`
      trains on 8 devices, and the same trainer resumes from its last checkpoint on 4 (see the docs' recipe).
    """

    def save(self, state: Any, *, step: int, force: bool = False, metrics: Any = None) -> bool:
        """Saves `state` (the training loop's `CheckpointState`) at `step`, its optimizer state apart."""
        return super().save(_split(state), step=step, force=force, metrics=metrics)

    def restore(self, state: Any, *, step: int = -1, noop_if_missing: bool = False, donate: bool = True) -> Any:
        """Restores the checkpoint of `step` (-1: the latest) into the structure and shardings of `state`."""
        split = _split(state)
        if split is state or self.latest_step is None:
            return super().restore(state, step=step, noop_if_missing=noop_if_missing, donate=donate)
        _check_has_opt_state(self, step)
        opt_state = split.opt_state.state
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), opt_state)
        if donate:  # as Kauldron frees the rest of `state`: the restore never holds two copies
            jax.tree.map(lambda x: x.delete() if isinstance(x, jax.Array) else None, opt_state)
        restored = super().restore(split._replace(opt_state=_OptState(target)), step=step,
                                   noop_if_missing=noop_if_missing, donate=donate)
        train_state = restored.train_state.replace(opt_state=restored.opt_state)
        if isinstance(restored, _ZeroTrainState):
            return train_state
        return checkpoint_state.CheckpointState(train_state, restored.timer, restored.ds_iter)


def _check_has_opt_state(checkpointer: Checkpointer, step: int) -> None:
    """Refuses a step that Kauldron's own checkpointer wrote (its optimizer state inside the train state)."""
    name = f"ckpt_{checkpointer.latest_step if step == -1 else step}"  # Kauldron's step directories
    path = epath.Path(checkpointer.workdir) / CHECKPOINT_FOLDER_NAME / name
    if path.exists() and not (path / "opt_state").exists():
        raise ZeroCheckpointError(
            f"The checkpoint {path} has no `opt_state` item: `kd.ckpts.Checkpointer` wrote it, with the optimizer "
            "state inside the train state. Resume it with `kd.ckpts.Checkpointer`, on the device count that saved "
            "it; a run checkpointed by `zero_optax.with_kauldron.Checkpointer` from its start resumes on any.")


def _split(state: Any) -> Any:
    """A `CheckpointState` or `TrainState` with an optimizer state as Kauldron's items and `opt_state`; else `state`."""
    if isinstance(state, checkpoint_state.CheckpointState) and state.train_state.opt_state is not None:
        return _ZeroCheckpointState(train_state=state.train_state.replace(opt_state=None),
                                    opt_state=_OptState(state.train_state.opt_state),
                                    timer=state.timer, ds_iter=state.ds_iter)
    if isinstance(state, kd.train.TrainState) and state.opt_state is not None:
        return _ZeroTrainState(train_state=state.replace(opt_state=None), opt_state=_OptState(state.opt_state))
    return state
