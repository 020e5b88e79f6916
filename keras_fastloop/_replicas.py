"""Replicated step state and the cross-replica sum: what the step and the public components
(clipping, weighting) share, below both."""

from __future__ import annotations

import keras
import tensorflow as tf


def num_replicas() -> int:
    """Number of replicas in sync of the current strategy.

    Returns:
        An int, 1 outside any strategy.

    Example:
        >>> num_replicas()
        1
    """
    return tf.distribute.get_strategy().num_replicas_in_sync


def all_reduce_sum(grads):
    """Sum a list of per-replica tensors across replicas (identity with one replica).

    Args:
        grads: a list of tensors (gradients, losses), one value per replica.

    Returns:
        A list of tensors, each the sum over all replicas, identical on every replica. One batched
        all-reduce: the same number Keras' optimizer issues for gradients.

    Raises:
        RuntimeError: from TensorFlow when called in cross-replica context of a strategy with
            more than one replica.

    Example:
        >>> all_reduce_sum([tf.constant(1.0)])  # outside any strategy: unchanged
        [<tf.Tensor: shape=(), dtype=float32, numpy=1.0>]
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return list(grads)
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, list(grads))


def state_variable(owner, name, shape=(), value=0, dtype="float32"):
    """A non-trainable, checkpointed variable of the step's state, identical on every replica.

    `owner` is the layer that tracks it (the model's `StepState`); the value is assigned on
    every replica from all-reduced inputs, so the first replica's copy is kept
    (`aggregation="only_first_replica"`).
    """
    return owner.add_weight(
        shape=shape,
        initializer=keras.initializers.Constant(value),
        dtype=dtype,
        trainable=False,
        name=name,
        aggregation="only_first_replica",
    )
