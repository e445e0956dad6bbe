"""One MaxText pre-training run in its own process, for `tests/integration/test_maxtext.py`.

`python _maxtext_run.py SPEC.json`: SPEC holds `optimizer` ("adamw": MaxText's own; "zero1": it wrapped by
`zo.zero1` through `zero_optax.with_maxtext.use_zero1()`, the one call), `devices`, `out` (a JSON file written at the
end) and `args` (MaxText's `key=value` overrides). The output holds the losses by step, the optimizer state's bytes
per device after set-up (initialised or restored) and after the last step, and how many times the restore laid a
zero1 state out (`zo.relayout`).
"""

import json
import os
import pathlib
import sys

SPEC = json.loads(pathlib.Path(sys.argv[1]).read_text())
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={SPEC['devices']}"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["DECOUPLE_GCLOUD"] = "TRUE"  # no Google Cloud services

import jax  # noqa: E402
import maxtext  # noqa: E402
from maxtext.trainers.pre_train import train  # noqa: E402
from maxtext.utils import train_utils  # noqa: E402

import zero_optax.with_maxtext  # noqa: E402

relayouts = []
if SPEC["optimizer"] == "zero1":
    zero_optax.with_maxtext.use_zero1(axis_name="data")  # the one call of docs/recipes/maxtext.md
    laid_out = zero_optax.with_maxtext.relayout

    def relayout(*args, **kwargs):
        """`zo.relayout`, counted: a restore at the saved size must not call it."""
        relayouts.append(1)
        return laid_out(*args, **kwargs)

    zero_optax.with_maxtext.relayout = relayout


def bytes_per_device(opt_state) -> list[int]:
    """The optimizer state's bytes on each device, from its arrays' addressable shards."""
    per = {}
    for x in jax.tree.leaves(opt_state):
        for shard in x.addressable_shards:
            per[shard.device.id] = per.get(shard.device.id, 0) + shard.data.nbytes
    return [per[d] for d in sorted(per)]


seen = {}
maxtexts_setup = train_utils.setup_train_loop


def setup_train_loop(*args, **kwargs):
    """MaxText's set-up, noting the state's bytes per device before the first step (initialised or restored)."""
    out = maxtexts_setup(*args, **kwargs)
    seen["setup"] = bytes_per_device(out[-1].optimizer.opt_state)  # (a TrainStateNNX here)
    return out


train_utils.setup_train_loop = setup_train_loop
config_file = os.path.join(os.path.dirname(maxtext.__file__), "configs", "decoupled_base_test.yml")
config, recorder = train.initialize(["train", config_file, *SPEC["args"]])
state = train.train_loop(config, recorder)
opt_state = state["optimizer"]["opt_state"]
metrics = [json.loads(line) for line in pathlib.Path(config.metrics_file).read_text().splitlines()]
pathlib.Path(SPEC["out"]).write_text(json.dumps({"losses": {int(m["step"]): m["learning/loss"] for m in metrics},
           "setup": seen["setup"], "relayouts": len(relayouts), "end": bytes_per_device(opt_state),
           "global": sum(x.nbytes for x in jax.tree.leaves(opt_state)),
           "specs": sorted({json.dumps(list(x.sharding.spec)) for x in jax.tree.leaves(opt_state)})}))
