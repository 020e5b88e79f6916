"""A batch's Keras loss as a sum of shares: over micro-batches and over replicas.

A Keras loss with reduction `"sum_over_batch_size"`, `"mean"` or
`"mean_with_sample_weight"` is a ratio `L = N / D`: `N` sums the (sample-weighted,
masked) loss elements and `D` is its denominator, a sum over samples too:

- no Keras mask on the prediction: the number of elements (proportional to the number of
  samples `n`), or `sum(sample_weight)` for `"mean_with_sample_weight"` with sample
  weights;
- a Keras mask on the prediction (`Embedding(mask_zero=True)`, `Masking`): the number of
  unmasked elements (sample-weighted for `"mean_with_sample_weight"`), counted by Keras' own
  reduction code (`CountProbe`).

So for any split of the batch into parts `p` (micro-batches, or the shards of the replicas)::

    L = sum_p (D_p / D) * L_p                      (D = sum_p D_p)

Every part's own Keras loss `L_p` is weighted by its *share* `D_p / D` of the whole
denominator. `"sum"` is not divided: `L = sum_p L_p` (share 1). `denominator` gives
`D_p` for one task's term; `keras_fastloop._step.micro_batching` uses it for micro-batches and
`sync_replicas` for replicas.

**Replicas.** Under `tf.distribute` each replica's Keras loss is `(N_r / D_r) / R`
(`R` replicas; `"sum"` is not scaled), which adds up to the global mean only when every
replica holds the same share `D_r / D = 1 / R`: not so for a last, smaller global batch split
2/1, nor for masked tokens spread unevenly. `sync_replicas` all-reduces every task's
`D_r` (and the batch size, and each replica's numerator) in **one** small all-reduce per step
and weights the replica's loss by `R * D_r / D` (held constant), so the replicas' losses add up
to the 1-replica loss for any split, and so do their gradients.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop import _keras_internals as internals
from keras_fastloop import _replicas
from keras_fastloop._step import batch

DIVIDING_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


class CountProbe(keras.losses.Loss):
    """`"sum"`-reduced loss of ones: Keras' own count of a loss's (weighted, unmasked) elements.

    Called like the task's loss, it returns `sum(ones * sample_weight * mask)` with Keras'
    broadcasting rules: the denominator of the task's loss (up to a factor that is the same for
    every part of the batch).
    """

    def __init__(self, inner):
        super().__init__(name="count_probe", reduction="sum", dtype=inner.dtype)
        self._inner = inner

    def call(self, y_true, y_pred):
        return ops.ones_like(self._inner.call(y_true, y_pred))


def is_masked(term):
    """Whether the task's prediction carries a Keras mask."""
    return internals.get_keras_mask(term.y_pred) is not None


def denominator(term, size, probe=None):
    """`D_p`: the denominator of one task's Keras loss on one part of the batch.

    Args:
        term: the task's `TaskTerm` on this part.
        size: int or int32 scalar, the part's number of samples.
        probe: optional `CountProbe` of the task's loss (made on demand).

    Returns:
        A float32 scalar (a count of elements is given as `size`, the same factor for every
        part), or `None` when the loss is not divided (`"sum"`, `"none"`).
    """
    reduction = term.loss_fn.reduction
    if reduction not in DIVIDING_REDUCTIONS:
        return None
    if is_masked(term):
        probe = probe or CountProbe(term.loss_fn)
        sw = term.sample_weight if reduction == "mean_with_sample_weight" else None
        return ops.cast(probe(term.y_true, term.y_pred, sw), "float32")
    if reduction == "mean_with_sample_weight" and term.sample_weight is not None:
        return ops.sum(ops.cast(term.sample_weight, "float32"))
    return ops.cast(size, "float32")


@dataclasses.dataclass
class ReplicaSync:
    """What `sync_replicas` learned in its one all-reduce.

    Attributes:
        factors: float32 `(T,)`, held constant: `R * D_r / D` per dividing task, `1` for
            the others (all ones with one replica).
        batch_size: int32 scalar, the global batch's number of samples (the loss trackers'
            weight, so that the replicas' updates add up to the 1-replica epoch mean).
        global_losses: float32 `(T,)`, every task's loss on the global batch (`None` when
            no losses were given).
        global_extra: float32 scalar, the sum over replicas of `extra` (`None` if not given).
    """

    factors: object
    batch_size: object
    global_losses: object = None
    global_extra: object = None


