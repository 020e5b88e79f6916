"""What the step does with a non-finite gradient: ``compile(nonfinite="skip"|"raise"|"terminate")``.

* ``"skip"`` (default): the whole update is skipped on every replica (weights, optimizer slots,
  ``iterations``) and counted in ``skipped_steps``; training goes on. A warning is issued once
  when more than ``SKIP_RATE_WARNING`` of the last ``SKIP_RATE_WINDOW`` steps were skipped.
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

import collections
import warnings

import keras
import tensorflow as tf
from keras import ops

SKIP_RATE_WINDOW = 100
SKIP_RATE_WARNING = 0.2


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
    """Internal callback of ``OptimizedModel.fit``: stops on "terminate", warns on many skips."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy
        self.window = collections.deque()  # (batches, skipped) per callback call
        self.warned = False

    def on_train_begin(self, logs=None):
        self.last_skipped = int(self.model.skipped_steps.numpy())
        self.last_iterations = int(self.model.optimizer.iterations.numpy())
        self.last_batch = -1

    def on_epoch_begin(self, epoch, logs=None):
        self.last_batch = -1

    def on_train_batch_end(self, batch, logs=None):
        state = self.model._fastloop_state
        if self.policy == "terminate" and bool(state.halted.numpy()):
            self.model.stop_training = True
            return
        skipped = int(state.skipped_steps.numpy())
        # With steps_per_execution=N this runs every N batches, with the last batch's index.
        self.window.append((batch - self.last_batch, skipped - self.last_skipped))
        self.last_batch, self.last_skipped = batch, skipped
        while sum(b for b, _ in self.window) > SKIP_RATE_WINDOW:
            self.window.popleft()
        batches = sum(b for b, _ in self.window)
        rate = sum(s for _, s in self.window) / max(batches, 1)
        if not self.warned and batches >= SKIP_RATE_WINDOW // 2 and rate > SKIP_RATE_WARNING:
            self.warned = True
            warnings.warn(
                f"{rate:.0%} of the last {batches} training batches had non-finite "
                "gradients and were skipped (`skipped_steps`); check the learning rate, the "
                "inputs and the loss.",
                stacklevel=2,
            )
