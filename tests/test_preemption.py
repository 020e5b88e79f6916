"""SaveOnPreemption: SIGTERM to a real training process, then a restart, gives the uninterrupted run.

Each test runs `tests/preemption_worker.py` in subprocesses (one process, or 2
`MultiWorkerMirroredStrategy` workers through `keras_fastloop_cli.launch`): once uninterrupted,
once sent SIGTERM at a random step (the process must save and exit with
`PREEMPTED_EXIT_CODE`), then again to completion. Every model and optimizer variable must equal
the uninterrupted run's (max |diff| <= 1e-6; CPU, `enable_op_determinism`).
"""

import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from keras_fastloop.callbacks import preemption
from keras_fastloop_cli import launch as launch_module

pytestmark = pytest.mark.slow  # integration: the slow job

WORKER = os.path.join(os.path.dirname(__file__), "preemption_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCHS, STEPS = 3, 12


def _env():
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": path,
    }


def _config(tmp_path, name, **extra):
    return {
        "out": str(tmp_path / name),
        "backup_dir": str(tmp_path / f"backup_{name}"),
        "epochs": EPOCHS,
        **extra,
    }


def run_one(config, sigterm_at=None):
    """Runs one process; with `sigterm_at`, sends it SIGTERM once it printed that batch count."""
    process = subprocess.Popen(
        [sys.executable, WORKER, json.dumps(config)],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in process.stdout:
        lines.append(line)
        if sigterm_at is not None and line.strip() == f"batch {sigterm_at}":
            process.send_signal(signal.SIGTERM)
            sigterm_at = None
    process.wait(timeout=300)
    return process.returncode, "".join(lines)


def backup_step(config):
    """The optimizer step after the backup's batch (read before the restart deletes it)."""
    path = os.path.join(config["backup_dir"], "worker0", "training_metadata.json")
    with open(path) as f:
        saved = json.load(f)
    return saved["epoch"] * STEPS + saved["batch"] + 1


def assert_resumed(output, step):
    """The restart began right after the backup's step, not from scratch."""
    assert f"first step {step}" in output, output[-3000:]
    assert "first step 0" not in output


def load(config):
    return dict(np.load(config["out"] + ".npz"))


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    diffs = {k: float(np.max(np.abs(a[k].astype("float64") - b[k].astype("float64")))) for k in a}
    assert max(diffs.values()) <= 1e-6, diffs


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_sigterm_at_random_step_then_restart_equals_uninterrupted(tmp_path, steps_per_execution):
    reference = _config(tmp_path, "ref", steps_per_execution=steps_per_execution)
    code, output = run_one(reference)
    assert code == 0, output[-3000:]

    resumed = _config(tmp_path, "res", steps_per_execution=steps_per_execution, sleep=0.05)
    executions = (EPOCHS * STEPS - 6) // steps_per_execution
    at = random.Random(steps_per_execution).randrange(1, executions) * steps_per_execution
    code, output = run_one(resumed, sigterm_at=at)
    assert code == preemption.PREEMPTED_EXIT_CODE, output[-3000:]
    assert "preemption: saved the backup" in output
    assert not os.path.exists(resumed["out"] + ".npz")
    metadata = json.load(
        open(os.path.join(resumed["backup_dir"], "worker0", "training_metadata.json"))
    )
    assert metadata["epoch"] * STEPS + metadata["batch"] + 1 >= at

    step = backup_step(resumed)
    code, output = run_one({**resumed, "sleep": 0.0})
    assert code == 0, output[-3000:]
    assert_resumed(output, step)
    assert_same(load(resumed), load(reference))


def test_kill_during_the_save_leaves_the_previous_backup(tmp_path):
    reference = _config(tmp_path, "ref")
    code, output = run_one(reference)
    assert code == 0, output[-3000:]

    resumed = _config(tmp_path, "res", sigterm_after=13, kill_during_save=True)
    code, output = run_one(resumed)
    assert code == -signal.SIGKILL, output[-3000:]
    directory = os.path.join(resumed["backup_dir"], "worker0")
    assert os.path.exists(os.path.join(directory, preemption._TMP_WEIGHTS))
    with open(os.path.join(directory, "training_metadata.json")) as f:
        assert json.load(f) == {"epoch": 0, "batch": 9}  # the periodic save after batch 10

    step = backup_step(resumed)
    code, output = run_one({**resumed, "sigterm_after": None, "kill_during_save": False})
    assert code == 0, output[-3000:]
    assert_resumed(output, step)
    assert_same(load(resumed), load(reference))


def _launch(config, workers=2):
    out = io.StringIO()
    code = launch_module.launch(
        [WORKER, json.dumps(config)], workers=workers, timeout=300, env=_env(), stdout=out
    )
    return code, out.getvalue()


@pytest.mark.distributed
def test_two_workers_sigterm_on_one_both_save_the_same_step_and_resume_exactly(tmp_path):
    reference = _config(tmp_path, "ref")
    code, output = _launch(reference)
    assert code == 0, output[-3000:]

    at = random.Random(2).randrange(2, EPOCHS * STEPS - 6)
    resumed = _config(tmp_path, "res", sigterm_after=at)
    code, output = _launch(resumed)
    assert code == preemption.PREEMPTED_EXIT_CODE, output[-3000:]
    assert output.count("preemption: saved the backup") == 2, output[-3000:]
    saved = [
        json.load(open(os.path.join(resumed["backup_dir"], f"worker{i}", "training_metadata.json")))
        for i in range(2)
    ]
    assert saved[0] == saved[1]  # worker 1 got no signal but stopped after the same step

    step = backup_step(resumed)
    code, output = _launch({**resumed, "sigterm_after": None})
    assert code == 0, output[-3000:]
    assert_resumed(output, step)
    assert_same(load(resumed), load(reference))


@pytest.mark.distributed
@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_resume_on_another_number_of_workers_same_global_batch(tmp_path, before, after):
    reference = _config(tmp_path, "ref")
    code, output = run_one(reference)
    assert code == 0, output[-3000:]

    resumed = _config(tmp_path, "res", sigterm_after=17)
    code, output = _launch(resumed) if before == 2 else run_one(resumed)
    assert code == preemption.PREEMPTED_EXIT_CODE, output[-3000:]
    if after > before:  # the new worker starts from worker 0's backup
        shutil.copytree(
            os.path.join(resumed["backup_dir"], "worker0"),
            os.path.join(resumed["backup_dir"], "worker1"),
        )
    resumed["sigterm_after"] = None
    step = backup_step(resumed)
    code, output = _launch(resumed) if after == 2 else run_one(resumed)
    assert code == 0, output[-3000:]
    assert_resumed(output, step)
    # One process and two workers sum the same gradients in another order: float32 rounding.
    a, b = load(resumed), load(reference)
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-5, err_msg=key)
