"""Builds the step's state before the first trace, so `tf.function` traces each step once.

Without a distribution strategy, Keras 3 defers building the compiled metrics, the compiled
loss and the optimizer's slots to the first trace of the train (test) function
(`TensorFlowTrainer._maybe_symbolic_build` returns early "for backwards compatibility"). A
`tf.function` whose first trace creates variables traces a second time, so `keras.Model.fit`
traces `train_step` twice before its first step runs (half of its first epoch on small models).
Here the same state is built before the trace, at the points where it is fully determined:

- the compiled metrics and loss in `_maybe_symbolic_build`, from the data's spec (no batch is
  read, so the data order is that of `keras.Model`), as Keras' `Trainer._symbolic_build` does
  under a strategy;
- the optimizer right before the first call of the train function, i.e. after the callbacks'
  `on_train_begin` and with the trainable variables of that moment, which are the ones Keras'
  first trace would build it with (a layer unfrozen after `evaluate()` or by a callback is
  included).

The values are those Keras would create in the trace (zeros, the same initializers), so training
gives the same numbers. Only models whose layers are all built and that keep the default
`train_step` / `test_step` are pre-built (an overridden step may transform `y` before the metrics
see it); if the symbolic build fails, the rest is left to the trace, as in Keras.
"""

from __future__ import annotations

from keras_fastloop import _keras_internals as internals
from keras_fastloop._step import objective


def _compiled_state_unbuilt(model):
    metrics, loss = internals.compile_metrics(model), internals.compile_loss(model)
    return (metrics is not None and not metrics.built) or (loss is not None and not loss.built)


def _eligible(model):
    cls = type(model)
    # The trainer names its own steps (`OptimizedTrainer._fastloop_default_steps`).
    default_steps = getattr(cls, "_fastloop_default_steps", None)
    return (
        internals.distribute_strategy(model) is None  # under a strategy Keras builds it itself
        and model.compiled
        and default_steps is not None
        and cls.train_step is default_steps[0]
        and cls.test_step is default_steps[1]
        and all(layer.built for layer in internals.flatten_layers(model))
    )


def build_layers(model, x):
    """Build the model's unbuilt layers with a forward pass on `x` (inside the train step).

    Without a strategy Keras builds in the first trace; the variables must exist before the
    step reads them (`tf.function` traces once more, with them built).
    """
    if not all(layer.built for layer in internals.flatten_layers(model)):
        objective.forward(model, x, training=False)


def build_before_first_trace(model, iterator=None, data_batch=None):
    """Builds the compiled metrics and loss of a built model from the data's spec.

    Args:
        model: the compiled model.
        iterator: `fit`'s / `evaluate`'s epoch iterator, or `None`.
        data_batch: a batch (`train_on_batch`, `test_on_batch`), or `None`.

    Nothing is built for a model that is not eligible, or when neither a batch nor the
    iterator's spec is at hand; a failing symbolic build leaves the rest to the trace.
    """
    if not _eligible(model) or not _compiled_state_unbuilt(model):
        return
    if data_batch is None:
        data_batch = internals.epoch_iterator_element_spec(iterator)
        if data_batch is None:
            return
    try:
        internals.build_compiled_metrics_and_loss(model, data_batch)  # symbolic
    except Exception:  # noqa: BLE001 - the trace builds what is left, as in keras.Model
        return


def build_optimizer_before_first_call(model, function):
    """`function` (the train function), building the optimizer right before its first call.

    Only when the compiled metrics and loss are already built (by `build_before_first_trace`
    or an earlier step) and the model is eligible; otherwise `function` itself. The first call
    then puts `function` back as `model.train_function`.
    """
    optimizer = getattr(model, "optimizer", None)
    if function is None or optimizer is None or optimizer.built:
        return function
    if getattr(function, "_fastloop_first_call", False):  # already wrapped
        return function
    if not _eligible(model) or _compiled_state_unbuilt(model):
        return function

    def first_call(*args, **kwargs):
        if not optimizer.built and _eligible(model):
            optimizer.build(model.trainable_variables)
        model.train_function = function
        return function(*args, **kwargs)

    first_call._fastloop_first_call = True
    model.train_function = first_call
    return first_call


__all__ = ["build_before_first_trace", "build_optimizer_before_first_call"]
