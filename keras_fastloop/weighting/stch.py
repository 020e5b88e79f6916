"""Smooth Tchebycheff scalarization (STCH)."""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop import _keras_internals as internals
from keras_fastloop import _validation
from keras_fastloop._replicas import state_variable
from keras_fastloop.weighting import _utils
from keras_fastloop.weighting.base import _PACKAGE, LossWeighting

_EPS = 1e-20


class _EndEpoch(keras.callbacks.Callback):
    """Counts `fit` epochs for an `STCH` (its warmup and nadir point)."""

    def __init__(self, stch):
        super().__init__()
        self.stch = stch

    def on_epoch_end(self, epoch, logs=None):
        self.stch.end_epoch()


@keras.saving.register_keras_serializable(package=_PACKAGE)
class STCH(LossWeighting):
    """Smooth Tchebycheff scalarization of the log-losses, after a warmup (`stch`).

    Algorithm (LibMTL's, from the authors' MTL code), with `e` the number of finished
    epochs:

    - `e <= warmup_epochs`: objective `sum_i log(L_i + 1e-20)` (weights `1 / L_i`).
      During epoch `e = warmup_epochs` the losses of every applied update are averaged into
      the nadir point `z_i`.
    - afterwards: `u_i = log(L_i / z_i + 1e-20)` and the objective is the smooth maximum
      `T * mu * log(sum_i exp(u_i / mu))` (weights `T softmax(u / mu)_i / (L_i + 1e-20 z_i)`).

    The logged `{task}_weight` is the weight the objective applies to each loss, `dObj/dL_i`
    (LibMTL reports ones); the logged `loss` is the objective (LibMTL's value omits the constant
    `T max_i u_i`, which has no gradient). Epochs are counted by a callback that
    `OptimizedModel.fit` adds (`end_epoch`; call it at each epoch end in a custom loop), as
    `DWA`'s windows: an epoch without an applied update is not counted. The epoch count, the
    loss sum and the nadir point are checkpointed state; under `tf.distribute` the objective
    and the nadir use the global batch's losses (as `FAMO`).

    Args:
        mu: positive float, default `1.0` (LibMTL `STCH_mu`): smoothing; smaller is closer to
            the plain maximum.
        warmup_epochs: non-negative int, default `4` (LibMTL `STCH_warmup_epoch`).

    Raises:
        ValueError: a non-positive `mu`, a negative or non-int `warmup_epochs`.

    Example:
        >>> model.compile("adam", losses, loss_weighting=STCH(mu=1.0, warmup_epochs=4))

    Reference:
        Lin, Zhang, Yang, Liu, Wang & Zhang, "Smooth Tchebycheff Scalarization for Multi-Objective
        Optimization", ICML 2024; LibMTL's `STCH`.
    """

    name = "stch"

    def __init__(self, mu: float = 1.0, warmup_epochs: int = 4) -> None:
        super().__init__()
        self.mu = _utils.check_positive(mu, "mu")
        self.warmup_epochs = _validation.check_int("warmup_epochs", warmup_epochs, minimum=0)

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        t = (len(task_names),)
        self.epochs = state_variable(state, "stch_epochs", (), 0, "int64")
        self.count = state_variable(state, "stch_count", (), 0, "int64")
        self.loss_sum = state_variable(state, "stch_loss_sum", t, 0.0, "float64")
        self.nadir = state_variable(state, "stch_nadir", t, 1.0)

    def _objective(self, losses):
        """`(objective, weights)` from the global losses `(T,)`."""
        nadir = tf.identity(self.nadir.value)
        warm = ops.less_equal(self.epochs, self.warmup_epochs)
        plain = ops.sum(ops.log(losses + _EPS))
        u = ops.log(losses / nadir + _EPS)
        smooth = self.num_tasks * self.mu * ops.logsumexp(u / self.mu)
        weights = ops.where(
            warm,
            1.0 / (losses + _EPS),
            self.num_tasks * ops.softmax(u / self.mu) / (losses + _EPS * nadir),
        )
        return ops.where(warm, plain, smooth), ops.stop_gradient(weights)

    def combine(self, losses):
        global_losses = internals.unscale_loss_for_distribution(ops.stack(losses))
        objective, weights = self._objective(global_losses)
        return internals.scale_loss_for_distribution(objective), weights

    def gradients(self, tape, losses, objective, variables, scale_loss):
        grads = super().gradients(tape, losses, objective, variables, scale_loss)
        global_losses = internals.unscale_loss_for_distribution(ops.stack(losses))
        self.weights.assign(self._objective(global_losses)[1])  # this step's weights (as RLW)
        return grads

    def update(self, losses):
        losses = ops.cast(_utils.update_losses(losses), "float64")
        averaging = ops.equal(self.epochs, self.warmup_epochs)
        self.loss_sum.assign_add(ops.where(averaging, losses, ops.zeros_like(losses)))
        self.count.assign_add(1)

    def end_epoch(self):
        """Close an epoch (eagerly): count it, and after the averaging epoch set the nadir.

        Called at every epoch end by `OptimizedModel.fit`; an epoch without any applied
        update is not counted.
        """
        count = int(self.count.numpy())
        if count == 0:
            return
        if int(self.epochs.numpy()) == self.warmup_epochs:
            self.nadir.assign(tf.cast(tf.convert_to_tensor(self.loss_sum) / count, "float32"))
        self.epochs.assign_add(1)
        self.count.assign(0)
        self.loss_sum.assign(tf.zeros_like(tf.convert_to_tensor(self.loss_sum)))

    def callbacks(self):
        return [_EndEpoch(self)]

    def get_config(self):
        return {"mu": self.mu, "warmup_epochs": self.warmup_epochs}
