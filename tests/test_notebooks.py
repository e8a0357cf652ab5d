"""The notebooks ship with their outputs: the stored outputs have the shape each cell should give (which cells print
what, which draw a plot, no errors), and the quickstart, re-executed on CPU with the shipped model, gives the same
shape. The GPU notebook may be stored unexecuted (it needs a GPU run); executed, it is held to its shape too."""

import os
from pathlib import Path

import pytest

from waiting import HANG_S

from zipage_jax.config import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

# Per code cell, in order: the strings its printed text holds (None: it prints nothing) and the plots it draws.
SHAPES = {
    "quickstart.ipynb": [
        (None, 0),                                                                       # imports and parameters
        (["What is", "expected", "tokens, correct:"], 0),                                # one problem, generated
        (["full KV", "budget", "accuracy", "peak pages / request", "compressions / request"], 0),
        (None, 1),                                                                       # pages held over time
        (["budget (pages)", "compressed (zipage scoring)", "window-only eviction"], 1),  # accuracy against budget
        (["| rkv-like |", "| window-only |", "| triattention |", "synthetic:test:64",
          "synthetic:interleaved_sums:test:400", "synthetic:stored_product:test:400", "notebook ran in"], 3),
                                                                                         # the three saved sweeps
    ],
    "gpu_benchmark.ipynb": [
        (None, 0),                                                                       # the install
        (["Cuda"], 0),                                                                   # jax.devices()
        (["full KV", "compressed", "tok/s", "accuracy", "preemptions"], 0),              # the throughput runs
        (None, 1),                                                                       # throughput and accuracy
    ],
}


def read(name):
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(notebook)
    return notebook


def code_cells(notebook):
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def printed(cell) -> str:
    return "".join(out.get("text", "") for out in cell.outputs if out.output_type == "stream" and out.name == "stdout")


def plots(cell) -> int:
    return sum("image/png" in out.get("data", {}) for out in cell.outputs)


def assert_shape(name, notebook):
    cells = code_cells(notebook)
    assert len(cells) == len(SHAPES[name]), name
    for i, (cell, (strings, images)) in enumerate(zip(cells, SHAPES[name])):
        where = f"{name}, code cell {i}"
        assert not [out for out in cell.outputs if out.output_type == "error"], where
        assert cell.execution_count is not None, where
        text = printed(cell)
        if strings is None:
            assert not text.strip(), where
        else:
            missing = [s for s in strings if s not in text]
            assert not missing, f"{where}: {missing} not printed"
        assert plots(cell) == images, where


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_stored_outputs_have_their_shape(name):
    notebook = read(name)
    cells = code_cells(notebook)
    if name == "gpu_benchmark.ipynb" and all(not c.outputs and c.execution_count is None for c in cells):
        return  # not yet run on a GPU
    assert_shape(name, notebook)


@pytest.mark.slow
@pytest.mark.skipif(not (Path(DEFAULT_MODEL) / "model.safetensors").is_file(), reason="shipped model absent")
def test_quickstart_executes_to_the_same_shape(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = read("quickstart.ipynb")
    for cell in code_cells(notebook):
        cell.outputs, cell.execution_count = [], None
    parameters, engines = code_cells(notebook)[:2]
    # every cell, less work: two problems (the sweep's batch fits the smallest decode bucket) and 128 tokens (every
    # answer is cut there, so the derived budget is the smallest, 2 pages, compressing 8 times a request, and the
    # sweep runs budgets 2 and 4: each cell prints and plots what it does at 800 tokens); the engines hold 256 tokens
    # a request (prompt and 128 tokens fit), so the page tables the steps read are a quarter as wide
    for cell, full, light in ((parameters, "NUM_PROBLEMS = 8", "NUM_PROBLEMS = 2"),
                              (parameters, "max_tokens=800", "max_tokens=128"),
                              (engines, "max_model_len=1024", "max_model_len=256")):
        assert full in cell.source
        cell.source = cell.source.replace(full, light)
    # the kernel imports this checkout's zipage_jax, wherever the package is installed from
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    client = nbclient.NotebookClient(notebook, timeout=HANG_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    nbformat.validate(notebook)
    assert_shape("quickstart.ipynb", notebook)
