"""Cross-replica helpers for the step under ``tf.distribute``.

Keras' optimizer sums gradients across replicas inside ``apply()``, *after* its own clipping, so
``global_clipnorm`` acts on each replica's share (tensorflow#33929). OptimizedModel instead sums
the gradients once itself, takes the finite check and clipping on that sum, and then lets the
optimizer apply it without summing again. The only Keras internal this needs is the optimizer's
``_all_reduce_sum_gradients`` hook, replaced on the optimizer *instance* while the step is
traced (never globally); ``tests/test_keras_internals.py`` pins it.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf


def num_replicas() -> int:
    """Number of replicas in sync of the current strategy (1 outside any strategy)."""
    return tf.distribute.get_strategy().num_replicas_in_sync


def all_reduce_sum(grads):
    """Sum a list of per-replica gradients across replicas (identity with one replica).

    Must be called in replica context (inside ``train_step``). One batched all-reduce, the same
    number Keras' optimizer issues.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return list(grads)
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, list(grads))


@contextlib.contextmanager
def gradients_already_reduced(optimizer):
    """While active, ``optimizer`` applies gradients as given, without its cross-replica sum.

    Args:
        optimizer: a Keras optimizer (a ``LossScaleOptimizer`` is unwrapped to its inner one).
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if num_replicas() == 1 or not hasattr(inner, "_all_reduce_sum_gradients"):
        yield
        return
    inner._all_reduce_sum_gradients = lambda grads_and_vars: list(grads_and_vars)
    try:
        yield
    finally:
        del inner._all_reduce_sum_gradients
