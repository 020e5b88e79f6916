"""Per-task losses: the unweighted loss of every output of a compiled model.

Keras' ``CompileLoss`` returns only the weighted sum of its outputs' losses, with the weights
baked into the traced step. The step of :class:`~keras_fastloop.OptimizedModel` needs each task's
loss on its own (to log it, to weight it with values held in variables, and to take per-task
gradients), so it resolves the ``loss`` argument of ``compile()`` into :class:`Task` entries here.
Each loss is the same Keras ``Loss`` object ``keras.Model`` would use (``sum_over_batch_size``
reduction, masks, sample weights and the ``1 / num_replicas`` scaling under ``tf.distribute``),
so the numbers are Keras' own.
"""

from __future__ import annotations

import dataclasses
import math

import keras
from keras import ops

from keras_fastloop import _keras_internals as internals


@dataclasses.dataclass
class Task:
    """One output of the model that has a loss.

    Attributes:
        name: the output's name (``"{name}_loss"`` is its log key).
        key: index (list outputs) or key (dict outputs) of the output; ``None`` for a single output.
        loss_spec: the user's loss identifier (string, function or ``keras.losses.Loss``).
        loss_weight: the static weight from ``loss_weights`` (``1.0`` when not given).
        loss_fn: the resolved ``keras.losses.Loss`` (set on the first call).
    """

    name: str
    key: int | str | None
    loss_spec: object
    loss_weight: float = 1.0
    loss_fn: keras.losses.Loss | None = None


def _check_loss_identifier(spec):
    """Fail at compile time, not in the first step, for a loss id Keras does not know."""
    if isinstance(spec, str) and spec.lower() not in ("crossentropy", "ce"):
        try:
            keras.losses.get(spec)
        except (ValueError, TypeError):
            raise ValueError(
                "Unknown loss identifier: expected a loss name from `keras.losses` (e.g. "
                f"'mse', 'sparse_categorical_crossentropy') or a Loss object. Received: loss={spec!r}"
            ) from None


