"""The one owner of `OptimizedModel.fit`: its arguments, its internal callbacks, its run.

`OptimizedModel.fit`, `_maybe_symbolic_build` and `make_train_function` delegate here; no
other module wraps `fit` or patches its epoch iterator. Per `fit` call this module

1. binds `fit`'s arguments once (`inspect.signature(keras.Model.fit).bind`);
2. builds the callback list from `INTERNAL_CALLBACKS`, the one declared, ordered list of the
   internal callbacks, around the user's;
3. runs Keras' `fit` inside a `FitRun` (`keras_fastloop._fit_run`), which owns the changes to
   the epochs (resume skipping, execution grouping, step events) and drives the
   `steps_per_execution="auto"` tuning. The design is in `docs/fit_loop.md`.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import NamedTuple

import keras

from keras_fastloop import _cluster_report as cluster_report
from keras_fastloop import _fit_callbacks as fit_callbacks
from keras_fastloop import _resume as resume
from keras_fastloop._fit_run import FitRun, current_run
from keras_fastloop._step import prebuild
from keras_fastloop.callbacks import ema
from keras_fastloop.tuning import _glue

__all__ = ["INTERNAL_CALLBACKS", "FitRun", "current_run", "fit"]

_FIT_SIGNATURE = inspect.signature(keras.Model.fit)

# Per model: the optimizer's EMA update rule when its train function was made.
_TRACED_EMA_RULE = weakref.WeakKeyDictionary()


class InternalCallback(NamedTuple):
    """One entry of `INTERNAL_CALLBACKS`.

    Attributes:
        place: `"before"` (ahead of the user's callbacks), `"after_each"` (right after each
            user callback it follows) or `"after"` (after all of them).
        factory: `"before"`/`"after"`: `model -> list of callbacks`; `"after_each"`:
            `(model, user_callback) -> list of callbacks`.
    """

    place: str
    factory: Callable


def _execution_clock(model):
    state = _glue.fit_state(model)
    return [] if state is None else [state.execution_clock]


def _loss_weighting(model):
    return list(model.fastloop_step.weighting.callbacks())


# The internal callbacks of a compiled model's `fit`, in the order they run: the "before"
# entries, then each user callback followed by its "after_each" entries, then the "after"
# entries. An entry's factory may return no callback.
INTERNAL_CALLBACKS = {
    # "auto": marks each execution's end before any other `on_train_batch_end` runs
    "execution_clock": InternalCallback("before", _execution_clock),
    # the weighting's (DWA closes its epoch window before a checkpoint saves its state)
    "loss_weighting": InternalCallback("before", _loss_weighting),
    # exact mid-epoch resume after each `BackupAndRestore(save_freq=N)`
    "exact_resume": InternalCallback("after_each", resume.after_backup),
    # the Graphs tab's model summary after each `TensorBoard(write_graph=True)`
    "tensorboard_model_summary": InternalCallback("after_each", fit_callbacks.after_tensorboard),
    # `micro_batch_size` larger than every batch, said once
    "micro_batch_size": InternalCallback("after", fit_callbacks.batch_size_monitor),
    # one line per worker under a multi-worker strategy
    "worker_line": InternalCallback("after", cluster_report.worker_line),
    # the `nonfinite` policy's warnings, stops and errors, after every other callback
    "non_finite": InternalCallback("after", fit_callbacks.non_finite_monitor),
}


def bind_fit_arguments(model, args, kwargs):
    """`fit`'s arguments as a dict by name (a `TypeError` for arguments `fit` lacks)."""
    arguments = dict(_FIT_SIGNATURE.bind(model, *args, **kwargs).arguments)
    arguments.pop(next(iter(_FIT_SIGNATURE.parameters)))  # self
    return arguments


