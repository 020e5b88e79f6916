"""The default `compute_loss`: the compiled tasks' losses combined by the loss weighting.

`OptimizedTrainer.compute_loss` (Keras' hook, which users may override) calls `compute_loss`
here. The library's steps call `loss_terms`, which returns the scalar to differentiate with its
`LossRecord`: the unweighted task losses, the weights, the logged loss' task part and the global
batch's losses.
"""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from keras_fastloop import _keras_internals as internals
from keras_fastloop._step import batch, loss_shares
from keras_fastloop._step.results import restore_point


class LossRecord:
    """What the default `compute_loss` computed, for the step that called it.

    Attributes:
        values: the unweighted per-task losses (float32 scalars, or `(batch, ...)` tensors
            with `reduction=None`).
        objective: what the weighting differentiates (`sum_i w_i L_i` by default).
        weights: float32 `(T,)`, the weights the weighting used.
        logged_task_loss: the task part of the logged loss (`StepResult.logged_loss`): the
            tasks weighted by the static `loss_weights`.
        batch_size: int32 scalar, the global batch's number of samples (the `loss` tracker's
            weight).
        global_losses: `[logged_loss, *task losses]` of the global batch when the replicas'
            losses were already all-reduced (`None` otherwise).
        part_losses: for a weighting with `sub_batches = k > 1`, `k` lists of the tasks'
            losses on the `k` consecutive parts of the (per-replica) batch (`part_losses`);
            `None` otherwise.
        replica_batch_size: int32 scalar, the replica's number of samples (with
            `part_losses`; `None` otherwise).
    """

    def __init__(self, values, objective, weights, logged_task_loss, batch_size):
        self.values = values
        self.objective, self.weights = objective, weights
        self.logged_task_loss = logged_task_loss
        self.batch_size = batch_size
        self.global_losses = None
        self.part_losses = self.replica_batch_size = None


def compute_loss(model, step, y, y_pred, sample_weight, training=True):
    """The body of `OptimizedTrainer.compute_loss`, Keras' hook: `loss_and_record`'s total,
    with the `{name}_loss` trackers updated as Keras' `CompileLoss` updates them (the hook is
    called by a user's own `train_step`/`test_step`; the library's steps call
    `loss_and_record` and record after the guards).

    Raises:
        ValueError: when there is no loss at all (no compiled loss, no `add_loss`).
    """
    total, record = loss_and_record(model, step, y, y_pred, sample_weight, training)
    if record is not None:
        internals.compile_loss(model).record(record.values)
    return total


def loss_and_record(model, step, y, y_pred, sample_weight, training=True):
    """`(total, record)`: the scalar the step differentiates and its `LossRecord`.

    Args:
        model: the compiled model.
        step: its `TrainingStep`.
        y, y_pred, sample_weight, training: as Keras' `compute_loss` (the parts of a
            `sub_batches` weighting are taken only when training).

    Returns:
        `total`: float32 scalar (or Keras' per-sample total, `(batch, ...)`, with losses of
        `reduction=None`): the weighting's objective plus the regularization and `add_loss`
        losses. `record`: the compiled tasks' `LossRecord`, `None` without a compiled loss.

    Raises:
        ValueError: when there is no loss at all (no compiled loss, no `add_loss`).
    """
    terms, record = [], None
    regularization = batch.regularization_terms(model)
    task_loss = internals.compile_loss(model)
    if task_loss is not None:
        regularization_sum = ops.sum(ops.stack(regularization)) if regularization else None
        record = _task_record(
            model, step, task_loss.evaluate(y, y_pred, sample_weight), regularization_sum, training
        )
        terms.append(record.objective)
    terms += regularization
    if not terms:
        raise ValueError("No loss to compute. Provide a `loss` argument in `compile()`.")
    if len(terms) == 1:
        return terms[0], record
    if terms[0].shape.rank:  # per-sample losses plus the (scalar) regularization
        return terms[0] + ops.sum(ops.stack(terms[1:])), record
    return ops.sum(ops.stack(terms)), record


