"""ExcessMTL: a gradient-based method (`keras_fastloop.weighting._gradient`)."""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop._replicas import state_variable
from keras_fastloop.weighting import _utils
from keras_fastloop.weighting._gradient import GradientWeighting
from keras_fastloop.weighting.base import _PACKAGE


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ExcessMTL(GradientWeighting):
    """ExcessMTL: weight tasks by their estimated excess risk (`excess_mtl`).

    Algorithm, at every applied update with shared task gradients `g_i` (LibMTL's code):

    - `S_i <- S_i + g_i^2` (element-wise, from 0) and `e_i = sum(g_i^2 / sqrt(S_i + 1e-7))`,
      a diagonal (AdaGrad) estimate of task `i`'s excess risk;
    - at the first update `e_i` is recorded as `e_i(0)` and the weights stay 1; afterwards
      `w_i <- w_i exp(robust_step_size e_i / e_i(0))`, renormalised to sum `T`;
    - every variable, shared or not, gets `sum_i w_i g_i` (the objective `sum_i w_i L_i`).

    The weights are decided from this step's gradients: the logged `{task}_weight` and
    `weights` are this step's `w`. LibMTL's flag `first_epoch` is cleared after the first
    step, so `e(0)` is the first step's (not the first epoch's), as here. `S` lives in step
    state, a `(T, size)` float32 array per shared variable plus this step's value, committed
    on applied updates only (see `_gradient`): `2 T` times the shared variables' size,
    created at `compile()` for every trainable variable that may be shared (only
    `shared_variables` when given). The committed weights are `committed_weights` (assign it to
    change the next step's starting weights). Under `tf.distribute` every statistic is of the
    global batch's gradients.

    Args:
        robust_step_size: positive float, default `0.01` (LibMTL `robust_step_size`): step
            size of the multiplicative weight update.

    Raises:
        ValueError: a non-positive `robust_step_size`; at `compile()`, a model without
            variables.

    Example:
        >>> model.compile("adam", losses, loss_weighting="excess_mtl")

    Reference:
        He, Zhou, Zhang, Yun, Xu, Zeng, Chilimbi & Zhao, "Robust Multi-Task Learning with
        Excess Risks", ICML 2024; LibMTL's `ExcessMTL`.
    """

    name = "excess_mtl"
    buffer_prefix = "excess_mtl_squares"

    def __init__(self, robust_step_size: float = 1e-2) -> None:
        super().__init__()
        self.robust_step_size = _utils.check_positive(robust_step_size, "robust_step_size")

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        t = (len(task_names),)
        self.committed_weights = state_variable(state, "excess_mtl_loss_weights", t, 1.0)
        self.initial = state_variable(state, "excess_mtl_initial", t, 1.0)
        self.pending_initial = state_variable(state, "excess_mtl_initial_pending", t, 1.0)
        self.started = state_variable(state, "excess_mtl_started", (), 0.0)

    def head_weights(self):
        return self.read_weights()

    def gradients(self, tape, losses, objective, variables, scale_loss):
        variables = list(variables)
        grads, _ = self.task_gradients(tape, losses, variables, scale_loss)
        excess = []
        for flat, (current, pending) in zip(grads.flat, self._shared_in_trace):
            squares = current + ops.square(flat)
            pending.assign(squares)
            excess.append(ops.sum(ops.square(flat) / ops.sqrt(squares + 1e-7), axis=1))
        excess = ops.sum(ops.stack(excess), axis=0)
        first = ops.equal(self.started, 0.0)
        initial = ops.where(first, excess, tf.identity(self.initial.value))
        previous = tf.identity(self.committed_weights.value)
        weights = previous * ops.exp(self.robust_step_size * excess / initial)
        weights = self.num_tasks * weights / ops.sum(weights)
        weights = ops.where(first, previous, weights)
        self.pending_initial.assign(initial)
        self.weights.assign(weights)
        shared = {k: self.weighted_sum(grads, k, weights) for k in grads.shared}
        return self.assemble(tape, objective, variables, grads, shared, weights)

    def update(self, losses):
        self.commit_buffers()
        self.committed_weights.assign(tf.identity(self.weights.value))
        self.initial.assign(tf.identity(self.pending_initial.value))
        self.started.assign(1.0)

    def get_config(self):
        return {"robust_step_size": self.robust_step_size}
