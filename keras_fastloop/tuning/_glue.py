"""`steps_per_execution="auto"`: compile-time state and the variable-count train function.

Keras' multi-step `tf.function` has `steps_per_execution` baked in as a Python int; here the
step count is a tensor argument, so one trace serves every count (`docs/fit_loop.md`). The
grouping of batches into executions lives in `keras_fastloop._fit_loop`.
"""

from __future__ import annotations

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
        self.variable_steps = False  # the train function is the variable-count one (glue)
        # this fit groups steps: every execution, one step included, runs the loop function,
        # so it is the only function compiled (decided by the fit loop once per fit; `None`
        # until then: one-step executions run Keras' one-step function)
        self.use_loop = False


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
    from keras_fastloop._step import multi_worker

    strategy = model.distribute_strategy
    return (
        not model.run_eagerly
        and not multi_worker.is_multi_worker(strategy)
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

    state.variable_steps = True

    def function(iterator):
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            before = traces()
            try:
                if state.k == 1 and not state.use_loop:
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
    from keras_fastloop._step import multi_worker

    model.train_function = multi_worker.make_function(
        model, lambda step: _variable_steps_function(model, step, state), model.train_step
    )
    return model.train_function
