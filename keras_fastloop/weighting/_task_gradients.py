"""Per-task gradients for the gradient-based methods whose update is not one `beta` on one Gram
matrix: GradVac (a Gram matrix per group of variables), MoCo (tracked gradient estimates),
MoDo and SDMGrad (gradients of three parts of the batch).

Same conventions as `GradientWeighting.gradients` (`keras_fastloop.weighting._gradient`): task
gradients are taken with `output_gradients=s` (the loss scale), the shared rows are divided by
`s` and summed across replicas, and the returned gradients are of the *scaled* objective.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop._replicas import state_variable
from keras_fastloop._warnings import FastloopWarning
from keras_fastloop.weighting._gradient import (
    GradientWeighting,
    loss_scale,
    shared_rows,
    task_gradients,
)


def weighted_sum(per_task, k, weights):
    """`sum_i weights[i] * per_task[i][k]` over the tasks that reach variable `k` (a list of
    terms, empty when none does)."""
    return [
        ops.cast(weights[i], grads[k].dtype) * grads[k]
        for i, grads in enumerate(per_task)
        if grads[k] is not None
    ]


def assemble(num_variables, shared_terms, head_terms, regularization):
    """The gradient of every variable: its shared or head terms plus its regularization
    gradient (`None` for a variable nothing reaches).

    Args:
        num_variables: the number of variables.
        shared_terms: dict from a shared variable's index to its (scaled) update.
        head_terms: callable `k -> list of tensors` for the other variables.
        regularization: the regularization gradients (`tape.gradient` of the objective).
    """
    result = []
    for k in range(num_variables):
        terms = [shared_terms[k]] if k in shared_terms else head_terms(k)
        if regularization[k] is not None:
            terms = [*terms, regularization[k]]
        result.append(ops.sum(ops.stack(terms), axis=0) if terms else None)
    return result


def regularization_gradients(tape, objective, variables):
    """The gradients of the step's objective (only regularization for these methods)."""
    return tape.gradient(objective, variables, unconnected_gradients=tf.UnconnectedGradients.NONE)


class _ReportWholeBatches(keras.callbacks.Callback):
    """Warns at an epoch's end when steps used their whole batch for every part."""

    def __init__(self, method):
        super().__init__()
        self.method = method

    def on_epoch_end(self, epoch, logs=None):
        self.method.report_whole_batches()


class PartsWeighting(GradientWeighting):
    """Base of MoDo and SDMGrad: task gradients of the batch's three consecutive parts.

    The step hands `gradients` every task's loss on each part (`part_losses`, see
    `keras_fastloop._step.objective.part_losses`); the subclass' `part_weights(rows)`
    returns `beta` and the part whose gradients it weights, from the parts' shared rows.
    Heads get the mean of the three parts' head gradients (as LibMTL's MoDo). Steps whose
    (first replica's) batch has fewer than 3 samples, where every part is the whole batch,
    are counted and reported by a `FastloopWarning` at the end of the epoch.
    """

    sub_batches = 3

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        self.whole_batches = state_variable(state, f"{self.name}_whole_batches", (), 0, "int64")

    def callbacks(self):
        return [_ReportWholeBatches(self)]

    def report_whole_batches(self):
        """Warn (eagerly) if steps since the last report had batches of fewer than 3 samples."""
        count = int(self.whole_batches.numpy())
        if count:
            self.whole_batches.assign(0)
            warnings.warn(
                f"{count} step(s) of '{self.name}' had batches of fewer than "
                f"{self.sub_batches} samples (per replica): each of its {self.sub_batches} "
                "parts was the whole batch, so its gradient estimates were not independent. "
                f"Use a larger batch or drop the last partial batch. Received: "
                f"loss_weighting='{self.name}'",
                FastloopWarning,
                stacklevel=2,
            )

    def part_weights(self, rows):
        """`(beta, part)` from `rows[p][k]`, the `(T, size)` shared rows of part `p`."""
        raise NotImplementedError

    def task_weights(self, gram, losses):
        raise NotImplementedError("PartsWeighting decides its weights in `gradients`.")

    def gradients(
        self, tape, losses, objective, variables, scale_loss, part_losses=None, batch_size=None
    ):
        if part_losses is None or len(part_losses) != self.sub_batches:
            raise RuntimeError(
                f"Loss weighting '{self.name}' needs the tasks' losses on "
                f"{self.sub_batches} parts of the batch, which OptimizedModel's step passes "
                f"as `part_losses`. Received: part_losses={part_losses!r}"
            )
        if batch_size is not None:
            whole = ops.cast(ops.less(batch_size, self.sub_batches), "int64")
            self.whole_batches.assign_add(whole)
        variables = list(variables)
        scale = loss_scale(scale_loss)
        parts = [task_gradients(tape, part, variables, scale) for part in part_losses]
        shared = self._shared_indices(parts[0], variables)
        rows = [shared_rows(part, shared, variables, scale) for part in parts]
        beta, used = self.part_weights(rows)
        self.weights.assign(beta)
        shared_terms = {
            k: ops.sum(ops.stack(weighted_sum(parts[used], k, beta)), axis=0) for k in shared
        }
        mean = ops.full((self.num_tasks,), 1.0 / len(parts), "float32")
        regularization = regularization_gradients(tape, objective, variables)
        return assemble(
            len(variables),
            shared_terms,
            lambda k: [term for part in parts for term in weighted_sum(part, k, mean)],
            regularization,
        )


def cross_gram(rows_a, rows_b):
    """`C_ij = <a_i, b_j>` summed over the shared variables' rows."""
    return sum(ops.matmul(a, ops.transpose(b)) for a, b in zip(rows_a, rows_b))
