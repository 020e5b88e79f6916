"""Every notebook under notebooks/ executes top to bottom (small sizes, real offline data)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    # Run from notebooks/ (Jupyter's default working directory), nothing may land in the
    # repository: the kernel's working directory must stay empty.
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # Figures are shown inline (a PNG in the outputs), not only written to files.
    if any("plt." in c.source for c in nb.cells if c.cell_type == "code"):
        assert any("image/png" in o.get("data", {}) for o in outputs), path.name


def test_quickstart_notebook_exists():
    assert any(p.name == "quickstart.ipynb" for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_executed(path):
    # A reader on GitHub sees the results: every code cell ran, top to bottom, in one kernel.
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
    assert any(c.outputs for c in code)
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
