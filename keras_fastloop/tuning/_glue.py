"""`steps_per_execution="auto"`: compile-time state and the variable-count train function.

Keras' multi-step `tf.function` has `steps_per_execution` baked in as a Python int; here the
step count is a tensor argument, so one trace serves every count (`docs/fit_loop.md`). The
grouping of batches into executions lives in `keras_fastloop._fit_loop`.
"""

from __future__ import annotations

import threading
import time

import keras
import tensorflow as tf

from keras_fastloop.tuning.tuner import (
    AUTO,
    AUTO_MAX_SECONDS_PER_STEP,
    StepsPerExecutionTuner,
    validate_steps_per_execution,
)


class _AutoState:
    """Per-model runtime state of `steps_per_execution="auto"` (not serialized)."""

    def __init__(self, tuner):
        self.tuner = tuner
        self.k = 1  # steps of the execution about to run; read by the train function
        self.clock = time.perf_counter
        self.execution_end = None  # clock() at the running execution's first on_train_batch_end
        self.traced = False  # whether the last train-function call traced a function
        self.execution_clock = None  # the fit loop's callback that sets it
        self.executions = []  # (begin_step, steps) of the current fit, for tests and reports
        self.multi_step = None  # the `_MultiStepCompile` of the current train function
        self.loop_wanted = False  # the tuner asks for more than one step: compile the loop
        self.compile_in_background = True  # False: compile when first needed (tests)


class _MultiStepCompile:
    """Compiles the multi-step train function in the background while `fit` trains on.

    The first call of a `tf.function` traces it (Python) and then instantiates its graph:
    grappler's optimizations and the executor's setup, in C++, without the GIL. The loop's
    first call does not trace the step again, yet took 0.46-0.59 s on the bench CNN (AMD EPYC
    with AVX512_BF16; about 0.28 s of it grappler's, `docs/performance.md`), all of it paid
    by the first execution of more than one step. Here the loop is traced on the main
    thread (tracing reads Keras' thread-local state) and then called once in a background
    thread with an *empty* iterator of the same element spec: the same concrete function is
    instantiated, no batch is read and no step runs. The train function starts this at its
    first call when the tuner wants more than one step (from the start: it probes at once),
    so the loop compiles on the core the one-step function's own first compile leaves idle.
    Meanwhile the fit loop runs one step per execution. Under a distribution strategy (a
    `DistributedIterator`) the loop is compiled by its first call, as without the warm-up.
    """

    def __init__(self, multi_step_function):
        self._function = multi_step_function
        self._started = False
        self._thread = None

    def start(self, iterator, background=True):
        """Starts the compile, once (tracing happens here, on the calling thread).

        Args:
            iterator: the data iterator of the train function's call.
            background: bool, compile in a background thread (else here, before returning).
                Defaults to `True`.
        """
        if self._started or not isinstance(iterator, tf.data.Iterator):
            return
        self._started = True
        self._thread = self._launch(iterator)
        if not background:
            self.join()

    def ready(self, iterator):
        """Whether an execution of more than one step can run without compiling first.

        Args:
            iterator: the data iterator the execution would read.

        Returns:
            bool: the compile ran to its end, or there is none to wait for (not a
            `tf.data.Iterator`).
        """
        if not isinstance(iterator, tf.data.Iterator):
            return True
        return self._started and (self._thread is None or not self._thread.is_alive())

    def _launch(self, iterator):
        """Traces the loop here and instantiates it in a new thread, which it returns (`None`:
        the spec allows no empty data set, the loop compiles at its first real call)."""
        steps = tf.constant(2, tf.int32)
        self._function.get_concrete_function(iterator, steps)  # trace on this thread
        try:
            empty = tf.data.Dataset.from_generator(
                lambda: iter(()), output_signature=iterator.element_spec
            )
        except (TypeError, ValueError):  # a spec from_generator cannot give: compile in line
            return None
        thread = threading.Thread(
            target=self._instantiate,
            args=(empty, steps),
            name="keras_fastloop-multi-step-compile",
            daemon=True,
        )
        thread.start()
        return thread

    def _instantiate(self, empty, steps):
        try:
            self._function(iter(empty), steps)
        except Exception:  # noqa: BLE001 - the function's first real call raises it again
            pass

    def join(self):
        """Waits for a running compile (at the end of `fit`)."""
        if self._thread is not None:
            self._thread.join()


def resolve_steps_per_execution(value, tuner=None):
    """Splits a `compile` argument into Keras' value and the auto state.

    Args:
        value: `"auto"` or a positive int (validated).
        tuner: optional `StepsPerExecutionTuner` to use for `"auto"`. Defaults to a new
            one with default arguments and `max_seconds_per_step=AUTO_MAX_SECONDS_PER_STEP`
            (0.05 s: a longer step never compiles the multi-step loop).

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
        return 1, _AutoState(tuner)
    return value, None


def auto_state(model):
    """The model's `_AutoState`, or `None` when it was not compiled with `"auto"`."""
    return getattr(model, "_fastloop_auto_spe", None)


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
    from keras_fastloop._step import distributed

    strategy = model.distribute_strategy
    return (
        not model.run_eagerly
        and not distributed.is_multi_worker(strategy)
        and strategy.num_replicas_in_sync == 1
    )


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
    traceable = [one_step_on_data]
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

    state.multi_step = _MultiStepCompile(multi_step_on_iterator)

    def function(iterator):
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            before = traces()
            try:
                if state.loop_wanted:
                    state.multi_step.start(iterator, state.compile_in_background)
                if state.k == 1:
                    return one_step_on_iterator(iterator)
                optional = multi_step_on_iterator(iterator, tf.constant(state.k, tf.int32))
                if not optional.has_value():
                    raise StopIteration
                return optional.get_value()
            finally:
                state.traced = traces() > before  # the tuner leaves such executions out
        outputs = None
        for _, data in zip(range(max(1, state.k)), iterator):  # train_on_batch & co.
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
    from keras_fastloop._step import distributed

    model.train_function = distributed.make_function(
        model, lambda step: _variable_steps_function(model, step, state), model.train_step
    )
    return model.train_function
