"""Every use of Keras internals (`keras.src`) in keras_fastloop, in one place.

Keras 3 keeps a few things we need off its public API. Each one is imported here (or, for
rematerialization, in `remat.py` beside this file) and nowhere else, and
`tests/test_keras_internals.py` fails loudly if a Keras upgrade moves or changes them.
"""

import contextlib
from typing import NamedTuple

import keras
from keras.src.backend import get_keras_mask
from keras.src.backend.tensorflow.trainer import reduce_per_replica
from keras.src.callbacks.tensorboard import keras_model_summary
from keras.src.losses.loss import scale_loss_for_distribution, unscale_loss_for_distribution
from keras.src.models.functional import Functional
from keras.src.models.model import Model, Trainer, functional_init_arguments
from keras.src.saving import object_registration, serialization_lib
from keras.src.trainers.compile_utils import CompileLoss, get_loss

from keras_fastloop._keras_internals.remat import (
    exact_remat,
    install_remat_hook,
    remat_modes,
    with_exact_remat,
)


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


def enumerate_iterator(iterator):
    """The generator function of Keras' `EpochIterator` that yields an epoch's `(begin, end,
    data iterator)` slots (`_enumerate_iterator`), or `None` when Keras lacks it."""
    return getattr(iterator, "_enumerate_iterator", None)


def set_enumerate_iterator(iterator, function):
    """Replaces `_enumerate_iterator` on this one iterator; `None` restores the class's."""
    if function is None:
        iterator.__dict__.pop("_enumerate_iterator", None)
    else:
        iterator._enumerate_iterator = function


def batches_since_saving(callback):
    """A `ModelCheckpoint`'s own count of batches since it last saved (an int), else `None`.

    Keras counts them in `_batches_seen_since_last_saving` and saves when it reaches the
    callback's integer `save_freq`.
    """
    return getattr(callback, "_batches_seen_since_last_saving", None)


class BackupFiles(NamedTuple):
    """A `BackupAndRestore`'s files: the weights and the `{"epoch", "batch"}` metadata it
    restores, and their previous versions (kept when `double_checkpoint=True`)."""

    weights: str
    metadata: str
    previous_weights: str
    previous_metadata: str


def backup_files(backup):
    """The `BackupFiles` of a `keras.callbacks.BackupAndRestore` (Keras' private paths)."""
    return BackupFiles(
        backup._weights_path,
        backup._training_metadata_path,
        backup._prev_weights_path,
        backup._prev_training_metadata_path,
    )


_SAVE_COUNTERS = {
    "batches_since_saving": "_batches_seen_since_last_saving",
    "last_batch": "_last_batch_seen",
    "epoch": "_current_epoch",
}


def set_save_counters(callback, **counters):
    """Sets the counters by which a `BackupAndRestore` or `ModelCheckpoint` decides when to
    save: `batches_since_saving`, `last_batch` (the last batch index seen) and, for
    `BackupAndRestore`, `epoch`."""
    for name, value in counters.items():
        setattr(callback, _SAVE_COUNTERS[name], value)


def symbolic_build(model, data_batch):
    """Keras' `model._symbolic_build`: builds the compiled metrics and loss on `data_batch`."""
    model._symbolic_build(data_batch=data_batch)


def tensorboard_train_writer(callback):
    """The train summary writer of a `keras.callbacks.TensorBoard` (Keras' `_train_writer`)."""
    return callback._train_writer


def save_as(variant, registered_name):
    """Keras saves instances of `variant` under `registered_name`.

    Only the name mapping is set (`object_registration.GLOBAL_CUSTOM_NAMES`); the object
    registry (what `registered_name` loads as) is left as it is.
    """
    object_registration.GLOBAL_CUSTOM_NAMES[variant] = registered_name


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
    "outputs_struct",
    "autoconvert_optionals",
    "set_initial_epoch",
    "exact_remat",
    "with_exact_remat",
    "remat_modes",
    "install_remat_hook",
    "keras_model_summary",
    "tensorboard_train_writer",
    "Model",
    "save_as",
    "CompileLoss",
    "onednn_enabled",
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


# ----------------------------------------------------------------- Keras' trainer state
# Private attributes of `keras.Model` (Keras' `Trainer`) that the step reads; each one is
# checked in tests/test_keras_internals.py.


def compile_loss(model):
    """`model._compile_loss`: the compiled loss (`CompileLoss`, ours `TaskLoss`) or None."""
    return getattr(model, "_compile_loss", None)


def set_compile_loss(model, loss):
    """Installs `loss` as the model's compiled loss (`model._compile_loss`)."""
    model._compile_loss = loss


def compile_config(model):
    """`model._compile_config`: `compile()`'s arguments (a `SerializableDict`), or None."""
    return getattr(model, "_compile_config", None)


def set_compile_config(model, **config):
    """Sets `model._compile_config` (what `get_compile_config` serializes) to `config`."""
    model._compile_config = serialization_lib.SerializableDict(**config)


def compile_metrics(model):
    """`model._compile_metrics`: the compiled metrics (`CompileMetrics`) or None."""
    return model._compile_metrics


def loss_tracker(model):
    """`model._loss_tracker`: the `Mean` that logs `loss`."""
    return model._loss_tracker


def call_has_training_arg(model):
    """Whether the model's `call` takes a `training` argument."""
    return model._call_has_training_arg


def compute_loss_hook(model, **kwargs):
    """`model._compute_loss(...)`: Keras' dispatch to `compute_loss` (overrides included)."""
    return model._compute_loss(**kwargs)


def set_initial_epoch(model, epoch):
    """`model._initial_epoch`: the epoch `fit` starts from (Keras' `BackupAndRestore` sets it)."""
    model._initial_epoch = epoch


def autoconvert_optionals(model, step_function):
    """`model._autoconvert_optionals(f)`: Keras' wrapper for a multi-step loop's outputs."""
    return model._autoconvert_optionals(step_function)


def outputs_struct(model):
    """`model._outputs_struct`: a functional model's output structure, or `None`."""
    return getattr(model, "_outputs_struct", None)


def distribute_strategy(model):
    """`model._distribute_strategy`: the strategy the model was created under, or None."""
    return model._distribute_strategy


def flatten_layers(model):
    """Every layer of `model`, itself included (`model._flatten_layers()`)."""
    return model._flatten_layers()


def user_loss(compile_loss):
    """`compile_loss._user_loss`: the `loss` argument given to `compile()`."""
    return compile_loss._user_loss


# ------------------------------------------------------------- optimizer hooks (_step/, callbacks/)
# `BaseOptimizer.apply` (TensorFlow) sums gradients across replicas in this method; replaced by
# the identity where the step has summed them already (_step/distributed.py).
ALL_REDUCE_HOOK = "_all_reduce_sum_gradients"


# `BaseOptimizer.build` keeps the optimized variables in `_trainable_variables` and (use_ema)
# their averages, optimizer variables, in `_model_variables_moving_average`, same order. After
# every update `apply` calls `_update_model_variables_moving_average(_trainable_variables)`,
# before `iterations` is incremented (the first call sees `iterations == 0`).


def ema_pairs(optimizer):
    """`[(model variable, its moving average)]` of a built optimizer with `use_ema=True`."""
    averages = optimizer._model_variables_moving_average
    return [(v, a) for v, a in zip(optimizer._trainable_variables, averages) if a is not None]


def set_ema_update(optimizer, update):
    """Replaces the optimizer's moving-average update: `update(trainable_variables)`."""
    optimizer._update_model_variables_moving_average = update
