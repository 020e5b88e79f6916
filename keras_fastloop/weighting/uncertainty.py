"""Uncertainty weighting (UW): trainable homoscedastic log-variances."""

from __future__ import annotations

import math

import keras
from keras import ops

from keras_fastloop import _keras_internals as internals
from keras_fastloop.weighting.base import _PACKAGE, LossWeighting


def _model_variable(model, name, shape, value):
    """A trainable float32 variable of ``model`` (re-used when ``compile`` runs again)."""
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
    """Homoscedastic uncertainty weighting with trainable log-variances (``uw``).

    Objective, with one trainable log-variance ``s_i = log sigma_i^2`` per task::

        sum_i exp(-s_i) * L_i + s_i

    This is Kendall et al.'s regression form ``L_i / (2 sigma_i^2) + log sigma_i`` multiplied by
    2 (the same optimum in ``s`` and in the network's parameters; LibMTL uses the halved form).
    The factor choice makes ``s = 0`` give weight 1 per task, i.e. ``ew``'s objective at the
    start, and is used for every task (classification included, as in LibMTL). The optimum for a
    fixed loss is ``s_i = log L_i``, so the weight ``exp(-s_i)`` tracks ``1 / L_i``.

    The ``s_i`` are created with ``model.add_weight(..., trainable=True)`` (name
    ``uw_log_variances``), so they are in ``model.trainable_variables`` and trained by the
    model's optimizer (with its learning rate, clipping and loss scale), saved with the model and
    restored by checkpoints. The ``+ s_i`` term is divided by the number of replicas like any
    regularization loss, so the gradient summed across replicas is the global one. The logged
    ``{task}_weight`` is ``exp(-s_i)``; to change the weights mid-``fit`` assign
    ``log_variances`` (``weights`` only mirrors them, as used by the last step).

    Args:
        initial_log_variance: float, default ``0.0``: the starting value of every ``s_i``.

    Example:
        >>> model.compile("adam", {"cls": "sparse_categorical_crossentropy",
        ...                        "seg": "binary_crossentropy"}, loss_weighting="uw")

    Reference:
        Kendall, Gal & Cipolla, "Multi-Task Learning Using Uncertainty to Weigh Losses for Scene
        Geometry and Semantics", CVPR 2018.
    """

    name = "uw"

    def __init__(self, initial_log_variance=0.0):
        super().__init__()
        if (
            isinstance(initial_log_variance, bool)
            or not isinstance(initial_log_variance, (int, float))
            or not math.isfinite(initial_log_variance)
        ):
            raise ValueError(
                "`initial_log_variance` must be a finite float. "
                f"Received: initial_log_variance={initial_log_variance!r}"
            )
        self.initial_log_variance = float(initial_log_variance)
        self.log_variances = None

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        self.log_variances = _model_variable(
            model, "uw_log_variances", (len(task_names),), self.initial_log_variance
        )

    def combine(self, losses):
        s = ops.cast(ops.convert_to_tensor(self.log_variances), "float32")
        precision = ops.exp(-s)
        regularizer = internals.scale_loss_for_distribution(ops.sum(s))
        objective = ops.sum(precision * ops.stack(losses)) + regularizer
        return objective, ops.stop_gradient(precision)

    def gradients(self, tape, losses, objective, variables, scale_loss):
        grads = super().gradients(tape, losses, objective, variables, scale_loss)
        # Mirror the weights used by this step. Done here, after the backward pass: under
        # MirroredStrategy an ``only_first_replica`` assignment is a collective, which must not
        # sit inside the tape's forward pass nor the step's conditional ``update`` branch.
        self.weights.assign(ops.exp(-ops.cast(self.log_variances, "float32")))
        return grads

    def get_config(self):
        return {"initial_log_variance": self.initial_log_variance}
