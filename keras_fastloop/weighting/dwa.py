"""Dynamic Weight Average (DWA)."""

from __future__ import annotations

import keras
from keras import ops

from keras_fastloop.weighting import _utils
from keras_fastloop.weighting.base import _PACKAGE, LossWeighting


@keras.saving.register_keras_serializable(package=_PACKAGE)
class DWA(LossWeighting):
    """Dynamic Weight Average: weight tasks by how slowly their loss is falling (``dwa``).

    Algorithm. Training is cut into windows of ``window`` optimizer updates, which stand in for
    the paper's epochs (the compiled step does not see epoch boundaries; set ``window`` to the
    number of steps per epoch to reproduce the paper exactly). ``Lbar_i(k)`` is task ``i``'s mean
    loss over window ``k``. For window ``k >= 2``::

        r_i = Lbar_i(k-1) / Lbar_i(k-2)
        w_i = T * exp(r_i / temperature) / sum_j exp(r_j / temperature)

    and ``w_i = 1`` during the first two windows. Weights sum to ``T``. They change only at window
    boundaries, are held in the ``weights`` variable and can be assigned mid-``fit`` (they then
    hold until the next window boundary).

    Args:
        temperature: positive float, default ``2.0`` (the paper's ``T``); larger is softer.
        window: positive int, default ``100``: optimizer updates per averaging window.

    Example:
        >>> model.compile("adam", losses, loss_weighting=DWA(temperature=2.0, window=50))

    Reference:
        Liu, Johns & Davison, "End-to-End Multi-Task Learning with Attention", CVPR 2019.
    """

    name = "dwa"

    def __init__(self, temperature=2.0, window=100):
        super().__init__()
        self.temperature = _utils.check_positive(temperature, "temperature")
        self.window = _utils.check_positive_int(window, "window")

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        t = len(task_names)
        self.loss_sum = _utils.state_variable(state, "dwa_loss_sum", (t,))
        self.count = _utils.state_variable(state, "dwa_count", (), 0, "int64")
        self.previous = _utils.state_variable(state, "dwa_previous", (2, t), 1.0)
        self.windows = _utils.state_variable(state, "dwa_windows", (), 0, "int64")

    def update(self, losses):
        # Branch-free (ops.where): the step already runs this inside its own conditional, and
        # under MirroredStrategy a nested cond holding assignments is not allowed there.
        loss_sum = self.loss_sum + _utils.update_losses(losses)
        count = self.count + 1
        close = ops.greater_equal(count, self.window)
        mean = loss_sum / ops.cast(count, "float32")
        # previous[0] = window k-2, previous[1] = window k-1
        previous = ops.where(close, ops.stack([self.previous[1], mean]), self.previous)
        windows = self.windows + ops.cast(close, "int64")
        ratio = previous[1] / ops.maximum(previous[0], 1e-12)
        weights = self.num_tasks * ops.softmax(ratio / self.temperature)
        weights = ops.where(ops.greater_equal(windows, 2), weights, ops.ones_like(weights))
        self.previous.assign(previous)
        self.windows.assign(windows)
        self.loss_sum.assign(ops.where(close, ops.zeros_like(loss_sum), loss_sum))
        self.count.assign(ops.where(close, ops.zeros_like(count), count))
        self.weights.assign(ops.where(close, weights, self.weights))

    def get_config(self):
        return {"temperature": self.temperature, "window": self.window}
