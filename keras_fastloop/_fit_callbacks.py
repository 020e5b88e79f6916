"""The fit side's internal callbacks and eager reports (Python, outside the trace).

- `NonFiniteMonitor` and `report_skips`: the `nonfinite` policy's warnings, stops and
  `NonFiniteError` (the traced decision is `keras_fastloop._step.guards`).
- `BatchSizeMonitor`: `micro_batch_size` larger than every batch, said once.
- `TensorBoardModelSummary`: the Graphs tab's model summary for our functional and Sequential
  models (Keras' `TensorBoard` writes it only for the class names `Functional`/`Sequential`).
- `maybe_symbolic_build`: Keras' build under `MultiWorkerMirroredStrategy`, from the first
  local batch (keras-team/keras#20585).
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

from keras_fastloop import _keras_internals as internals
from keras_fastloop._step import guards, micro_batching, multi_worker
from keras_fastloop._warnings import FastloopWarning


class NonFiniteError(FloatingPointError, RuntimeError):
    """Raised by `fit`/`train_on_batch` under `compile(nonfinite="raise")`.

    The message names the optimizer step and the first variable whose gradient is not finite;
    that step's update was not applied. A `RuntimeError`, as what Keras'
    `TerminateOnNaN(raise_error=True)` raises, so handlers written for it catch this too.
    """


def clear_report(state):
    """Reset the skip report's counters (eagerly, from Python)."""
    for name, _, value in guards.REPORT_VARIABLES:
        getattr(state, name).assign(value)


def report_skips(model, when):
    """Warn about the steps skipped since the last report, then reset the report.

    Called at the end of every epoch of `fit` and after every `train_on_batch`.

    Args:
        model: the compiled `OptimizedModel`.
        when: where the steps were skipped, for the message (`"epoch 3"`).

    Returns:
        `(skipped, overflows)`: the steps skipped for non-finite values and the loss-scale
        overflows since the last report (`(0, 0)`: no warning).

    Warns:
        FastloopWarning: when a step was skipped. A non-finite skip names the count, the
            first skipped optimizer step and the first variable with a non-finite gradient.
            Loss-scale overflows (a `LossScaleOptimizer` halving its scale, expected under
            dynamic loss scaling) are counted apart; an epoch with overflows only gets a
            message that starts with `"Loss-scale overflows"` and says they are expected.
    """
    step = model.__dict__.get("_fastloop_step")
    if step is None:
        return 0, 0
    state = step.state
    skipped = int(state.unreported_skipped_steps.numpy())
    overflows = int(state.unreported_overflows.numpy())
    if not skipped and not overflows:
        return 0, 0
    step = int(state.first_skipped_step.numpy())
    index = int(state.first_skipped_variable.numpy())
    clear_report(state)
    total = int(state.skipped_steps.numpy())
    overflow_text = (
        f"{overflows} loss-scale overflow{'s' if overflows != 1 else ''} (steps skipped by the "
        "LossScaleOptimizer's dynamic scaling, which halves the scale: expected under mixed "
        "precision, not a fault)"
    )
    if not skipped:
        message = (
            f"Loss-scale overflows only in {when}: {overflow_text}; no step was skipped for "
            f"non-finite data. `model.skipped_steps` counts both ({total} so far)."
        )
    else:
        paths = state.__dict__.get("skipped_paths") or []
        if 0 <= index < len(paths):
            culprit = f"the first variable with a non-finite gradient is '{paths[index]}'"
        else:
            culprit = "the loss is not finite (every gradient is finite)"
        also = f" Besides, {overflow_text}." if overflows else ""
        message = (
            f"{skipped} training step{'s' if skipped != 1 else ''} skipped for a non-finite "
            f"loss or gradient in {when} (compile(nonfinite='skip')): the first at optimizer "
            f"step {step}, where {culprit}. Their batches were not trained on. Check the "
            "inputs, labels and sample weights, the learning rate and the loss. "
            f"`model.skipped_steps` counts every skipped step ({total} so far).{also}"
        )
    warnings.warn(message, FastloopWarning, stacklevel=3)
    return skipped, overflows


class NonFiniteMonitor(keras.callbacks.Callback):
    """Internal callback of `OptimizedModel.fit` for the non-finite policy.

    For `"skip"` it only looks at epoch ends (no per-batch hook, so Keras keeps dispatching
    batch callbacks asynchronously and the default setup is as fast as plain `fit`): it warns
    once per epoch in which steps were skipped (`report_skips`). For `"terminate"` it also
    checks after every batch (every execution with `steps_per_execution > 1`) and stops
    training.
    """

    def __init__(self, policy):
        super().__init__()
        self.policy = policy
        if policy == "terminate":
            self.on_train_batch_end = self._stop_if_halted
        if policy == "raise":
            self.on_train_batch_end = lambda batch, logs=None: raise_if_recorded(self.model)

    def on_train_begin(self, logs=None):
        # A halt ends one fit only (as TerminateOnNaN): the next fit trains again.
        self.model.fastloop_step.state.halted.assign(False)
        if self.policy == "raise":
            _clear_record(self.model.fastloop_step.state)

    def _stop_if_halted(self, batch, logs=None):
        if bool(self.model.fastloop_step.state.halted.numpy()) and not self.model.stop_training:
            self.model.stop_training = True
            print(
                f"Batch {batch}: non-finite loss or gradient, terminating training "
                "(compile(nonfinite='terminate')); the weights are those of the last good step."
            )

    def on_epoch_end(self, epoch, logs=None):
        report_skips(self.model, f"epoch {epoch + 1}")