def sync_replicas(denominators, batch_size, losses=None, extra=None):
    """One all-reduce of the step's denominators (only with more than one replica).

    Args:
        denominators: per task, the replica's `D_r` (float32 scalar), or `None` for a loss
            that is not divided.
        batch_size: int32 scalar, the replica's number of samples.
        losses: optional per-task float32 scalars, the replica's Keras losses (`x 1/R` for
            dividing reductions, as Keras scales them); their global values come back too.
        extra: optional float32 scalar summed across replicas in the same all-reduce (the
            regularization losses, for the step's non-finite check).

    Returns:
        A `ReplicaSync`.
    """
    num_tasks = len(denominators)
    replicas = _replicas.num_replicas()
    if replicas == 1:
        global_losses = None if losses is None else ops.stack(losses)
        return ReplicaSync(tf.ones([num_tasks]), batch_size, global_losses, extra)
    dividing = [d is not None for d in denominators]
    local_d = ops.stack([d if d is not None else tf.constant(0.0) for d in denominators])
    parts = [local_d, ops.reshape(ops.cast(batch_size, "float32"), [1])]
    if losses is not None:
        stacked = ops.stop_gradient(ops.stack([ops.cast(v, "float32") for v in losses]))
        # The replica's numerator N_r = R * V_r * D_r (dividing), its loss V_r otherwise.
        numerators = ops.where(dividing, stacked * float(replicas) * local_d, stacked)
        parts.append(numerators)
    if extra is not None:
        parts.append(ops.reshape(ops.stop_gradient(ops.cast(extra, "float32")), [1]))
    (total,) = _replicas.all_reduce_sum([ops.concatenate(parts, axis=0)])
    global_d = total[:num_tasks]
    factors = ops.where(
        dividing, float(replicas) * ops.divide_no_nan(local_d, global_d), tf.ones([num_tasks])
    )
    global_losses = None
    if losses is not None:
        global_n = total[num_tasks + 1 : 2 * num_tasks + 1]
        global_losses = ops.where(dividing, ops.divide_no_nan(global_n, global_d), global_n)
    return ReplicaSync(
        ops.stop_gradient(factors),
        ops.cast(ops.round(total[num_tasks]), "int32"),
        global_losses,
        None if extra is None else total[-1],
    )


def global_share(local, global_loss):
    """A replica's loss whose value is `global_loss / R` and whose gradient is `local`'s.

    Every replica then hands the loss weighting the same value (the global loss, scaled by
    `1 / R` as Keras' losses are), so a weighting that is not linear in the losses (FAMO's
    logarithm) sees the global losses, while each replica's gradient is its own share's (the
    gradients' all-reduce adds them up to the global gradient).
    """
    replicas = _replicas.num_replicas()
    if replicas == 1:
        return local
    return ops.stop_gradient(global_loss / float(replicas)) + (local - ops.stop_gradient(local))


def replica_losses(terms, extra=None):
    """The tasks' losses of one replica, as its shares of the global batch's losses.

    Args:
        terms: the replica's `TaskTerm` list (from the default
            `compute_loss`).
        extra: optional float32 scalar to sum across replicas in the same all-reduce.

    Returns:
        `(values, sync)`: per task a float32 scalar whose value is the global loss `/ R`
        (the same on every replica, see `global_share`) and whose gradient is the
        replica's share `(R * D_r / D) * L_r`'s; and the `ReplicaSync` (global batch
        size, global losses, `extra` summed). With one replica: the terms' own values and
        `ReplicaSync(None, batch_size)`, no collective.
    """
    values = [t.value for t in terms]
    batch_size = batch.batch_size(terms[0].y_pred)
    if _replicas.num_replicas() == 1:
        return values, ReplicaSync(None, batch_size)
    denominators = [denominator(t, batch.batch_size(t.y_pred)) for t in terms]
    sync = sync_replicas(denominators, batch_size, values, extra)
    shares = [v * sync.factors[i] for i, v in enumerate(values)]
    globals_ = tf.unstack(sync.global_losses, num=len(terms))
    return [global_share(s, g) for s, g in zip(shares, globals_)], sync


def global_losses(result):
    """`[logged_loss, *task losses]` of the global batch, for the step's `StepResult`.

    Taken from the denominators' all-reduce when the loss already did one (the plain path under
    `tf.distribute`), else summed across replicas here (one all-reduce; none with one replica).
    """
    if result.global_losses is not None:
        return result.global_losses
    return _replicas.all_reduce_sum([result.logged_loss] + list(result.task_losses or []))
