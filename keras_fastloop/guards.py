"""What the step does with a non-finite gradient: ``compile(nonfinite="skip"|"raise"|"terminate")``.

* ``"skip"`` (default): the whole update is skipped on every replica (weights, optimizer slots,
  ``iterations``) and counted in ``skipped_steps``; training goes on. A warning is issued once
  when more than ``SKIP_RATE_WARNING`` of an epoch's batches were skipped.
* ``"raise"``: the step fails with ``InvalidArgumentError`` naming the optimizer step and the
  first variable whose gradient is not finite; no update is applied.
* ``"terminate"``: the update is skipped, every later update is blocked (also inside the same
  ``steps_per_execution`` block), and training stops cleanly at the end of the batch, like
  ``keras.callbacks.TerminateOnNaN`` but keeping the last good weights.

Under dynamic loss scaling (``LossScaleOptimizer``) an overflowing gradient is part of normal
operation: Keras halves the scale and skips the step. There ``"raise"`` and ``"terminate"`` act
only when the *unscaled loss* is non-finite (a real divergence), never on a scale overflow.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf
from keras import ops

SKIP_RATE_WINDOW = 100  # batches in the tests' high/low skip-rate epochs
SKIP_RATE_WARNING = 0.2
SKIP_RATE_MIN_SKIPS = 5


def first_nonfinite_name(grads, variables):
    """Scalar string tensor: the path of the first variable whose gradient is not finite."""
    flags = ops.stack([ops.logical_not(ops.all(ops.isfinite(g))) for g in grads])
    names = tf.constant([v.path for v in variables])
    index = tf.argmax(tf.cast(flags, "int32"))
    return tf.gather(names, index)


def check(policy, state, finite, loss_finite, grads, variables, iterations):
    """Apply the policy before the update; returns the extra condition the update needs.

    Args:
        policy: ``"skip"``, ``"raise"`` or ``"terminate"``.
        state: the model's :class:`~keras_fastloop.state.StepState`.
        finite: scalar bool tensor, the (cross-replica) gradient is finite.
        loss_finite: scalar bool tensor or ``None``; with loss scaling, the policy acts on it
            instead of ``finite``.
        grads, variables: the unscaled gradients and their variables (to name the culprit).
        iterations: the optimizer's step counter (for the message).

    Returns:
        ``None`` (no extra condition) or a scalar bool tensor that must hold for the update.
    """
    trigger = ops.logical_not(finite if loss_finite is None else loss_finite)
    if policy == "raise":
        tf.debugging.Assert(
            ops.logical_not(trigger),
            [
                "Non-finite gradient (compile(nonfinite='raise')) at optimizer step",
                iterations,
                "first variable with a non-finite gradient:",
                first_nonfinite_name(grads, variables),
            ],
            name="nonfinite_gradient",
        )
        return None
    if policy == "terminate":
        halted = ops.logical_or(state.halted, trigger)
        state.halted.assign(halted)
        return ops.logical_not(halted)
    return None


class NonFiniteMonitor(keras.callbacks.Callback):
    """Internal callback of ``OptimizedModel.fit`` for the non-finite policy.

    For ``"skip"`` it only looks at epoch ends (no per-batch hook, so Keras keeps dispatching
    batch callbacks asynchronously and the default setup is as fast as plain ``fit``): it warns
    once when more than ``SKIP_RATE_WARNING`` of an epoch's batches, and at least
    ``SKIP_RATE_MIN_SKIPS`` of them, were skipped. For ``"terminate"`` it also checks after
    every batch (every execution with ``steps_per_execution > 1``) and stops training.
    """

    def __init__(self, policy):
        super().__init__()
        self.policy = policy
        self.warned = False
        if policy == "terminate":
            self.on_train_batch_end = self._stop_if_halted

    def _counters(self):
        return int(self.model.skipped_steps.numpy()), int(self.model.optimizer.iterations.numpy())

    def on_train_begin(self, logs=None):
        # A halt ends one fit only (as TerminateOnNaN): the next fit trains again.
        self.model._fastloop_state.halted.assign(False)

    def on_epoch_begin(self, epoch, logs=None):
        self.start = self._counters()

    def _stop_if_halted(self, batch, logs=None):
        if bool(self.model._fastloop_state.halted.numpy()) and not self.model.stop_training:
            self.model.stop_training = True
            print(
                f"Batch {batch}: non-finite loss or gradient, terminating training "
                "(compile(nonfinite='terminate')); the weights are those of the last good step."
            )

    def on_epoch_end(self, epoch, logs=None):
        skipped, iterations = self._counters()
        skipped -= self.start[0]
        batches = skipped + iterations - self.start[1]
        rate = skipped / max(batches, 1)
        if not self.warned and skipped >= SKIP_RATE_MIN_SKIPS and rate > SKIP_RATE_WARNING:
            self.warned = True
            warnings.warn(
                f"{rate:.0%} of the last {batches} training batches had non-finite "
                "gradients and were skipped (`skipped_steps`); check the learning rate, the "
                "inputs and the loss.",
                stacklevel=2,
            )
