"""notebooks/quickstart.ipynb executes top to bottom in a fresh kernel of this Python, without a cell error."""

from __future__ import annotations

import pathlib
import time

import pytest

from tests.helpers import xla_flags

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"
CELL_TIMEOUT_S = 240  # whole notebook: ~30 s on 2 CPU cores


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    # The kernel is a subprocess that inherits this environment: give it 2 CPU devices (conftest sets 8), so the
    # notebook shows a sharded run and still compiles quickly.
    monkeypatch.setenv("XLA_FLAGS", xla_flags(2))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert nb.metadata.kernelspec.name == "python3"
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError naming the cell and the traceback on any error
    elapsed = time.perf_counter() - t0
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the loss plot was not drawn"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "fp8_rowwise" in text and "loss" in text
    assert elapsed < 4 * CELL_TIMEOUT_S
