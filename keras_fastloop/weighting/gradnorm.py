"""GradNorm (Chen et al., ICML 2018): a gradient-based method (`keras_fastloop.weighting._gradient`)."""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop._replicas import state_variable
from keras_fastloop.weighting import _utils
from keras_fastloop.weighting._gradient import GradientWeighting
from keras_fastloop.weighting._solvers import (
    gradnorm_update,
)
from keras_fastloop.weighting.base import _PACKAGE


@keras.saving.register_keras_serializable(package=_PACKAGE)
class GradNorm(GradientWeighting):
    """Gradient normalization: learn loss weights that equalise the tasks' training rates.

    Algorithm (Chen et al.'s Eqs. 1-2 and Algorithm 1), every step with loss weights `w`
    (sum `T`, start at 1), shared-gradient norms `|g_i|` and losses `L_i` (`L_i(0)`
    recorded at the first applied step)::

        G_i = w_i |g_i|,  r_i = (L_i / L_i(0)) / mean_j (L_j / L_j(0))
        L_grad = sum_i |G_i - mean(G) r_i^alpha|          (the target held constant)
        dL_grad/dw_i = sign(G_i - target_i) |g_i|
        w <- renormalise_T(max(w - learning_rate * dL_grad/dw, 1e-6))

    i.e. one plain gradient step on `L_grad` with respect to `w` (the paper leaves that
    optimizer open), the floor keeping `w` positive, then the paper's renormalisation to sum
    `T`. The update uses this step's `w`; the new `w` is committed after the update is
    applied (skipped steps leave it unchanged). Every variable, shared or not, gets
    `sum_i w_i g_i` (the paper's objective `sum_i w_i L_i` back-propagated to the whole
    network). The norms are taken over all shared variables (LibMTL); the paper uses the last
    shared layer only, which `compile(shared_variables=[that_layer])` reproduces. Assigning
    `weights` mid-`fit` sets the next step's weights.

    LibMTL differs: its weights are `T * softmax(logits)` with the logits trained on
    `L_grad` by the network's own optimizer (learning rate included), it trains the first
    epoch with equal weights and takes `L_i(0)` as that epoch's mean loss, and its heads get
    the plain task gradient (weight 1). See `docs/weighting.md`.

    Args:
        alpha: non-negative float, default `1.5`: strength of the restoring force.
        learning_rate: positive float, default `0.025`: step size of the weight update.

    Example:
        >>> model.compile("adam", losses, loss_weighting=GradNorm(alpha=1.5))

    Reference:
        Chen, Badrinarayanan, Lee & Rabinovich, "GradNorm: Gradient Normalization for Adaptive
        Loss Balancing in Deep Multitask Networks", ICML 2018.
    """

    name = "gradnorm"

    def __init__(self, alpha: float = 1.5, learning_rate: float = 0.025) -> None:
        super().__init__()
        self.alpha = _utils.check_positive(alpha, "alpha", allow_zero=True)
        self.learning_rate = _utils.check_positive(learning_rate, "learning_rate")

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        t = (len(task_names),)
        self.initial_losses = state_variable(state, "gradnorm_initial_losses", t, 1.0)
        self.initialized = state_variable(state, "gradnorm_initialized", (), 0.0)
        self.pending = state_variable(state, "gradnorm_pending", t, 1.0)

    def head_weights(self):
        return self.read_weights()

    def task_weights(self, gram, losses):
        weights = self.read_weights()
        initial = ops.where(ops.greater(self.initialized, 0.0), self.initial_losses, losses)
        norms = ops.sqrt(ops.maximum(tf.linalg.diag_part(gram), 0.0))
        self.pending.assign(
            gradnorm_update(weights, norms, losses, initial, self.alpha, self.learning_rate)
        )
        return weights

    def update(self, losses):
        first = ops.equal(self.initialized, 0.0)
        self.initial_losses.assign(
            ops.where(first, _utils.update_losses(losses), self.initial_losses)
        )
        self.initialized.assign(1.0)
        self.weights.assign(self.pending)

    def get_config(self):
        return {"alpha": self.alpha, "learning_rate": self.learning_rate}
