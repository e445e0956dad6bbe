"""zero_optax: ZeRO stage 1 optimizer-state sharding for JAX, as an optax GradientTransformation."""

from zero_optax._checkpoint import ZeroCheckpointHandler
from zero_optax._checkpoint import ZeroRestore
from zero_optax._checkpoint import ZeroSave
from zero_optax._errors import ZeroCheckpointError
from zero_optax._errors import ZeroCouplingError
from zero_optax._errors import ZeroError
from zero_optax._errors import ZeroStructureError
from zero_optax._layout import Layout
from zero_optax._migrate import Migration
from zero_optax._migrate import ParamSlice
from zero_optax._migrate import RankRecord
from zero_optax._migrate import load_rank_records
from zero_optax._migrate import reshard_explicit
from zero_optax._owners import balanced_owners
from zero_optax._reduce import reduce_gradients
from zero_optax._reshard import reshard
from zero_optax._state import ZeroFlatState
from zero_optax._state import ZeroLeafState
from zero_optax._zero1 import as_local
from zero_optax._zero1 import describe
from zero_optax._zero1 import zero1

__version__ = "0.1.0"

__all__ = (
    "Layout",
    "Migration",
    "ParamSlice",
    "RankRecord",
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
    "load_rank_records",
    "reduce_gradients",
    "reshard",
    "reshard_explicit",
    "zero1",
)
