"""PCGrad (Yu et al., NeurIPS 2020): a gradient-based method (`keras_fastloop.weighting._gradient`)."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_fastloop._replicas import state_variable
from keras_fastloop.weighting import _utils
from keras_fastloop.weighting._gradient import GradientWeighting
from keras_fastloop.weighting._solvers import (
    pcgrad_weights,
)
from keras_fastloop.weighting.base import _PACKAGE


@keras.saving.register_keras_serializable(package=_PACKAGE)
class PCGrad(GradientWeighting):
    """Projecting conflicting gradients ("gradient surgery").

    Algorithm: for every task `i`, `g_i^PC = g_i`; for every other task `j` in a random
    order, if `<g_i^PC, g_j> < 0`: `g_i^PC -= <g_i^PC, g_j> / |g_j|^2 g_j`. The shared
    variables get `sum_i g_i^PC`, computed exactly as `sum_j beta_j g_j` (the logged weights;
    1 each without conflicts). The order comes from a stateless generator keyed by
    `(seed, step)` with `step` a checkpointed counter of applied updates.

    Args:
        seed: int or `None` (default: drawn from Python's `random`, which
            `keras.utils.set_random_seed` seeds). Stored in the config.

    Example:
        >>> model.compile("adam", losses, loss_weighting=PCGrad(seed=0))

    Reference:
        Yu, Kumar, Gupta, Levine, Hausman & Finn, "Gradient Surgery for Multi-Task Learning",
        NeurIPS 2020.
    """

    name = "pcgrad"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        self.seed = _utils.resolve_seed(seed)

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        self.step = state_variable(state, "pcgrad_step", (), 0, "int64")

    def task_weights(self, gram, losses):
        t = self.num_tasks
        keys = tf.random.stateless_uniform((t, t), seed=_utils.stateless_seed(self.seed, self.step))
        order = tf.cast(tf.argsort(keys, axis=1), "int32")
        return pcgrad_weights(gram, order)

    def update(self, losses):
        self.step.assign_add(1)

    def get_config(self):
        return {"seed": self.seed}
