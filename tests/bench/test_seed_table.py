"""The seed-table suite: structure only (no timing assertions), both profiles at quick size."""

import json

import keras
import pytest

from keras_fastloop_bench import seed_table

pytestmark = pytest.mark.slow  # integration: the slow job


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_quick_run_writes_the_table(tmp_path, profile):
    result = seed_table.run(tmp_path, quick=True, profile=profile, progress=lambda line: None)
    assert [r["row"] for r in result["rows"]] == list(seed_table.ROWS)
    assert result["rows"][0]["speedup_percent"] == pytest.approx(0.0)
    for row in result["rows"]:
        assert row["samples_per_s"] > 0
        assert row["policy"] in ("float32", "mixed_float16", "mixed_bfloat16")
        assert row["claimed_speedup_percent"] == seed_table.SEED_CLAIMS[row["row"]][0]
    mixed_rows = [r for r in result["rows"] if seed_table.ROWS[r["row"]][1]]
    assert {r["policy"] for r in mixed_rows} == {result["policy"]["policy"]}
    assert "markdown" in result and "seed claims" in result["markdown"]
    if profile == "gpu":
        assert "SYNTHETIC" in result["markdown"]
    saved = json.loads((tmp_path / "seed_table.json").read_text())
    assert saved["profile"] == profile
    assert (tmp_path / "seed_table.md").read_text() == result["markdown"]
    assert keras.config.dtype_policy().name == "float32"  # the global policy is restored


def test_unknown_profile_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="Received: profile='tpu'"):
        seed_table.run(tmp_path, quick=True, profile="tpu")


def test_resnet50_head_is_float32_under_mixed_precision():
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = seed_table.build_resnet50(input_shape=(32, 32, 3))
    finally:
        keras.config.set_dtype_policy("float32")
    assert model.output.dtype == "float32"
    assert model.count_params() > 20_000_000
