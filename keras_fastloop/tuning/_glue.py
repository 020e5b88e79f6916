"""`steps_per_execution="auto"`: compile-time state and the variable-count train function.

Keras' multi-step `tf.function` has `steps_per_execution` baked in as a Python int; here the
step count is a tensor argument, so one trace serves every count (`docs/fit_loop.md`). The
grouping of batches into executions is `keras_fastloop._fit_run.FitRun`'s, which drives
this module's `AutoSteps` through its methods.
"""

from __future__ import annotations

import time
import warnings

import keras
import tensorflow as tf

from keras_fastloop import _tf_internals as tf_internals
from keras_fastloop import _validation
from keras_fastloop._warnings import FastloopWarning
from keras_fastloop.callbacks import events
from keras_fastloop.tuning.tuner import StepsPerExecutionTuner

AUTO = "auto"
# `max_seconds_per_step` of the tuner that `steps_per_execution="auto"` creates (seconds)
AUTO_MAX_SECONDS_PER_STEP = 0.05


def validate_steps_per_execution(
    value: int | str, strategy: tf.distribute.Strategy | None = None
) -> int | str:
    """Checks a `steps_per_execution` argument.

    Args:
        value: `"auto"` or a positive int.
        strategy: the model's `tf.distribute.Strategy`, or `None`.

    Returns:
        The value, unchanged (a Python int or `"auto"`).

    Raises:
        ValueError: if it is neither `"auto"` nor a positive int, or an int > 1 under a
            `MirroredStrategy` with several replicas (Keras 3.15 fails inside `fit` there,
            keras.Model too: keras#19246; pinned by tests/test_distributed.py).

    Example:
        >>> validate_steps_per_execution("auto")
        'auto'
    """
    if value == AUTO and isinstance(value, str):
        return value
    if not (_validation.is_int(value) and value >= 1):
        raise ValueError(
            '`steps_per_execution` must be "auto" or a positive integer. '
            f"Received: steps_per_execution={value!r}"
        )
    replicas = strategy.num_replicas_in_sync if strategy is not None else 1
    if value > 1 and replicas > 1 and isinstance(strategy, tf.distribute.MirroredStrategy):
        raise ValueError(
            "An integer `steps_per_execution` > 1 does not work under a MirroredStrategy with "
            "several replicas (Keras 3.15's multi-step loop fails in `fit` with 'You must feed "
            'a value for placeholder tensor\', keras.Model too; keras#19246). Use 1, or "auto" '
            f"(which stays at 1 there). Received: steps_per_execution={value}, "
            f"num_replicas_in_sync={replicas}"
        )
    return int(value)


def _one_step_reason(callback):
    """Why `callback` needs a call after every batch (then "auto" runs one step per
    execution), or `None`."""
    if events.counts_calls(callback):
        return (
            f"{type(callback).__name__}(update_freq={callback.update_freq}) numbers "
            "its batch summaries by calls, so grouped steps would be written at the "
            'wrong steps. With update_freq="epoch" "auto" groups steps.'
        )
    if events.logged_batch_period(callback) == 1:
        return (
            f"{type(callback).__name__} logs after every batch (log_freq=1). "
            'With log_freq=N it logs every N batches and "auto" groups the steps '
            'between; log_freq="epoch" leaves "auto" free.'
        )
    return None


