"""The SAM and EMA suite runs end to end at tiny size and writes its report (structure only)."""

import json

import pytest

import keras_fastloop_cli as cli
from keras_fastloop_bench import sam


@pytest.mark.slow
def test_sam_suite_quick(tmp_path):
    assert cli.SUITES["sam"] == "sam"
    result = sam.run(tmp_path, quick=True, progress=lambda line: None)
    names = [row["contender"] for row in result["rows"]]
    assert names == [sam.PLAIN, sam.SAM, sam.ASAM, sam.EMA, sam.VALIDATION, sam.EMA_VALIDATION]
    assert result["rows"][0]["throughput_ratio"] == 1.0
    for row in result["rows"]:
        assert row["throughput_samples_per_s"] > 0
        assert 0.0 <= row["val_accuracy"] <= 1.0
    # Both validating contenders validated, the EMA one on the averages.
    validations = result["config"]["validations"]
    assert validations[sam.VALIDATION] == validations[sam.EMA_VALIDATION] > 0
    for suffix in ("md", "json", "png"):
        assert (tmp_path / f"sam.{suffix}").stat().st_size > 0
    assert json.loads((tmp_path / "sam.json").read_text())["suite"] == "sam"
    assert "| contender |" in result["markdown"]
    assert "EMA swap" in result["markdown"]
