"""MoDo (Chen et al., NeurIPS 2023): double sampling on three parts of the batch
(`keras_fastloop.weighting._gradient`)."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_fastloop._replicas import state_variable
from keras_fastloop.weighting import _utils
from keras_fastloop.weighting._gradient import GradientWeighting, cross_gram
from keras_fastloop.weighting._simplex import project_to_simplex
from keras_fastloop.weighting.base import _PACKAGE


def modo_weights(cross, weights, gamma, rho):
    """One MoDo step: `Pi_simplex(lambda - gamma (C lambda + rho lambda))`.

    `C_ij = <g_i^(1), g_j^(2)>` is the cross-Gram matrix of the first two parts' task
    gradients (an unbiased estimate of `M`'s action when the parts are independent).
    """
    v = weights - gamma * (tf.linalg.matvec(cross, weights) + rho * weights)
    return project_to_simplex(v - tf.reduce_max(v))  # shift-invariant, exact sums in float32


_modo_weights_xla = tf.function(modo_weights, jit_compile=True, autograph=False)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MoDo(GradientWeighting):
    """MoDo: multi-objective gradient with double sampling (`modo`).

    Algorithm: LibMTL draws three batches per step; here they are the three consecutive
    parts of the batch (samples `[p n // 3, (p + 1) n // 3)`, sizes differing by at most one
    when 3 does not divide `n`; a batch of fewer than 3 samples is used whole by all three,
    which a `FastloopWarning` reports at the epoch's end).
    With `G_p` the parts' task gradients of the shared variables,
    `lambda <- Pi_simplex(lambda - gamma (G_1 G_2^T lambda + rho lambda))` (start `1/T`;
    two independent estimates make `G_1 G_2^T` unbiased), then the shared variables get
    `G_3^T lambda`. Heads get the mean of the three parts' head gradients (LibMTL divides
    the accumulated head gradients by 3), i.e. the batch's head gradient when 3 divides `n`.
    The logged `{task}_weight` is the new `lambda`, held in step state (`modo_lambda`,
    committed after applied steps only). Each step of `steps_per_execution` splits its own
    batch. Under `tf.distribute` each replica splits its share of the batch and the part
    gradients are summed across replicas (every replica computes the same `lambda`). Costs
    `3 T` backward passes. Keras masks on predictions are refused (first step). No random
    numbers: the parts follow the dataset's order (shuffled by `fit` as usual).

    Args:
        gamma: positive float, default `1e-3` (LibMTL's `MoDo_gamma`): step size of `lambda`.
        rho: non-negative float, default `0.1` (`MoDo_rho`): `l2` regularization of `lambda`.

    Raises:
        ValueError: at construction, for a non-positive `gamma` or a negative `rho`.

    Example:
        >>> model.compile("adam", losses, loss_weighting=MoDo(gamma=1e-3))

    Reference:
        Chen, Fernando, Ying & Chen, "Three-Way Trade-Off in Multi-Objective Learning:
        Optimization, Generalization and Conflict-Avoidance", NeurIPS 2023.
    """

    name = "modo"
    sub_batches = 3

    def __init__(self, gamma: float = 1e-3, rho: float = 0.1) -> None:
        super().__init__()
        self.gamma = _utils.check_positive(gamma, "gamma")
        self.rho = _utils.check_positive(rho, "rho", allow_zero=True)

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        t = (len(task_names),)
        self.lambd = state_variable(state, "modo_lambda", t, 1.0 / len(task_names))
        self.pending_lambd = state_variable(state, "modo_pending_lambda", t)

    def part_weights(self, rows):
        cross = cross_gram(rows[0], rows[1])
        lambd = _modo_weights_xla(cross, tf.identity(self.lambd.value), self.gamma, self.rho)
        self.pending_lambd.assign(lambd)
        return lambd, 2

    def update(self, losses):
        self.lambd.assign(self.pending_lambd)

    def get_config(self):
        return {"gamma": self.gamma, "rho": self.rho}