def with_internal_callbacks(model, callbacks):
    """`callbacks` (a list) with the internal callbacks of `INTERNAL_CALLBACKS`, as a new list
    (the user's alone when the model is not compiled: Keras' `fit` says so)."""
    if model.fastloop_step is None:
        return list(callbacks)
    before, user, after = [], [], []
    for entry in INTERNAL_CALLBACKS.values():
        if entry.place == "before":
            before += entry.factory(model)
        elif entry.place == "after":
            after += entry.factory(model)
    followers = [e.factory for e in INTERNAL_CALLBACKS.values() if e.place == "after_each"]
    for callback in callbacks:
        user.append(callback)
        for follow in followers:
            user += follow(model, callback)
    return [*before, *user, *after]


def fit(model, keras_fit, args, kwargs):
    """Runs Keras' `fit` with the internal callbacks, inside a `FitRun`.

    Args:
        model: the `OptimizedModel`.
        keras_fit: the bound Keras `fit` (`super().fit`).
        args, kwargs: `fit`'s positional and keyword arguments.

    Returns:
        What Keras' `fit` returns (the `History`).

    Raises:
        TypeError: arguments `keras.Model.fit` does not take.
        ValueError: callbacks in an order that would lose state (`ema.check_callback_order`).
    """
    arguments = bind_fit_arguments(model, args, kwargs)
    given = arguments.get("callbacks")
    user_list = given if isinstance(given, keras.callbacks.CallbackList) else None
    user_callbacks = list(user_list.callbacks if user_list is not None else given or [])
    ema.check_callback_order(user_callbacks)
    callbacks = with_internal_callbacks(model, user_callbacks)
    run = FitRun(model, callbacks, _glue.fit_state(model))
    if user_list is not None:
        # Keras runs a given CallbackList as it is (no History or progress bar added): a new
        # one over the same callbacks and params, so the user's list is left unchanged.
        callbacks = keras.callbacks.CallbackList(callbacks, model=model, **(user_list.params or {}))
    arguments["callbacks"] = callbacks
    if not any(isinstance(c, keras.callbacks.BackupAndRestore) for c in run.callbacks):
        # Skips are said at epoch ends: those of a fit that an exception ended mid-epoch are
        # said now, not as this fit's. A BackupAndRestore continues that epoch, its step
        # state included, and says them at its end.
        fit_callbacks.report_skips(
            model, "an earlier fit that ended before its epoch end, or steps outside fit"
        )
    with run:
        return keras_fit(**arguments)


def maybe_symbolic_build(model, keras_maybe_symbolic_build, iterator=None, data_batch=None):
    """`_maybe_symbolic_build`: the running `fit` captures its epoch iterator, then builds.

    Without a strategy the compiled metrics and loss are built here too, from the data's spec
    (and the optimizer before the train function's first call), so the step is traced once
    (`keras_fastloop._step.prebuild`).

    Args:
        model: the model.
        keras_maybe_symbolic_build: Keras' bound `super()._maybe_symbolic_build`.
        iterator: the `EpochIterator` Keras passes (`fit`'s first, then `evaluate`'s).
        data_batch: a batch, or `None`.
    """
    run = current_run(model)
    if run is not None:
        run.capture(iterator)
    fit_callbacks.maybe_symbolic_build(
        model, keras_maybe_symbolic_build, iterator=iterator, data_batch=data_batch
    )
    prebuild.build_before_first_trace(model, iterator=iterator, data_batch=data_batch)


def make_train_function(model, keras_make_train_function, force=False):
    """`make_train_function`: the variable-count train function under `"auto"`; the optimizer
    is built right before the first call (`keras_fastloop._step.prebuild`). A function traced
    before `use_ema_warmup` changed the optimizer's EMA rule is traced again."""
    rule = ema.ema_rule(getattr(model, "optimizer", None))
    if model.train_function is not None and _TRACED_EMA_RULE.get(model) is not rule:
        force = True
    _TRACED_EMA_RULE[model] = rule
    _glue.make_train_function(model, keras_make_train_function, force)
    return prebuild.build_optimizer_before_first_call(model, model.train_function)
