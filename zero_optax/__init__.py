"""zero_optax: ZeRO stage 1 optimizer-state sharding for JAX, as an optax GradientTransformation."""

from zero_optax._checkpoint import ZeroCheckpointHandler
from zero_optax._checkpoint import ZeroRestore
from zero_optax._checkpoint import ZeroSave
from zero_optax._errors import ZeroCheckpointError
from zero_optax._errors import ZeroCouplingError
from zero_optax._errors import ZeroError
from zero_optax._errors import ZeroStructureError
from zero_optax._layout import Layout
from zero_optax._owners import balanced_owners
from zero_optax._reduce import reduce_gradients
from zero_optax._state import ZeroFlatState
from zero_optax._state import ZeroLeafState
from zero_optax._zero1 import as_local
from zero_optax._zero1 import describe
from zero_optax._zero1 import zero1

__version__ = "0.1.0"

__all__ = (
    "Layout",
    "ZeroCheckpointError",
    "ZeroCheckpointHandler",
    "ZeroCouplingError",
    "ZeroError",
    "ZeroFlatState",
    "ZeroLeafState",
    "ZeroRestore",
    "ZeroSave",
    "ZeroStructureError",
    "as_local",
    "balanced_owners",
    "describe",
    "reduce_gradients",
    "zero1",
)
