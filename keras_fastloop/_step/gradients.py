"""The step's first stages: forward, loss and the loss-scaled gradient of one batch.

`compute` takes the gradient of the whole (per-replica) batch in one pass, or micro-batch by
micro-batch (`keras_fastloop._step.micro_batching`); either way it returns a `StepResult`.
`connected` then leaves out the variables that get no gradient, as Keras does.
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from keras_fastloop import _keras_internals as internals
from keras_fastloop._step import batch, micro_batching, objective, user_metrics
from keras_fastloop._step.results import StepResult
from keras_fastloop._warnings import FastloopWarning


def compute(model, step, x, y, sample_weight, variables):
    """`StepResult` of the batch: micro-batched under `compile(micro_batch_size=k)`.

    Args:
        model: the compiled model.
        step: its `TrainingStep`.
        x, y, sample_weight: the (per-replica) batch, as unpacked by Keras.
        variables: the variables to differentiate (`model.trainable_variables`).
    """
    if step.micro_batch_size:
        return micro_batching.accumulate(
            model, step, x, y, sample_weight, variables, step.micro_batch_size
        )
    return full_batch(model, step, x, y, sample_weight, variables)


def full_batch(model, step, x, y, sample_weight, variables):
    """`StepResult` of one gradient of the whole (per-replica) batch.

    The gradient is that of `optimizer.scale_loss(loss)`; with a gradient-based loss
    weighting it is the weighting's combination of the per-task gradients.
    """
    weighting = step.weighting
    undo_trackers = objective.override_trackers_restore_point(model, step)
    with tf.GradientTape(persistent=weighting.requires_task_gradients) as tape:
        y_pred = objective.forward(model, x, training=True)
        total, logged_loss, record = objective.loss_terms(
            model, step, x, y, y_pred, sample_weight, training=True
        )
        scaled = model.optimizer.scale_loss(total)
    if record is None:
        grads = tape.gradient(scaled, variables, unconnected_gradients=tf.UnconnectedGradients.NONE)
        task_losses = weights = objective_value = global_losses = None
    else:
        # A weighting of several parts of the batch also gets their losses (taken in the tape).
        parts = {}
        if record.part_losses is not None:
            parts = {"part_losses": record.part_losses, "batch_size": record.replica_batch_size}
        grads = weighting.gradients(
            tape, record.values, scaled, variables, model.optimizer.scale_loss, **parts
        )
        weights = record.weights
        if weighting.requires_task_gradients:  # weights decided from this step's gradients
            weights = weighting.read_weights()
        task_losses, objective_value = record.values, record.objective
        global_losses = record.global_losses
    del tape
    compile_metrics = internals.compile_metrics(model)
    if user_metrics.overrides_compute_metrics(model):
        compile_metrics = None  # the step calls the override after the update

    def update_metrics():
        if compile_metrics is not None:
            compile_metrics.update_state(y, y_pred, sample_weight)

    return StepResult(
        grads=list(grads),
        logged_loss=logged_loss,
        task_losses=task_losses,
        weights=weights,
        objective=objective_value,
        batch_size=batch.batch_size(x) if record is None else record.batch_size,
        update_metrics=update_metrics,
        undo_metrics=undo_trackers,
        global_losses=global_losses,
        y_pred=y_pred,
    )


def connected(step, grads, variables):
    """`(grads, variables)` of the variables that get a gradient.

    Keras leaves the others untouched; a `FastloopWarning` names them, once per
    `TrainingStep` (`step.warned`).
    """
    missing = [v.path for g, v in zip(grads, variables) if g is None]
    if missing and "unconnected" not in step.warned:
        step.warned.add("unconnected")
        warnings.warn(
            f"{len(missing)} trainable variable(s) get no gradient from the loss and are "
            f"left out of the update (as in keras.Model): {missing}",
            FastloopWarning,
            stacklevel=3,
        )
    pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
    return [g for g, _ in pairs], [v for _, v in pairs]
