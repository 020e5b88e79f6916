"""In-step micro-batching: one optimizer update per batch, one micro-batch's activations alive.

`compile(micro_batch_size=k)` makes `train_step` call `accumulate` instead of taking one
gradient of the whole batch: the (per-replica) batch is split into micro-batches of `k`
samples (the last may be smaller), forward and backward run on one at a time inside a
`tf.while_loop` (`parallel_iterations=1`), and the gradients are summed in loop variables,
each micro-batch's loss weighted by its share of the full batch's denominator
(`keras_fastloop._step.loss_shares`). The step then does everything else once. A batch
smaller than `k` runs as one micro-batch (exact, saves no memory; one `FastloopWarning`).

Why the sum equals the full batch, with masks, sample weights, replicas, regularization,
loss weighting and metrics, and what is not equivalent (`BatchNormalization`, `Dropout`,
Adam on `IndexedSlices`): `docs/design.md`, "Micro-batching".
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop import _keras_internals as internals
from keras_fastloop._step import batch, loss_shares, overwrite
from keras_fastloop._step.objective import forward
from keras_fastloop._step.results import StepResult, restore_point
from keras_fastloop._warnings import FastloopWarning


def warn_small_batch(step, samples):
    """Warn once per `TrainingStep` that a batch held fewer samples than `micro_batch_size`."""
    if "small_batch" in step.warned:
        return
    step.warned.add("small_batch")
    warnings.warn(
        f"The (per-replica) batch has fewer samples ({samples}) than `micro_batch_size` "
        f"({step.micro_batch_size}): each batch runs as one micro-batch, so no memory is "
        "saved (training stays exact). Use a larger batch or a smaller `micro_batch_size`. "
        f"Received: micro_batch_size={step.micro_batch_size}",
        FastloopWarning,
        stacklevel=2,
    )


def largest_batch_variable():
    """Untracked (never saved) float32 variable: the largest per-replica batch trained so far.

    Created by `compile(micro_batch_size=...)` under the caller's scope; read at epoch ends
    by `BatchSizeMonitor`.
    """
    return keras.Variable(
        0.0,
        dtype="float32",
        trainable=False,
        aggregation="only_first_replica",
        name="micro_batch_largest_batch",
    )


def _track_batch_size(step, n, k):
    """Trace-time warning when the batch size is static, else record it for the monitor."""
    static = tf.get_static_value(n)
    if static is not None:
        if int(static) < k:
            warn_small_batch(step, int(static))
        return
    variable = step.largest_batch
    if variable is not None:
        variable.assign(ops.maximum(variable, ops.cast(n, "float32")))


def _slice(structure, start, size):
    """Rows `[start, start + size)` of every tensor in `structure` (`None` passes through).

    `tf.slice` with a constant `size` keeps the micro-batch's shape static inside the loop
    (XLA compiles it as a dynamic slice). The other dimensions are set back to the batch's:
    with a tensor `start` shape inference loses them, and Keras' losses and metrics read
    them (sparse labels of shape `(batch, 1)` are squeezed only when the 1 is static).
    """
    static_size = tf.get_static_value(size)

    def cut(t):
        if t is None:
            return None
        t = tf.convert_to_tensor(t)
        rank = t.shape.rank
        begin = [start] + [0] * (rank - 1)
        part = tf.slice(t, begin, [size] + [-1] * (rank - 1))
        part.set_shape(tf.TensorShape([static_size]).concatenate(t.shape[1:]))
        return part

    if structure is None:
        return None
    return tf.nest.map_structure(cut, structure)


def _spec(structure):
    """`tf.TensorSpec` of every tensor in `structure`, batch dimension unknown."""
    if structure is None:
        return None
    return tf.nest.map_structure(
        lambda t: tf.TensorSpec([None] + list(t.shape[1:]), t.dtype), structure
    )


def _detect_masks(model, x, y, sample_weight):
    """Trace the step's loss once, symbolically, to learn which tasks' predictions carry a mask.

    Nothing runs: a throwaway concrete function is traced on the micro-batch's signature (the
    tasks and the weighting were built by Keras' symbolic build before training).

    Returns:
        `(masked, reductions)`: per task, whether its prediction carries a mask, and its
        loss' reduction.
    """
    found = {}

    def scratch(x_spec, y_spec, sw_spec):
        y_pred = forward(model, x_spec, training=False)
        terms = internals.compile_loss(model).evaluate(y_spec, y_pred, sw_spec)
        found["masked"] = [loss_shares.is_masked(t) for t in terms]
        found["reductions"] = [_reduction(t) for t in terms]
        return tf.constant(0)

    tf.function(scratch, autograph=False).get_concrete_function(
        _spec(x), _spec(y), _spec(sample_weight)
    )
    return found["masked"], found["reductions"]


def _for_each_micro_batch(n, k, body, carry):
    """Run `body(start, size, carry) -> carry` over `[0, n)` in steps of `k`.

    Full micro-batches (static size `k`) run in a `tf.while_loop` with
    `parallel_iterations=1`; the ragged remainder (`n % k` samples, possibly none) runs once
    after it under `tf.cond`.
    """
    full = n // k

    def loop_body(i, *c):
        return (i + 1, *body(i * k, k, tuple(c)))

    _, *carry = tf.while_loop(
        lambda i, *c: i < full,
        loop_body,
        (tf.constant(0, n.dtype), *carry),
        parallel_iterations=1,
    )
    carry = tuple(carry)
    start = full * k
    rest = n - start
    return tf.cond(rest > 0, lambda: body(start, rest, carry), lambda: carry)


def _reduction(term):
    reduction = term.loss_fn.reduction
    if reduction not in ("sum", *loss_shares.DIVIDING_REDUCTIONS):
        raise ValueError(
            "`micro_batch_size` needs every loss to reduce to a scalar (reduction "
            f"'sum_over_batch_size', 'mean', 'mean_with_sample_weight' or 'sum'). Task "
            f"'{term.name}' has reduction={reduction!r}. Received: loss={term.loss_fn!r}"
        )
    return reduction


def _masked_denominators(model, x, y, sample_weight, n, k, masked):
    """Full-batch denominator of every masked task (0 for the others), from a no-tape pass."""
    probes = {}

    def body(start, size, carry):
        (total,) = carry
        y_pred = forward(model, _slice(x, start, size), training=False)
        terms = internals.compile_loss(model).evaluate(
            _slice(y, start, size), y_pred, _slice(sample_weight, start, size)
        )
        counts = []
        for i, (term, is_masked) in enumerate(zip(terms, masked)):
            if not is_masked or _reduction(term) == "sum":
                counts.append(tf.constant(0.0))
                continue
            probe = probes.setdefault(i, loss_shares.CountProbe(term.loss_fn))
            counts.append(loss_shares.denominator(term, size, probe))
        return (total + ops.stack(counts),)

    num_tasks = len(internals.compile_loss(model).names)
    (total,) = _for_each_micro_batch(n, k, body, (tf.zeros([num_tasks], "float32"),))
    return total, probes


def _loss_coefficients(weighting, losses):
    """`d combine / d L_t` at `losses` (the loss weights, for an affine weighting)."""
    stacked = ops.stop_gradient(ops.stack(losses))
    with tf.GradientTape() as tape:
        tape.watch(stacked)
        objective, _ = weighting.combine(tf.unstack(stacked))
    coefficients = tape.gradient(objective, stacked)
    if coefficients is None:
        return ops.zeros_like(stacked)
    return ops.stop_gradient(coefficients)


def _task_sample_weights(model, sample_weight):
    """Each task's full-batch sample weight, picked by Keras' rule (by path when nested)."""
    entries = internals.compile_loss_entries(internals.compile_loss(model))
    if sample_weight is None or not tf.nest.is_nested(sample_weight):
        return [sample_weight] * len(entries)
    picked = []
    for entry in entries:
        value = sample_weight
        for key in entry.path:
            value = value[key]
        picked.append(value)
    return picked


def _metrics_snapshot(model):
    """`(update, undo)` of the compiled metrics: `undo` restores their values from now."""
    compile_metrics = internals.compile_metrics(model)
    if compile_metrics is None:
        return (lambda *args: None), None
    return compile_metrics.update_state, restore_point(compile_metrics.variables)


def _total(reduction, masked, mask_total, weight_total, n):
    """The (per-replica) batch's denominator `D` of one task, `None` for `"sum"`."""
    if reduction == "sum":
        return None
    if masked:
        return mask_total
    if reduction == "mean_with_sample_weight" and weight_total is not None:
        return weight_total
    return ops.cast(n, "float32")


