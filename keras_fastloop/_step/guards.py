"""What the step does with a non-finite gradient: `compile(nonfinite="skip"|"raise"|"terminate")`.

* `"skip"` (default): the whole update is skipped on every replica (weights, optimizer slots,
  `iterations`) and counted in `skipped_steps`; training goes on. A skipped step is never
  silent: at the end of every epoch in which steps were skipped (and after every
  `train_on_batch` call that skipped one) a `FastloopWarning` gives their count, the first
  skipped optimizer step and the first variable whose gradient was not finite (`report_skips`).
* `"raise"`: the update is skipped, every later update is blocked (also inside the same
  `steps_per_execution` block), the step records the optimizer step and the first variable
  whose gradient is not finite, and `fit` (`train_on_batch`) raises `NonFiniteError`
  with that message at the end of the batch, from Python (not from inside the graph). The
  weights are those of the last good step.
* `"terminate"`: the update is skipped, every later update is blocked (also inside the same
  `steps_per_execution` block), and training stops cleanly at the end of the batch, like
  `keras.callbacks.TerminateOnNaN` but keeping the last good weights.

Under dynamic loss scaling (`LossScaleOptimizer`) an overflowing gradient is part of normal
operation: Keras halves the scale and skips the step. There `"raise"` and `"terminate"` act
only when the *unscaled loss* is non-finite (a real divergence), never on a scale overflow.
Under `"skip"` a non-finite loss (bad data: NaN/inf in inputs, labels or sample weights that
reaches the loss) skips the step without handing the gradient to the `LossScaleOptimizer`, so
the scale is not halved; only a finite loss whose scaled gradient overflows halves it (a finite
loss with a non-finite gradient, e.g. an `inf` input saturated by `tanh`, counts as an
overflow). Every decision is taken on the all-reduced gradient and loss, hence the same on
every replica.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf
from keras import ops

from keras_fastloop._replicas import state_variable
from keras_fastloop._step import scaling

# What the skip report reads (all policies): counts since the last report, and the first
# skipped step of them, created in `compile()` (`build`) and reset by `report_skips`.
REPORT_VARIABLES = (
    ("unreported_skipped_steps", "int64", 0),
    ("unreported_overflows", "int64", 0),
    ("first_skipped_step", "int64", -1),
    ("first_skipped_variable", "int32", -1),
)


def build(state, policy):
    """Create the variables of `policy` on the model's step `state` (in `compile()`).

    `"raise"` records the first fault: `nonfinite_step` (the optimizer step, `-1` for
    none) and `nonfinite_variable` (index of the first variable whose gradient is not finite,
    `-1` when every gradient is finite but the loss is not).

    Every policy gets the variables of the skip report (`REPORT_VARIABLES`): the steps skipped
    for non-finite values and the loss-scale overflows since the last report, and the first
    skipped step's optimizer step and variable index (`-1` for none).
    """
    for name, dtype, value in REPORT_VARIABLES:
        if not hasattr(state, name):
            setattr(state, name, state_variable(state, name, value=value, dtype=dtype))
    if policy != "raise" or hasattr(state, "nonfinite_step"):
        return
    for name, dtype in (("nonfinite_step", "int64"), ("nonfinite_variable", "int32")):
        setattr(state, name, state_variable(state, name, value=-1, dtype=dtype))


def first_nonfinite_index(grads):
    """Scalar int32 tensor: index of the first gradient that is not finite (`-1` for none)."""
    flags = ops.stack([ops.logical_not(ops.all(ops.isfinite(_values(g)))) for g in grads])
    index = ops.cast(tf.argmax(ops.cast(flags, "int32")), "int32")
    return ops.where(ops.any(flags), index, -1)


def _values(gradient):
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the step does with this gradient (scalar bool tensors, the same on every replica).

    Attributes:
        applied: the update is applied: the gradient is finite and the policy allows updates.
        skipped: the update is skipped for a non-finite value or a loss-scale overflow (a step
            blocked by an earlier halt of `"raise"`/`"terminate"` is not counted).
        loss_finite: under loss scaling, the global loss is finite; `None` otherwise.
        allowed: the policy's condition for any update (`None`: always allowed).
    """

    applied: object
    skipped: object
    loss_finite: object = None
    allowed: object = None


