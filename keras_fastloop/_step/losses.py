"""Per-task losses on Keras' own `CompileLoss`.

Keras' `CompileLoss` resolves every structure `compile(loss=..., loss_weights=...)` accepts
(nested outputs, dict keys that are not layer names, outputs that share a tensor, lists inside
dicts) and keeps one unweighted `{name}_loss` tracker per output, but returns only the
weighted sum, with the weights baked into the trace as Python floats.
`TaskLoss` keeps all of Keras' resolution and adds the two things the step of
`OptimizedModel` needs: each task's unweighted loss on its own (with the
`y_true`/`y_pred`/`sample_weight` Keras picked for it), and trackers that record only
when the step says so (a skipped step leaves them untouched).
"""

from __future__ import annotations

import dataclasses

import keras
from keras import ops, tree

from keras_fastloop import _keras_internals as internals


@dataclasses.dataclass(frozen=True)
class TaskTerm:
    """One task's loss in one call.

    Attributes:
        name: the task's name (its log key is `"{name}_loss"`).
        value: float32 scalar, the unweighted loss (divided by the number of replicas under
            `tf.distribute`, as Keras' losses are).
        y_true, y_pred, sample_weight: what Keras passed to the task's loss function.
        loss_fn: the resolved `keras.losses.Loss`.
    """

    name: str
    value: object
    y_true: object
    y_pred: object
    sample_weight: object
    loss_fn: object


class _TaskLossTracker(keras.metrics.Mean):
    """`Mean` that ignores `CompileLoss`' own per-call update; the step calls `record`."""

    def update_state(self, values, sample_weight=None):
        del values, sample_weight

    def record(self, value, weight):
        keras.metrics.Mean.update_state(
            self, internals.unscale_loss_for_distribution(value), sample_weight=weight
        )


def _static_batch_size(y_pred):
    """What Keras' `CompileLoss` weights a `{name}_loss` update by: the prediction's *static*
    first dimension (`None` inside a graph traced for batches of any size, when every batch
    counts once; the batch's size when run eagerly or traced for one size)."""
    return tree.flatten(y_pred)[0].shape[0]


class _Recorder:
    """Stands in for one entry's loss function inside `CompileLoss.call`; remembers the call."""

    def __init__(self, owner, name, loss_fn):
        self.owner, self.name, self.loss_fn = owner, name, loss_fn

    def __call__(self, y_true, y_pred, sample_weight=None):
        value = ops.cast(self.loss_fn(y_true, y_pred, sample_weight), "float32")
        self.owner._terms.append(
            TaskTerm(self.name, value, y_true, y_pred, sample_weight, self.loss_fn)
        )
        return value


def task_layout(loss, loss_weights, model):
    """`(names, static_weights)` of a functional model's tasks, known before any data.

    Resolves `loss`/`loss_weights` with Keras' own `CompileLoss` on the model's symbolic
    outputs (a scratch instance: loss functions that depend on the targets' shape are resolved
    again, with real targets, by the model's `TaskLoss`). `None` when the model's
    outputs are unknown (subclassed models before their first call) or there is no loss.
    """
    outputs = internals.outputs_struct(model)
    if loss is None or outputs is None:
        return None
    scratch = internals.CompileLoss(
        loss, loss_weights, output_names=getattr(model, "output_names", None)
    )
    scratch.build(outputs, outputs)
    entries = internals.compile_loss_entries(scratch)
    return [e.name for e in entries], [_static_weight(e) for e in entries]


def _static_weight(entry):
    return 1.0 if entry.loss_weights is None else float(entry.loss_weights)


class TaskLoss(internals.CompileLoss):
    """Keras' `CompileLoss` that returns each task's unweighted loss.

    Args:
        loss, loss_weights, output_names: as `keras.Model.compile` / `CompileLoss`.

    Attributes (after the first call, i.e. once the outputs are known):
        names: the task names, in Keras' order (the order of `{name}_loss` logs).
        static_weights: the float weight of every task from `loss_weights` (1.0 if unset).
        trackers: the `{name}_loss` metrics (multi-task models only, as in Keras).
    """

    def __init__(self, loss, loss_weights=None, output_names=None):
        super().__init__(loss, loss_weights, output_names=output_names)
        self.names = None
        self.static_weights = None
        self._terms = []
        self._tracker_weights = None

    def build(self, y_true, y_pred):
        super().build(y_true, y_pred)
        entries = internals.compile_loss_entries(self)
        self.names = [e.name for e in entries]
        self.static_weights = [
            1.0 if e.loss_weights is None else float(e.loss_weights) for e in entries
        ]
        internals.set_compile_loss_entries(
            self,
            [e._replace(loss=_Recorder(self, e.name, e.loss), loss_weights=None) for e in entries],
        )
        trackers = self.metrics
        trackers[:] = [_TaskLossTracker(name=m.name) for m in trackers]

    def call(self, y_true, y_pred, sample_weight=None):
        for argument, given in (("targets", y_true), ("sample weights", sample_weight)):
            if isinstance(given, dict) and isinstance(y_pred, dict):
                needed = [k for k in y_pred if self._has_loss(k)]
                missing = [k for k in needed if k not in given]
                if missing:
                    raise ValueError(
                        f"The {argument} have no entry for output '{missing[0]}'. Expected "
                        f"keys {needed}. Received: keys={sorted(given)}"
                    )
        return super().call(y_true, y_pred, sample_weight)

    def _has_loss(self, key):
        loss = internals.user_loss(self)
        return not isinstance(loss, dict) or loss.get(key) is not None

    @property
    def trackers(self):
        return self.metrics

    def evaluate(self, y_true, y_pred, sample_weight=None):
        """Every task's `TaskTerm` for one batch, in task order (no tracker update)."""
        self._terms = []
        self(y_true, y_pred, sample_weight)
        terms, self._terms = self._terms, []
        self._tracker_weights = [_static_batch_size(t.y_pred) for t in terms]
        return terms

    def record(self, values):
        """Update the `{name}_loss` trackers with unweighted per-replica task losses.

        Each update is weighted as Keras' `CompileLoss` weights it (by the static batch
        dimension of the last `evaluate`'s predictions, see `_static_batch_size`), so the logs
        are `keras.Model`'s in graph and in eager mode, a partial last batch included.
        """
        weights = self._tracker_weights or [None] * len(values)
        for tracker, value, weight in zip(self.trackers, values, weights):
            tracker.record(value, weight)