def _share(term, probe, total, size):
    """Micro-batch `m`'s share `D_m / D` of the batch's loss denominator (see above)."""
    _reduction(term)
    if total is None:
        return tf.constant(1.0)
    return ops.divide_no_nan(loss_shares.denominator(term, size, probe), total)


def accumulate(model, step, x, y, sample_weight, variables, micro_batch_size):
    """Loss-scaled gradient of the full batch's objective, one micro-batch at a time.

    Called by the trainer's `train_step` (per replica under `tf.distribute`) when
    `compile(micro_batch_size=k)` is set. See the module docstring for the weighting.

    Args:
        model: the compiled model (`OptimizedModel` or
            `OptimizedSequential`).
        step: its `TrainingStep`.
        x: inputs, a tensor or a nest of tensors with the batch (`n` samples, may be unknown
            while tracing) on axis 0.
        y: targets, same batch layout (a tensor, list or dict per output).
        sample_weight: `None`, or one tensor / a list or dict per output, shape `(n,)` or
            broadcastable to each loss's elements (class weights arrive here).
        variables: the variables to differentiate (`model.trainable_variables`).
        micro_batch_size: `k`, a positive int; the last micro-batch holds `n % k` samples
            when `k` does not divide `n`.

    Returns:
        A `StepResult`: the gradient of
        `optimizer.scale_loss(objective)` for the whole batch (before the cross-replica sum,
        unscaling and clipping, which the step does once; `None` for variables no micro-batch
        reaches), the full-batch losses and weights. The compiled metrics were updated once per
        micro-batch (their sums and counts add up to the full batch's); `undo_metrics`
        restores them if the step is skipped.

    Raises:
        ValueError: a loss with `reduction=None`/`"none"`.
        RuntimeError: a prediction whose Keras mask appears only in training mode.

    Example:
        >>> model.compile("sgd", losses, micro_batch_size=4)
        >>> history = model.fit(x, y, batch_size=16, verbose=0)  # 32 samples, 4 micro-batches each
        >>> int(model.optimizer.iterations)  # one update per batch of 16
        2
    """
    k = int(micro_batch_size)
    task_loss = internals.compile_loss(model)
    weighting = step.weighting
    if task_loss.names is None or weighting.task_names is None:
        # First trace of a model whose outputs were unknown at compile: build the loss and the
        # weighting (the unused full-batch forward pass is pruned from the graph).
        task_loss.evaluate(y, forward(model, x, training=False), sample_weight)
        step.build_weighting()
    masked, reductions = _detect_masks(model, x, y, sample_weight)
    num_tasks = len(masked)
    first = batch.first_tensor(x)
    n = tf.shape(first, out_type=tf.int32)[0]
    _track_batch_size(step, first.shape[0] if first.shape[0] is not None else n, k)
    weight_totals = [
        None if sw is None else ops.sum(ops.cast(sw, "float32"))
        for sw in _task_sample_weights(model, sample_weight)
    ]
    if any(masked):
        mask_totals, probes = _masked_denominators(model, x, y, sample_weight, n, k, masked)
    else:
        mask_totals, probes = tf.zeros([num_tasks]), {}
    totals = [
        _total(reductions[i], masked[i], mask_totals[i], weight_totals[i], n)
        for i in range(num_tasks)
    ]
    # Under tf.distribute: each replica's share R * D_r / D of the global denominators.
    sync = loss_shares.sync_replicas(totals, n)
    update_metrics, undo_metrics = _metrics_snapshot(model)
    connected = [False] * len(variables)

    def body(start, size, carry):
        grad_acc, loss_acc, reg_acc = carry
        x_m, y_m, sw_m = (_slice(t, start, size) for t in (x, y, sample_weight))
        with tf.GradientTape() as tape:
            y_pred = forward(model, x_m, training=True)
            terms = task_loss.evaluate(y_m, y_pred, sw_m)
            contributions = []
            for i, term in enumerate(terms):
                if (internals.get_keras_mask(term.y_pred) is not None) != masked[i]:
                    raise RuntimeError(
                        f"The prediction for task '{term.name}' carries a Keras mask in "
                        "training mode but not in inference mode (or the reverse); "
                        "`micro_batch_size` cannot weight it exactly. "
                        f"Received: micro_batch_size={k}"
                    )
                share = _share(term, probes.get(i), totals[i], size) * sync.factors[i]
                contributions.append(share * term.value)
            losses = [t.value for t in terms]
            with tape.stop_recording():
                coefficients = _loss_coefficients(weighting, losses)
            extra = batch.regularization_terms(model)
            size_share = ops.cast(size, "float32") / ops.cast(n, "float32")
            reg = ops.sum(ops.stack(extra)) * size_share if extra else tf.constant(0.0)
            objective = ops.sum(coefficients * ops.stack(contributions)) + reg
            scaled = model.optimizer.scale_loss(objective)
        grads = tape.gradient(scaled, variables, unconnected_gradients=tf.UnconnectedGradients.NONE)
        for i, g in enumerate(grads):
            connected[i] = connected[i] or g is not None
        grad_acc = tuple(
            a if g is None else overwrite.accumulate(a, g, v)
            for a, g, v in zip(grad_acc, grads, variables)
        )
        update_metrics(y_m, y_pred, sw_m)
        loss_acc = loss_acc + ops.stack([ops.stop_gradient(c) for c in contributions])
        reg_acc = reg_acc + ops.stop_gradient(ops.cast(reg, "float32"))
        return grad_acc, loss_acc, reg_acc

    init = (
        tuple(tf.zeros(v.shape, v.dtype) for v in variables),
        tf.zeros([num_tasks], "float32"),
        tf.constant(0.0),
    )
    grad_acc, loss_acc, reg_acc = _for_each_micro_batch(n, k, body, init)

    # The weighting's own variables: their gradient, once, at the full-batch losses.
    losses = tf.unstack(loss_acc, num=num_tasks)
    with tf.GradientTape() as tape:
        combined, weights = weighting.combine(losses)
        scaled = model.optimizer.scale_loss(combined)
    theta = tape.gradient(scaled, variables, unconnected_gradients=tf.UnconnectedGradients.NONE)
    grads = []
    for i, (acc, g) in enumerate(zip(grad_acc, theta)):
        if g is not None:
            connected[i] = True
            acc = acc + ops.cast(g, acc.dtype)
        grads.append(acc if connected[i] else None)
    logged_task_loss = combined
    if not step.settings.loss_is_objective:  # `loss` stays what keras.Model would report
        static = ops.convert_to_tensor(task_loss.static_weights, "float32")
        logged_task_loss = ops.sum(loss_acc * static)
    return StepResult(
        grads=grads,
        logged_loss=logged_task_loss + reg_acc,
        task_losses=losses,
        weights=weights,
        objective=combined,
        batch_size=sync.batch_size,
        update_metrics=lambda: None,
        undo_metrics=undo_metrics,
    )
