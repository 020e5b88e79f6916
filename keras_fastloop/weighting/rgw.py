"""Random Gradient Weighting (RGW): a gradient-based method (`keras_fastloop.weighting._gradient`)."""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop._replicas import state_variable
from keras_fastloop.weighting import _utils
from keras_fastloop.weighting._gradient import GradientWeighting
from keras_fastloop.weighting.base import _PACKAGE


@keras.saving.register_keras_serializable(package=_PACKAGE)
class RGW(GradientWeighting):
    """Random Gradient Weighting: random weights on the tasks' shared gradients (`rgw`).

    Algorithm, at every step `t`: `z ~ N(0, I_T)`, `beta = softmax(z)`; the shared variables
    get `sum_i beta_i g_i`, the task-specific ones their plain task gradient (weight 1), as in
    LibMTL (v1.1.6 tag; the paper's RLW applied to gradients instead of losses). The logged
    `{task}_weight` is `beta`.

    Randomness: `z` comes from a stateless generator keyed by `(seed, t)`, `t` a
    checkpointed counter of applied updates (as `RLW`): a run is reproducible under
    `keras.utils.set_random_seed` (which seeds the default `seed`), independent of
    `steps_per_execution`, the same on every replica, and a restored checkpoint continues the
    sequence. The numbers differ from torch's `randn` (LibMTL), not their distribution.

    Args:
        seed: int or `None` (default: drawn once from Python's `random`, which
            `keras.utils.set_random_seed` seeds). Stored in the config.

    Raises:
        ValueError: a `seed` that is not an int.

    Example:
        >>> model.compile("adam", losses, loss_weighting=RGW(seed=0))

    Reference:
        Lin, Ye, Xu, Shi & Zhang, "Reasonable Effectiveness of Random Weighting: A Litmus Test for
        Multi-Task Learning", Transactions on Machine Learning Research (TMLR), 2022; LibMTL's
        `RGW` (tag v1.1.6).
    """

    name = "rgw"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        self.seed = _utils.resolve_seed(seed)

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        self.step = state_variable(state, "rgw_step", (), 0, "int64")

    def task_weights(self, gram, losses):
        z = tf.random.stateless_normal(
            (self.num_tasks,), seed=_utils.stateless_seed(self.seed, self.step)
        )
        return ops.softmax(z)

    def update(self, losses):
        self.step.assign_add(1)

    def get_config(self):
        return {"seed": self.seed}
