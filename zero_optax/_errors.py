"""Exceptions raised by zero_optax. Every one is a `ValueError`, so callers can catch bad input uniformly."""


class ZeroError(ValueError):
    """Base class: an input to zero_optax is wrong, and the message says how to fix it."""


class ZeroAxisError(ZeroError):
    """`init`/`update` ran outside `jax.shard_map`, or with an axis name the mesh does not bind."""


class ZeroStructureError(ZeroError):
    """Gradients, parameters or state do not match the layout the state was initialised with."""


class ZeroCouplingError(ZeroError):
    """The inner transformation couples values that this partition updates on different devices."""


class ZeroCheckpointError(ZeroError):
    """A checkpoint record is missing, damaged, or does not match what it is restored into."""
