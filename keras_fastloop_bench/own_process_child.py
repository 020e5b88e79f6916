"""The child process of `keras_fastloop_bench.own_process`: runs one default-suite contender.

`python -m keras_fastloop_bench.own_process_child SPEC` (`SPEC`: the JSON file that
`own_process_contender` writes) rebuilds the suite's data with the suite's seed, trains the
named contender of `keras_fastloop_bench.default.contenders(..., extras=False)` from the
parent's initial weights, and writes what a `harness.Run` holds to `SPEC["out"]` as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import keras
import numpy as np

from keras_fastloop import _keras_internals
from keras_fastloop_bench import default, harness


def _child(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    keras.utils.set_random_seed(default.SEED)  # as `default.run`: tf.data's shuffle order
    data = default.Data(spec["quick"])
    stored = np.load(spec["weights"])
    initial = [stored[f"arr_{i}"] for i in range(len(stored.files))]
    train = default.contenders(data, spec["policy"], extras=False)[spec["contender"]]
    run = harness.Run(name=spec["contender"], epochs=spec["epochs"], initial_weights=initial)
    peak_mb = harness.timed_run(train, run)
    Path(spec["out"]).write_text(
        json.dumps(
            {
                "curve": run.curve,
                "train_seconds": run.train_seconds,
                "samples": run.samples,
                "val_accuracy": run.val_accuracy,
                "total_seconds": run.total_seconds,
                "peak_memory_mb": peak_mb,
                "extra": {**run.extra, "onednn": _keras_internals.onednn_enabled()},
            }
        )
    )


if __name__ == "__main__":
    _child(sys.argv[1])
