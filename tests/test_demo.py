"""`python -m zero_optax.demo`, the main job: it trains, checks every step against plain optax, reshards, resumes."""

import os
import re
import subprocess
import sys
from pathlib import Path

import optax
import pytest

import zero_optax as zo
from zero_optax import demo

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_demo_end_to_end(tmp_path):
    """The default run (AdamW flat, then Muon leaf) at few steps, as a user starts it."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "160"}  # this checkout's zero_optax; wide tables
    proc = subprocess.run([sys.executable, "-m", "zero_optax.demo", "--steps", "4", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "OK: every step of zero1 matched plain optax" in proc.stdout, log
    # One row per optimizer in the checks table, each passing: 2 steps on 8 devices, then 2 on 4.
    for name in ("AdamW flat", "Muon leaf"):
        row = next(line for line in proc.stdout.splitlines() if name in line and "2 (8) + 2 (4)" in line)
        assert "pass" in row and "FAIL" not in row, row
    # The memory table, under a one-line title: per optimizer, replicated optax's bytes, then zero1's on 8 devices
    # and resumed on 4, each with its ratio to optax: about 1/8 and 1/4 for AdamW flat.
    lines = proc.stdout.splitlines()
    assert sum("Optimizer state per device (bytes)" in line for line in lines) == 1, log
    flat = next(line for line in lines if line.startswith("│ AdamW flat"))
    optax_bytes, on_8, ratio_8, on_4, ratio_4 = (cell.strip() for cell in flat.split("│")[2:-1])
    assert 0.12 <= float(ratio_8) <= 0.13 and 0.24 <= float(ratio_4) <= 0.26, flat
    assert abs(int(on_8.replace(",", "")) / int(optax_bytes.replace(",", "")) - float(ratio_8)) < 1e-3, flat
    assert "describe" not in flat and "stored" not in flat, flat  # zo.describe counts what the shards hold
    assert (out / "loss_curves.png").read_bytes()[:8] == PNG_MAGIC
    assert {p.name for p in (out / "checkpoints").iterdir()} == {"adamw_flat", "muon_leaf"}


def test_demo_fails_when_zero1_differs_from_optax(tmp_path, monkeypatch, capsys):
    """The checks are real: a zero1 whose updates are 1% too large makes the demo exit non-zero."""
    real_zero1 = zo.zero1
    monkeypatch.setattr(zo, "zero1", lambda inner, **kw: real_zero1(optax.chain(inner, optax.scale(1.01)), **kw))
    status = demo.main(["--steps", "2", "--partition", "flat", "--out", str(tmp_path)])
    assert status == 1
    assert "FAILED" in capsys.readouterr().out


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args(["--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    for flag in ("--steps", "--devices", "--partition", "--out"):
        assert flag in usage


@pytest.mark.parametrize("argv", [["--steps", "1"], ["--partition", "diagonal"]])
def test_bad_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args(argv)
    assert exit_info.value.code == 2


def test_batches_come_from_the_shipped_text():
    text = demo.Text.load()
    assert text.ids.size > 50_000 and "".join(text.alphabet[i] for i in text.ids[:10]) == "CHAPTER I."
    inputs, targets = text.batch(3)
    assert inputs.shape == targets.shape == (demo.BATCH, demo.SEQ_LEN)
    assert (inputs[:, 1:] == targets[:, :-1]).all()  # targets are the next characters
    assert (text.batch(3)[0] == inputs).all()  # deterministic per step


def test_quantize_trains_the_four_runs_and_plots_them(tmp_path, capsys):
    """`--quantize`: the exact run and the int8 runs (params, grads, both), their final losses within a few percent
    of the exact one at a few steps, and one plot of the curves."""
    assert demo.main(["--quantize", "--steps", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    gaps = [float(m) for m in re.findall(r"([+-]\d+\.\d+)%", out)]
    assert len(gaps) == 4 and gaps[0] == 0.0 and all(abs(g) < 5 for g in gaps), out
    assert (tmp_path / "quantize_curves.png").read_bytes()[:8] == PNG_MAGIC
