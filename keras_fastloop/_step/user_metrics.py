"""A user's `compute_metrics` override, called where Keras' train step calls it.

Keras' `train_step` ends with `return self.compute_metrics(x, y, y_pred, sample_weight)`, so
an override decides the step's logs and may update metrics of its own. The training step
calls it the same way, once per batch after the update. A step that the non-finite guards
skip must leave every metric as if the batch had not been seen: the metric variables are
saved before the call and restored after it when the step was skipped, and the logs of a
skipped step report the restored values for the keys that name metrics.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop._step.results import restore_point


def overrides_compute_metrics(model) -> bool:
    """Whether the model's class replaces Keras' `compute_metrics`."""
    return type(model).compute_metrics is not keras.Model.compute_metrics


def compute_metrics(model, x, y, y_pred, sample_weight, applied):
    """`model.compute_metrics(x, y, y_pred, sample_weight)`, undone when not `applied`.

    Args:
        model: the model whose `compute_metrics` is overridden.
        x, y, y_pred, sample_weight: the batch and the predictions of the training forward
            pass.
        applied: bool scalar tensor, whether the step's update was applied.

    Returns:
        The override's logs; where the step was skipped, the keys that are metric results
        hold the restored results.
    """
    undo = restore_point(v for metric in model.metrics for v in metric.variables)
    logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    tf.cond(applied, lambda: None, undo)
    restored = model.get_metrics_result()

    def pick(key, value):
        before = restored.get(key)
        if before is None or not tf.is_tensor(value):
            return value
        value, before = ops.convert_to_tensor(value), ops.convert_to_tensor(before)
        if value.shape != before.shape or value.dtype != before.dtype:
            return value
        return ops.where(applied, value, before)

    return {key: pick(key, value) for key, value in logs.items()}
