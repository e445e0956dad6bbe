"""zero_optax: ZeRO stage 1 optimizer-state sharding for JAX, as an optax GradientTransformation."""

from zero_optax._plan import (
    Plan,
    plan,
)
from zero_optax.api._flax import (
    ZeroOptimizer,
    ZeroTrainState,
)
from zero_optax.api._transfer import (
    gather_state,
    master_params,
    relayout,
    scatter_state,
)
from zero_optax.api._zero1 import (
    apply_gradients,
    as_local,
    describe,
    zero1,
)
from zero_optax.checkpoint._handler import (
    ZeroCheckpointHandler,
    ZeroRestore,
    ZeroSave,
)
from zero_optax.checkpoint._offline import reshard
from zero_optax.checkpoint._rank_migration import (
    Migration,
    ParamSlice,
    RankRecord,
    load_rank_records,
    reshard_explicit,
    state_from_rank_records,
)
from zero_optax.core._errors import (
    OwnersError,
    StoreError,
    WeightError,
    ZeroAxisError,
    ZeroCheckpointError,
    ZeroCouplingError,
    ZeroError,
    ZeroGradientError,
    ZeroStructureError,
)
from zero_optax.core._version import __version__ as __version__
from zero_optax.layout._attribution import balanced_owners
from zero_optax.layout._layout import Layout
from zero_optax.layout._specs import state_specs
from zero_optax.layout._state import (
    ZeroFlatState,
    ZeroLeafState,
    ZeroState,
)
from zero_optax.step._quantize import Quantize
from zero_optax.step._reduce import reduce_gradients

__all__ = (
    "Layout",
    "Migration",
    "OwnersError",
    "ParamSlice",
    "Plan",
    "Quantize",
    "RankRecord",
    "StoreError",
    "WeightError",
    "ZeroAxisError",
    "ZeroCheckpointError",
    "ZeroCheckpointHandler",
    "ZeroCouplingError",
    "ZeroError",
    "ZeroFlatState",
    "ZeroGradientError",
    "ZeroLeafState",
    "ZeroOptimizer",
    "ZeroRestore",
    "ZeroSave",
    "ZeroState",
    "ZeroStructureError",
    "ZeroTrainState",
    "apply_gradients",
    "as_local",
    "balanced_owners",
    "describe",
    "gather_state",
    "load_rank_records",
    "master_params",
    "plan",
    "reduce_gradients",
    "relayout",
    "reshard",
    "reshard_explicit",
    "scatter_state",
    "state_from_rank_records",
    "state_specs",
    "zero1",
)
