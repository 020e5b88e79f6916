"""The one owner of `OptimizedModel.fit`: arguments, internal callbacks, epoch transforms.

`OptimizedModel.fit`, `_maybe_symbolic_build` and `make_train_function` delegate here; no
other module wraps `fit` or patches its epoch iterator. Per `fit` call this module

1. binds `fit`'s arguments once (`inspect.signature(keras.Model.fit).bind`);
2. adds the internal callbacks: those of the extensions listed in `EXTENSIONS` (`keras_fastloop._resume`
   adds the exact-resume callback after each `BackupAndRestore(save_freq=N)`,
   `keras_fastloop._fit_callbacks` its batch-size monitor), then the
   non-finite monitor of `keras_fastloop._fit_callbacks`;
3. captures `fit`'s epoch iterator once (Keras hands it to `_maybe_symbolic_build` first
   thing) and replaces its `_enumerate_iterator` on that instance only, for the whole `fit`,
   by the composition of its transforms, always in this order:

   a. **resume skipping** (first epoch after a mid-epoch resume only): the batches already
      trained before the crash are read from the data iterator and dropped, without training
      and without callbacks;
   b. **execution grouping** (`steps_per_execution="auto"` only): consecutive one-batch slots
      of Keras' own generator are joined into one execution of `k` steps;
   c. **step events**: `k` never passes the next step event of any callback
      (`keras_fastloop.tuning.events`: `PeriodicValidation`, `ThroughputMonitor`,
      `ProfilerWindow`, `ModelCheckpoint`/`BackupAndRestore` with an integer
      `save_freq`, any `steps_until_next_event` / `batches_until_next_event` method) nor
      the epoch end.

The grouping never reads data ahead of what Keras would: on data of unknown length (a
`tf.data.Dataset` of unknown cardinality, after `filter` or `bucket_by_length`) it keeps
one step per execution, so `"auto"` never changes which batch is trained when. The design
and what Keras 3.15 allows are in `docs/fit_loop.md`.
"""

from __future__ import annotations

import inspect
import numbers
import warnings

import keras

from keras_fastloop import _cluster_report as cluster_report
from keras_fastloop import _fit_callbacks as fit_callbacks
from keras_fastloop import _resume as resume
from keras_fastloop._fit_run import FitRun, current_run
from keras_fastloop._step import prebuild
from keras_fastloop._warnings import FastloopWarning
from keras_fastloop.tuning import _glue, events

__all__ = ["EXTENSIONS", "FitRun", "current_run", "fit"]

_FIT_SIGNATURE = inspect.signature(keras.Model.fit)

# The extensions of `fit`, in this order: name -> callable(model, callbacks) -> callbacks,
# which returns the callbacks (a list) with the extension's internal callbacks added.
EXTENSIONS = {
    "exact_resume": resume.with_exact_resume,
    "micro_batch_size": fit_callbacks.with_batch_size_monitor,
    "tensorboard_model_summary": fit_callbacks.with_tensorboard_model_summary,
    "worker_line": cluster_report.with_worker_line,
}


def bind_fit_arguments(model, args, kwargs):
    """`fit`'s arguments as a dict by name (a `TypeError` for arguments `fit` lacks)."""
    arguments = dict(_FIT_SIGNATURE.bind(model, *args, **kwargs).arguments)
    arguments.pop(next(iter(_FIT_SIGNATURE.parameters)))  # self
    return arguments


def with_internal_callbacks(model, callbacks):
    """`callbacks` (a list) plus the weighting's and the extensions' callbacks and the
    non-finite monitor, as a new list.

    The weighting's callbacks run first (e.g. DWA closes its epoch window before a
    checkpointing callback saves the state); the non-finite monitor runs last.
    """
    callbacks = list(callbacks)
    step = model.fastloop_step
    if step is None:  # not compiled: Keras' fit says so
        return callbacks
    for add_callbacks in EXTENSIONS.values():
        callbacks = add_callbacks(model, callbacks)
    monitor = fit_callbacks.NonFiniteMonitor(step.nonfinite)
    first = step.weighting.callbacks()
    return [*first, *callbacks, monitor]


