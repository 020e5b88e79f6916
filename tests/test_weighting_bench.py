"""The multi-task benchmark and its notebook: structure only (timing is never asserted)."""

import json
from pathlib import Path

import numpy as np
import pytest

from keras_fastloop.bench import multitask


def test_data_is_real_digits_with_a_derived_ink_mask():
    x, y, x_test, y_test = multitask.load_data()
    assert x.shape[1:] == (8, 8, 1) and len(x) + len(x_test) == 1797
    assert set(np.unique(y["cls"])) == set(range(10))
    assert set(np.unique(y["seg"])) == {0.0, 1.0}
    assert 0.2 < y["seg"].mean() < 0.6


def test_delta_m_as_libmtl_defines_it():
    baseline = {"accuracy": 0.8, "iou": 0.5}
    assert multitask.delta_m({"accuracy": 0.88, "iou": 0.45}, baseline) == pytest.approx(0.0)
    assert multitask.delta_m({"accuracy": 0.88, "iou": 0.5}, baseline) == pytest.approx(5.0)


def test_quick_run_writes_the_report(tmp_path):
    # Three methods (one of each family besides `ew`) keep the test short; every method trains
    # in tests/test_weighting.py, and the notebook runs the full quick suite (slow job).
    result = multitask.run(tmp_path, quick=True, methods=("uw", "mgda"))
    for name in ("multitask.md", "multitask.json", "multitask.png"):
        assert (tmp_path / name).stat().st_size > 0
    saved = json.loads((tmp_path / "multitask.json").read_text())
    assert set(saved["methods"]) == {"ew", "uw", "mgda"}
    with pytest.raises(ValueError, match=r"`methods` must be ids .*Received: methods=\('uww',\)"):
        multitask.run(tmp_path, quick=True, methods=("uww",))
    for row in result["methods"].values():
        for key in ("accuracy", "iou", "delta_m", "relative_step_time", "meets_target"):
            assert key in row
        assert 0.0 <= row["accuracy"] <= 1.0 and 0.0 <= row["iou"] <= 1.0
    assert result["methods"]["ew"]["relative_step_time"] == pytest.approx(1.0)
    assert "| mgda |" in result["markdown"]


def test_notebook_is_stripped_and_runs_the_quick_benchmark():
    nbformat = pytest.importorskip("nbformat")
    path = Path(__file__).parents[1] / "notebooks" / "multitask.ipynb"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "multitask.run(" in code and "quick=True" in code
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
