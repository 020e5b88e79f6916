"""The interface between OptimizedModel's step and a multi-task loss weighting method.

The step calls, in order, inside one `tf.function`:

1. `build(model, state, task_names, static_weights)` once, from `compile()` (with
   `shared_variables` set to `compile(shared_variables=...)`'s value): create every
   variable. Trainable ones (e.g. UW's log-variances) with `model.add_weight` so the optimizer
   trains them; state (EMAs, previous losses, current weights) with `state.add_weight(...,
   trainable=False)` so it is checkpointed, restored by `BackupAndRestore` and identical on
   every replica (use `aggregation="only_first_replica"`).
2. `combine(losses)` inside the gradient tape: returns the differentiable weighted objective
   (without regularization losses) and the weights used, a float32 vector of shape `(T,)`.
3. `gradients(tape, losses, objective, variables, scale_loss)`: the gradients of the (loss
   scaled) objective for `variables`. Loss-based methods keep the default (one backward pass);
   gradient-based methods override it and set `requires_task_gradients = True` (the step then
   records a persistent tape). A gradient-based method decides its weights from this step's
   gradients: it assigns them to `weights` inside `gradients` and the step logs
   `read_weights()` taken right after (so the logged weights are this step's). A method that
   sets `sub_batches = k > 1` (MoDo, SDMGrad) also gets `part_losses=`: `k` lists of the
   tasks' losses on the `k` consecutive parts of the batch, taken in the same tape, and
   `batch_size=` (the replica's number of samples; under `k` each part is the whole batch).
4. `update(losses)` after the optimizer applied the update (only on steps that were applied):
   advance the method's state.
5. `callbacks()`, outside the step: Keras callbacks that `OptimizedModel.fit` adds to every
   `fit` (default: none; DWA closes its per-epoch averaging window there).

Weights are read from variables at run time, never baked into the trace: assigning
`model.loss_weighting.weights` (or any state variable) during `fit` takes effect on the next
step without retracing.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop._replicas import state_variable

_PACKAGE = "keras_fastloop"


class LossWeighting:
    """Base class of multi-task loss weighting methods (see the module docstring for the protocol).

    Subclasses set `name` (the LibMTL short id), implement `combine` and, for
    gradient-based methods, `gradients`. Keras-serializable through `get_config` /
    `from_config`.
    """

    name = "base"
    requires_task_gradients = False
    # k > 1: `gradients` also gets the tasks' losses on k consecutive parts of the batch.
    sub_batches = 1
    # Whether the method uses compile(loss_weights=...) (see weighting.check_loss_weights).
    accepts_loss_weights = False
    # compile(shared_variables=...) as given (variables or layers), set by the step before
    # `build`; read by the gradient-based methods (`validate` refuses it for the others).
    shared_variables = None

    def __init__(self) -> None:
        self.task_names = None
        self.weights = None  # float32 variable of shape (T,), the weights used by the last step

    @property
    def num_tasks(self):
        return len(self.task_names)

    def build(self, model, state, task_names, static_weights):
        """Create variables. `static_weights` are the floats of `compile(loss_weights=...)`."""
        self.check_tasks(task_names)
        self.task_names = list(task_names)
        self.weights = state_variable(
            state, "loss_weights", (len(task_names),), self.initial_weights(static_weights)
        )

    def validate(self, model, task_names, shared_variables=None):
        """Raise `ValueError` at `compile()`, before any state changes, for what `build` would
        refuse. `task_names` may be `None` (the outputs are not known yet)."""
        del model
        if shared_variables is not None and not self.requires_task_gradients:
            raise ValueError(
                "`shared_variables` is only read by the gradient-based loss weighting methods "
                f"(it has no effect on '{self.name}'). Received: "
                f"shared_variables={shared_variables!r}"
            )
        if task_names is not None:
            self.check_tasks(task_names)

    def check_tasks(self, task_names):
        """Raise `ValueError` unless a multi-task method gets at least two tasks."""
        if len(task_names) < 2 and self.name not in ("static", "ew"):
            raise ValueError(
                f"Loss weighting '{self.name}' needs a model with at least two outputs that have "
                f"a loss. Received: {len(task_names)} task(s) {list(task_names)}"
            )

    def initial_weights(self, static_weights):
        return [1.0] * len(static_weights)

    def read_weights(self):
        """A snapshot (a read at this point of the step) of the `weights` variable.

        `ops.convert_to_tensor` on a variable may return the variable itself, whose value a
        `tf.function` output would show only after later assignments in the same step.
        """
        return tf.identity(self.weights.value)

    def combine(self, losses):
        """Weighted objective `sum_i w_i * L_i` with `w` read from the `weights` variable."""
        weights = self.read_weights()
        return ops.sum(ops.stack(losses) * ops.stop_gradient(weights)), weights

    def gradients(self, tape, losses, objective, variables, scale_loss):
        """Gradients of `objective` (already loss-scaled) for `variables`; one backward pass.

        Returns `None` for variables the objective does not reach; the step turns those into
        zeros and names them in one warning.
        """
        del losses, scale_loss
        return tape.gradient(
            objective, variables, unconnected_gradients=tf.UnconnectedGradients.NONE
        )

    @property
    def has_state_update(self):
        """Whether `update` does anything (the step then gathers the global-batch losses)."""
        return type(self).update is not LossWeighting.update

    def update(self, losses):
        """Advance the method's state after an applied step (default: nothing)."""

    def callbacks(self):
        """Keras callbacks `OptimizedModel.fit` adds to every `fit` (default: none).

        E.g. DWA closes its averaging window at each epoch end.
        """
        return []

    def get_config(self):
        return {}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class Static(LossWeighting):
    """Fixed weights, equal to `compile(loss_weights=...)` (Keras' behaviour).

    Unlike Keras, the weights live in a variable (`weights`), so assigning new values during
    `fit` changes the next step's objective without retracing.

    Example:
        >>> model.compile("adam", losses, loss_weights={"cls": 1.0, "seg": 0.5},
        ...               loss_weighting="static")
        >>> _ = model.loss_weighting.weights.assign([1.0, 2.0])  # next step, no retrace

    Reference:
        Keras' `compile(loss_weights=...)`; the fixed-weight baseline of Caruana, "Multitask
        Learning", Machine Learning 28, 1997.
    """

    name = "static"
    accepts_loss_weights = True

    def initial_weights(self, static_weights):
        return list(static_weights)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class EqualWeighting(LossWeighting):
    """Equal weights: every task's loss counts with weight 1 (LibMTL `ew`).

    Objective `sum_i L_i`. The weights are held in a variable like `static`'s.

    Example:
        >>> model.compile("adam", losses, loss_weighting="ew")

    Reference:
        The equal-weighting baseline of Caruana, "Multitask Learning", Machine Learning 28, 1997;
        LibMTL's `EW` (Lin & Zhang, "LibMTL: A Python Library for Multi-Task Learning", JMLR 2023).
    """

    name = "ew"
