"""A bench contender that trains in a child Python process, for settings read at import.

TensorFlow reads some settings once, when it is imported: `TF_ENABLE_ONEDNN_OPTS` (oneDNN
CPU kernels, which TensorFlow leaves off on CPUs without AVX-512) among them. A contender
that needs one cannot share the bench's process, so `own_process_contender` runs it in a
child with its own environment. The parent alternates it with the in-process contenders like
any other. The child rebuilds the suite's data (the same seed, the same order), trains the named
contender of the default suite from the parent's initial weights, and sends back what a
`harness.Run` holds, as JSON. As for every in-process contender, the clock starts when
training starts: TensorFlow's import in the child (a few seconds) is not counted.

The child is `python -m keras_fastloop.bench.own_process_child SPEC`, with `SPEC` a JSON file:
`{"contender", "policy", "quick", "epochs", "weights", "out"}`. This module
imports nothing of the suite (`keras_fastloop.bench.default` imports it); the child module,
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
        contender: string, a name from `keras_fastloop.bench.default.contenders`.
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
            try:
                child = subprocess.run(
                    [sys.executable, "-m", "keras_fastloop.bench.own_process_child", str(spec)],
                    env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **env},
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                )
            except subprocess.TimeoutExpired as e:
                stderr = e.stderr or ""
                if isinstance(stderr, bytes):
                    stderr = stderr.decode(errors="replace")
                raise RuntimeError(
                    f"The own-process contender {contender!r} ran past timeout={timeout} s and "
                    f"was killed. Its standard error ends with:\n{stderr[-3000:]}"
                ) from None
            if child.returncode != 0 or not out.exists():
                raise RuntimeError(
                    f"The own-process contender {contender!r} failed (exit code "
                    f"{child.returncode}). Its standard error ends with:\n{child.stderr[-3000:]}"
                )
            result = json.loads(out.read_text())
        run.curve = [tuple(point) for point in result["curve"]]
        run.train_seconds = result["train_seconds"]
        run.samples = result["samples"]
        run.val_accuracy = result["val_accuracy"]
        run.total_seconds = result["total_seconds"]
        run.peak_memory_mb = result["peak_memory_mb"]
        run.extra.update(result["extra"])

    return train
