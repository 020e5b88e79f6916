"""Fast Adaptive Multitask Optimization (FAMO)."""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop import _keras_internals as internals
from keras_fastloop._replicas import state_variable
from keras_fastloop.weighting import _utils
from keras_fastloop.weighting.base import _PACKAGE, LossWeighting

_EPS = 1e-8


@keras.saving.register_keras_serializable(package=_PACKAGE)
class FAMO(LossWeighting):
    """Fast Adaptive Multitask Optimization: balance the tasks' log-loss decrease (`famo`).

    Algorithm. Logits `xi` (init 0), `z = softmax(xi)`, `D_i = L_i - min_loss + 1e-8`
    (`min_loss = 0`). The step minimises `sum_i z_i log(D_i) / c` with
    `c = sum_j z_j / D_j` held constant, whose gradient is `sum_i w_i grad L_i` with the
    effective weights `w_i = z_i / (c D_i)` (they sum to 1; they are the logged
    `{task}_weight`). After an update, FAMO moves `xi` along the decrease of the log-losses::

        delta_i = log D_i(before) - log D_i(after)
        g       = J_softmax(xi)^T delta = z * (delta - <z, delta>) + gamma * xi
        xi      <- Adam(learning_rate=w_lr, beta_1=0.9, beta_2=0.999, epsilon=1e-8) step with g

    "After" is taken from the next step's losses (a new batch) rather than a second forward pass
    on the same batch, as in LibMTL's training loop: no extra compute, one step of lag. The logged
    `loss` is FAMO's log-objective. The Adam state, logits and previous losses live in
    checkpointed variables. Under `tf.distribute` the objective and the update use the global
    batch's losses (every replica keeps the same state; see `_utils.update_losses`), so 1 and
    `R` replicas train alike.

    Args:
        w_lr: positive float, default `0.025`: Adam learning rate of the logits.
        gamma: non-negative float, default `1e-3` (LibMTL; the paper's code uses `1e-5`):
            weight decay of the logits.

    Example:
        >>> model.compile("adam", losses, loss_weighting=FAMO(w_lr=0.025))

    Reference:
        Liu, Liu, Jin, Stone & Liu, "FAMO: Fast Adaptive Multitask Optimization", NeurIPS 2023.
    """

    name = "famo"

    def __init__(self, w_lr: float = 0.025, gamma: float = 1e-3) -> None:
        super().__init__()
        self.w_lr = _utils.check_positive(w_lr, "w_lr")
        self.gamma = _utils.check_positive(gamma, "gamma", allow_zero=True)

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        t = (len(task_names),)
        self.logits = state_variable(state, "famo_logits", t)
        self.adam_m = state_variable(state, "famo_adam_m", t)
        self.adam_v = state_variable(state, "famo_adam_v", t)
        self.adam_t = state_variable(state, "famo_adam_t", (), 0.0)
        self.previous = state_variable(state, "famo_previous_losses", t, 1.0)
        self.has_previous = state_variable(state, "famo_has_previous", (), 0.0)

    def combine(self, losses):
        z = ops.softmax(ops.convert_to_tensor(self.logits))
        # Under tf.distribute every replica passes the global losses x 1/R (the step's
        # loss_shares.global_share): the log is taken of the global losses, and each replica's
        # objective is its 1/R share of the global one.
        d = internals.unscale_loss_for_distribution(ops.stack(losses)) + _EPS
        c = ops.stop_gradient(ops.sum(z / d))
        objective = internals.scale_loss_for_distribution(ops.sum(z * ops.log(d)) / c)
        return objective, ops.stop_gradient(z / (c * d))

    def update(self, losses):
        current = _utils.update_losses(losses)
        delta = ops.log(self.previous + _EPS) - ops.log(current + _EPS)
        xi = tf.identity(self.logits.value)
        z = ops.softmax(xi)
        grad = z * (delta - ops.sum(z * delta)) + self.gamma * xi
        t = self.adam_t + 1.0
        m = 0.9 * self.adam_m + 0.1 * grad
        v = 0.999 * self.adam_v + 0.001 * ops.square(grad)
        step = self.w_lr * (m / (1.0 - 0.9**t)) / (ops.sqrt(v / (1.0 - 0.999**t)) + _EPS)
        apply = ops.greater(self.has_previous, 0.0)
        self.logits.assign(ops.where(apply, xi - step, xi))
        self.adam_m.assign(ops.where(apply, m, self.adam_m))
        self.adam_v.assign(ops.where(apply, v, self.adam_v))
        self.adam_t.assign(ops.where(apply, t, self.adam_t))
        self.previous.assign(current)
        self.has_previous.assign(1.0)
        z = ops.softmax(ops.convert_to_tensor(self.logits))
        self.weights.assign(z / ops.sum(z / (current + _EPS)) / (current + _EPS))

    def get_config(self):
        return {"w_lr": self.w_lr, "gamma": self.gamma}
