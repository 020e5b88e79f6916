"""Cross-replica helpers for the step under `tf.distribute` (internal to the step).

- `all_reduce_sum` sums the gradients across replicas once; the finite check and clipping
  act on that sum, and `gradients_already_reduced` keeps the optimizer from summing again
  (case C10: Keras' `global_clipnorm` clips each replica's share, tensorflow#33929).
- `cond` is a replica-context `tf.cond` whose branches may synchronise (`merge_call`).

The corrections of Keras' `fit` under `MultiWorkerMirroredStrategy` live apart: the step's
packed outputs in `keras_fastloop._step.multi_worker` (traced), the build from the first
local batch in `keras_fastloop._fit_callbacks` (eager).

Why, and the Keras internals relied on (pinned by `tests/test_keras_internals.py`):
`docs/design.md`, section "Distributed training".
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from keras_fastloop import _keras_internals as internals
from keras_fastloop._replicas import num_replicas

_PATCH_LOCK = threading.Lock()
_DEPTH_ATTR = "_fastloop_reduced_depth"
_HOOK = internals.ALL_REDUCE_HOOK


def _needs_merge_call():
    """Whether synchronisation in replica context goes through `merge_call` (not in a cond)."""
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return False
    return not tf.__internal__.distribute.strategy_supports_no_merge_call()


def cond(pred, true_fn, false_fn=None, args=()):
    """`ops.cond` in replica context whose branches may hold synchronisation points.

    Under a strategy that synchronises with `merge_call` (`MirroredStrategy`,
    `MultiWorkerMirroredStrategy`), enters cross-replica context, takes `pred` from the
    first local replica and calls the chosen branch on every replica with that replica's
    `args`. Elsewhere it is a plain `tf.cond`.

    Args:
        pred: scalar boolean tensor, **identical on every replica** (e.g. computed from
            all-reduced values).
        true_fn: callable `true_fn(*args)`, run when `pred` is true. Its return value is
            ignored (use it for side effects: optimizer updates, variable assignments).
        false_fn: callable `false_fn(*args)` or `None` (default: do nothing).
        args: tuple of per-replica tensors (or nests) passed to the branch. Every replica-local
            tensor a branch uses must come through `args`, never a closure: only one replica's
            closure survives `merge_call`.

    Returns:
        `None`.

    Example:
        >>> finite = tf.constant(True)
        >>> cond(finite, lambda g: optimizer.apply(g, variables), args=(grads,))  # doctest: +SKIP
    """
    false_fn = false_fn or (lambda *a: None)

    def branch(fn):
        def run(*a):
            fn(*a)
            return tf.constant(0)

        return run

    if not _needs_merge_call():
        tf.cond(pred, lambda: branch(true_fn)(*args), lambda: branch(false_fn)(*args))
        return None

    def merge_fn(strategy, pred, *args):
        first = strategy.experimental_local_results(pred)[0]

        def call(fn):
            def run():
                strategy.extended.call_for_each_replica(fn, args=args)
                return tf.constant(0)

            return run

        tf.cond(first, call(true_fn), call(false_fn))

    tf.distribute.get_replica_context().merge_call(merge_fn, args=(pred, *args))
    return None


@contextlib.contextmanager
def gradients_already_reduced(optimizer):
    """While active, `optimizer` applies gradients as given, without its cross-replica sum.

    Replaces Keras' `TFOptimizer._all_reduce_sum_gradients` on the optimizer *instance* (a
    `LossScaleOptimizer` is unwrapped to its inner optimizer) for the duration of the trace.
    Re-entrant and safe for the replica threads of `MirroredStrategy`, which enter and leave it
    interleaved: the hook is installed by the first to enter and removed by the last to leave.

    Args:
        optimizer: a Keras optimizer.

    Returns:
        A context manager.

    Raises:
        RuntimeError: if the Keras optimizer has no `_all_reduce_sum_gradients` hook while
            training with more than one replica (a Keras upgrade changed it; applying as-is
            would sum the gradients twice).

    Example:
        >>> with gradients_already_reduced(optimizer):  # doctest: +SKIP
        ...     optimizer.apply(summed_grads, variables)
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if num_replicas() == 1 and not tf.distribute.has_strategy():
        yield
        return
    if not callable(getattr(type(inner), _HOOK, None)):
        raise RuntimeError(
            "keras_fastloop needs the Keras optimizer hook `_all_reduce_sum_gradients` to apply "
            "gradients it has already summed across replicas; this Keras version does not have "
            f"it. Received: optimizer={type(inner).__name__}"
        )
    with _PATCH_LOCK:
        depth = inner.__dict__.get(_DEPTH_ATTR, 0)
        if depth == 0:
            object.__setattr__(inner, _HOOK, lambda grads_and_vars: list(grads_and_vars))
        object.__setattr__(inner, _DEPTH_ATTR, depth + 1)
    try:
        yield
    finally:
        with _PATCH_LOCK:
            depth = inner.__dict__[_DEPTH_ATTR] - 1
            object.__setattr__(inner, _DEPTH_ATTR, depth)
            if depth == 0:
                object.__delattr__(inner, _HOOK)
                object.__delattr__(inner, _DEPTH_ATTR)
