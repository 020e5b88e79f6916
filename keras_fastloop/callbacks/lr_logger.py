"""A callback that puts the optimizer's learning rate into the training logs."""

from __future__ import annotations

from typing import Any

import keras

__all__ = ["LearningRateLogger"]


class LearningRateLogger(keras.callbacks.Callback):
    """Adds `learning_rate` (a Python float) to the logs at every batch and epoch end.

    The value is `model.optimizer.learning_rate` read at that moment, i.e. the rate the
    optimizer will use for its *next* update (for a schedule: the schedule evaluated
    at the optimizer's current step counter). This is the same reading Keras'
    `ReduceLROnPlateau` and `TensorBoard` log at epoch end. Place this callback before
    the callbacks that should see the value (`History`, which `fit` appends last,
    always does), so `history.history["learning_rate"]` holds one value per epoch.

    Example:

    ```python
    history = model.fit(x, y, epochs=3, callbacks=[LearningRateLogger()])
    history.history["learning_rate"]  # three floats
    ```
    """

    def _current_learning_rate(self):
        return float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["learning_rate"] = self._current_learning_rate()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["learning_rate"] = self._current_learning_rate()