def _by_task(value, names, what):
    """Spread a per-output argument (single value, list or dict) over the output names."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(
                f"`{what}` has keys that are not outputs of the model {names}. "
                f"Received: {what}={value}"
            )
        return [value.get(n) for n in names]
    if isinstance(value, (list, tuple)):
        if len(value) != len(names):
            raise ValueError(
                f"`{what}` must have one entry per output ({len(names)}: {names}). "
                f"Received: {what}={value}"
            )
        return list(value)
    return [value] * len(names)


class TaskLosses:
    """Resolves ``compile(loss=..., loss_weights=...)`` into per-task unweighted losses.

    Args:
        loss: what ``keras.Model.compile`` accepts: a loss identifier for every output, or a list
            or dict with one per output (``None`` entries mean "no loss for this output").
        loss_weights: ``None``, a float (single output), or a list or dict with one float per
            output. Default ``None`` (all 1.0).
        output_names: the model's output names, when known at compile time.

    Raises:
        ValueError: if ``loss_weights`` or a list/dict ``loss`` does not match the outputs, or a
            weight is negative or not a number.
    """

    def __init__(self, loss, loss_weights=None, output_names=None):
        self._loss = loss
        self._loss_weights = loss_weights
        self._output_names = list(output_names) if output_names else None
        self.tasks: list[Task] | None = None
        self.trackers: list[keras.metrics.Mean] = []
        if self._output_names:
            self._resolve(self._output_names, keyed=isinstance(loss, dict))

    @property
    def built(self):
        return self.tasks is not None

    @property
    def names(self):
        return [t.name for t in self.tasks] if self.tasks else []

    def _resolve(self, names, keyed, single=False):
        if not isinstance(self._loss, (list, tuple, dict)):
            specs = [self._loss] * len(names)
        else:
            specs = _by_task(self._loss, names, "loss")
        if isinstance(self._loss_weights, (int, float)) and len(names) > 1:
            raise ValueError(
                "A single float `loss_weights` is only valid for a single-output model. "
                f"Received: loss_weights={self._loss_weights}"
            )
        weights = _by_task(self._loss_weights, names, "loss_weights")
        tasks = []
        for i, (name, spec, weight) in enumerate(zip(names, specs, weights)):
            if spec is None:
                continue
            weight = 1.0 if weight is None else weight
            if (
                isinstance(weight, bool)
                or not isinstance(weight, (int, float))
                or not math.isfinite(weight)
                or weight < 0
            ):
                raise ValueError(
                    "Every entry of `loss_weights` must be a finite, non-negative number. "
                    f"Received: loss_weights={self._loss_weights}"
                )
            _check_loss_identifier(spec)
            key = None if single else (name if keyed else i)
            tasks.append(Task(name=name, key=key, loss_spec=spec, loss_weight=float(weight)))
        if not tasks:
            raise ValueError(f"`loss` gives no output a loss. Received: loss={self._loss}")
        self.tasks = tasks
        if len(tasks) > 1:
            self.trackers = [keras.metrics.Mean(name=f"{t.name}_loss") for t in tasks]

    def build(self, y_pred):
        """Resolve the tasks from the first predictions (models without output names)."""
        if isinstance(y_pred, dict):
            self._resolve(list(y_pred), keyed=True)
        elif isinstance(y_pred, (list, tuple)):
            self._resolve([f"output_{i}" for i in range(len(y_pred))], keyed=False)
        else:
            self._resolve(["output"], keyed=False, single=True)

    def _pick(self, structure, task, index):
        """The part of ``y``/``y_pred``/``sample_weight`` that belongs to ``task``."""
        if structure is None or not isinstance(structure, (list, tuple, dict)):
            return structure
        if isinstance(structure, dict):
            for key in (task.name, task.key):
                if key in structure:
                    return structure[key]
            raise ValueError(
                f"The targets (or sample weights) have no entry for output '{task.name}'. "
                f"Expected keys {self.names}. Received: keys={sorted(structure)}"
            )
        if len(structure) == 1 and len(self.tasks) == 1 and task.key in (None, 0):
            return structure[0]
        return structure[index if isinstance(task.key, str) else task.key]

    def __call__(self, y, y_pred, sample_weight=None):
        """Unweighted loss of every task, in task order.

        Args:
            y: targets, a tensor or a list/dict with one tensor per output.
            y_pred: the model's outputs (same structure as the model returns).
            sample_weight: ``None``, one tensor for all outputs, or a list/dict per output.

        Returns:
            List of float32 scalar tensors, one per task (already divided by the number of
            replicas under ``tf.distribute``, as Keras' own losses are).
        """
        if not self.built:
            self.build(y_pred)
        if isinstance(y_pred, (list, tuple)) and isinstance(y, dict) and self._output_names:
            y = [y.get(n) for n in self._output_names]
        values = []
        for i, task in enumerate(self.tasks):
            index = self._output_index(task, i)
            y_t = self._pick(y, task, index)
            y_p = self._pick(y_pred, task, index)
            sw = self._pick(sample_weight, task, index)
            if task.loss_fn is None:
                task.loss_fn = internals.get_loss(task.loss_spec, y_t, y_p)
            values.append(ops.cast(task.loss_fn(y_t, y_p, sw), "float32"))
        return values

    def _output_index(self, task, i):
        if isinstance(task.key, int):
            return task.key
        if self._output_names and task.name in self._output_names:
            return self._output_names.index(task.name)
        return i

    def update_trackers(self, values, batch_size):
        """Record each task's unweighted loss (undoing the per-replica scaling) for the logs."""
        for tracker, value in zip(self.trackers, values):
            tracker.update_state(
                internals.unscale_loss_for_distribution(value), sample_weight=batch_size
            )

    @property
    def static_weights(self):
        return [t.loss_weight for t in self.tasks]
