"""Every exception zero_optax raises. Each is a `ValueError` (through `ZeroError`), so callers can catch bad input
uniformly, and each message names what is wrong and how to fix it."""


class ZeroError(ValueError):
    """Base class: an input to zero_optax is wrong, and the message says how to fix it."""


class ZeroAxisError(ZeroError):
    """`init`/`update` ran outside `jax.shard_map` without a mesh, or with an axis name the mesh does not bind."""


class ZeroStructureError(ZeroError):
    """Gradients, parameters, extra arguments or state do not match the layout the state was initialised with."""


class ZeroGradientError(ZeroError):
    """Gradients whose meaning (per-device sum or global mean) does not fit the `reduce` setting."""


class ZeroCouplingError(ZeroError):
    """The inner transformation couples values that this partition updates on different devices."""


class NotZero1Error(ZeroError):
    """A function that needs a zero1 transformation (`scatter_state`, say) got another (a chain holding one)."""


class ZeroCheckpointError(ZeroError):
    """A checkpoint record is missing, damaged, or does not match what it is restored into."""


class WeightError(ZeroError):
    """A sample/token weight is negative or not a scalar."""


class OwnersError(ZeroError):
    """An `owners` list does not fit the parameters or the world size."""


class StoreError(ZeroCheckpointError):
    """A stored array is missing, incomplete, or does not match what was expected."""
