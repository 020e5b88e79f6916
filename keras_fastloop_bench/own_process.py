"""A bench contender that trains in a child Python process, for settings read at import.

TensorFlow reads some settings once, when it is imported: `TF_ENABLE_ONEDNN_OPTS` (oneDNN
CPU kernels, which TensorFlow leaves off on CPUs without AVX-512) among them. A contender
that needs one cannot share the bench's process, so `own_process_contender` runs it in a
child with its own environment. The parent alternates it with the in-process contenders like
any other. The child rebuilds the suite's data (the same seed, the same order), trains the named
contender of the default suite from the parent's initial weights, and sends back what a
`harness.Run` holds, as JSON. As for every in-process contender, the clock starts when
training starts: TensorFlow's import in the child (a few seconds) is not counted.

The child is `python -m keras_fastloop_bench.own_process_child SPEC`, with `SPEC` a JSON file:
`{"contender", "policy", "quick", "epochs", "weights", "out"}`. This module
imports nothing of the suite (`keras_fastloop_bench.default` imports it); the child module,
above both, runs the suite's contender.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["own_process_contender"]


def own_process_contender(
    contender: str, env: dict[str, str], quick: bool, policy=None, timeout: float = 1800.0
):
    """A contender `train(run)` that runs `contender` of the default suite in a child process.

    Args:
        contender: string, a name from `keras_fastloop_bench.default.contenders`.
        env: dict of environment variables set in the child on top of this process's.
        quick: bool, the default suite's `quick` data (the child rebuilds the same data).
        policy: string or None, the dtype policy for the recommended-setup contender.
        timeout: float, seconds the child may take before it is killed. Defaults to 1800.

    Returns:
        A callable `train(run)`. It fills `run` (curve, per-epoch training seconds and
        samples, validation accuracy, total seconds, peak RSS growth of the child) and
        `run.extra`: the child run's own (e.g. `"steps_per_execution"`) and `"onednn"`, the
        child's oneDNN switch as TensorFlow reports it.

    Raises:
        RuntimeError: from `train(run)`, if the child fails or runs past `timeout`; the
            message ends with the tail of its standard error.
    """

    def train(run):
        with tempfile.TemporaryDirectory() as tmp:
            weights = Path(tmp) / "initial.npz"
            out = Path(tmp) / "run.json"
            np.savez(weights, *run.initial_weights)
            spec = Path(tmp) / "spec.json"
            spec.write_text(
                json.dumps(
                    {
                        "contender": contender,
                        "policy": policy,
                        "quick": bool(quick),
                        "epochs": run.epochs,
                        "weights": str(weights),
                        "out": str(out),
                    }
                )
            )
            result = run_child(
                [sys.executable, "-m", "keras_fastloop_bench.own_process_child", str(spec)],
                out,
                {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **env},
                timeout,
                f"The own-process contender {contender!r}",
            )
        record_result(run, result)
        run.extra.update(result["extra"])

    return train


def run_child(command, out, env, timeout, what):
    """Runs `command` in a child process and returns the JSON it wrote to the path `out`.

    Args:
        command: list of str, the child's command line.
        out: `Path` the child writes its result to (JSON).
        env: dict, the child's whole environment.
        timeout: float, seconds before the child is killed.
        what: str, the contender as the error messages name it.

    Raises:
        RuntimeError: if the child fails, writes no result, or runs past `timeout`; the
            message ends with the tail of its standard error.
    """
    try:
        child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr or ""
        if isinstance(stderr, bytes):
            stderr = stderr.decode(errors="replace")
        raise RuntimeError(
            f"{what} ran past timeout={timeout} s and was killed. Its standard error ends "
            f"with:\n{stderr[-3000:]}"
        ) from None
    if child.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"{what} failed (exit code {child.returncode}). Its standard error ends with:\n"
            f"{child.stderr[-3000:]}"
        )
    return json.loads(out.read_text())


def record_result(run, result):
    """Fills a `harness.Run` from a child's result dict (curve, times, samples, accuracy,
    peak memory)."""
    run.curve = [tuple(point) for point in result["curve"]]
    run.train_seconds = result["train_seconds"]
    run.samples = result["samples"]
    run.val_accuracy = result["val_accuracy"]
    run.total_seconds = result["total_seconds"]
    run.peak_memory_mb = result["peak_memory_mb"]
