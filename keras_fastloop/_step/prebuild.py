"""Builds the step's state before the first trace, so `tf.function` traces each step once.

Without a distribution strategy, Keras 3 defers building the compiled metrics, the compiled
loss and the optimizer's slots to the first trace of the train (test) function
(`TensorFlowTrainer._maybe_symbolic_build` returns early "for backwards compatibility"). A
`tf.function` whose first trace creates variables traces a second time, so `keras.Model.fit`
traces `train_step` twice before its first step runs (half of its first epoch on small models).
Under a strategy Keras builds that state symbolically first (`Trainer._symbolic_build`); here the
same Keras method runs without a strategy too, from the data's spec (no batch is read, so the
data order is that of `keras.Model`). The values are those Keras would create in the trace
(zeros, the same initializers), so training gives the same numbers.

Only models whose layers are all built are pre-built (a subclassed model that builds in its
first call keeps Keras' deferred build), and if the symbolic build fails the state is left to
the trace, as in Keras.
"""

from __future__ import annotations

from keras_fastloop import _keras_internals as internals


def _unbuilt_state(model):
    metrics = model._compile_metrics
    loss = model._compile_loss
    optimizer = getattr(model, "optimizer", None)
    return (
        (metrics is not None and not metrics.built)
        or (loss is not None and not loss.built)
        or (optimizer is not None and not optimizer.built)
    )


def build_before_first_trace(model, iterator=None, data_batch=None):
    """Builds metrics, loss and optimizer state of a built model from the data's spec.

    Args:
        model: the compiled model.
        iterator: `fit`'s / `evaluate`'s epoch iterator, or `None`.
        data_batch: a batch (`train_on_batch`, `test_on_batch`), or `None`.

    Returns:
        bool, whether the state was built here.
    """
    if model._distribute_strategy is not None:  # Keras builds it symbolically itself
        return False
    if not model.compiled or not _unbuilt_state(model):
        return False
    if not all(layer.built for layer in model._flatten_layers()):
        return False
    if data_batch is None:
        data_batch = internals.epoch_iterator_element_spec(iterator)
        if data_batch is None:
            return False
    try:
        internals.symbolic_build(model, data_batch)
    except Exception:  # noqa: BLE001 - the trace builds what is left, as in keras.Model
        return False
    return not _unbuilt_state(model)


__all__ = ["build_before_first_trace"]
