"""`fit`'s internal callback that prints one line per worker at the start of a multi-worker `fit`.

Under a strategy with more than one worker (`MultiWorkerMirroredStrategy`), each worker prints
`[keras_fastloop] worker i of n: r replicas (l here), global batch b` when `fit` starts, so a
cluster's logs show that every worker joined with the same view. Nothing is printed with one
worker.
"""

from __future__ import annotations

import json
import os

import keras

from keras_fastloop import _fit_run as fit_run
from keras_fastloop import _tf_internals as tf_internals

__all__ = ["worker_line"]


def worker_line(model):
    """`[_WorkerLine()]` when the model's strategy spans several workers, else `[]`."""
    if tf_internals.num_workers(model.distribute_strategy) <= 1:
        return []
    return [_WorkerLine()]


class _WorkerLine(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        strategy = self.model.distribute_strategy
        workers = tf_internals.num_workers(strategy)
        task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
        index = task.get("index", "?")
        local = len(strategy.extended.worker_devices)
        run = fit_run.current_run(self.model)
        adapter = getattr(getattr(run, "iterator", None), "data_adapter", None)
        batch = getattr(adapter, "batch_size", None)
        print(
            f"[keras_fastloop] worker {index} of {workers}: {strategy.num_replicas_in_sync} "
            f"replicas ({local} here), global batch "
            f"{batch if batch is not None else 'set by the dataset (unknown statically)'}",
            flush=True,
        )
