"""The quickstart notebook runs top to bottom on CPU with the shipped model; notebooks are stored without outputs."""

from pathlib import Path

import pytest

from waiting import HANG_S

from zipage_jax.config import DEFAULT_MODEL

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"


@pytest.mark.parametrize("name", ["quickstart.ipynb", "gpu_benchmark.ipynb"])
def test_notebooks_are_stored_without_outputs(name):
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)


@pytest.mark.slow
@pytest.mark.skipif(not (Path(DEFAULT_MODEL) / "model.safetensors").is_file(), reason="shipped model absent")
def test_quickstart_executes(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    parameters = notebook.cells[[c.cell_type for c in notebook.cells].index("code")]
    # every cell, less work: two problems (the sweep's batch fits the smallest decode bucket) and half the tokens
    # (compression still runs many times per request at the budgets the notebook derives from them)
    for full, light in (("NUM_PROBLEMS = 8", "NUM_PROBLEMS = 2"), ("max_tokens=800", "max_tokens=400")):
        assert full in parameters.source
        parameters.source = parameters.source.replace(full, light)
    client = nbclient.NotebookClient(notebook, timeout=HANG_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    text = "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for out in cell.outputs)
    images = sum("image/png" in out.get("data", {}) for cell in notebook.cells if cell.cell_type == "code"
                 for out in cell.outputs)
    assert images == 4  # pages over time, accuracy versus budget, the two saved sweeps
    assert "full KV" in text and "window-only eviction" in text
    assert "| rkv-like |" in text and "| window-only |" in text  # the saved sweeps' tables
    assert "synthetic:interleaved_sums:test:400" in text  # the second one, on both tasks
