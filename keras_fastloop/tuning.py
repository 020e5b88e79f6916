"""Automatic ``steps_per_execution`` and the one-line recommended setup.

``OptimizedModel.compile(steps_per_execution="auto")`` tunes how many training steps run inside
one compiled execution while ``fit`` runs. Keras 2 had this (``StepsPerExecutionTuner``); Keras 3
dropped it. Three parts live here:

1. :class:`StepsPerExecutionTuner`, a pure state machine fed with ``(steps, seconds)``
   measurements of finished executions. It knows no clock and no model, so tests drive it with
   made-up numbers.
2. The glue into ``fit`` (:func:`fit`, :func:`capture_epoch_iterator`,
   :func:`make_train_function`), called from three one-line hooks in ``OptimizedModel``.
3. :func:`recommended_setup`: precision chosen for the hardware (confirmed by timing when the
   user gives a model function), ``steps_per_execution="auto"`` and a tf.data pipeline helper.

**What Keras 3.15 allows, and the design that follows.** ``TensorFlowTrainer._make_function``
reads ``self.steps_per_execution`` as a Python int while it traces the multi-step
``tf.function`` (``tf.less(execution_step, self.steps_per_execution)``), so a traced train
function has the value baked in; changing the attribute later changes nothing until the function
is rebuilt and retraced. ``EpochIterator`` takes ``steps_per_execution`` once, when ``fit``
creates it, and each epoch iterates ``range(0, steps_per_epoch, steps_per_execution)``; ``fit``
passes each yielded ``(begin_step, end_step)`` to the batch callbacks. With stock Keras the value
can therefore only change between ``fit`` calls. Here, instead:

- Keras is compiled with ``steps_per_execution=1``, so its epoch iterator yields one slot per
  batch, with the batch's exact index.
- The train function is our own multi-step ``tf.function`` whose step count is a *tensor
  argument* (Keras' loop, with the Python int replaced): one trace serves every count, and the
  count may differ from one execution to the next.
- The epoch iterator that ``fit`` created is handed to :func:`capture_epoch_iterator` (through
  ``OptimizedModel._maybe_symbolic_build``, which ``fit`` calls with it first thing). Its
  ``_enumerate_iterator`` is wrapped on that instance only: each execution takes ``k`` of
  Keras' one-batch slots and yields ``(first begin_step, last end_step, iterator)``, so Keras'
  own step accounting (``_steps_seen``, epoch ends, ``steps_per_epoch``) stays in charge and
  the callbacks see exact batch indices.

**The rule** (also in :class:`StepsPerExecutionTuner`). Each execution runs
``k = min(candidate, max_steps, batches to the epoch end, batches to the next step-gated
event)``. A step-gated event is an optimizer step at which a callback must act:
``PeriodicValidation(every_n_steps=n)`` and ``ThroughputMonitor(log_every_n_steps=n)``
(attributes ``every_n_steps`` / ``log_every_n_steps``: multiples of ``n``) or any callback
with a method ``steps_until_next_event(step) -> int | None``. Steps are
``optimizer.iterations``; with the optimizer's ``gradient_accumulation_steps=a`` one step is
``a`` batches. Executions therefore end exactly at every event and at every epoch end, and the
progress bar advances at least every ``k`` batches (the tuner does not grow ``k`` once one
execution takes ``max_seconds_per_execution`` or more).

Not tuned (``k`` stays 1, as Keras' default): ``run_eagerly=True``, and
``MultiWorkerMirroredStrategy`` (workers timing differently could choose different counts).
``evaluate``/``predict`` use Keras' ``steps_per_execution=1``.

Keras internals used here (checked by ``tests/test_tuning.py``): ``EpochIterator.
_enumerate_iterator`` (wrapped per instance), ``TensorFlowTrainer._autoconvert_optionals``,
``keras.src.backend.tensorflow.trainer.reduce_per_replica``.

Reference: Keras 2.13 ``keras/utils/steps_per_execution_tuning.py`` (the runtime tuner Keras 3
dropped); TensorFlow's ``tf.data`` performance guide for the pipeline part.
"""

from __future__ import annotations

import dataclasses
import numbers
import statistics
import time
from collections.abc import Callable

