"""Exact resume after a real SIGKILL, with `keras.callbacks.BackupAndRestore(save_freq=N)`.

Each test runs `tests/resume_worker.py` in subprocesses: once uninterrupted, once killed with
SIGKILL (from a callback, after `BackupAndRestore` saved at global batch 16 and two batches
later, i.e. in the middle of epoch 1), then again to completion. Every variable (model weights,
the `uw` log-variances, optimizer slots and `iterations`, the loss scale, `skipped_steps`,
AutoClip's history) and PeriodicValidation's history and driven `EarlyStopping` state must
equal the uninterrupted run's (max |diff| <= 1e-6; CPU, `enable_op_determinism`). The
learning-rate schedule reads `optimizer.iterations`, so its position is checked through it and
through the weights. The data hold a NaN sample, so `skipped_steps` (and, under mixed
precision, the halved loss scale) differ from their initial values before the kill.

`test_stock_keras_restarts_the_epoch` documents what Keras 3.15 alone does (re-runs the
interrupted epoch from its first batch): without `keras_fastloop._resume` the weights differ.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # integration: the slow job

WORKER = os.path.join(os.path.dirname(__file__), "resume_worker.py")
EPOCHS = 3
BATCHES_PER_EPOCH = 12
TOTAL_BATCHES = EPOCHS * BATCHES_PER_EPOCH
SKIPPED_PER_EPOCH = 1  # the NaN sample's batch


def run_worker(tmp_path, name, case, backup_dir, kill_after=None, exact=True, **extra):
    config = {
        "case": case,
        "out": str(tmp_path / name),
        "backup_dir": str(backup_dir),
        "kill_after": kill_after,
        "exact": exact,
        "epochs": EPOCHS,
        **extra,
    }
    # The worker imports this checkout's keras_fastloop (not another editable install).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": path,
    }
    process = subprocess.run(
        [sys.executable, WORKER, json.dumps(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if kill_after is not None:
        assert process.returncode == -9, (process.returncode, process.stderr[-3000:])
        assert not os.path.exists(config["out"] + ".npz")
        return None
    assert process.returncode == 0, process.stderr[-3000:]
    with open(config["out"] + ".json") as f:
        result = json.load(f)
    result["arrays"] = dict(np.load(config["out"] + ".npz"))
    return result


def max_differences(a, b):
    assert sorted(a) == sorted(b)
    return {
        key: float(np.max(np.abs(a[key].astype("float64") - b[key].astype("float64")))) for key in a
    }


def kill_and_resume(tmp_path, case, kills=(18,), exact=True, **extra):
    backup_dir = tmp_path / f"backup_{case}"
    for i, kill_after in enumerate(kills):
        run_worker(tmp_path, f"killed_{case}_{i}", case, backup_dir, kill_after, exact, **extra)
        assert (backup_dir / "latest.weights.h5").exists()
    resumed = run_worker(tmp_path, f"resumed_{case}", case, backup_dir, None, exact, **extra)
    assert not backup_dir.exists()  # BackupAndRestore deletes its backup at a clean end
    return resumed


def uninterrupted(tmp_path, case, **extra):
    return run_worker(tmp_path, f"full_{case}", case, tmp_path / f"full_backup_{case}", **extra)


def assert_same_end(full, resumed, first=(1, 4)):
    # The resumed process really resumed: it started mid-epoch, after the backup of batch 16.
    assert resumed["first"][:2] == list(first)
    assert resumed["batches"] == TOTAL_BATCHES - (first[0] * BATCHES_PER_EPOCH + first[1])
    assert full["first"] == [0, 0, 0] and full["batches"] == TOTAL_BATCHES
    assert resumed["iterations"] == full["iterations"]
    assert resumed["skipped_steps"] == full["skipped_steps"] >= EPOCHS * SKIPPED_PER_EPOCH
    differences = max_differences(full["arrays"], resumed["arrays"])
    worst = max(differences, key=differences.get)
    assert differences[worst] <= 1e-6, (worst, differences[worst])
    return differences


@pytest.fixture(scope="module")
def plain_full(tmp_path_factory):
    return uninterrupted(tmp_path_factory.mktemp("plain_full"), "plain")


def test_plain_resume_is_exact(tmp_path, plain_full):
    resumed = kill_and_resume(tmp_path, "plain")
    differences = assert_same_end(plain_full, resumed)
    assert any(key.startswith("optimizer/") for key in differences)
    assert any("skipped_steps" in key for key in differences)


def test_stock_keras_restarts_the_epoch(tmp_path, plain_full):
    """Without the fix Keras re-runs epoch 1 from batch 0 on top of the restored weights."""
    resumed = kill_and_resume(tmp_path, "plain", exact=False)
    assert resumed["first"][:2] == [1, 0]  # the interrupted epoch starts over
    assert resumed["iterations"] > plain_full["iterations"]  # 4 extra updates
    differences = max_differences(plain_full["arrays"], resumed["arrays"])
    assert max(differences.values()) > 1e-3


@pytest.mark.slow
def test_second_kill_in_the_resumed_epoch(tmp_path, plain_full):
    """Killed at batch 18, resumed, killed again at batch 22 (after the save at 20), resumed.

    Stock Keras would write `"epoch": 0` with the save at batch 20 and replay epoch 0.
    """
    resumed = kill_and_resume(tmp_path, "plain", kills=(18, 22))
    assert_same_end(plain_full, resumed, first=(1, 8))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mixed", "uw", "autoclip"])
def test_feature_state_resume_is_exact(tmp_path, case):
    full = uninterrupted(tmp_path, case)
    resumed = kill_and_resume(tmp_path, case)
    differences = assert_same_end(full, resumed)
    if case == "mixed":
        scale = [k for k in differences if "dynamic_scale" in k or "loss_scale" in k]
        assert scale, sorted(differences)
        assert any(full["arrays"][k] < 2.0**15 for k in scale)  # halved by the NaN batches
    if case == "uw":
        assert any("uw_log_variances" in k for k in differences)
    if case == "autoclip":
        history = [k for k in differences if "autoclip_history" in k]
        assert history and np.any(full["arrays"][history[0]] > 0)


@pytest.mark.slow
def test_periodic_validation_resume_is_exact(tmp_path):
    full = uninterrupted(tmp_path, "pv")
    resumed = kill_and_resume(tmp_path, "pv")
    assert_same_end(full, resumed)
    expected, got = full["validation"], resumed["validation"]
    # Validations at steps 5, 10, ..., 30: the ones before the backup come from the file.
    assert [r["step"] for r in got["history"]] == [r["step"] for r in expected["history"]]
    assert len(expected["history"]) == 6
    assert got["last_validated_step"] == expected["last_validated_step"]
    for a, b in zip(expected["history"], got["history"]):
        assert a["epoch"] == b["epoch"]
        assert abs(a["val_loss"] - b["val_loss"]) <= 1e-6
    (early_a,), (early_b,) = expected["callbacks"], got["callbacks"]
    assert early_a["wait"] == early_b["wait"] and abs(early_a["best"] - early_b["best"]) <= 1e-6