def fit(model, keras_fit, args, kwargs):
    """Runs Keras' `fit` with the internal callbacks and the epoch transforms in effect.

    Args:
        model: the `OptimizedModel`.
        keras_fit: the bound Keras `fit` (`super().fit`).
        args, kwargs: `fit`'s positional and keyword arguments.

    Returns:
        What Keras' `fit` returns (the `History`).

    Raises:
        TypeError: arguments `keras.Model.fit` does not take.
    """
    arguments = bind_fit_arguments(model, args, kwargs)
    given = arguments.get("callbacks")
    user_list = given if isinstance(given, keras.callbacks.CallbackList) else None
    callbacks = with_internal_callbacks(
        model, user_list.callbacks if user_list is not None else given or []
    )
    auto = _glue.auto_state(model)
    if auto is not None and not _glue.tunable(model):
        auto = None
    if auto is not None:
        auto.executions = []
        auto.use_loop = None  # decided once, at this fit's first epoch (`_grouped`)
        auto.tuner.begin(warmup=False)  # the executions that trace are left out instead
        auto.execution_clock = _ExecutionClock(auto)
        callbacks.insert(0, auto.execution_clock)
    run = FitRun(model, callbacks, auto)
    if user_list is not None:
        # Keras runs a given CallbackList as it is (no History or progress bar added): a new
        # one over the same callbacks and params, so the user's list is left unchanged.
        callbacks = keras.callbacks.CallbackList(callbacks, model=model, **(user_list.params or {}))
    arguments["callbacks"] = callbacks
    previous = current_run(model)
    object.__setattr__(model, "_fastloop_fit_run", run)  # untracked runtime state
    try:
        return keras_fit(**arguments)
    finally:
        if previous is None:
            model.__dict__.pop("_fastloop_fit_run", None)
        else:
            object.__setattr__(model, "_fastloop_fit_run", previous)
        if run.iterator is not None:
            run.iterator.__dict__.pop("_enumerate_iterator", None)
        if auto is not None:
            auto.k, auto.use_loop = 1, False


