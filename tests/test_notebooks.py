"""Every notebook under notebooks/ runs top to bottom (nbclient), so none can rot; the repository keeps them clean."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: clear the outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    # The kernel inherits this environment: CPU only with 8 simulated devices (conftest sets JAX_PLATFORMS and
    # XLA_FLAGS), and this checkout's zero_optax ahead of any installed copy, so an install cell has nothing to do.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(path, as_version=4)
    # A last cell reports what the kernel ran on.
    nb.cells.append(nbformat.v4.new_code_cell("import jax, zero_optax\nprint(zero_optax.__file__, jax.device_count())"))
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails
    module_file, devices = nb.cells[-1].outputs[0]["text"].split()
    assert Path(module_file).is_relative_to(ROOT) and devices == "8"
