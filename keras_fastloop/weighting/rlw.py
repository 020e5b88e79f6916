"""Random Loss Weighting (RLW)."""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop._replicas import state_variable
from keras_fastloop.weighting import _utils
from keras_fastloop.weighting.base import _PACKAGE, LossWeighting


@keras.saving.register_keras_serializable(package=_PACKAGE)
class RLW(LossWeighting):
    """Random Loss Weighting: fresh random weights every step (`rlw`).

    Algorithm, at every step `t`: `z ~ N(0, I_T)`, `w = softmax(z)` (weights sum to 1, as in
    the paper and LibMTL), objective `sum_i w_i L_i`. `z` comes from a stateless generator
    keyed by `(seed, t)`, where `t` counts applied updates in a checkpointed variable: runs are
    reproducible, a restored checkpoint continues the same sequence, every replica draws the same
    weights, and `evaluate` (which uses the current `t`) does not advance the sequence.

    Args:
        seed: int or `None` (default: drawn once from Python's `random`, which
            `keras.utils.set_random_seed` seeds). Stored in the config.

    Example:
        >>> model.compile("adam", losses, loss_weighting=RLW(seed=0))

    Reference:
        Lin, Ye, Xu, Shi & Zhang, "Reasonable Effectiveness of Random Weighting: A Litmus Test for
        Multi-Task Learning", Transactions on Machine Learning Research (TMLR), 2022.
    """

    name = "rlw"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        self.seed = _utils.resolve_seed(seed)

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        self.step = state_variable(state, "rlw_step", (), 0, "int64")

    def sample(self):
        """The weights of the current step (a function of `seed` and the step counter)."""
        z = tf.random.stateless_normal(
            (self.num_tasks,), seed=_utils.stateless_seed(self.seed, self.step)
        )
        return ops.softmax(z)

    def combine(self, losses):
        weights = self.sample()
        return ops.sum(ops.stack(losses) * ops.stop_gradient(weights)), weights

    def gradients(self, tape, losses, objective, variables, scale_loss):
        grads = super().gradients(tape, losses, objective, variables, scale_loss)
        # Mirror this step's weights after the backward pass (see UncertaintyWeighting).
        self.weights.assign(self.sample())
        return grads

    def update(self, losses):
        self.step.assign_add(1)

    def get_config(self):
        return {"seed": self.seed}
