"""Step events: the protocol a callback follows so that `steps_per_execution` respects it.

An execution of several training steps (`compile(steps_per_execution=...)`) is opaque to
callbacks: Keras calls `on_train_batch_begin`/`on_train_batch_end` once per execution, before
and after all of its steps, never inside. A callback that must see the model after a given step
(to validate, save, log or profile there) declares that step as a *step event*; under
`steps_per_execution="auto"` the fit loop ends every execution at the next step event of any
callback (and at the epoch end), so the callback's `on_train_batch_end` runs right after that
step. A fixed integer `steps_per_execution` is the user's choice and is not changed.

A callback declares its events in one or more of these ways; all are honoured, the nearest
event wins:

- a method `steps_until_next_event(step) -> int | None`: optimizer steps from `step`
  (`optimizer.iterations` now) to the next step after which it must run (`None`: no event);
- a positive int attribute `every_n_steps` or `log_every_n_steps`: an event after every
  multiple of it in optimizer steps (`PeriodicValidation`, `ThroughputMonitor`, MLflow's
  `MlflowCallback(log_every_n_steps=N)`);
- a method `batches_until_next_event(batch) -> int | None`: batches, counting the next one to
  train (index `batch` of the epoch), until the next batch after which it must run
  (`ProfilerWindow`: before its first step and after its last);
- a positive int attribute `save_freq` (`keras.callbacks.ModelCheckpoint`,
  `keras.callbacks.BackupAndRestore`): a save after every `save_freq` batches, counted by
  the callback itself;
- `keras.callbacks.TensorBoard` with an integer `update_freq`: an event after every batch,
  since it numbers its batch summaries by its calls, not by batch (`counts_calls`);
- W&B's `WandbMetricsLogger` with an integer `log_freq` (`"batch"`: 1): an event after each
  batch whose index in the epoch is a multiple of it, where it logs, on a step axis
  (`batch/batch_step`) it advances by `log_freq` per log (`logged_batch_period`).

With the optimizer's `gradient_accumulation_steps=a` one optimizer step is `a` batches.
Callbacks nested inside another (the `callbacks` of `PeriodicValidation`) are not searched:
they act at its validations. The attributes also cap the tuner (`event_periods`); an event
declared by a method only cuts the executions that would pass it.

Example:
    >>> class AtPowersOfTwo(keras.callbacks.Callback):
    ...     def steps_until_next_event(self, step):  # after steps 1, 2, 4, 8, ...
    ...         return (1 << step.bit_length()) - step
    >>> steps_until_next_event([AtPowersOfTwo()], 5)  # from step 5: after step 8
    3
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import TYPE_CHECKING

from keras_fastloop import _keras_internals as internals
from keras_fastloop import _validation

if TYPE_CHECKING:
    import keras

__all__ = [
    "batches_until_next_event",
    "counts_calls",
    "event_periods",
    "logged_batch_period",
    "reads_optimizer_step",
    "steps_until_next_event",
]

_STEP_PERIOD_ATTRIBUTES = ("every_n_steps", "log_every_n_steps")


def _positive_int(value):
    return _validation.is_int(value) and value > 0


def _step_gaps(callback, step):
    method = getattr(callback, "steps_until_next_event", None)
    if callable(method):
        gap = method(step)
        return [] if gap is None else [max(1, int(gap))]
    return [
        int(period) - step % int(period)
        for period in (getattr(callback, name, None) for name in _STEP_PERIOD_ATTRIBUTES)
        if _positive_int(period)
    ]


def steps_until_next_event(callbacks: Iterable[keras.callbacks.Callback], step: int) -> int | None:
    """Optimizer steps from `step` until the next step a callback must act on.

    Only the step-counted declarations (`steps_until_next_event` methods, `every_n_steps`
    and `log_every_n_steps` attributes; see the module docstring) count here.

    Args:
        callbacks: iterable of `keras.callbacks.Callback`.
        step: int, the optimizer step now (`optimizer.iterations`).

    Returns:
        The smallest number of steps to an event (>= 1), or `None` when no callback is
        step-gated.

    Example:
        >>> class Every(keras.callbacks.Callback):
        ...     every_n_steps = 10
        >>> steps_until_next_event([Every()], 23)
        7
    """
    gaps = [gap for callback in callbacks for gap in _step_gaps(callback, step)]
    return min(gaps) if gaps else None


def _save_gap(callback):
    save_freq = getattr(callback, "save_freq", None)
    if not _positive_int(save_freq):
        return None
    seen = internals.batches_since_saving(callback)
    if not isinstance(seen, numbers.Integral):
        return None
    return max(1, int(save_freq) - int(seen))


def batches_until_next_event(
    callbacks: Iterable[keras.callbacks.Callback], step: int, batch: int, accumulation: int = 1
) -> int | None:
    """Batches, counting the next one, until the next step event of any callback.

    Args:
        callbacks: iterable of `keras.callbacks.Callback`.
        step: int, `optimizer.iterations` now.
        batch: int, index in the epoch of the next batch to train.
        accumulation: int >= 1, batches per optimizer step (the optimizer's
            `gradient_accumulation_steps`). Defaults to `1`.

    Returns:
        An int >= 1: the next execution may train at most this many batches; or `None` when
        no callback declares an event.
    """
    gaps = []
    for callback in callbacks:
        gaps += [gap * accumulation for gap in _step_gaps(callback, step)]
        method = getattr(callback, "batches_until_next_event", None)
        if callable(method):
            gap = method(batch)
            if gap is not None:
                gaps.append(max(1, int(gap)))
        gap = _save_gap(callback)
        if gap is not None:
            gaps.append(gap)
        period = logged_batch_period(callback)
        if period is not None:
            gaps.append(-batch % period + 1)
    return min(gaps) if gaps else None


def event_periods(
    callbacks: Iterable[keras.callbacks.Callback], accumulation: int = 1
) -> list[int]:
    """The periods, in batches, of the callbacks' periodic events (step periods and save_freq).

    Args:
        callbacks: iterable of `keras.callbacks.Callback`.
        accumulation: int >= 1, batches per optimizer step. Defaults to `1`.

    Returns:
        A list of ints >= 1 (empty when no callback has a periodic event).
    """
    periods = []
    for callback in callbacks:
        for name in _STEP_PERIOD_ATTRIBUTES:
            period = getattr(callback, name, None)
            if _positive_int(period):
                periods.append(int(period) * accumulation)
        if _positive_int(getattr(callback, "save_freq", None)):
            periods.append(int(callback.save_freq))
        if counts_calls(callback):
            periods.append(1)
        period = logged_batch_period(callback)
        if period is not None:
            periods.append(period)
    return periods


def counts_calls(callback: keras.callbacks.Callback) -> bool:
    """Whether `callback` numbers batches by its `on_train_batch_*` calls, not by batch.

    Keras' `TensorBoard` with an integer `update_freq` writes its batch summaries at step
    "number of `on_train_batch_begin` calls" when that count is a multiple of `update_freq`:
    under several steps per execution they land at the wrong steps with the wrong values.

    Args:
        callback: a `keras.callbacks.Callback`.

    Returns:
        bool.
    """
    import keras

    return isinstance(callback, keras.callbacks.TensorBoard) and _positive_int(
        getattr(callback, "update_freq", None)
    )


def logged_batch_period(callback: keras.callbacks.Callback) -> int | None:
    """The batch-index period of W&B's `WandbMetricsLogger(log_freq=N)`, else `None`.

    It logs after a batch whose index in the epoch is a multiple of `N` (`log_freq="batch"`:
    1), at `batch/batch_step` = its own count of logs times `N`. Under several steps per
    execution it sees only each execution's last batch: it logs fewer rows, and puts later
    steps' figures at the step axis of earlier ones. Recognised by class name and module
    (`wandb.`), subclasses included, so that keras_fastloop does not import wandb.

    Args:
        callback: a `keras.callbacks.Callback`.

    Returns:
        An int >= 1, or `None` (another callback, or `log_freq="epoch"`).
    """
    if not any(
        cls.__name__ == "WandbMetricsLogger" and cls.__module__.startswith("wandb.")
        for cls in type(callback).__mro__
    ):
        return None
    period = getattr(callback, "log_freq", None)
    if getattr(callback, "logging_batch_wise", False) and _positive_int(period):
        return int(period)
    return None


def reads_optimizer_step(callbacks: Iterable[keras.callbacks.Callback]) -> bool:
    """Whether any callback declares step-counted events (then `optimizer.iterations` is read).

    Args:
        callbacks: iterable of `keras.callbacks.Callback`.

    Returns:
        bool.
    """
    return any(
        callable(getattr(callback, "steps_until_next_event", None))
        or any(_positive_int(getattr(callback, name, None)) for name in _STEP_PERIOD_ATTRIBUTES)
        for callback in callbacks
    )