import keras
import tensorflow as tf

__all__ = [
    "StepsPerExecutionTuner",
    "RecommendedSetup",
    "recommended_setup",
    "optimize_pipeline",
    "validate_steps_per_execution",
    "steps_until_next_event",
]

AUTO = "auto"
_STEP_PERIOD_ATTRIBUTES = ("every_n_steps", "log_every_n_steps")


def validate_steps_per_execution(value):
    """Checks a ``steps_per_execution`` argument.

    Args:
        value: ``"auto"`` or a positive int.

    Returns:
        The value, unchanged (a Python int or ``"auto"``).

    Raises:
        ValueError: if it is neither ``"auto"`` nor a positive int.

    Example:
        >>> validate_steps_per_execution("auto")
        'auto'
    """
    if value == AUTO and isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1:
        return int(value)
    raise ValueError(
        '`steps_per_execution` must be "auto" or a positive integer. '
        f"Received: steps_per_execution={value!r}"
    )


# --------------------------------------------------------------------------------------------
# The state machine
# --------------------------------------------------------------------------------------------


class StepsPerExecutionTuner:
    """Chooses the number of steps per execution from measured step throughput.

    A pure state machine: :meth:`propose` says how many steps the next execution should run,
    :meth:`observe` receives how many steps the finished execution ran and how long it took.

    The first ``warmup_executions`` observations after :meth:`begin` (each ``fit``) are dropped:
    they include tracing. Phases:

    - ``"probing"``: the candidate starts at ``initial`` and is measured over ``window``
      executions of exactly ``candidate`` steps (median of steps/second). If it beats the best
      rate so far by more than ``min_gain`` (a fraction) it becomes the best and the candidate
      grows by ``growth_factor``; after ``patience`` candidates in a row that do not pay, or
      when the next candidate would pass the cap (``max_steps`` and the horizon set with
      :meth:`set_horizon`) or one execution already takes ``max_seconds_per_execution``, it
      settles on the best. Observations of other step counts (executions cut short by an event
      or an epoch end) are not measurements of the candidate; after ``4 * window`` of them in a
      row it settles on the best so far.
    - ``"settled"``: it keeps measuring the chosen count in windows; when ``drift_windows``
      windows in a row differ from the rate it settled with by more than ``drift_tolerance``
      (a fraction), it probes again from ``chosen // growth_factor`` (at least ``initial``).

    Args:
        initial: int >= 1, the first candidate. Defaults to ``1``.
        max_steps: int >= initial, the largest count ever proposed. Defaults to ``64``.
        growth_factor: int >= 2, candidate multiplier. Defaults to ``2``.
        min_gain: float >= 0, relative throughput gain a larger count must bring.
            Defaults to ``0.05``.
        window: int >= 1, executions per measurement. Defaults to ``3``.
        warmup_executions: int >= 0, observations dropped after :meth:`begin`. Defaults to
            ``1``.
        patience: int >= 1, non-paying candidates in a row before settling. Defaults to ``2``
            (one noisy window on a shared machine does not end the search).
        drift_tolerance: float > 0, relative change of the settled rate that counts as drift.
            Defaults to ``0.3``.
        drift_windows: int >= 1, drifting windows in a row that trigger re-tuning. Defaults to
            ``2``.
        max_seconds_per_execution: float > 0, no growth once an execution takes this long
            (keeps progress and interrupts responsive). Defaults to ``1.0``.

    Raises:
        ValueError: an argument out of range.

    Example:
        >>> tuner = StepsPerExecutionTuner(warmup_executions=0, window=1)
        >>> tuner.propose()
        1
        >>> tuner.observe(1, 0.010)           # 100 steps/s at k=1
        >>> tuner.propose()
        2
        >>> tuner.observe(2, 0.010)           # 200 steps/s at k=2: pays, grow
        >>> tuner.propose()
        4

    Reference: Keras 2.13 ``StepsPerExecutionTuner`` (grow while the rate improves).
    """

    def __init__(
        self,
        initial=1,
        max_steps=64,
        growth_factor=2,
        min_gain=0.05,
        window=3,
        warmup_executions=1,
        patience=2,
        drift_tolerance=0.3,
        drift_windows=2,
        max_seconds_per_execution=1.0,
    ):
        def need(ok, name, value, what):
            if not ok:
                raise ValueError(f"`{name}` must be {what}. Received: {name}={value!r}")

        def is_int(v, low):
            return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= low

        need(is_int(initial, 1), "initial", initial, "an int >= 1")
        need(
            is_int(max_steps, 1) and max_steps >= initial,
            "max_steps",
            max_steps,
            f"an int >= initial ({initial})",
        )
        need(is_int(growth_factor, 2), "growth_factor", growth_factor, "an int >= 2")
        need(
            isinstance(min_gain, numbers.Real) and min_gain >= 0,
            "min_gain",
            min_gain,
            "a number >= 0",
        )
        need(is_int(window, 1), "window", window, "an int >= 1")
        need(is_int(warmup_executions, 0), "warmup_executions", warmup_executions, "an int >= 0")
        need(is_int(patience, 1), "patience", patience, "an int >= 1")
        need(
            isinstance(drift_tolerance, numbers.Real) and drift_tolerance > 0,
            "drift_tolerance",
            drift_tolerance,
            "a number > 0",
        )
        need(is_int(drift_windows, 1), "drift_windows", drift_windows, "an int >= 1")
        need(
            isinstance(max_seconds_per_execution, numbers.Real) and max_seconds_per_execution > 0,
            "max_seconds_per_execution",
            max_seconds_per_execution,
            "a number > 0",
        )
        self.initial = int(initial)
        self.max_steps = int(max_steps)
        self.growth_factor = int(growth_factor)
        self.min_gain = float(min_gain)
        self.window = int(window)
        self.warmup_executions = int(warmup_executions)
        self.patience = int(patience)
        self.drift_tolerance = float(drift_tolerance)
        self.drift_windows = int(drift_windows)
        self.max_seconds_per_execution = float(max_seconds_per_execution)
        self.horizon = None
        self.phase = "probing"
        self.candidate = self.initial
        self.best_steps = self.initial
        self.best_rate = None
        self.reference_rate = None
        self.history = []  # (phase, steps, median steps/s) per finished window; "retune"/"settle"
        self._warmup_left = self.warmup_executions
        self._rates = []
        self._seconds = []
        self._misses = 0
        self._off_size = 0
        self._drifts = 0
        self.begin()

    # -- inputs ----------------------------------------------------------------------------

    def begin(self):
        """Starts a new ``fit``: the next ``warmup_executions`` observations are dropped.

        Whatever was learned (the settled count) is kept.
        """
        self._warmup_left = self.warmup_executions
        self._rates, self._seconds = [], []
        self._off_size = 0

    def set_horizon(self, horizon):
        """Caps every proposal at ``horizon`` steps (e.g. the period of a step-gated callback).

        Args:
            horizon: int >= 1 or ``None`` (no cap besides ``max_steps``).
        """
        self.horizon = None if horizon is None else max(1, int(horizon))
        cap = self.cap
        if self.candidate > cap:
            self.candidate = cap
        if self.best_steps > cap:
            self.best_steps = cap

    @property
    def cap(self):
        """The largest count the tuner may propose: ``max_steps`` and the horizon."""
        return self.max_steps if self.horizon is None else min(self.max_steps, self.horizon)

    @property
    def steps(self):
        """The count the tuner wants now (the candidate while probing, the choice when settled)."""
        return self.candidate

    def propose(self, limit=None):
        """The number of steps the next execution should run.

        Args:
            limit: int >= 1 or ``None``: steps left before the next event or epoch end.

        Returns:
            ``min(current count, cap, limit)``, at least 1.
        """
        k = min(self.candidate, self.cap)
        if limit is not None:
            k = min(k, int(limit))
        return max(1, k)

    def observe(self, steps, seconds):
        """Feeds the measurement of one finished execution.

        Args:
            steps: int, steps the execution ran.
            seconds: float, its wall time (training plus the per-execution overhead: callbacks,
                dispatch).
        """
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return
        if steps != self.candidate or not seconds > 0:
            self._off_size += 1
            if self.phase == "probing" and self._off_size >= 4 * self.window:
                self._settle(reason="candidate cannot run in full")
            return
        self._off_size = 0
        self._rates.append(steps / seconds)
        self._seconds.append(seconds)
        if len(self._rates) < self.window:
            return
        rate = statistics.median(self._rates)
        seconds_per_execution = statistics.median(self._seconds)
        self._rates, self._seconds = [], []
        self.history.append((self.phase, steps, rate))
        if self.phase == "probing":
            self._probe_decision(rate, seconds_per_execution)
        else:
            self._drift_check(rate)

    # -- decisions --------------------------------------------------------------------------

    def _probe_decision(self, rate, seconds_per_execution):
        if self.best_rate is None or rate > self.best_rate * (1.0 + self.min_gain):
            self.best_steps, self.best_rate = self.candidate, rate
            self._misses = 0
        else:
            self._misses += 1
            if self._misses >= self.patience:
                self._settle(reason="no gain")
                return
        grown = min(self.candidate * self.growth_factor, self.cap)
        if grown <= self.candidate or seconds_per_execution >= self.max_seconds_per_execution:
            self._settle(reason="bound")
            return
        self.candidate = grown

    def _settle(self, reason):
        self.phase = "settled"
        self.candidate = min(self.best_steps, self.cap)
        self.reference_rate = self.best_rate
        self._drifts = 0
        self._misses = 0
        self._off_size = 0
        self.history.append(("settle", self.candidate, reason))

    def _drift_check(self, rate):
        if self.reference_rate is None:
            self.reference_rate = rate
            return
        if abs(rate / self.reference_rate - 1.0) > self.drift_tolerance:
            self._drifts += 1
        else:
            self._drifts = 0
        if self._drifts >= self.drift_windows:
            self.history.append(("retune", self.candidate, rate))
            self.phase = "probing"
            self.candidate = max(self.initial, self.candidate // self.growth_factor)
            self.best_steps, self.best_rate = self.candidate, None
            self._drifts = 0
            self._misses = 0

    def get_config(self):
        """The constructor arguments, as a dict."""
        return {
            "initial": self.initial,
            "max_steps": self.max_steps,
            "growth_factor": self.growth_factor,
            "min_gain": self.min_gain,
            "window": self.window,
            "warmup_executions": self.warmup_executions,
            "patience": self.patience,
            "drift_tolerance": self.drift_tolerance,
            "drift_windows": self.drift_windows,
            "max_seconds_per_execution": self.max_seconds_per_execution,
        }


# --------------------------------------------------------------------------------------------
# Step-gated callbacks
# --------------------------------------------------------------------------------------------


def steps_until_next_event(callbacks, step):
    """Optimizer steps from ``step`` until the next step a callback must act on.

    A callback is step-gated when it has a method ``steps_until_next_event(step)`` (returning an
    int >= 1 or ``None``) or a positive int attribute ``every_n_steps`` /
    ``log_every_n_steps`` (events at the multiples; ``PeriodicValidation``,
    ``ThroughputMonitor``). Nested ``callbacks`` lists are not searched: those of
    ``PeriodicValidation`` act at its validations.

    Args:
        callbacks: iterable of ``keras.callbacks.Callback``.
        step: int, the optimizer step now (``optimizer.iterations``).

    Returns:
        The smallest number of steps to an event (>= 1), or ``None`` when no callback is
        step-gated.

    Example:
        >>> class Every(keras.callbacks.Callback):
        ...     every_n_steps = 10
        >>> steps_until_next_event([Every()], 23)
        7
    """
    gaps = []
    for callback in callbacks:
        method = getattr(callback, "steps_until_next_event", None)
        if callable(method):
            gap = method(step)
            if gap is not None:
                gaps.append(max(1, int(gap)))
            continue
        for name in _STEP_PERIOD_ATTRIBUTES:
            period = getattr(callback, name, None)
            if isinstance(period, numbers.Integral) and not isinstance(period, bool) and period > 0:
                gaps.append(period - step % period)
    return min(gaps) if gaps else None


def _step_periods(callbacks):
    periods = []
    for callback in callbacks:
        for name in _STEP_PERIOD_ATTRIBUTES:
            period = getattr(callback, name, None)
            if isinstance(period, numbers.Integral) and not isinstance(period, bool) and period > 0:
                periods.append(int(period))
    return periods


def _flatten_callbacks(callbacks):
    if callbacks is None:
        return []
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return list(callbacks.callbacks)
    return list(callbacks)


# --------------------------------------------------------------------------------------------
# Glue into fit
# --------------------------------------------------------------------------------------------


class _AutoState:
    """Per-model runtime state of ``steps_per_execution="auto"`` (not serialized)."""

    def __init__(self, tuner):
        self.tuner = tuner
        self.k = 1  # steps of the execution about to run; read by the train function
        self.callbacks = []
        self.pending_capture = False
        self.clock = time.perf_counter
        self.executions = []  # (begin_step, steps) of the current fit, for tests and reports


def resolve_steps_per_execution(value, tuner=None):
    """Splits a ``compile`` argument into Keras' value and the auto state.

    Args:
        value: ``"auto"`` or a positive int (validated).
        tuner: optional ``StepsPerExecutionTuner`` to use for ``"auto"``. Defaults to a new
            one with default arguments.

    Returns:
        ``(keras_steps_per_execution, state)``: ``(1, state)`` for ``"auto"``, ``(value, None)``
        otherwise.

    Raises:
        ValueError: as :func:`validate_steps_per_execution`.
    """
    value = validate_steps_per_execution(value)
    if value == AUTO:
        return 1, _AutoState(tuner or StepsPerExecutionTuner())
    return value, None


def _auto_state(model):
    return getattr(model, "_fastloop_auto_spe", None)


def _tunable(model):
    from keras_fastloop import distributed

    return not model.run_eagerly and not distributed.is_multi_worker(model.distribute_strategy)


def fit(model, keras_fit, *args, **kwargs):
    """``keras.Model.fit`` with ``steps_per_execution="auto"`` in effect (glue).

    Args:
        model: the ``OptimizedModel``.
        keras_fit: the bound Keras ``fit`` to call.
        *args, **kwargs: ``fit``'s arguments.

    Returns:
        What ``keras_fit`` returns (the ``History``).
    """
    state = _auto_state(model)
    if state is None or not _tunable(model):
        return keras_fit(*args, **kwargs)
    callbacks = args[5] if len(args) > 5 else kwargs.get("callbacks")
    state.callbacks = _flatten_callbacks(callbacks)
    state.pending_capture = True
    state.executions = []
    state.tuner.begin()
    try:
        return keras_fit(*args, **kwargs)
    finally:
        state.pending_capture = False
        state.k = 1


def capture_epoch_iterator(model, iterator):
    """Groups the batches of the epoch iterator that ``fit`` just created (glue).

    Called from ``OptimizedModel._maybe_symbolic_build``; acts once per ``fit`` of a model
    compiled with ``steps_per_execution="auto"``, on the first iterator it receives (``fit``'s;
    ``evaluate`` creates its own later).

    Args:
        model: the model.
        iterator: the ``EpochIterator`` passed to ``_maybe_symbolic_build`` (or ``None``).
    """
    state = _auto_state(model)
    if state is None or not state.pending_capture or iterator is None:
        return
    state.pending_capture = False
    if not hasattr(iterator, "_enumerate_iterator"):  # pragma: no cover - Keras changed
        raise RuntimeError(
            "keras_fastloop's steps_per_execution='auto' relies on Keras' "
            "`EpochIterator._enumerate_iterator`, which this Keras version lacks. "
            f"Received: {type(iterator).__name__}. Use an int steps_per_execution."
        )
    optimizer = model.optimizer
    accumulation = int(getattr(optimizer, "gradient_accumulation_steps", None) or 1)
    horizons = [p * accumulation for p in _step_periods(state.callbacks)]
    if iterator.num_batches:
        horizons.append(int(iterator.num_batches))
    state.tuner.set_horizon(min(horizons) if horizons else None)
    original = iterator._enumerate_iterator

    def grouped():
        slots = original()
        num_batches = iterator.num_batches
        pending = None  # (steps, start time, tainted by an event)
        for begin, end, data_iterator in slots:
            now = state.clock()
            if pending is not None and not pending[2]:
                state.tuner.observe(pending[0], now - pending[1])
            limit = None
            if num_batches:
                limit = num_batches - begin
            gap = None
            if state.callbacks:
                step = int(keras.ops.convert_to_numpy(optimizer.iterations))
                gap = steps_until_next_event(state.callbacks, step)
                if gap is not None:
                    gap *= accumulation
                    limit = gap if limit is None else min(limit, gap)
            k = state.tuner.propose(limit)
            last = end
            taken = 1
            while taken < k:
                try:
                    _, last, _ = next(slots)
                except StopIteration:
                    break
                taken += 1
            state.k = taken
            state.executions.append((begin, taken))
            pending = (taken, state.clock(), gap is not None and taken >= gap)
            yield begin, last, data_iterator

    iterator._enumerate_iterator = grouped


def _variable_steps_function(model, step_function, state):
    """Keras' multi-step loop with the step count as a tensor argument (one trace for all)."""
    from keras_fastloop._keras_internals import reduce_per_replica

    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = strategy.run(step_function, args=(data,))
        return reduce_per_replica(outputs, strategy, reduction="auto")

    one_step_on_data = tf.function(
        one_step_on_data, reduce_retracing=True, jit_compile=model.jit_compile
    )
    one_step_on_data = model._autoconvert_optionals(one_step_on_data)

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
                empty_outputs._element_spec = outputs.element_spec
                return outputs

            def no_has_next():
                optional_outputs._element_spec = empty_outputs._element_spec
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
        final._element_spec = empty_outputs.element_spec
        return final

    multi_step_on_iterator = tf.function(multi_step_on_iterator, reduce_retracing=True)

    def function(iterator):
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            optional = multi_step_on_iterator(iterator, tf.constant(state.k, tf.int32))
            if not optional.has_value():
                raise StopIteration
            return optional.get_value()
        outputs = None
        for _, data in zip(range(max(1, state.k)), iterator):  # train_on_batch & co.
            outputs = one_step_on_data(data)
        return outputs

    return function


def make_train_function(model, keras_make_train_function, force=False):
    """``make_train_function`` that builds the variable-count train function under "auto" (glue).

    Args:
        model: the model.
        keras_make_train_function: the bound Keras ``make_train_function``.
        force: bool, rebuild even if one exists. Defaults to ``False``.

    Returns:
        The train function (``model.train_function``).
    """
    state = _auto_state(model)
    if state is None or not _tunable(model):
        return keras_make_train_function(force=force)
    if model.train_function is not None and not force:
        return model.train_function
    from keras_fastloop import distributed

    model.train_function = distributed.make_function(
        model, lambda step: _variable_steps_function(model, step, state), model.train_step
    )
    return model.train_function


# --------------------------------------------------------------------------------------------
# Recommended setup
# --------------------------------------------------------------------------------------------


def optimize_pipeline(dataset, cache=False):
    """A tf.data pipeline that overlaps input work with training.

    Turns on tf.data's autotuning and parallel/fused map optimizations, optionally caches the
    (already batched) elements in memory, and ends with ``prefetch(tf.data.AUTOTUNE)``. The
    element order is unchanged (``deterministic`` stays on).

    Args:
        dataset: a ``tf.data.Dataset`` of batches.
        cache: bool, cache the elements in memory after the first pass (only for data sets that
            fit in memory and whose elements do not change between epochs; shuffling before
            batching would be frozen). Defaults to ``False``.

    Returns:
        The ``tf.data.Dataset`` to pass to ``fit``.

    Raises:
        TypeError: if ``dataset`` is not a ``tf.data.Dataset``.

    Example:
        >>> ds = tf.data.Dataset.range(8).batch(4)
        >>> [b.numpy().tolist() for b in optimize_pipeline(ds)]
        [[0, 1, 2, 3], [4, 5, 6, 7]]

    Reference: TensorFlow guide "Better performance with the tf.data API".
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"`dataset` must be a tf.data.Dataset. Received: dataset={type(dataset).__name__}"
        )
    options = tf.data.Options()
    options.autotune.enabled = True
    options.experimental_optimization.map_parallelization = True
    options.experimental_optimization.parallel_batch = True
    dataset = dataset.with_options(options)
    if cache:
        dataset = dataset.cache()
    return dataset.prefetch(tf.data.AUTOTUNE)


@dataclasses.dataclass
class RecommendedSetup:
    """What :func:`recommended_setup` chose; spread ``compile_kwargs`` into ``compile``.

    Args:
        policy: string, the global dtype policy now set.
        policy_choice: the ``keras_fastloop.mixed_precision.PolicyChoice`` behind it.
        steps_per_execution: ``"auto"`` (the compile argument). Defaults to ``"auto"``.
    """

    policy: str
    policy_choice: object
    steps_per_execution: object = AUTO

    @property
    def compile_kwargs(self):
        """Keyword arguments for ``OptimizedModel.compile``: ``{"steps_per_execution": ...}``."""
        return {"steps_per_execution": self.steps_per_execution}

    def pipeline(self, dataset, cache=False):
        """The dataset through :func:`optimize_pipeline`."""
        return optimize_pipeline(dataset, cache=cache)


def recommended_setup(
    model_fn: Callable[[], keras.Model] | None = None,
    data=None,
    *,
    min_speedup: float = 1.05,
    steps: int = 5,
    hardware=None,
    timer: Callable[[], float] = time.perf_counter,
) -> RecommendedSetup:
    """Turns on the recommended fast setup for the next models: one line, before building them.

    1. Precision: sets the global dtype policy chosen for the hardware by
       ``keras_fastloop.mixed_precision`` (``mixed_bfloat16`` on GPUs of compute capability
       >= 8.0 and CPUs with AVX512_BF16/AMX, ``mixed_float16`` on 7.x GPUs, else float32). With
       ``model_fn`` and ``data`` the choice is timed against float32 on the user's model and the
       mixed policy is kept only if it is faster by more than ``min_speedup``; otherwise float32
       stays (never slower than plain precision, by measurement). Without them the hardware
       rule alone decides.
    2. ``steps_per_execution="auto"`` for ``compile`` (see this module's docstring): it starts
       at 1 (Keras' default) and grows only while measured throughput improves, so it falls back
       to 1 when larger counts do not pay.
    3. :meth:`RecommendedSetup.pipeline`: prefetch/autotune for a tf.data input.

    Call it before building the model (layers take the policy when they are created). The
    model's output layers that feed losses should be float32 (``dtype="float32"`` or
    ``keras_fastloop.mixed_precision.Float32Output``); ``check_output_dtypes`` names offenders.

    Args:
        model_fn: callable with no arguments returning a compiled model, or ``None``. Defaults
            to ``None``.
        data: one batch ``(x, y)`` or a dataset, used with ``model_fn``. Defaults to ``None``.
        min_speedup: float > 0, required speed-up of the mixed policy. Defaults to ``1.05``.
        steps: int >= 1, timed steps per candidate policy. Defaults to ``5``.
        hardware: ``mixed_precision.HardwareInfo`` or ``None`` (this machine). Defaults to
            ``None``.
        timer: callable returning seconds. Defaults to ``time.perf_counter``.

    Returns:
        A :class:`RecommendedSetup`.

    Raises:
        ValueError: ``model_fn`` given without ``data`` (or the reverse), or as
            ``mixed_precision.set_recommended_policy``.

    Example:
        >>> setup = recommended_setup()          # before building the model
        >>> model = OptimizedModel(inputs, outputs)             # doctest: +SKIP
        >>> model.compile("adam", "mse", **setup.compile_kwargs)  # doctest: +SKIP
        >>> model.fit(setup.pipeline(train_ds), epochs=3)        # doctest: +SKIP
    """
    from keras_fastloop import mixed_precision

    if (model_fn is None) != (data is None):
        raise ValueError(
            "`model_fn` and `data` go together (the policy is timed on the model with one "
            f"batch). Received: model_fn={model_fn!r}, data={'None' if data is None else 'given'}"
        )
    choice = mixed_precision.set_recommended_policy(
        model_fn,
        data,
        confirm=model_fn is not None,
        steps=steps,
        min_speedup=min_speedup,
        hardware=hardware,
        timer=timer,
    )
    return RecommendedSetup(policy=choice.policy, policy_choice=choice)
