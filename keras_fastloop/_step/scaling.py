"""Thin glue around Keras' loss scaling (`keras.optimizers.LossScaleOptimizer`).

Keras owns the loss scale and its dynamic update; nothing here keeps a second scale. The step
multiplies the loss by the optimizer's scale inside the tape (`optimizer.scale_loss`), divides
the gradients by it before the finite check and clipping, and multiplies the clipped gradients
by it again just before `optimizer.apply`, which divides once more and runs Keras' own
finite check and dynamic-scale update. Keras' dynamic scale is a power of two (`initial_scale`
defaults to 2**15 and only ever doubles or halves), so the extra multiply and divide are exact.
"""

from __future__ import annotations

import keras
from keras import ops


def is_loss_scale_optimizer(optimizer) -> bool:
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def current_scale(optimizer):
    """The factor `optimizer.scale_loss` multiplies by, or `None` when it does not scale.

    `LossScaleOptimizer` -> its `dynamic_scale` variable; a plain optimizer built with
    `loss_scale_factor` -> that constant; otherwise `None`.
    """
    if is_loss_scale_optimizer(optimizer):
        return optimizer.dynamic_scale if optimizer.built else optimizer.initial_scale
    return getattr(optimizer, "loss_scale_factor", None)


def unscale(grads, scale):
    """Divide gradients by the loss scale (no-op when `scale` is `None`)."""
    if scale is None:
        return list(grads)
    return [g / ops.cast(scale, g.dtype) for g in grads]


def rescale(grads, scale):
    """Multiply gradients back by the loss scale, for an optimizer that divides by it itself."""
    if scale is None:
        return list(grads)
    return [g * ops.cast(scale, g.dtype) for g in grads]


def update_condition(optimizer, decision):
    """When the step hands the gradient to `optimizer.apply` (scalar bool tensor).

    A plain optimizer gets it when the update is applied (`decision.applied`). A
    `LossScaleOptimizer` gets it whenever the loss is finite and the non-finite policy allows
    updates, overflowing gradients included: it skips those updates and halves its scale itself.

    Args:
        optimizer: the model's optimizer.
        decision: the step's `keras_fastloop._step.guards.Decision`.
    """
    if not is_loss_scale_optimizer(optimizer):
        return decision.applied
    if decision.allowed is None:
        return decision.loss_finite
    return ops.logical_and(decision.loss_finite, decision.allowed)
