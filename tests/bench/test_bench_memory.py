"""The memory suite: its workers train in their own processes, rematerialization leaves the
loss unchanged, and the report is written (figures are measured by the bench, not asserted)."""

import json

import pytest

from keras_fastloop_bench import memory

pytestmark = pytest.mark.slow  # integration: the slow job


def test_remat_worker_trains_to_the_no_remat_loss_in_its_own_process():
    plain = memory._run_setting("transformer", "none", True)
    remat = memory._run_setting("transformer", "remat", True)
    assert remat["final_loss"] == pytest.approx(plain["final_loss"], abs=1e-6)
    for row in (plain, remat):
        assert row["allocator_peak_mb"] >= 0 and row["step_ms"] > 0
        assert row["samples_per_forward"] == row["batch_size"]


def test_report_gives_ratios_to_no_remat_and_the_largest_batch(tmp_path, monkeypatch):
    def fake(workload, config, quick):
        remat, micro = "remat" in config, "micro" in config
        return {
            "workload": workload,
            "config": config,
            "batch_size": 8,
            "samples_per_forward": 2 if micro else 8,
            "allocator_peak_mb": (4.0 if remat else 8.0) / (4 if micro else 1),
            "rss_growth_mb": 10.0,
            "step_ms": 13.0 if remat else 10.0,
            "final_loss": 1.0,
            "jit_compile": "xla" in config,
        }

    monkeypatch.setattr(memory, "_run_setting", fake)
    result = memory.run(tmp_path, quick=True, budget_mb=64.0)
    rows = {(r["workload"], r["config"]): r for r in result["rows"]}
    remat = rows[("transformer", "remat")]
    assert remat["memory_ratio"] == 0.5 and remat["time_ratio"] == pytest.approx(1.3)
    assert remat["largest_batch_in_budget"] == 128  # 64 MiB / (4 MiB / 8 samples)
    assert rows[("resnet", "micro")]["largest_batch_in_budget"] == "any (micro-batch <= 64)"
    assert result["target_met"]
    assert json.loads((tmp_path / "memory.json").read_text())["suite"] == "memory"
    assert "| transformer | remat | 8 |" in (tmp_path / "memory.md").read_text()
