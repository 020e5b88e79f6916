"""Loss-EMA weighting: each task's weight follows an exponential moving average of its loss."""

from __future__ import annotations

import keras
from keras import ops

from keras_fastloop import _validation
from keras_fastloop._replicas import state_variable
from keras_fastloop.weighting import _utils
from keras_fastloop.weighting.base import _PACKAGE, LossWeighting


@keras.saving.register_keras_serializable(package=_PACKAGE)
class LossEMA(LossWeighting):
    """Weights proportional to an exponential moving average of each task's loss (`loss_ema`).

    Algorithm, after every applied update with per-task losses `L_i` (under `tf.distribute`:
    the first replica's, so every replica keeps the same state)::

        e_i <- L_i                                   on the first update
        e_i <- decay * e_i + (1 - decay) * L_i       afterwards
        w_i <- T * e_i / sum_j e_j

    The next step minimises `sum_i w_i L_i`: tasks whose loss stays high get more weight. The
    weights are normalised to sum to the number of tasks `T` (not to 1) so that equal losses
    give `w_i = 1`, exactly `ew`, and a learning rate tuned for `ew` carries over. The first
    step uses equal weights. Everything runs inside the compiled step on variables (no
    `.numpy()`); assigning `weights` mid-`fit` sets the next step's weights (the EMA then
    takes over again after that step).

    Args:
        decay: float in `[0, 1)`, default `0.9`. EMA decay; `0` uses the last loss only.

    Example:
        >>> model.compile("adam", {"cls": "sparse_categorical_crossentropy",
        ...                        "seg": "binary_crossentropy"}, loss_weighting=LossEMA(0.9))

    Reference:
        The project's seed scheme (loss-proportional weighting with a moving average); related to
        Liu, Johns & Davison, "End-to-End Multi-Task Learning with Attention", CVPR 2019 (DWA),
        which uses loss ratios instead of loss levels.
    """

    name = "loss_ema"

    def __init__(self, decay: float = 0.9) -> None:
        super().__init__()
        if not _validation.is_real(decay) or not 0 <= decay < 1:
            raise ValueError(f"`decay` must be a float in [0, 1). Received: decay={decay!r}")
        self.decay = float(decay)

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        self.ema = state_variable(state, "loss_ema", (len(task_names),))
        self.updates = state_variable(state, "loss_ema_updates", (), 0, "int64")

    def update(self, losses):
        losses = _utils.update_losses(losses)
        first = ops.equal(self.updates, 0)
        ema = ops.where(first, losses, self.decay * self.ema + (1.0 - self.decay) * losses)
        self.ema.assign(ema)
        self.updates.assign_add(1)
        total = ops.maximum(ops.sum(ema), 1e-12)
        self.weights.assign(self.num_tasks * ema / total)

    def get_config(self):
        return {"decay": self.decay}
