"""One MaxText pre-training run in its own process, for `tests/integration/test_maxtext.py`.

`python _maxtext_run.py SPEC.json`: SPEC holds `optimizer` ("adamw": MaxText's own; "zero1": it wrapped by
`zo.zero1`), `devices`, `out` (a JSON file written at the end) and `args` (MaxText's `key=value` overrides). The
output holds the losses by step and the optimizer state's bytes per device after set-up (initialised or restored)
and after the last step.
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
from maxtext.optimizers import optimizers  # noqa: E402
from maxtext.trainers.pre_train import train  # noqa: E402
from maxtext.utils import train_utils  # noqa: E402

import zero_optax as zo  # noqa: E402

if SPEC["optimizer"] == "zero1":
    maxtexts_own = optimizers.get_optimizer

    def get_optimizer(config, learning_rate_schedule, model=None, mesh=None):
        """MaxText's optimizer, its state sharded by zero1 over the mesh's "data" axis."""
        return zo.zero1(maxtexts_own(config, learning_rate_schedule, model, mesh=mesh), axis_name="data", mesh=mesh)

    optimizers.get_optimizer = get_optimizer
    if SPEC.get("relayout_call"):
        made = []

        def get_optimizer_kept(*args, **kwargs):
            made.append(get_optimizer(*args, **kwargs))
            return made[-1]

        optimizers.get_optimizer = get_optimizer_kept
        from jax.sharding import NamedSharding  # noqa: E402
        from jax.sharding import PartitionSpec as P  # noqa: E402
        from maxtext.common import checkpointing  # noqa: E402

        def as_saved(target, saved):
            """The restore target with the saved shapes of zero1's arrays, replicated on the new mesh."""
            if isinstance(target, dict):
                return {k: as_saved(v, saved[str(k)]) for k, v in target.items()}
            return jax.ShapeDtypeStruct(saved.shape, target.dtype, sharding=NamedSharding(target.sharding.mesh, P()))

        def like(target, state):
            """`state`'s arrays in the nested dict `target` is (its keys, ints or strings)."""
            flat = {tuple(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in p): v
                    for p, v in jax.tree_util.tree_flatten_with_path(state)[0]}

            def walk(node, at):
                return {k: walk(v, (*at, str(k))) for k, v in node.items()} if isinstance(node, dict) else flat[at]
            return walk(target, ())

        maxtexts_load = checkpointing.load_state_if_possible

        def load_state_if_possible(checkpoint_manager, *args, **kwargs):
            """MaxText's restore, reading zero1's state at its saved shapes and laying it out for this run."""
            if checkpoint_manager is not None:
                manager_load = checkpoint_manager.load_checkpointables

                def load_checkpointables(step, abstract):
                    saved = checkpoint_manager.checkpointables_metadata(step).metadata["items"]["opt_state"]
                    target = abstract["items"]["opt_state"]
                    restored = manager_load(step, {**abstract, "items": {**abstract["items"],
                                                                         "opt_state": as_saved(target, saved)}})
                    items = restored["items"]
                    state = zo.relayout(items["opt_state"], made[-1], items["params"]["params"])
                    return {**restored, "items": {**items, "opt_state": like(target, state)}}

                checkpoint_manager.load_checkpointables = load_checkpointables
            return maxtexts_load(checkpoint_manager, *args, **kwargs)

        checkpointing.load_state_if_possible = load_state_if_possible
    if SPEC.get("over_data_call"):
        # the documented call of docs/recipes/maxtext.md: MaxText's own ZeRO-1 shards the parameters like Adam's `mu`,
        # which a zero1 state does not hold; zero1 shards the state itself, so the parameters keep their sharding
        import types  # noqa: E402

        from maxtext.utils import sharding  # noqa: E402

        maxtexts_params_sharding = sharding.maybe_update_params_sharding_with_opt
        sharding.maybe_update_params_sharding_with_opt = lambda config, shardings: maxtexts_params_sharding(
            types.SimpleNamespace(shard_optimizer_over_data=False), shardings)


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
           "setup": seen["setup"], "end": bytes_per_device(opt_state),
           "global": sum(x.nbytes for x in jax.tree.leaves(opt_state)),
           "specs": sorted({json.dumps(list(x.sharding.spec)) for x in jax.tree.leaves(opt_state)})}))