class AutoSteps:
    """Per-model runtime state of `steps_per_execution="auto"` (not serialized).

    The fit run (`keras_fastloop._fit_run.FitRun`) drives it, in this order per `fit`:
    `begin_fit`, `plan` (once the epoch iterator is known), then per execution
    `start_grouping` (first epoch), `propose`, `begin_execution`, `end_execution`; finally
    `end_fit`. Its `execution_clock` callback runs first among `fit`'s callbacks.

    Attributes:
        tuner: the `StepsPerExecutionTuner` (replaceable before `fit`).
        clock: callable returning seconds (`time.perf_counter`; tests replace it).
    """

    def __init__(self, tuner):
        self.tuner = tuner
        self.clock = time.perf_counter
        self.execution_clock = _ExecutionClock(self)
        self._k = 1  # steps of the execution about to run; read by the train function
        self._execution_end = None  # clock() at the running execution's on_train_batch_end
        self._traced = False  # whether the last train-function call traced a function
        self._executions = []  # (begin_step, steps) of the current fit
        self._variable_steps = False  # the train function is the variable-count one
        # this fit groups steps: every execution, one step included, runs the loop function,
        # so it is the only function compiled (decided once per fit by `start_grouping`;
        # `None` until then: one-step executions run Keras' one-step function)
        self._use_loop = False

    @property
    def executions(self):
        """`(begin_step, steps)` of each execution of the current (or last) `fit`."""
        return self._executions

    def begin_fit(self):
        """Starts a `fit`: no executions yet, the loop decision open, the tuner told."""
        self._executions = []
        self._use_loop = None
        self.tuner.begin(warmup=False)  # the executions that trace are left out instead

    def plan(self, callbacks, num_batches, accumulation):
        """Caps the tuner at the shortest event period and the epoch (`fit`'s epoch iterator
        is known), and warns when a callback forces one step per execution.

        Args:
            callbacks: the `fit`'s callbacks (a list).
            num_batches: int or `None`, batches per epoch.
            accumulation: int >= 1, batches per optimizer step.
        """
        for callback in callbacks:
            reason = _one_step_reason(callback)
            if reason is not None:
                warnings.warn(
                    'steps_per_execution="auto" runs one step per execution in this fit: ' + reason,
                    FastloopWarning,
                    stacklevel=4,
                )
                break
        periods = events.event_periods(callbacks, accumulation)
        if num_batches:
            periods.append(int(num_batches))
        self.tuner.set_horizon(min(periods) if periods else None)

    def start_grouping(self, length_known):
        """Whether this epoch may group steps: the data's length is known and the train
        function is the variable-count one (one Keras built before, e.g. under `run_eagerly`,
        runs one step whatever the count). At the fit's first epoch it also decides, once,
        which function compiles: the loop (one step included) when this fit may group, else
        Keras' one-step function (a cap of 1, or a count settled at 1 by an earlier fit).

        Args:
            length_known: bool, the data's number of batches is known.
        """
        groupable = length_known and self._variable_steps
        if self._use_loop is None:
            tuner = self.tuner
            self._use_loop = (
                groupable and tuner.cap > 1 and not (tuner.phase == "settled" and tuner.steps == 1)
            )
        return groupable

    def propose(self, limit):
        """The steps of the next execution (`StepsPerExecutionTuner.propose`)."""
        return self.tuner.propose(limit)

    def begin_execution(self, begin, steps):
        """The next train-function call runs `steps` steps from batch `begin`.

        Returns:
            The clock reading at its start.
        """
        self._k = steps
        self._executions.append((begin, steps))
        self._execution_end = None
        self._traced = False
        return self.clock()

    def end_execution(self, steps, start, at_event):
        """Feeds the tuner the execution begun at clock reading `start`, if it ran to its
        `on_train_batch_end` without tracing a function.

        It is timed to now (Keras asks for the next slot: the callbacks' per-batch work, which
        grouping saves too, is part of it), or, when it ended at a step event (`at_event`), to
        its first `on_train_batch_end`: the event's work (a checkpoint, a validation) is not
        the execution's.
        """
        end = self._execution_end if at_event else self.clock()
        if self._execution_end is not None and not self._traced:
            self.tuner.observe(steps, end - start)

    def end_fit(self):
        """Back to one step per call with Keras' one-step function (`train_on_batch` & co.)."""
        self._k, self._use_loop = 1, False

    def _mark_execution_end(self):
        self._execution_end = self.clock()


class _ExecutionClock(keras.callbacks.Callback):
    """Marks the end of each execution for `"auto"`, before any other callback's
    `on_train_batch_end` (see `AutoSteps.end_execution`)."""

    def __init__(self, state):
        super().__init__()
        self._state = state

    def on_train_batch_end(self, batch, logs=None):
        self._state._mark_execution_end()


def resolve_steps_per_execution(value, tuner=None):
    """Splits a `compile` argument into Keras' value and the auto state.

    Args:
        value: `"auto"` or a positive int (validated).
        tuner: optional `StepsPerExecutionTuner` to use for `"auto"`. Defaults to a new
            one with default arguments, `max_seconds_per_step=AUTO_MAX_SECONDS_PER_STEP`
            (0.05 s: a longer step stays at one step per execution) and
            `largest_first=True`.

    Returns:
        `(keras_steps_per_execution, state)`: `(1, state)` for `"auto"`, `(value, None)`
        otherwise.

    Raises:
        ValueError: as `validate_steps_per_execution`.
    """
    value = validate_steps_per_execution(value)
    if value == AUTO:
        if tuner is None:
            tuner = StepsPerExecutionTuner(
                max_seconds_per_step=AUTO_MAX_SECONDS_PER_STEP, largest_first=True
            )
        return 1, AutoSteps(tuner)
    return value, None


def auto_state(model):
    """The model's `AutoSteps`, or `None` when it was not compiled with `"auto"`."""
    return getattr(getattr(model, "fastloop_step", None), "auto_steps", None)


def steps_per_execution_tuner(model: keras.Model) -> StepsPerExecutionTuner | None:
    """The tuner of a model compiled with `steps_per_execution="auto"`, else `None`.

    Its `phase` is `"probing"` or `"settled"`; `steps` the count under test while probing (it
    alternates with `best_steps`), the chosen count once settled; `history` a
    `(phase, steps, median steps/s)` entry per finished measurement window, and
    `("settle", steps, reason)` / `("retune", steps, steps/s)` entries
    (`StepsPerExecutionTuner`). It lives as long as the compiled model: a second `fit`
    continues from what the first one learned.

    Args:
        model: any Keras model.

    Returns:
        A `StepsPerExecutionTuner` or `None`.
    """
    state = auto_state(model)
    return None if state is None else state.tuner


