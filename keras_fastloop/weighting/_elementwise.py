"""Gradient-based methods whose rule needs the task gradients element by element.

DB-MTL (a running average of each task's gradient), ExcessMTL (an AdaGrad-style accumulator of
each task's squared gradient) and GradDrop (a sign mask per parameter entry) are not functions
of the Gram matrix, so they cannot use `GradientWeighting.gradients` as it is. They share its
conventions (see `keras_fastloop.weighting._gradient`): one backward pass per task, shared
variables inferred (or `compile(shared_variables=...)`), per-task shared gradients summed
across replicas and divided by the loss scale before the rule sees them, the returned gradients
loss-scaled and per replica (the step sums and unscales them as usual).

Per-element state. A method that keeps state per shared entry sets `buffer_prefix`; `build`
then creates, for every variable that may be shared (the given `shared_variables`, else every
trainable variable of the model at `compile()`), a `(T, size)` float32 state variable and a
second one for this step's value. The step writes the second one; `update`, which runs only on
applied steps, commits it (`commit_buffers`), so a skipped step leaves the state unchanged.
Memory: `2 T` copies of those variables.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import tensorflow as tf
from keras import ops

from keras_fastloop import _replicas
from keras_fastloop._replicas import state_variable
from keras_fastloop.weighting import _gradient
from keras_fastloop.weighting._gradient import GradientWeighting


class TaskGradients(NamedTuple):
    """One step's per-task gradients (see `ElementwiseGradientWeighting.task_gradients`)."""

    per_task: list  # per task, per variable: the local loss-scaled gradient or None
    shared: list  # indices of the shared variables
    flat: list  # per shared variable: (T, size) float32, summed across replicas, unscaled
    losses: object  # (T,) float32 global losses


class ElementwiseGradientWeighting(GradientWeighting):
    """Base of gradient-based methods with element-wise rules (see the module docstring)."""

    buffer_prefix = None

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        self._buffers = []
        self._shared_in_trace = []
        if self.buffer_prefix is None:
            return
        candidates = self.compiled_candidates(model)
        if not candidates:
            raise ValueError(
                f"Loss weighting '{self.name}' keeps per-task state for every shared variable "
                "and needs the model's variables at compile(): build the model first (call it "
                "on a batch, or `model.build(input_shape)`) or pass `shared_variables`. "
                f"Received: a model without trainable variables ({model.name})"
            )
        t = len(task_names)
        for k, variable in enumerate(candidates):
            size = int(np.prod(variable.shape))
            current = state_variable(state, f"{self.buffer_prefix}_{k}", (t, size))
            pending = state_variable(state, f"{self.buffer_prefix}_{k}_pending", (t, size))
            self._buffers.append((variable, current, pending))

    def buffers(self, variable):
        """`(state, pending)` variables of `variable`; a clear error for an unknown one."""
        for candidate, current, pending in self._buffers:
            if candidate is variable:
                return current, pending
        raise self.unknown_at_compile(variable)

    def commit_buffers(self):
        """Copy this step's pending per-element state into the state (in `update`)."""
        for current, pending in self._shared_in_trace:
            current.assign(pending)

    def task_gradients(self, tape, losses, variables, scale_loss):
        """Per-task gradients: `(TaskGradients, scale)`; `scale` is the loss scale."""
        scale = _gradient.loss_scale(scale_loss)
        per_task = _gradient.task_gradients(tape, losses, variables, scale)
        shared = self._shared_indices(per_task, variables)
        flat = _gradient.shared_rows(per_task, shared, variables, scale)
        global_losses = _replicas.all_reduce_sum([ops.cast(loss, "float32") for loss in losses])
        if self.buffer_prefix is not None:
            self._shared_in_trace = [self.buffers(variables[k]) for k in shared]
        return TaskGradients(per_task, shared, flat, ops.stack(global_losses)), scale

    def assemble(self, tape, objective, variables, grads, shared_update, head_weights):
        """The step's gradients: `shared_update[k]` (local, loss-scaled) for shared variable
        `k`, `sum_i head_weights_i g_i` for the others, plus the regularization gradients."""
        none = tf.UnconnectedGradients.NONE
        regularization = tape.gradient(objective, variables, unconnected_gradients=none)
        result = []
        for k in range(len(variables)):
            terms = []
            if k in shared_update:
                terms.append(shared_update[k])
            else:
                terms += [
                    ops.cast(head_weights[i], g[k].dtype) * g[k]
                    for i, g in enumerate(grads.per_task)
                    if g[k] is not None
                ]
            if regularization[k] is not None:
                terms.append(regularization[k])
            result.append(ops.sum(ops.stack(terms), axis=0) if terms else None)
        return result

    def weighted_sum(self, grads, k, weights):
        """`sum_i weights_i g_i` of the local loss-scaled gradients of variable `k`."""
        terms = [
            ops.cast(weights[i], g[k].dtype) * g[k]
            for i, g in enumerate(grads.per_task)
            if g[k] is not None
        ]
        return ops.sum(ops.stack(terms), axis=0)
