"""The benchmark suites run end to end at tiny size and write their reports (structure only:
speed is measured by the bench, never asserted in a test)."""

import json

import pytest

from keras_fastloop import cli
from keras_fastloop.bench import bucketing, default


@pytest.mark.slow
def test_default_suite_quick(tmp_path):
    result = default.run(tmp_path, quick=True, progress=lambda line: None)
    names = [row["contender"] for row in result["rows"]]
    assert names[0] == default.BASELINE
    assert {
        "seed's GradientTape loop (eager)",
        "OptimizedModel.fit (features off)",
        default.VALIDATE_EVERY_2,
    } <= set(names)
    for row in result["rows"]:
        assert row["throughput_samples_per_s"] > 0
        assert 0.0 <= row["val_accuracy"] <= 1.0
    assert result["rows"][0]["throughput_ratio"] == 1.0
    for suffix in ("md", "json", "png"):
        assert (tmp_path / f"default.{suffix}").stat().st_size > 0
    assert json.loads((tmp_path / "default.json").read_text())["suite"] == "default"
    assert "| contender |" in result["markdown"]


@pytest.mark.slow
def test_bucketing_suite_quick(tmp_path):
    result = bucketing.run(tmp_path, quick=True, progress=lambda line: None)
    padding = {row["contender"]: row for row in result["rows"]}
    bucketed = padding["(c) bucket_by_length"]
    longest = padding["(a) pad to longest in data set"]
    # Deterministic properties of the pipelines (not timings): bucketing wastes far less.
    assert bucketed["padding_share"] <= 0.10 < longest["padding_share"]
    assert bucketed["distinct_shapes"] <= 2 * len(result["boundaries"])
    assert (tmp_path / "bucketing.md").exists()


def test_cli_lists_every_suite_module():
    import importlib

    for module in cli.SUITES.values():
        assert hasattr(importlib.import_module(f"keras_fastloop.bench.{module}"), "run")
