"""Uncertainty weighting (UW): trainable homoscedastic log-variances."""

from __future__ import annotations

import math

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop import _keras_internals as internals
from keras_fastloop import _validation
from keras_fastloop.weighting.base import _PACKAGE, LossWeighting


def _model_variable(model, name, shape, value):
    """A trainable float32 variable of `model` (re-used when `compile` runs again)."""
    for variable in model.trainable_variables:
        if variable.name == name and tuple(variable.shape) == tuple(shape):
            return variable
    with internals.unlocked_state(model):  # a subclassed model is built by its first call
        return model.add_weight(
            shape=shape,
            initializer=keras.initializers.Constant(value),
            dtype="float32",
            trainable=True,
            name=name,
        )


@keras.saving.register_keras_serializable(package=_PACKAGE)
class UncertaintyWeighting(LossWeighting):
    """Homoscedastic uncertainty weighting with trainable log-variances (`uw`).

    Objective, with one trainable log-variance `s_i = log sigma_i^2` per task::

        sum_i (exp(-s_i) * L_i + s_i) / 2          (halved=True, the default)
        sum_i  exp(-s_i) * L_i + s_i               (halved=False)

    The default is Kendall et al.'s Eq. 7, `L_i / (2 sigma_i^2) + log sigma_i`, written in
    `s_i` (their "in practice we train ... the log variance"), and is used for every task,
    classification included, as in LibMTL (the paper's classification form, Eq. 10, drops the
    1/2 on the loss term). `halved=False` is the same objective times 2 (the same optimum in
    `s` and in the network's parameters): `s = 0` then gives weight 1 per task, `ew`'s
    objective at the start; with Adam-type optimizers the two train alike, with SGD the default
    halves the effective learning rate. The optimum for a fixed loss is `s_i = log L_i`, so
    the weight tracks `1 / L_i`.

    `initial_log_variance` defaults to `0` (`sigma = 1`; the paper fixes no initial
    value). LibMTL starts at `-0.5` (weights `e^0.5 / 2 = 0.82`):
    `UncertaintyWeighting(initial_log_variance=-0.5)` reproduces it.

    The `s_i` are created with `model.add_weight(..., trainable=True)` (name
    `uw_log_variances`), so they are in `model.trainable_variables` and trained by the
    model's optimizer (with its learning rate, clipping and loss scale), saved with the model and
    restored by checkpoints. The `s_i` term is divided by the number of replicas like any
    regularization loss, so the gradient summed across replicas is the global one. The logged
    `{task}_weight` is the effective weight `exp(-s_i) / 2` (`exp(-s_i)` when not halved)
    of the step, before its update of `s`. `weights` is computed from `log_variances` when
    read (a tensor, not a variable): to change the weights mid-`fit` assign
    `log_variances`.

    Args:
        initial_log_variance: finite float, default `0.0`: the starting value of every `s_i`.
        halved: bool, default `True`: the paper's `1/2` factor (see above).

    Raises:
        ValueError: a non-finite or non-numeric `initial_log_variance`, a non-bool `halved`.

    Example:
        >>> model.compile("adam", {"cls": "sparse_categorical_crossentropy",
        ...                        "seg": "binary_crossentropy"}, loss_weighting="uw")

    Reference:
        Kendall, Gal & Cipolla, "Multi-Task Learning Using Uncertainty to Weigh Losses for Scene
        Geometry and Semantics", CVPR 2018.
    """

    name = "uw"

    def __init__(self, initial_log_variance: float = 0.0, halved: bool = True) -> None:
        super().__init__()
        if not _validation.is_real(initial_log_variance) or not math.isfinite(initial_log_variance):
            raise ValueError(
                "`initial_log_variance` must be a finite float. "
                f"Received: initial_log_variance={initial_log_variance!r}"
            )
        if not isinstance(halved, bool):
            raise ValueError(f"`halved` must be a bool. Received: halved={halved!r}")
        self.initial_log_variance = float(initial_log_variance)
        self.halved = halved
        self.log_variances = None

    @property
    def weights(self):
        """`exp(-s) / 2` (or `exp(-s)`) from the current `log_variances`; `None` unbuilt."""
        if self.log_variances is None:
            return None
        return self._factor * ops.exp(
            -ops.cast(ops.convert_to_tensor(self.log_variances), "float32")
        )

    @weights.setter
    def weights(self, value):
        # The base class creates a `weights` variable; UW derives its weights instead.
        del value

    @property
    def _factor(self):
        return 0.5 if self.halved else 1.0

    def build(self, model, state, task_names, static_weights):
        self.check_tasks(task_names)
        self.task_names = list(task_names)
        self.log_variances = _model_variable(
            model, "uw_log_variances", (len(task_names),), self.initial_log_variance
        )

    def read_weights(self):
        return tf.identity(self.weights)

    def combine(self, losses):
        s = ops.cast(ops.convert_to_tensor(self.log_variances), "float32")
        precision = ops.exp(-s)
        objective = ops.sum(precision * ops.stack(losses)) + internals.scale_loss_for_distribution(
            ops.sum(s)
        )
        if self.halved:
            return 0.5 * objective, ops.stop_gradient(0.5 * precision)
        return objective, ops.stop_gradient(precision)

    def get_config(self):
        return {"initial_log_variance": self.initial_log_variance, "halved": self.halved}
