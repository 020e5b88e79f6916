"""Sharpness-aware minimization, `compile(sam_rho=...)`: the step's second gradient.

SAM (Foret et al., "Sharpness-Aware Minimization for Efficiently Improving Generalization",
ICLR 2021) updates with the gradient taken at `w + e`, `e = rho * g / ||g||`, `g` the gradient
at `w`. ASAM (`sam_adaptive=True`; Kwon et al., "ASAM: Adaptive Sharpness-Aware Minimization
for Scale-Invariant Learning of Deep Neural Networks", ICML 2021) uses
`e = rho * T^2 g / ||T g||` with `T = |w| + 0.01` elementwise.

`second_gradient` runs between the step's first gradient and its shared stages
(`TrainingStep.apply`): `g` is summed across replicas and unscaled, so `e` is the same on every
replica and independent of the loss scale; a non-finite `g` perturbs nothing and turns the
second gradient non-finite, so the step's guards skip the update (an overflow under a
`LossScaleOptimizer` halves its scale). The second pass is the step's own gradient computation
(micro-batched when compiled so), its metric updates and the model's float non-trainable state
(`BatchNormalization` statistics) reset to what the first pass left; the trainable weights are
restored from a copy (exactly, not by subtracting `e`). float8 scales and amax histories
(`overwrite_with_gradient`) are not perturbed and keep the first pass' values. Clipping, the finite check and the
update then act on the second gradient only. Design: docs/design.md, "Sharpness-aware
minimization".
"""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from keras_fastloop import _replicas
from keras_fastloop._step import gradients, overwrite, scaling
from keras_fastloop._step.results import restore_point

ASAM_ETA = 0.01
_EPSILON = 1e-12


def second_gradient(model, step, x, y, sample_weight, grads, variables, optimizer):
    """The loss-scaled per-replica gradient at `w + e`, for the step's shared stages.

    Args:
        model: the compiled model.
        step: its `TrainingStep` (`sam_rho`, `sam_adaptive`).
        x, y, sample_weight: the (per-replica) batch.
        grads: the first pass' loss-scaled per-replica gradients of `variables`.
        variables: the connected trainable variables.
        optimizer: the model's optimizer (its loss scale).

    Returns:
        A list of gradients of `variables` (dense), non-finite everywhere when the first
        gradient summed across replicas is.
    """
    first, all_variables = grads, variables  # float8 scales and amax: not perturbed
    grads, variables, _ = overwrite.split(first, all_variables)
    scale = scaling.current_scale(optimizer)
    summed = scaling.unscale(_replicas.all_reduce_sum([_dense(g) for g in grads]), scale)
    summed = [ops.cast(g, "float32") for g in summed]
    weights = [ops.cast(v.value, "float32") for v in variables]
    if step.settings.sam_adaptive:
        t = [ops.abs(w) + ASAM_ETA for w in weights]
        norm = _norm([ti * g for ti, g in zip(t, summed)])
        directions = [ti * ti * g for ti, g in zip(t, summed)]
    else:
        norm = _norm(summed)
        directions = summed
    finite = ops.isfinite(norm)
    factor = ops.where(finite, step.settings.sam_rho / (norm + _EPSILON), 0.0)
    saved = [tf.identity(v.value) for v in variables]
    perturbed = [
        ops.cast(ops.where(finite, w + factor * d, w), v.dtype)
        for w, d, v in zip(weights, directions, variables)
    ]
    state = [v for v in model.non_trainable_variables if _is_float(v)]
    state_saved = [tf.identity(v.value) for v in state]
    undo_metrics = None
    if step.micro_batch_size:  # micro-batching updates the metrics inside its loop
        undo_metrics = restore_point(v for m in model.metrics for v in m.variables)
    _assign(variables, perturbed)
    result = gradients.compute(model, step, x, y, sample_weight, all_variables)
    _assign(variables, saved)
    _assign(state, state_saved)
    if undo_metrics is not None:
        undo_metrics()
    poison = ops.where(finite, 0.0, float("nan"))
    second = []
    for g, v, g_first in zip(result.grads, all_variables, first):
        if overwrite.is_overwritten(v):  # the values of the unperturbed pass
            second.append(g_first)
            continue
        g = ops.zeros(v.shape, v.dtype) if g is None else _dense(g)
        second.append(g + ops.cast(poison, g.dtype))
    return second


def _dense(g):
    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def _norm(grads):
    return ops.sqrt(ops.sum(ops.stack([ops.sum(ops.square(g)) for g in grads])))


def _is_float(variable):
    return tf.as_dtype(variable.dtype).is_floating


def _assign(variables, values):
    """Assign each variable its value (identical on every replica), in any replica context."""
    if not variables:
        return

    def update(strategy, values):
        for variable, value in zip(variables, values):
            strategy.extended.update(
                variable.value, lambda var, val: var.assign(val), args=(value,), group=False
            )

    tf.__internal__.distribute.interim.maybe_merge_call(
        update, tf.distribute.get_strategy(), list(values)
    )