def decide(step, optimizer, grad_norm, global_losses, grads, variables):
    """The finite check and the step's non-finite policy: a `Decision`, before the update.

    Args:
        step: the model's `TrainingStep` (its `nonfinite` policy and step state).
        optimizer: the optimizer the update goes to (its `iterations`, for the message).
        grad_norm: float32 scalar, the global norm of the (cross-replica, unscaled) gradient.
            inf/NaN anywhere makes it non-finite; so does a norm beyond float32's range
            (~1.8e19), which is treated as a divergence too: one check instead of one per
            variable.
        global_losses: `[logged_loss, *task losses]` of the global batch (`None` when not
            computed). Under loss scaling the policy acts on them, never on a scale overflow;
            without them every non-finite gradient counts as an overflow.
        grads, variables: the unscaled gradients and their variables (to name the culprit).
    """
    policy, state, iterations = step.nonfinite, step.state, optimizer.iterations
    finite = ops.isfinite(grad_norm)
    loss_finite = None
    if scaling.is_loss_scale_optimizer(optimizer):
        loss_finite = (
            tf.constant(True)
            if global_losses is None
            else ops.all(ops.isfinite(ops.stack(global_losses)))
        )
    halted = _halted_before(policy, state)
    allowed = _check(policy, state, finite, loss_finite, grads, variables, iterations)
    applied = finite if allowed is None else ops.logical_and(finite, allowed)
    skipped = ops.logical_not(applied)
    if halted is not None:  # steps blocked after a halt were not skipped for NaN
        skipped = ops.logical_and(skipped, ops.logical_not(halted))
    return Decision(applied, skipped, loss_finite, allowed)


def overflowed(decision):
    """Scalar bool tensor: the step was skipped for a loss-scale overflow (finite loss)."""
    if decision.loss_finite is None:
        return tf.constant(False)
    return ops.logical_and(decision.skipped, decision.loss_finite)


def _halted_before(policy, state):
    """The halt flag as the step begins (bool scalar tensor), `None` under `"skip"`.

    Steps that a halt blocks later in the same execution are not counted as skipped for
    non-finite values, so `skipped_steps` does not depend on `steps_per_execution`.
    """
    if policy not in ("raise", "terminate"):
        return None
    return tf.identity(state.halted.value)  # read now, before `_check` assigns it


def _check(policy, state, finite, loss_finite, grads, variables, iterations):
    """Apply the policy before the update; returns the extra condition the update needs.

    `loss_finite` (loss scaling) is what the policy acts on instead of `finite`. Returns
    `None` (no extra condition) or a scalar bool tensor that must hold for any update.
    """
    trigger = ops.logical_not(finite if loss_finite is None else loss_finite)
    if policy == "raise":
        # Record the first fault; NonFiniteMonitor raises from Python once the batch is done.
        object.__setattr__(state, "nonfinite_paths", [v.path for v in variables])
        first = ops.logical_and(trigger, ops.logical_not(state.halted))
        step = ops.cast(iterations, "int64")
        state.nonfinite_step.assign(ops.where(first, step, state.nonfinite_step))
        state.nonfinite_variable.assign(
            ops.where(first, first_nonfinite_index(grads), state.nonfinite_variable)
        )
    if policy in ("raise", "terminate"):
        halted = ops.logical_or(state.halted, trigger)
        state.halted.assign(halted)
        return ops.logical_not(halted)
    return None


def record_skip(step, optimizer, decision, grads, variables):
    """Count a skipped step in `skipped_steps` and for the skip report (after the update).

    Args:
        step: the model's `TrainingStep`. Under its policy `"raise"`/`"terminate"` a step skipped for
            a non-finite value halts training and is said by the error or the stop message, so
            only loss-scale overflows are counted for the report.
        optimizer: the optimizer the update went to (its `iterations`).
        decision: this step's `Decision` (under loss scaling a skipped step with a finite
            loss is a loss-scale overflow, expected).
        grads, variables: the unscaled gradients and their variables (to name the first one
            that is not finite; computed only for the first skipped step of a report).
    """
    policy, state, iterations = step.nonfinite, step.state, optimizer.iterations
    skipped = decision.skipped
    state.skipped_steps.assign_add(ops.cast(skipped, "int64"))
    overflow = overflowed(decision)
    real = ops.logical_and(skipped, ops.logical_not(overflow))
    if policy != "skip":
        real = tf.constant(False)
    object.__setattr__(state, "skipped_paths", [v.path for v in variables])
    state.unreported_overflows.assign_add(ops.cast(overflow, "int64"))
    state.unreported_skipped_steps.assign_add(ops.cast(real, "int64"))
    first = ops.logical_and(real, state.first_skipped_step < 0)
    index = tf.cond(
        first, lambda: first_nonfinite_index(grads), lambda: tf.constant(-1, dtype="int32")
    )
    step = ops.cast(iterations, "int64")
    state.first_skipped_step.assign(ops.where(first, step, state.first_skipped_step))
    state.first_skipped_variable.assign(ops.where(first, index, state.first_skipped_variable))
