"""The one internal contract of the training step, and the step's own metrics.

Both ways of computing a batch's gradient (one pass, `keras_fastloop._step.gradients.full_batch`, or
micro-batches, `keras_fastloop._step.micro_batching.accumulate`) return a `StepResult`;
only the trainer turns it into metric updates and logs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop._step import scaling

LOG_METRICS = ("grad_norm", "skipped_steps", "loss_scale")


def log_metric_names(settings, optimizer):
    """The optional step metrics to log: as asked, or those of the features that are on.

    `optimizer`: the model's optimizer after Keras' compile (a `LossScaleOptimizer` under a
    `mixed_float16` policy).
    """
    log_metrics, clipper, nonfinite = settings.log_metrics, settings.clipper, settings.nonfinite
    if log_metrics is None:
        lso = scaling.is_loss_scale_optimizer(optimizer)
        names = []
        if clipper is not None:
            names.append("grad_norm")
        if lso or nonfinite != "skip":
            names.append("skipped_steps")
        if lso:
            names.append("loss_scale")
        return tuple(names)
    return (log_metrics,) if isinstance(log_metrics, str) else tuple(log_metrics)


@dataclasses.dataclass
class StepResult:
    """What one (per-replica) batch contributes to the step.

    Attributes:
        grads: loss-scaled gradients, one per trainable variable; `None` where the variable
            gets no gradient (it is then left out of the update, as Keras does).
        logged_loss: float32 scalar, what the `loss` tracker records (task losses weighted by
            the static `loss_weights`, plus regularization), per replica (`1 / num_replicas`
            scaled). The step's one name for it (`global_losses[0]` is its global value).
        task_losses: the unweighted per-task losses (`None` when an overridden
            `compute_loss` did not call the default one).
        weights: float32 `(T,)` weights the weighting method used, or `None`.
        objective: the weighting method's own objective (what was differentiated), or `None`.
        batch_size: int32 scalar, samples in the *global* batch (the `loss` and `objective`
            trackers' sample weight: the replicas' updates then add up to the 1-replica epoch
            mean; the `{task}_loss` trackers are weighted as Keras weights them, see
            `keras_fastloop._step.losses.TaskLoss.record`).
        update_metrics: records the compiled metrics for this batch (called only when the
            update is applied).
        undo_metrics: restores the compiled metrics when they were already updated (micro-batches)
            and the update is skipped; `None` when nothing needs undoing.
        global_losses: `[logged_loss, *task_losses]` of the global batch when already all-reduced
            (the plain path under `tf.distribute`, keras_fastloop._step.loss_shares); `None`: the
            step sums the per-replica values itself.
    """

    grads: list
    logged_loss: object
    task_losses: list | None
    weights: object
    objective: object
    batch_size: object
    update_metrics: Callable[[], None]
    undo_metrics: Callable[[], None] | None = None
    global_losses: list | None = None
    y_pred: object = None


def restore_point(variables):
    """Saves the variables' values now; returns `undo`, which assigns them back."""
    variables = list(variables)
    saved = [tf.identity(v.value) for v in variables]

    def undo():
        for variable, value in zip(variables, saved):
            variable.assign(value)

    return undo


class LastValue(keras.metrics.Metric):
    """A metric that reports the last value given (identical on every replica).

    Its variable is aggregated with `"only_first_replica"`: the step assigns the same value on
    every replica (it comes from the all-reduced gradient or the replicated step state).
    """

    def __init__(self, name, dtype="float32"):
        super().__init__(name=name, dtype=dtype)
        self.value = self.add_variable(
            shape=(), initializer="zeros", dtype=dtype, aggregation="only_first_replica", name=name
        )

    def update_state(self, value):
        self.value.assign(ops.cast(value, self.value.dtype))

    def result(self):
        return ops.convert_to_tensor(self.value)


class StepMetrics:
    """The step's optional metrics (training only; never part of `evaluate`'s logs).

    A plain container, not a Keras object, so Keras' tracking and saving do not adopt the
    metrics, and not in `model.metrics`, so a custom step's loop over `self.metrics` cannot
    update them: only the stages write them. `TrainingStep.reset` resets them at each epoch's
    start and `TrainingStep.logs` adds them to the logs. What must survive a checkpoint lives
    elsewhere: `skipped_steps` in `StepState`, the loss scale in the optimizer.
    """

    def __init__(self, names):
        self.grad_norm = keras.metrics.Mean(name="grad_norm") if "grad_norm" in names else None
        self.skipped_steps = (
            LastValue("skipped_steps", dtype="int64") if "skipped_steps" in names else None
        )
        self.loss_scale = LastValue("loss_scale") if "loss_scale" in names else None
        self.objective = None
        self.weights = []

    def add_weighting(self, task_names, objective=True):
        """With `loss_weighting`: every `{task}_weight` and the method's `objective`."""
        self.objective = keras.metrics.Mean(name="objective") if objective else None
        self.weights = [LastValue(f"{name}_weight") for name in task_names]

    def all(self):
        single = [self.grad_norm, self.skipped_steps, self.loss_scale, self.objective]
        return [m for m in single if m is not None] + self.weights
