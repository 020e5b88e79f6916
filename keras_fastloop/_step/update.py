"""The step's last stages: apply the update (or skip it as a whole), then record the metrics."""

from __future__ import annotations

import tensorflow as tf

from keras_fastloop import _keras_internals as internals
from keras_fastloop._step import distributed, overwrite, scaling


def apply(optimizer, grads, variables, decision, scale, overwritten=()):
    """Apply the update, or skip it entirely (weights, slots, `iterations`).

    Args:
        optimizer: the optimizer the update goes to (built here with `variables` if it is
            not built yet, outside the conditional).
        grads, variables: the unscaled (clipped) gradients summed across replicas, and their
            variables.
        decision: the step's `keras_fastloop._step.guards.Decision`; when the optimizer gets
            the gradient is `scaling.update_condition`'s (a `LossScaleOptimizer` skips
            overflowing updates and halves its scale itself).
        scale: the loss scale the gradients were divided by (`None`: unscaled), multiplied
            back here because the `LossScaleOptimizer` divides by it again.
        overwritten: `overwrite.split`'s variables the optimizer assigns their "gradient"
            (float8 scales and amax histories), joined back as they are.
    """
    grads = scaling.rescale(grads, scale)
    grads, variables = overwrite.join(grads, variables, overwritten)
    if not optimizer.built:
        optimizer.build(variables)
    condition = scaling.update_condition(optimizer, decision)
    with distributed.gradients_already_reduced(optimizer):
        distributed.cond(condition, lambda g: optimizer.apply(g, variables), args=(grads,))


def update_weighting(step, decision, global_losses):
    """A loss weighting's state update (`LossWeighting.update`), on applied steps only.

    `global_losses`: `[logged_loss, *task losses]` of the global batch.
    """
    if step.weighting.has_state_update:
        distributed.cond(decision.applied, step.weighting.update, args=(list(global_losses[1:]),))


def needs_global_losses(step, optimizer):
    """The step needs the global batch's losses: loss scaling or a weighting state update."""
    return scaling.is_loss_scale_optimizer(optimizer) or step.weighting.has_state_update


def record_step_metrics(step, optimizer, applied, grad_norm):
    """`grad_norm` (applied steps only), `skipped_steps` and `loss_scale`, when logged.

    Args:
        step: the model's `TrainingStep`.
        optimizer: the optimizer of the update (its `dynamic_scale` for `loss_scale`).
        applied: scalar bool tensor, the update was applied.
        grad_norm: float32 scalar, the gradient's global norm.
    """
    metrics = step.metrics
    if metrics.grad_norm is not None:
        tf.cond(applied, lambda: metrics.grad_norm.update_state(grad_norm), lambda: None)
    if metrics.skipped_steps is not None:
        metrics.skipped_steps.update_state(step.state.skipped_steps)
    if metrics.loss_scale is not None and scaling.is_loss_scale_optimizer(optimizer):
        metrics.loss_scale.update_state(optimizer.dynamic_scale)


def record_metrics(model, step, result, applied):
    """Loss, compiled and weighting metrics of the default step; a skipped step leaves them
    as if the batch was not seen.

    Args:
        model: the compiled model.
        step: its `TrainingStep`.
        result: the step's `keras_fastloop._step.results.StepResult`.
        applied: scalar bool tensor, the update was applied.
    """

    def record():
        _record_losses(model, step, result)
        result.update_metrics()

    def skip():
        if result.undo_metrics is not None:
            result.undo_metrics()

    tf.cond(applied, record, skip)
    if result.weights is not None:
        for metric, weight in zip(step.metrics.weights, tf.unstack(result.weights)):
            metric.update_state(weight)


def _record_losses(model, step, result):
    internals.loss_tracker(model).update_state(
        internals.unscale_loss_for_distribution(result.logged_loss), sample_weight=result.batch_size
    )
    if result.task_losses is not None:
        internals.compile_loss(model).record(result.task_losses)
    objective = step.metrics.objective
    if objective is not None and result.objective is not None:
        objective.update_state(
            internals.unscale_loss_for_distribution(result.objective),
            sample_weight=result.batch_size,
        )