class _ExecutionClock(keras.callbacks.Callback):
    """Marks the end of each execution for `"auto"`, before any other callback's
    `on_train_batch_end`: an execution that ends at a step event is timed to here, so that the
    event's work (a checkpoint, a validation) is not counted as the execution's time."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.execution_end = self.state.clock()


def maybe_symbolic_build(model, keras_maybe_symbolic_build, iterator=None, data_batch=None):
    """`_maybe_symbolic_build`: captures `fit`'s epoch iterator, then builds.

    Without a strategy the compiled metrics and loss are built here too, from the data's spec
    (and the optimizer before the train function's first call), so the step is traced once
    (`keras_fastloop._step.prebuild`).

    Args:
        model: the model.
        keras_maybe_symbolic_build: Keras' bound `super()._maybe_symbolic_build`.
        iterator: the `EpochIterator` Keras passes (`fit`'s first, then `evaluate`'s).
        data_batch: a batch, or `None`.
    """
    capture_epoch_iterator(model, iterator)
    fit_callbacks.maybe_symbolic_build(
        model, keras_maybe_symbolic_build, iterator=iterator, data_batch=data_batch
    )
    prebuild.build_before_first_trace(model, iterator=iterator, data_batch=data_batch)


def make_train_function(model, keras_make_train_function, force=False):
    """`make_train_function`: the variable-count train function under `"auto"`; the optimizer
    is built right before the first call (`keras_fastloop._step.prebuild`)."""
    _glue.make_train_function(model, keras_make_train_function, force)
    return prebuild.build_optimizer_before_first_call(model, model.train_function)


def capture_epoch_iterator(model, iterator):
    """Installs the epoch transforms on `fit`'s epoch iterator (the first one after `fit`).

    Args:
        model: the model.
        iterator: an `EpochIterator` or `None`.

    Raises:
        RuntimeError: Keras' `EpochIterator` lacks `_enumerate_iterator` (a Keras change).
    """
    run = current_run(model)
    if run is None or not run._pending_capture or iterator is None:
        return
    run._pending_capture = False
    if not hasattr(iterator, "_enumerate_iterator"):  # pragma: no cover - Keras changed
        raise RuntimeError(
            "keras_fastloop's fit loop relies on Keras' `EpochIterator._enumerate_iterator`, "
            f"which this Keras version lacks. Received: {type(iterator).__name__}"
        )
    run.iterator = iterator
    original = iterator._enumerate_iterator
    if run.auto is not None:
        _warn_if_calls_are_counted(run.callbacks)
        periods = events.event_periods(run.callbacks, _accumulation(model))
        if iterator.num_batches:
            periods.append(int(iterator.num_batches))
        run.auto.tuner.set_horizon(min(periods) if periods else None)

    def transformed():
        slots = original()
        if run.skip:  # a. resume skipping
            count, run.skip = run.skip, 0
            slots = _skip_first_batches(slots, count)
        if run.auto is not None:  # b. + c. grouping up to the next step event
            slots = _grouped(run, slots)
        return slots

    iterator._enumerate_iterator = transformed


def _warn_if_calls_are_counted(callbacks):
    """Says that `"auto"` keeps one step per execution for a callback that counts calls."""
    for callback in callbacks:
        if events.counts_calls(callback):
            warnings.warn(
                'steps_per_execution="auto" runs one step per execution in this fit: '
                f"{type(callback).__name__}(update_freq={callback.update_freq}) numbers its "
                "batch summaries by calls, so grouped steps would be written at the wrong "
                'steps. With update_freq="epoch" "auto" groups steps.',
                FastloopWarning,
                stacklevel=4,
            )
            return


def _skip_first_batches(slots, count):
    """Slots whose first batch index is `>= count`; earlier ones are read and dropped."""
    for begin, end, iterator in slots:
        if begin < count:
            for _ in range(end - begin + 1):
                try:
                    next(iterator)
                except (StopIteration, _OutOfRange):
                    break
            continue
        yield begin, end, iterator


def _accumulation(model):
    optimizer = getattr(model, "optimizer", None)
    value = getattr(optimizer, "gradient_accumulation_steps", None)
    return int(value) if isinstance(value, numbers.Integral) and value > 1 else 1


def _grouped(run, slots):
    """Joins Keras' one-batch slots into executions of `k` steps (`"auto"`).

    `k = tuner.propose(min(batches to the epoch end, batches to the next step event))`; on
    data of unknown length `k = 1` (no batch is read before Keras would read it). Each
    execution is timed from its slot to Keras' request for the next slot, so the callbacks'
    per-batch work, which grouping saves too, is part of it; one that ends at a step event is
    timed to its first `on_train_batch_end` instead (`_ExecutionClock`: the event's work, a
    checkpoint or a validation, is not the execution's), and one whose call traced a function
    is left out.
    """
    state, model, iterator = run.auto, run.model, run.iterator
    accumulation = _accumulation(model)
    read_step = events.reads_optimizer_step(run.callbacks)
    # Grouping needs the data's length and our variable-count train function (a train function
    # Keras built before, e.g. while `run_eagerly` was on, runs one step whatever `k` says)
    groupable = iterator.data_adapter.num_batches is not None and state.variable_steps
    tuner = state.tuner
    if state.use_loop is None:
        # One function compiles per fit: the loop (one step included) when this fit may group,
        # else Keras' one-step function (a cap of 1, or a count settled at 1 by an earlier fit).
        # Decided once: a count settling at 1 during this fit does not compile a second one.
        state.use_loop = (
            groupable and tuner.cap > 1 and not (tuner.phase == "settled" and tuner.steps == 1)
        )
    num_batches = iterator.num_batches
    for begin, end, data_iterator in slots:
        taken, last, gap = 1, end, None
        if groupable:
            limit = num_batches - begin if num_batches else None
            step = int(keras.ops.convert_to_numpy(model.optimizer.iterations)) if read_step else 0
            gap = events.batches_until_next_event(run.callbacks, step, begin, accumulation)
            if gap is not None:
                limit = gap if limit is None else min(limit, gap)
            k = tuner.propose(limit)
            while taken < k:
                try:
                    _, last, _ = next(slots)
                except StopIteration:
                    break
                taken += 1
        state.k = taken
        state.executions.append((begin, taken))
        state.execution_end = None
        state.traced = False
        start = state.clock()
        yield begin, last, data_iterator
        if groupable:  # Keras asks for the next slot: this execution's callbacks have run
            at_event = gap is not None and taken == gap
            _observe(state, taken, start, state.execution_end if at_event else state.clock())


def _observe(state, steps, start, end):
    """Feeds the tuner an execution of `steps` steps from `start` to `end` (clock readings) if
    it ran to its `on_train_batch_end` without tracing a function."""
    if state.execution_end is not None and not state.traced:
        state.tuner.observe(steps, end - start)


try:
    import tensorflow as _tf

    _OutOfRange = _tf.errors.OutOfRangeError
except ImportError:  # pragma: no cover - the package requires TensorFlow
    _OutOfRange = StopIteration
