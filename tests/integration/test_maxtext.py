"""zero1 inside MaxText's own pre-training (`maxtext.trainers.pre_train.train`) after one call,
`zero_optax.with_maxtext.use_zero1()`.

Skipped unless MaxText is installed (it needs Python >= 3.12). Set-up (MaxText 0.2.5's wheel declares no base
dependencies; these are the packages its training entry imports), from the repository root:

    python3.12 -m venv /root/venvs/maxtext && source /root/venvs/maxtext/bin/activate
    pip install --no-deps maxtext==0.2.5
    pip install jax jaxlib flax optax orbax-checkpoint chex numpy omegaconf pydantic absl-py etils tensorboardx \
        ml-dtypes pathwaysutils jinja2 aqtp qwix tokamax huggingface_hub transformers grain drjax pillow tiktoken \
        sentencepiece sympy ml-collections
    pip install -e . pytest pytest-xdist
    pytest -n 0 tests/integration/test_maxtext.py      # about 4 minutes on 2 CPU cores (12 runs)

Each run is a process of its own (`_maxtext_run.py`, 8 simulated CPU devices): MaxText's
`configs/decoupled_base_test.yml` with `hardware=cpu dataset_type=synthetic`, a 2-layer model of width 64,
`ici_data_parallelism=8`, 6 steps. The oracle is MaxText's own AdamW (`opt_type=adamw`) on the same run.
"""

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("maxtext")

RUN = pathlib.Path(__file__).with_name("_maxtext_run.py")
MODEL = ["hardware=cpu", "dataset_type=synthetic", "skip_jax_distributed_system=true", "base_num_decoder_layers=2",
         "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=16", "base_mlp_dim=128",
         "vocab_size=256", "max_target_length=32", "dtype=float32", "ici_fsdp_parallelism=1", "learning_rate=1e-3",
         "learning_rate_schedule_steps=6", "warmup_steps_fraction=0", "log_period=1"]
STEPS = 6


def run(tmp: pathlib.Path, name: str, optimizer: str, *args: str, devices: int = 8,
        run_name: str | None = None) -> dict:
    """One MaxText run in its own process (`_maxtext_run.py`); its losses and state bytes per device."""
    out = tmp / f"{name}.json"
    spec = {"optimizer": optimizer, "devices": devices, "out": str(out),
            "args": [*MODEL, f"ici_data_parallelism={devices}", f"per_device_batch_size={8 // devices}",
                     f"base_output_directory={tmp / 'runs'}",
                     f"run_name={run_name or name}", f"metrics_file={tmp / name}.metrics", "enable_checkpointing=false",
                     "async_checkpointing=false", *args]}
    (tmp / f"{name}.spec").write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, str(RUN), str(tmp / f"{name}.spec")], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(out.read_text())
    return {**got, "losses": {int(step): loss for step, loss in got["losses"].items()}}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("maxtext")


@pytest.fixture(scope="module")
def adamw(tmp) -> dict:
    """MaxText's own AdamW, `STEPS` steps: the oracle."""
    return run(tmp, "adamw", "adamw", f"steps={STEPS}")


@pytest.mark.parametrize("over_data", [False, True])
def test_state_is_one_eighth_per_device_and_losses_equal_maxtexts_adamw(tmp, adamw, over_data):
    """zero1's state is 1/8 per device before the first step and after the last; the losses are MaxText's to float32
    rounding (bit for bit on JAX 0.12.0.1; on 0.12.1 MaxText's own AdamW moves by 1-2 ulps at three steps, zero1's
    losses are those of 0.12.0.1). With `shard_optimizer_over_data` true and false: `use_zero1` keeps the
    parameters' sharding."""
    flag = f"shard_optimizer_over_data={str(over_data).lower()}"
    got = run(tmp, f"zero1_{over_data}", "zero1", f"steps={STEPS}", flag)
    assert sorted(got["losses"]) == list(range(STEPS))
    assert got["losses"] == pytest.approx(adamw["losses"], rel=1e-6, abs=0)
    assert len(set(adamw["end"])) == 1 and adamw["end"][0] == adamw["global"]  # MaxText's AdamW: replicated
    assert got["setup"] == got["end"] == [got["global"] // 8] * 8 and got["global"] % 8 == 0
    assert got["specs"] == ['["data"]']
    assert got["global"] - adamw["global"] < 8 * 64  # the same state, padded to 8 rows


def test_checkpoint_resumes_as_the_uninterrupted_run(tmp, adamw):
    """MaxText's checkpointer saves zero1's state after 3 steps and restores it 1/8 per device; the resumed run's
    losses are the uninterrupted run's, bit for bit, and MaxText's AdamW's to float32 rounding (see above). At the
    saved size the restore is MaxText's own (no relayout)."""
    ckpt = ["enable_checkpointing=true", "checkpoint_period=100"]
    first = run(tmp, "first", "zero1", "steps=3", *ckpt, run_name="resumed")
    second = run(tmp, "second", "zero1", f"steps={STEPS}", *ckpt, run_name="resumed")
    assert sorted(first["losses"]) == [0, 1, 2] and sorted(second["losses"]) == [3, 4, 5]
    resumed = {**first["losses"], **second["losses"]}
    assert resumed == run(tmp, "zero1_uninterrupted", "zero1", f"steps={STEPS}")["losses"]
    assert resumed == pytest.approx(adamw["losses"], rel=1e-6, abs=0)
    assert second["setup"] == second["end"] == [second["global"] // 8] * 8
    assert first["relayouts"] == second["relayouts"] == 0


def test_checkpoint_resumes_at_another_data_parallel_size(tmp):
    """8 -> 4 -> 8 devices (the same global batch) through MaxText's checkpointer and `use_zero1`'s restore, which
    reads zero1's state at its saved shapes and lays it out with `zo.relayout`: 1/N per device after each restore,
    and the losses of MaxText's own AdamW moved 8 -> 4 -> 8 alike: bit for bit on 8 devices, to float32 rounding on
    4, where XLA partitions the step around zero1's gradient cut in rows (a reduce-scatter, as for GSPMD's own
    sharded state) where MaxText's AdamW all-reduces it: its third loss differs by one ulp."""
    ckpt = ["enable_checkpointing=true", "checkpoint_period=100"]
    runs = {}
    for optimizer in ("adamw", "zero1"):
        for i, (devices, steps) in enumerate([(8, 2), (4, 4), (8, STEPS)]):
            runs[optimizer, i] = run(tmp, f"moved_{optimizer}_{i}", optimizer, f"steps={steps}", *ckpt,
                                     devices=devices, run_name=f"moved_{optimizer}")
    for i, devices in enumerate([8, 4, 8]):
        got, own = runs["zero1", i], runs["adamw", i]
        assert sorted(got["losses"]) == sorted(own["losses"]) == [[0, 1], [2, 3], [4, 5]][i]
        if devices == 8:
            assert got["losses"] == own["losses"]
        else:
            assert got["losses"] == pytest.approx(own["losses"], rel=1e-6, abs=0)
        assert got["setup"] == got["end"] == [got["global"] // devices] * devices
        assert own["end"] == [own["global"]] * devices
        assert got["relayouts"] == [0, 1, 1][i]  # a restore at another size: on 4, and back on 8