def _clear_record(state):
    state.nonfinite_step.assign(-1)
    state.nonfinite_variable.assign(-1)


def raise_if_recorded(model):
    """Raise `NonFiniteError` if a step of `model` recorded a fault (`"raise"`).

    The record is cleared first, and updates are unblocked, so the model can train again.

    Raises:
        NonFiniteError: naming the optimizer step and the first variable with a non-finite
            gradient (or saying the loss was non-finite while every gradient was finite).
    """
    step = model.__dict__.get("_fastloop_step")
    if step is None or step.nonfinite != "raise" or not bool(step.state.halted.numpy()):
        return
    state = step.state
    fault_step = int(state.nonfinite_step.numpy())
    index = int(state.nonfinite_variable.numpy())
    paths = state.__dict__.get("nonfinite_paths") or []
    state.halted.assign(False)
    _clear_record(state)
    clear_report(state)  # this error says it; overflows before it are not reported apart
    if 0 <= index < len(paths):
        culprit = f"the first variable with a non-finite gradient is '{paths[index]}'"
    else:
        culprit = "the loss is not finite (every gradient is finite)"
    raise NonFiniteError(
        f"Non-finite loss or gradient at optimizer step {fault_step} (compile(nonfinite='raise')): "
        f"{culprit}. The update of that step was not applied: the weights and optimizer state "
        f"are those of the last good step ({fault_step} updates applied). Check the inputs, labels "
        "and sample weights of that batch, the learning rate and the loss; "
        "compile(nonfinite='skip') skips such batches."
    )


class BatchSizeMonitor(keras.callbacks.Callback):
    """Internal callback of `fit` with `micro_batch_size`: warns once when no batch was
    larger than `micro_batch_size` (checked at epoch ends, so a smaller last batch, which is
    routine, never warns, and batch callbacks stay asynchronous)."""

    def on_epoch_end(self, epoch, logs=None):
        step = self.model.fastloop_step
        if step.largest_batch is None or step.warned_small_batch:
            return
        largest = int(step.largest_batch.numpy())
        if 0 < largest < step.micro_batch_size:
            micro_batching.warn_small_batch(step, largest)


def batch_size_monitor(model):
    """`[BatchSizeMonitor()]` when `micro_batch_size` is set, else `[]`."""
    step = model.fastloop_step
    return [BatchSizeMonitor()] if step.micro_batch_size else []


def non_finite_monitor(model):
    """`[NonFiniteMonitor(policy)]` for the compiled `nonfinite` policy."""
    return [NonFiniteMonitor(model.fastloop_step.nonfinite)]


def first_local_batch(strategy, batch):
    """The first local replica's part of a distributed batch (plain tensors pass through).

    Args:
        strategy: the `tf.distribute.Strategy` that distributed `batch`.
        batch: a nest of tensors and `tf.distribute.DistributedValues`.

    Returns:
        The same nest with every distributed value replaced by its first local component.

    Example:
        >>> first_local_batch(tf.distribute.get_strategy(), (tf.ones((2, 3)),))[0].shape
        TensorShape([2, 3])
    """

    def first(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    return tf.nest.map_structure(first, batch)


def maybe_symbolic_build(model, keras_maybe_symbolic_build, iterator=None, data_batch=None):
    """`Trainer._maybe_symbolic_build` that works under `MultiWorkerMirroredStrategy`.

    Keras reduces the first batch across replicas (`strategy.reduce("MEAN", batch)`) only to
    learn its shapes; under `MultiWorkerMirroredStrategy` that fails ("Attempt to convert a
    value (PerReplica...)", keras-team/keras#20585). Here the first local replica's batch is used
    instead. Other strategies keep Keras' own method.

    Args:
        model: the Keras model being trained.
        keras_maybe_symbolic_build: Keras' bound method (`super()._maybe_symbolic_build`).
        iterator: Keras' epoch iterator, or `None`.
        data_batch: a batch, or `None`.

    Returns:
        `None`.

    Example:
        >>> # in the fit loop: maybe_symbolic_build(model, super()._maybe_symbolic_build, ...)
    """
    strategy = model.distribute_strategy
    if internals.distribute_strategy(model) is None or not multi_worker.is_multi_worker(strategy):
        return keras_maybe_symbolic_build(iterator=iterator, data_batch=data_batch)
    if iterator is not None:
        for _, _, it in iterator:
            data_batch = first_local_batch(strategy, next(it))
            break
    with strategy.scope():
        internals.symbolic_build(model, data_batch)
    return None


class TensorBoardModelSummary(keras.callbacks.Callback):
    """Writes the model summary a `keras.callbacks.TensorBoard(write_graph=True)` writes for
    `keras.Model` and `keras.Sequential` (the Graphs tab), which Keras' callback skips for
    any other class name, ours included. Subclassed models get none, as in Keras."""

    def __init__(self, tensorboard):
        super().__init__()
        self.tensorboard = tensorboard

    def set_model(self, model):
        super().set_model(model)
        if type(model).__name__ in ("Functional", "Sequential"):
            return  # Keras' callback writes it
        if not isinstance(model, (internals.Functional, keras.Sequential)):
            return
        writer = internals.tensorboard_train_writer(self.tensorboard)
        with writer.as_default():
            internals.keras_model_summary("keras", model, step=0)
        writer.flush()  # Keras' callback may drop its writers in a later `set_model`


def after_tensorboard(model, callback):
    """The internal callbacks that follow `callback`: a `TensorBoardModelSummary` after a
    `TensorBoard(write_graph=True)`, else none."""
    if isinstance(callback, keras.callbacks.TensorBoard) and callback.write_graph:
        return [TensorBoardModelSummary(callback)]
    return []
