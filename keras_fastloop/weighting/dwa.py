"""Dynamic Weight Average (DWA)."""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop._replicas import state_variable
from keras_fastloop.weighting import _utils
from keras_fastloop.weighting.base import _PACKAGE, LossWeighting


class _EndWindowAtEpochEnd(keras.callbacks.Callback):
    """Closes a `DWA` averaging window at the end of every `fit` epoch."""

    def __init__(self, dwa):
        super().__init__()
        self.dwa = dwa

    def on_epoch_end(self, epoch, logs=None):
        self.dwa.end_window()


@keras.saving.register_keras_serializable(package=_PACKAGE)
class DWA(LossWeighting):
    """Dynamic Weight Average: weight tasks by how slowly their loss is falling (`dwa`).

    Algorithm. `Lbar_i(k)` is task `i`'s mean training loss over window `k` (every applied
    update counts once). For window `k >= 2`::

        r_i = Lbar_i(k-1) / Lbar_i(k-2)
        w_i = T * exp(r_i / temperature) / sum_j exp(r_j / temperature)

    and `w_i = 1` during the first two windows. Weights sum to `T`. They change only at
    window boundaries, are held in the `weights` variable and can be assigned mid-`fit`
    (they then hold until the next window boundary).

    Windows. By default (`window=None`) a window is one epoch of `fit`, as in the paper and
    LibMTL: the step only adds the losses to a float64 running sum (two variable updates per
    step), and `OptimizedModel.fit` adds a callback that calls `end_window` at every
    epoch end. In a custom training loop call `model.loss_weighting.end_window()` yourself at
    each epoch end. The alternative, `window=N`, closes a window every `N` applied updates
    inside the compiled step (for very long epochs, or to decouple DWA from the epoch length;
    it costs a few more operations per step).

    Args:
        temperature: positive float, default `2.0` (the paper's `T`); larger is softer.
        window: `None` (default: one window per epoch) or a positive int: optimizer updates per
            averaging window.

    Raises:
        ValueError: a non-positive `temperature` or `window`.

    Example:
        >>> model.compile("adam", losses, loss_weighting=DWA(temperature=2.0))

    Reference:
        Liu, Johns & Davison, "End-to-End Multi-Task Learning with Attention", CVPR 2019.
    """

    name = "dwa"

    def __init__(self, temperature: float = 2.0, window: int | None = None) -> None:
        super().__init__()
        self.temperature = _utils.check_positive(temperature, "temperature")
        self.window = None if window is None else _utils.check_positive_int(window, "window")

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        t = len(task_names)
        self.loss_sum = state_variable(state, "dwa_loss_sum", (t,), dtype="float64")
        self.count = state_variable(state, "dwa_count", (), 0, "int64")
        # previous[0] = window k-2, previous[1] = window k-1
        self.previous = state_variable(state, "dwa_previous", (2, t), 1.0, "float64")
        self.windows = state_variable(state, "dwa_windows", (), 0, "int64")

    def _closed(self, previous, windows):
        ratio = previous[1] / ops.maximum(previous[0], 1e-12)
        weights = self.num_tasks * ops.softmax(ops.cast(ratio, "float32") / self.temperature)
        return ops.where(ops.greater_equal(windows, 2), weights, ops.ones_like(weights))

    def update(self, losses):
        losses = ops.cast(_utils.update_losses(losses), "float64")
        if self.window is None:  # epoch windows: closed by end_window(), outside the step
            self.loss_sum.assign_add(losses)
            self.count.assign_add(1)
            return
        # Branch-free (ops.where): the step already runs this inside its own conditional, and
        # under MirroredStrategy a nested cond holding assignments is not allowed there.
        loss_sum = self.loss_sum + losses
        count = self.count + 1
        close = ops.greater_equal(count, self.window)
        mean = loss_sum / ops.cast(count, "float64")
        previous = ops.where(close, ops.stack([self.previous[1], mean]), self.previous)
        windows = self.windows + ops.cast(close, "int64")
        self.previous.assign(previous)
        self.windows.assign(windows)
        self.loss_sum.assign(ops.where(close, ops.zeros_like(loss_sum), loss_sum))
        self.count.assign(ops.where(close, ops.zeros_like(count), count))
        self.weights.assign(ops.where(close, self._closed(previous, windows), self.weights))

    def end_window(self):
        """Close the current averaging window (eagerly) and set the next window's weights.

        Called at every epoch end by `OptimizedModel.fit` when `window` is `None`; a window
        without any applied update is left open.
        """
        count = int(self.count.numpy())
        if count == 0:
            return
        mean = tf.convert_to_tensor(self.loss_sum) / float(count)
        previous = tf.stack([tf.convert_to_tensor(self.previous)[1], mean])
        windows = self.windows.numpy() + 1
        self.previous.assign(previous)
        self.windows.assign(windows)
        self.loss_sum.assign(tf.zeros_like(mean))
        self.count.assign(0)
        self.weights.assign(self._closed(previous, windows))

    def callbacks(self):
        return [] if self.window is not None else [_EndWindowAtEpochEnd(self)]

    def get_config(self):
        return {"temperature": self.temperature, "window": self.window}
