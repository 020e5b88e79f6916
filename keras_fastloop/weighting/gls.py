"""Geometric Loss Strategy (GLS)."""

from __future__ import annotations

import keras
from keras import ops

from keras_fastloop import _keras_internals as internals
from keras_fastloop.weighting.base import _PACKAGE, LossWeighting


def _geometric_mean(losses):
    """`(prod_i L_i)^(1/T)` of a `(T,)` vector, as `exp(mean(log L))` (no under/overflow)."""
    return ops.exp(ops.mean(ops.log(losses)))


@keras.saving.register_keras_serializable(package=_PACKAGE)
class GLS(LossWeighting):
    """Geometric Loss Strategy: minimise the geometric mean of the task losses (`gls`).

    Algorithm: the objective is `(prod_i L_i)^(1/T)`. Its gradient is
    `sum_i w_i grad L_i` with `w_i = (prod_j L_j)^(1/T) / (T L_i)`: tasks with a small loss
    get a large weight. These applied weights are the logged `{task}_weight` and the
    `weights` after a step; the logged `loss` is the geometric mean. The losses must be
    positive (the weights are undefined at 0). Under `tf.distribute` the geometric mean is taken
    of the global batch's losses (as `FAMO`), so 1 and `R` replicas train alike. No state, no
    hyperparameter.

    LibMTL's `GLS` reports `L_i / (T prod_j L_j)` as its batch weights, which are not
    the weights its objective applies; we log the applied ones. It computes the product
    directly; we use `exp(mean(log L))` (the same value, without overflow for many tasks).

    Example:
        >>> model.compile("adam", losses, loss_weighting="gls")

    Reference:
        Chennupati, Sistu, Yogamani & Rawashdeh, "MultiNet++: Multi-Stream Feature Aggregation
        and Geometric Loss Strategy for Multi-Task Learning", CVPR Workshops 2019; LibMTL's
        `GLS`.
    """

    name = "gls"

    def _applied(self, losses):
        global_losses = internals.unscale_loss_for_distribution(ops.stack(losses))
        mean = _geometric_mean(global_losses)
        return mean, ops.stop_gradient(mean / (self.num_tasks * global_losses))

    def combine(self, losses):
        mean, weights = self._applied(losses)
        return internals.scale_loss_for_distribution(mean), weights

    def gradients(self, tape, losses, objective, variables, scale_loss):
        grads = super().gradients(tape, losses, objective, variables, scale_loss)
        self.weights.assign(self._applied(losses)[1])  # this step's weights (as RLW)
        return grads
