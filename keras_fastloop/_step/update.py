"""The step's last stages: apply the update (or skip it as a whole), then record the metrics."""

from __future__ import annotations

import tensorflow as tf

from keras_fastloop import _keras_internals as internals
from keras_fastloop._step import distributed, scaling


def apply(model, grads, variables, decision, scale, global_losses):
    """Apply the update, or skip it entirely (weights, slots, `iterations`, weighting state).

    Args:
        model: the compiled model.
        grads, variables: the unscaled (clipped) gradients summed across replicas, and their
            variables.
        decision: the step's `keras_fastloop._step.guards.Decision`; when the optimizer gets
            the gradient is `scaling.update_condition`'s (a `LossScaleOptimizer` skips
            overflowing updates and halves its scale itself).
        scale: the loss scale the gradients were divided by (`None`: unscaled), multiplied
            back here because the `LossScaleOptimizer` divides by it again.
        global_losses: `[loss, *task losses]` of the global batch, for a loss weighting with a
            state update (`LossWeighting.update`, on applied steps only); else unused.
    """
    optimizer = model.optimizer
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    grads = scaling.rescale(grads, scale)
    condition = scaling.update_condition(optimizer, decision)
    with distributed.gradients_already_reduced(optimizer):
        distributed.cond(condition, lambda g: optimizer.apply(g, variables), args=(grads,))
    weighting = model._loss_weighting
    if weighting.has_state_update:
        distributed.cond(decision.applied, weighting.update, args=(list(global_losses[1:]),))


def needs_global_losses(model):
    """The step needs the global batch's losses: loss scaling or a weighting state update."""
    return scaling.is_loss_scale_optimizer(model.optimizer) or (
        model._loss_weighting.has_state_update
    )


def record_metrics(model, result, applied, grad_norm):
    """Metrics of an applied step; a skipped one leaves them as if the batch was not seen.

    Args:
        model: the compiled model.
        result: the step's `keras_fastloop._step.results.StepResult`.
        applied: scalar bool tensor, the update was applied.
        grad_norm: float32 scalar, the gradient's global norm (`None`: not computed).
    """
    step_metrics = model._step_metrics

    def record():
        _record_losses(model, result)
        if step_metrics.grad_norm is not None and grad_norm is not None:
            step_metrics.grad_norm.update_state(grad_norm)
        result.update_metrics()

    def skip():
        if result.undo_metrics is not None:
            result.undo_metrics()

    tf.cond(applied, record, skip)
    if step_metrics.skipped_steps is not None:
        step_metrics.skipped_steps.update_state(model._fastloop_state.skipped_steps)
    if step_metrics.loss_scale is not None:
        step_metrics.loss_scale.update_state(model.optimizer.dynamic_scale)
    if result.weights is not None:
        for metric, weight in zip(step_metrics.weights, tf.unstack(result.weights)):
            metric.update_state(weight)


def _record_losses(model, result):
    model._loss_tracker.update_state(
        internals.unscale_loss_for_distribution(result.loss), sample_weight=result.batch_size
    )
    if result.task_losses is not None:
        model._compile_loss.record(result.task_losses)
    objective = model._step_metrics.objective
    if objective is not None and result.objective is not None:
        objective.update_state(
            internals.unscale_loss_for_distribution(result.objective),
            sample_weight=result.batch_size,
        )
