"""Variables the optimizer overwrites with their "gradient": float8 scales and amax histories.

`model.quantize("float8")` gives each quantized `Dense` and `EinsumDense` scale and
amax-history variables marked `overwrite_with_gradient=True`. Their "gradient" is their new
value (a custom gradient, never multiplied by the loss scale) and Keras' optimizer assigns it in
place of an update. They are not gradients, so the step:

- combines them by **maximum**, not sum: across micro-batches (as Keras'
  `gradient_accumulation_steps` does) and across replicas (the amax of the global batch, what
  one replica computes on it; `keras.Model` keeps one replica's own value);
- leaves them out of the loss-scale unscaling, the non-finite check, the global norm
  (`grad_norm`) and clipping: `split` takes them out before those stages and `join` puts them
  back, at their places, for the optimizer's `apply` (skipped whole with the step).
"""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from keras_fastloop import _replicas


def is_overwritten(variable) -> bool:
    """Whether the optimizer assigns `variable` its gradient (`overwrite_with_gradient`)."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def accumulate(total, grad, variable):
    """`total` combined with one micro-batch's `grad`: the sum, or for an overwritten variable
    the maximum (both start from zeros; scales and amax values are non-negative)."""
    if is_overwritten(variable):
        return ops.maximum(total, ops.cast(grad, total.dtype))
    return total + grad


def all_reduce(grads, variables):
    """The gradients summed across replicas, the overwritten variables' values maximized.

    Args:
        grads: one per-replica tensor per variable (no `None`).
        variables: their variables.

    Returns:
        A list of tensors, identical on every replica (unchanged with one replica). One
        all-reduce, and one all-gather when some variable is overwritten.
    """
    flags = [is_overwritten(v) for v in variables]
    if not any(flags):
        return _replicas.all_reduce_sum(grads)
    ordinary = [g for g, f in zip(grads, flags) if not f]
    summed = iter(_replicas.all_reduce_sum(ordinary) if ordinary else [])
    maxed = iter(_all_reduce_max([g for g, f in zip(grads, flags) if f]))
    return [next(maxed) if f else next(summed) for f in flags]


def _all_reduce_max(values):
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return list(values)
    # tf.distribute reduces by SUM or MEAN only: gather every replica's values, then the maximum.
    gathered = ctx.all_gather([ops.expand_dims(v, 0) for v in values], axis=0)
    return [ops.max(g, axis=0) for g in gathered]


def split(grads, variables):
    """`(grads, variables, overwritten)`: the pairs the step's stages act on, and the others.

    `overwritten` is a list of `(index, grad, variable)` for `join`.
    """
    kept, overwritten = [], []
    for i, (g, v) in enumerate(zip(grads, variables)):
        if is_overwritten(v):
            overwritten.append((i, g, v))
        else:
            kept.append((g, v))
    return [g for g, _ in kept], [v for _, v in kept], overwritten


def join(grads, variables, overwritten):
    """`split`'s inverse: `(grads, variables)` in their original order."""
    if not overwritten:
        return list(grads), list(variables)
    pairs = list(zip(grads, variables))
    for i, g, v in overwritten:
        pairs.insert(i, (g, v))
    return [g for g, _ in pairs], [v for _, v in pairs]
