"""Every use of Keras internals (`keras.src`) in keras_fastloop, in one place.

Keras 3 keeps a few things we need off its public API. Each one is imported here and nowhere
else, and `tests/test_keras_internals.py` fails loudly if a Keras upgrade moves or changes them.
"""

import contextlib

import keras
from keras.src.backend import get_keras_mask
from keras.src.backend.tensorflow.trainer import reduce_per_replica
from keras.src.callbacks.tensorboard import keras_model_summary
from keras.src.losses.loss import scale_loss_for_distribution, unscale_loss_for_distribution
from keras.src.models.functional import Functional
from keras.src.models.model import Model, Trainer, functional_init_arguments
from keras.src.saving import object_registration, serialization_lib
from keras.src.trainers.compile_utils import CompileLoss, get_loss


def compile_loss_entries(compile_loss):
    """A built `CompileLoss`' resolved entries: `(path, loss, loss_weights, name)` tuples.

    `CompileLoss.call` evaluates `entry.loss(y_true_at_path, y_pred_at_path, sample_weight)`
    for each entry in order, updates `compile_loss.metrics[i]` with the unweighted value (when
    there is more than one entry) and multiplies by `entry.loss_weights` unless it is `None`.
    """
    return list(compile_loss._flat_losses)


def set_compile_loss_entries(compile_loss, entries):
    compile_loss._flat_losses = list(entries)


@contextlib.contextmanager
def unlocked_state(layer):
    """Let `layer.add_weight` run on a built layer (Keras locks a layer's state after build).

    For step state whose shape is known only once a subclassed model has been called (e.g. one
    trainable log-variance per task), created before the first update is traced to the end.
    """
    tracker = layer._tracker
    locked = tracker.locked
    tracker.unlock()
    try:
        yield
    finally:
        if locked:
            tracker.lock()


def build_compiled_metrics_and_loss(model, data_batch):
    """Keras' `Trainer._symbolic_build` for the compiled metrics and loss, not the optimizer.

    `data_batch` is a nest of anything with `.shape` and `.dtype` (arrays, tensors,
    `tf.TensorSpec`s). As Keras does, it becomes `KerasTensor`s, the model runs with
    `backend.compute_output_spec` (`training=False`), and `compute_metrics` and `_compute_loss`
    run on the symbolic outputs, which builds their state. The optimizer is left unbuilt.
    """
    from keras.src import backend, tree

    def symbolic(value):
        if value is None:
            return None
        return backend.KerasTensor(value.shape, backend.standardize_dtype(value.dtype))

    batch = tree.map_structure(symbolic, data_batch)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
    y_pred = backend.compute_output_spec(model, x, training=False)
    metrics, loss = model._compile_metrics, model._compile_loss
    if metrics is not None and not metrics.built:
        backend.compute_output_spec(
            model.compute_metrics, x, y, y_pred, sample_weight=sample_weight
        )
    if loss is not None and not loss.built:
        backend.compute_output_spec(
            model._compute_loss, x, y, y_pred, sample_weight=sample_weight, training=False
        )


def epoch_iterator_element_spec(iterator):
    """The element spec of a TensorFlow `EpochIterator`'s data set, or `None` (no data read).

    Keras' TF epoch iterator keeps the (distributed) `tf.data.Dataset` it iterates over in
    `_distributed_dataset`.
    """
    dataset = getattr(iterator, "_distributed_dataset", None)
    return getattr(dataset, "element_spec", None)


def profiler_op_stats(xplane_paths):
    """TensorFlow's `framework_op_stats` tool (TensorBoard's Profile tab) on `.xplane.pb` traces.

    Not Keras but TensorFlow's profiler plugin (`tensorflow.python.profiler.internal`), which has
    no public Python API. Returns the first table as `(column labels, rows of cell values)`.
    """
    import json

    from tensorflow.python.profiler.internal import _pywrap_profiler_plugin

    raw, _ = _pywrap_profiler_plugin.xspace_to_tools_data(
        [str(p) for p in xplane_paths], "framework_op_stats", {}
    )
    table = json.loads(raw)
    table = table[0] if isinstance(table, list) else table
    labels = [column.get("label") or column.get("id") for column in table["cols"]]
    rows = [[cell.get("v") if cell else None for cell in row["c"]] for row in table["rows"]]
    return labels, rows


def tensorboard_train_writer(callback):
    """The train summary writer of a `keras.callbacks.TensorBoard` (Keras' `_train_writer`)."""
    return callback._train_writer


def save_as(variant, cls):
    """Keras saves instances of `variant` under `cls`' registered name (and loads `cls`).

    Only the name mapping is set (`object_registration.GLOBAL_CUSTOM_NAMES`); the object
    registry keeps `cls` under that name.
    """
    registered = keras.saving.get_registered_name(cls)
    if registered != cls.__name__:
        object_registration.GLOBAL_CUSTOM_NAMES[variant] = registered


def onednn_enabled():
    """Whether TensorFlow's oneDNN (formerly MKL) CPU kernels are on in this process.

    TensorFlow reads `TF_ENABLE_ONEDNN_OPTS` once, when it is imported; unset, it turns
    oneDNN on only for some x86 CPUs. Read through `tensorflow.python.util._pywrap_util_port`
    (no public API); `None` where this TensorFlow build has no such switch.
    """
    from tensorflow.python.util import _pywrap_util_port

    is_enabled = getattr(_pywrap_util_port, "IsMklEnabled", None)
    return None if is_enabled is None else bool(is_enabled())


__all__ = [
    "keras_model_summary",
    "tensorboard_train_writer",
    "Model",
    "save_as",
    "CompileLoss",
    "onednn_enabled",
    "profiler_op_stats",
    "epoch_iterator_element_spec",
    "build_compiled_metrics_and_loss",
    "compile_loss_entries",
    "set_compile_loss_entries",
    "unlocked_state",
    "Functional",
    "Trainer",
    "functional_init_arguments",
    "get_keras_mask",
    "reduce_per_replica",
    "get_loss",
    "scale_loss_for_distribution",
    "serialization_lib",
    "unscale_loss_for_distribution",
]