def _task_record(model, step, task_terms, regularization_sum, training=True):
    """The `LossRecord` of the compiled tasks' `TaskTerm`s."""
    # Under tf.distribute: the replicas' shares of the global losses (one all-reduce, which
    # also gives the global batch size and the global losses).
    values, sync = loss_shares.replica_losses(task_terms, regularization_sum)
    step.build_weighting()
    weighting = step.weighting
    if any(value.shape.rank for value in values):
        # reduction=None (one replica, static weights: compile checks it). As in Keras the
        # tape sums the per-sample losses and the trackers average them.
        objective, weights = _per_sample_objective(values, weighting)
    else:
        objective, weights = weighting.combine(values)
    logged_task_loss, per_task = objective, weights
    if not step.settings.loss_is_objective:
        per_task = ops.convert_to_tensor(internals.compile_loss(model).static_weights, "float32")
        logged_task_loss = ops.sum(ops.stack(values) * per_task)
    record = LossRecord(values, objective, weights, logged_task_loss, sync.batch_size)
    if weighting.sub_batches > 1 and training:  # parts only for the update, not evaluate
        record.part_losses = part_losses(task_terms, weighting.sub_batches)
        record.replica_batch_size = batch.batch_size(task_terms[0].y_pred)
    if sync.global_losses is not None:  # the step's global losses, no second collective
        logged_loss = ops.sum(sync.global_losses * per_task)
        if sync.global_extra is not None:
            logged_loss = logged_loss + sync.global_extra
        record.global_losses = [logged_loss, *tf.unstack(sync.global_losses)]
    return record


def part_losses(terms, parts):
    """Every task's Keras loss on each of `parts` consecutive parts of the batch.

    Part `p` holds samples `[p n // parts, (p + 1) n // parts)` of the (per-replica) batch of
    `n` samples (sizes differ by at most one); a batch of fewer than `parts` samples is used
    whole by every part. Each loss is the task's own loss function on its part's targets,
    predictions and sample weights (under `tf.distribute` scaled by `1 / R` as Keras scales
    it), so its gradient flows through the full batch's forward pass.

    Args:
        terms: the tasks' `TaskTerm`s of the batch.
        parts: int, the number of parts.

    Returns:
        `parts` lists of float32 scalars, one per task.

    Raises:
        ValueError: for a prediction with a Keras mask (not split here).
    """
    with tf.name_scope("part_losses"):  # a task's loss name is then never a root scope name
        return _part_losses(terms, parts)


def _part_losses(terms, parts):
    n = batch.batch_size(terms[0].y_pred)
    whole = n < parts
    result = []
    for p in range(parts):
        start = tf.where(whole, 0, p * n // parts)
        end = tf.where(whole, n, (p + 1) * n // parts)

        def cut(t, start=start, end=end):
            if t is None:
                return None
            t = tf.convert_to_tensor(t)
            return t[start:end] if t.shape.rank else t

        losses = []
        for term in terms:
            if loss_shares.is_masked(term):
                raise ValueError(
                    "A loss weighting that splits the batch into parts cannot split a "
                    f"prediction that carries a Keras mask (task '{term.name}'). Received: "
                    f"sub_batches={parts}"
                )
            y_true, y_pred, sample_weight = (
                tf.nest.map_structure(cut, s) if s is not None else None
                for s in (term.y_true, term.y_pred, term.sample_weight)
            )
            losses.append(ops.cast(term.loss_fn(y_true, y_pred, sample_weight), "float32"))
        result.append(losses)
    return result


def _per_sample_objective(values, weighting):
    """Keras' total of unreduced task losses: `sum_i w_i * L_i` per sample, and `w`."""
    weights = weighting.read_weights()
    objective = values[0] * weights[0]
    for i, value in enumerate(values[1:], start=1):
        objective = objective + value * weights[i]
    return objective, weights


def loss_terms(model, step, x, y, y_pred, sample_weight, training):
    """`(total, logged_loss, record)` of the library's steps.

    Without an override of `compute_loss`, `record` is the default loss' `LossRecord`;
    an override is called as Keras calls it (`record` is `None`, the logged loss is its total,
    and the trackers are what it records).
    """
    if step.settings.overrides_compute_loss:
        total = internals.compute_loss_hook(
            model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
        )
        return total, total, None
    total, record = loss_and_record(model, step, y, y_pred, sample_weight, training)
    if record is None:
        return total, total, None
    return total, total + (record.logged_task_loss - record.objective), record


def override_trackers_restore_point(model, step):
    """`undo` for the `{name}_loss` trackers an overridden `compute_loss` records during the
    forward pass (a skipped step must leave them as if the batch was not seen), else `None`."""
    compile_loss = internals.compile_loss(model)
    if not step.settings.overrides_compute_loss or compile_loss is None:
        return None
    variables = [v for metric in compile_loss.metrics for v in metric.variables]
    return restore_point(variables) if variables else None


def forward(model, x, training):
    """`model(x, training=training)`, or `model(x)` when its `call` takes no `training`."""
    if internals.call_has_training_arg(model):
        return model(x, training=training)
    return model(x)
