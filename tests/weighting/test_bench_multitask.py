"""The multi-task benchmark and its notebook: structure only (timing is never asserted)."""

import json
from pathlib import Path

import numpy as np
import pytest

from keras_fastloop_bench import multitask

pytestmark = pytest.mark.slow  # integration: the slow job


def test_data_is_two_overlapping_real_digits():
    from sklearn.datasets import load_digits

    x, y, x_test, y_test = multitask.load_data()
    assert x.shape == (2000, 11, 11, 1) and x_test.shape == (1000, 11, 11, 1)
    for labels in (y, y_test):
        assert set(labels) == {"left", "right"}
        assert set(np.unique(labels["left"])) == set(range(10))
    # every image is the maximum of a digit at (0, 0) and one of the right label at (3, 3)
    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")
    image = x[0, ..., 0]
    left = [i for i in np.flatnonzero(digits.target == y["left"][0])]
    right = [i for i in np.flatnonzero(digits.target == y["right"][0])]
    found = False
    for i in left:
        for j in right:
            canvas = np.zeros((11, 11), "float32")
            canvas[:8, :8] = images[i]
            canvas[3:, 3:] = np.maximum(canvas[3:, 3:], images[j])
            found = found or np.array_equal(canvas, image)
    assert found
    assert 0.0 <= x.min() and x.max() <= 1.0


def test_delta_m_as_libmtl_defines_it():
    baseline = {"left_accuracy": 0.8, "right_accuracy": 0.5}
    same = {"left_accuracy": 0.88, "right_accuracy": 0.45}
    assert multitask.delta_m(same, baseline) == pytest.approx(0.0)
    better = {"left_accuracy": 0.88, "right_accuracy": 0.5}
    assert multitask.delta_m(better, baseline) == pytest.approx(5.0)


def test_mean_se_and_paired_test_by_hand():
    mean, se = multitask.mean_se([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and se == pytest.approx(np.std([1, 2, 3, 4], ddof=1) / 2)
    # differences 1, 2, 3: mean 2, se 1/sqrt(3), t = 2 sqrt(3), df 2 -> p = 0.0742
    d, d_se, t, p, significant = multitask.paired_test([1.0, 2.0, 3.0])
    assert (d, d_se, t) == pytest.approx((2.0, 1 / np.sqrt(3), 2 * np.sqrt(3)))
    assert p == pytest.approx(0.07417990, rel=1e-6) and not significant
    assert multitask.paired_test([1.0, 1.1, 0.9, 1.05, 0.95])[4]
    assert not multitask.paired_test([1.0])[4]


def test_all_methods_come_from_the_registry():
    from keras_fastloop import weighting

    methods = multitask.all_methods()
    assert methods[0] == "ew" and set(methods) == set(weighting.METHODS) - {"static"}
    assert set(multitask.LOSS_BASED + multitask.GRADIENT_BASED) <= set(methods)
    assert multitask.is_gradient_based("mgda") and not multitask.is_gradient_based("famo")
    assert all(multitask.is_gradient_based(m) for m in multitask.GRADIENT_BASED)
    assert not any(multitask.is_gradient_based(m) for m in multitask.LOSS_BASED)


def test_quick_run_writes_the_report(tmp_path):
    # Two methods (one of each family besides `ew`) keep the test short; every method trains
    # in tests/weighting/test_weighting.py, and the notebook runs three more (slow job).
    result = multitask.run(tmp_path, quick=True, methods=("uw", "mgda"))
    for name in ("multitask.md", "multitask.json", "multitask.png"):
        assert (tmp_path / name).stat().st_size > 0
    saved = json.loads((tmp_path / "multitask.json").read_text())
    assert set(saved["methods"]) == {"ew", "uw", "mgda"}
    assert saved["config"]["seeds"] == [0, 1]
    with pytest.raises(ValueError, match=r"must be \"all\" or ids .*Received: methods=\('uww',\)"):
        multitask.run(tmp_path, quick=True, methods=("uww",))
    with pytest.raises(ValueError, match="Received: methods='every'"):
        multitask.run(tmp_path, quick=True, methods="every")
    with pytest.raises(ValueError, match="Received: seeds=0"):
        multitask.run(tmp_path, quick=True, seeds=0)
    for row in result["methods"].values():
        for key in ("left_accuracy", "right_accuracy", "delta_m", "delta_m_se", "delta_m_vs_ew"):
            assert key in row
        assert 0.0 <= row["left_accuracy"] <= 1.0 and 0.0 <= row["right_accuracy"] <= 1.0
        assert len(row["delta_m_per_seed"]) == 2
    ew = result["methods"]["ew"]
    assert ew["relative_step_time"] == pytest.approx(1.0)
    assert ew["delta_m_vs_ew"] == 0.0 and not ew["differs_from_ew"]
    mgda = result["methods"]["mgda"]
    diffs = np.subtract(mgda["delta_m_per_seed"], ew["delta_m_per_seed"])
    assert mgda["delta_m_vs_ew"] == pytest.approx(diffs.mean())
    assert "| mgda |" in result["markdown"] and "beyond" in result["markdown"]


def test_notebook_runs_the_quick_benchmark_and_shows_its_table():
    nbformat = pytest.importorskip("nbformat")
    path = Path(__file__).parents[2] / "notebooks" / "multitask.ipynb"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "multitask.run(" in code and "quick=True" in code
    # stored executed (tests/test_notebooks.py): the reader sees the Δm lines of the run
    printed = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "Δm" in printed and "ew" in printed