def tunable(model):
    """Whether `"auto"` may group steps: not under `run_eagerly` nor with several replicas.

    Multi-worker: workers timing differently could choose different counts. Several replicas
    on one worker (`MirroredStrategy`): Keras 3.15's multi-step loop fails there ("You must
    feed a value for placeholder tensor"), `keras.Model` with `steps_per_execution=4` too.
    """
    from keras_fastloop._step import multi_worker

    strategy = model.distribute_strategy
    return (
        not model.run_eagerly
        and not multi_worker.is_multi_worker(strategy)
        and strategy.num_replicas_in_sync == 1
    )


def fit_state(model):
    """The model's `AutoSteps` when `"auto"` may group steps in this `fit` (`tunable`), else
    `None`."""
    state = auto_state(model)
    return state if state is not None and tunable(model) else None


def _variable_steps_function(model, step_function, state):
    """Keras' multi-step loop with the step count as a tensor argument (one trace for all)."""
    from keras_fastloop import _keras_internals as internals

    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = strategy.run(step_function, args=(data,))
        return internals.reduce_per_replica(outputs, strategy, reduction="auto")

    one_step_on_data = tf.function(
        one_step_on_data, reduce_retracing=True, jit_compile=model.jit_compile
    )
    traceable = [one_step_on_data]
    one_step_on_data = internals.autoconvert_optionals(model, one_step_on_data)

    @tf.autograph.experimental.do_not_convert
    def multi_step_on_iterator(iterator, steps):
        empty_outputs = tf.experimental.Optional.empty(None)

        def cond(execution_step, optional_outputs, next_optional_inputs):
            return tf.logical_and(tf.less(execution_step, steps), next_optional_inputs.has_value())

        def body(execution_step, optional_outputs, next_optional_inputs):
            def has_next():
                outputs = tf.experimental.Optional.from_value(
                    one_step_on_data(next_optional_inputs.get_value())
                )
                tf_internals.set_optional_spec(empty_outputs, outputs.element_spec)
                return outputs

            def no_has_next():
                tf_internals.set_optional_spec(optional_outputs, empty_outputs.element_spec)
                return optional_outputs

            outputs = tf.cond(
                tf.logical_and(tf.less(execution_step, steps), next_optional_inputs.has_value()),
                has_next,
                no_has_next,
            )
            return (
                execution_step + 1,
                outputs,
                tf.cond(
                    tf.less(execution_step + 1, steps),
                    lambda: iterator.get_next_as_optional(),
                    lambda: next_optional_inputs,
                ),
            )

        _, final, _ = tf.while_loop(
            cond,
            body,
            loop_vars=[tf.constant(0), empty_outputs, iterator.get_next_as_optional()],
        )
        tf_internals.set_optional_spec(final, empty_outputs.element_spec)
        return final

    multi_step_on_iterator = tf.function(multi_step_on_iterator, reduce_retracing=True)

    @tf.autograph.experimental.do_not_convert
    def one_step_on_iterator(iterator):
        # Keras' own function for steps_per_execution=1 (no loop, no Optional): "auto" at 1
        # costs what plain `fit` costs. The end of the data raises OutOfRangeError, which
        # Keras' epoch iterator handles.
        return one_step_on_data(iterator.get_next())

    one_step_on_iterator = tf.function(one_step_on_iterator, reduce_retracing=True)
    traceable += [multi_step_on_iterator, one_step_on_iterator]

    def traces():
        return sum(f.experimental_get_tracing_count() for f in traceable)

    state._variable_steps = True

    def function(iterator):
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            before = traces()
            try:
                if state._k == 1 and not state._use_loop:
                    return one_step_on_iterator(iterator)
                optional = multi_step_on_iterator(iterator, tf.constant(state._k, tf.int32))
                if not optional.has_value():
                    raise StopIteration
                return optional.get_value()
            finally:
                state._traced = traces() > before  # the tuner leaves such executions out
        outputs = None
        for _, data in zip(range(max(1, state._k)), iterator):  # train_on_batch & co.
            outputs = one_step_on_data(data)
        return outputs

    return function


def make_train_function(model, keras_make_train_function, force=False):
    """`make_train_function` that builds the variable-count train function under "auto" (glue).

    Args:
        model: the model.
        keras_make_train_function: the bound Keras `make_train_function`.
        force: bool, rebuild even if one exists. Defaults to `False`.

    Returns:
        The train function (`model.train_function`).
    """
    state = auto_state(model)
    if state is None or not tunable(model):
        return keras_make_train_function(force=force)
    if model.train_function is not None and not force:
        return model.train_function
    from keras_fastloop._step import multi_worker

    model.train_function = multi_worker.make_function(
        model, lambda step: _variable_steps_function(model, step, state), model.train_step
    )
    return model.train_function
