"""The validation sets of `PeriodicValidation`: one, or several named, each checked when the
callback is made (or, for what needs the model, when `fit` starts).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import keras

from keras_fastloop import _keras_internals as internals


def named_sets(validation_data):
    """`{name: data}` when `validation_data` is a dict of named validation sets, else `None`.

    A dict whose values are all data sets (a `tf.data.Dataset`, a `keras.utils.PyDataset` or
    an `(x, y[, sample_weight])` tuple or list) names sets; a dict of none is one set's
    inputs by name, as `evaluate` reads it.

    Raises:
        ValueError: an empty dict, a dict mixing sets with other values, or a set name that
            is not a non-empty string of letters, digits and underscores (it becomes part of
            the log keys, `val_{name}_loss`).
    """
    import tensorflow as tf

    if not isinstance(validation_data, Mapping):
        return None

    def is_set(value):
        if isinstance(value, list):
            return len(value) in (2, 3)
        return isinstance(value, (tf.data.Dataset, keras.utils.PyDataset, tuple))

    sets = [name for name, value in validation_data.items() if is_set(value)]
    if not sets:
        if validation_data:
            return None
    elif len(sets) < len(validation_data):
        others = [name for name in validation_data if name not in sets]
        raise ValueError(
            "Named validation sets must each be a dataset or an `(x, y[, sample_weight])` "
            f"tuple; {others} are not (or, as one set's inputs by name, {sets} are not "
            f"arrays). Received: validation_data with keys {list(validation_data)}"
        )
    if not validation_data:
        raise ValueError(
            "`validation_data` must hold at least one validation set. Received: validation_data={}"
        )
    for name in validation_data:
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_]+", name):
            raise ValueError(
                "The name of each validation set must be a non-empty string of letters, "
                "digits and underscores (its results are logged as `val_{name}_loss`, ...). "
                f"Received: {name!r} in validation_data's keys {list(validation_data)}"
            )
    return {name: tuple(v) if isinstance(v, list) else v for name, v in validation_data.items()}


def logged_results(results, sets):
    """The logs of the sets' results: `{"val_{name}_{key}": value}`, `"val_{key}"` for the
    one unnamed set (name `None`).

    Args:
        results: `{set name: {key: value}}`, in the sets' order.
        sets: the names of all sets, for the error message.

    Raises:
        ValueError: two sets' results would share a key (sets `"a"` and `"a_b"` with a
            metric `"b_loss"` both give `val_a_b_loss`).
    """
    logs, origin = {}, {}
    for name, values in results.items():
        prefix = "val_" if name is None else f"val_{name}_"
        for metric, value in values.items():
            key = prefix + metric
            if key in logs:
                raise ValueError(
                    "Each validation set's results need their own keys: "
                    f"{key!r} comes from the sets {origin[key]!r} and {name!r}. "
                    f"Rename a set. Received: sets {list(sets)}"
                )
            logs[key], origin[key] = value, name
    return logs


def check_targets(model, sets):
    """Raises at the start of `fit` when arrays without targets validate a model that
    compiled a loss (the first validation would fail mid-training)."""
    import tensorflow as tf

    if all(
        isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)) or y is not None
        for x, y, _ in sets.values()
    ):
        return
    if internals.compile_loss(model) is not None:
        raise ValueError(
            "`validation_data` needs targets: the model compiled a loss. Pass (x, y) or "
            "(x, y, sample_weight). Received: validation_data with inputs only"
        )


def check_result_keys(model, sets, log_keys):
    """Raises at the start of `fit` when two sets' results, or a set's and a training
    metric's, would share a key, as the first validation would (`logged_results`,
    `LogKeys.check`). Needs the compiled metrics built (an `OptimizedModel` builds them before
    the first step) and Keras' `test_step` (its keys are the metrics'); else the check waits
    for the first validation."""
    test_step = type(model).test_step
    if not test_step.__module__.startswith(("keras.", "keras_fastloop.")) or any(
        getattr(metric, "built", True) is False for metric in model.metrics
    ):
        return
    keys = list(model.get_metrics_result())
    predicted = logged_results(dict.fromkeys(sets, dict.fromkeys(keys)), sets)
    log_keys.check(predicted, sets, training=keys)


def check_monitor_modes(named, callbacks):
    """A callback monitoring a named set's key needs `mode="min"` or `"max"`.

    Keras infers `mode="auto"` from the model's metric named after `val_`; `val_hard_loss`
    names none, and `ModelCheckpoint`/`EarlyStopping` would fail at the first validation.

    Raises:
        ValueError: a driven callback with `mode="auto"` monitors `val_{name}_...`.
    """
    for callback in callbacks:
        monitor = getattr(callback, "monitor", None)
        if not isinstance(monitor, str) or getattr(callback, "mode", None) != "auto":
            continue
        if any(monitor.startswith(f"val_{name}_") for name in named):
            raise ValueError(
                f"{type(callback).__name__} monitors {monitor!r}, a named validation set's "
                "key: give it mode='min' (losses, errors) or mode='max' (accuracies), which "
                f"Keras cannot infer from that name. Received: monitor={monitor!r}, mode='auto'"
            )


def unpack(data, validation_steps):
    """`(x, y, sample_weight)` of one validation set, checked (see the class' Raises)."""
    if isinstance(data, (tuple, list)):
        if not 1 <= len(data) <= 3:
            raise ValueError(
                "A tuple `validation_data` must be (x,), (x, y) or (x, y, sample_weight). "
                f"Received: validation_data of length {len(data)}"
            )
        _check_same_length(data)
        _check_not_empty(data)
        _check_finite_dataset(data, validation_steps)
        return keras.utils.unpack_x_y_sample_weight(tuple(data))
    _check_finite_dataset(data, validation_steps)
    _check_not_empty(data)
    return data, None, None


def _check_same_length(arrays):
    """Arrays of `(x, y[, sample_weight])` must share their first dimension (Keras' rule)."""
    lengths = {
        int(leaf.shape[0])
        for leaf in keras.tree.flatten(tuple(arrays))
        if getattr(leaf, "shape", None) is not None
        and len(leaf.shape)
        and leaf.shape[0] is not None
    }
    if len(lengths) > 1:
        raise ValueError(
            "The arrays of `validation_data` must all have the same number of samples. "
            f"Received: sizes {sorted(lengths)}"
        )


def _check_not_empty(data):
    """A validation set with no sample would log nothing (Keras' evaluate then fails)."""
    import tensorflow as tf

    if isinstance(data, tf.data.Dataset):
        empty = int(data.cardinality()) == 0
    elif isinstance(data, (tuple, list)):
        sizes = [
            leaf.shape[0]
            for leaf in keras.tree.flatten(tuple(data))
            if getattr(leaf, "shape", None) is not None and len(leaf.shape)
        ]
        empty = bool(sizes) and sizes[0] == 0
    elif isinstance(data, keras.utils.PyDataset):
        try:
            empty = data.num_batches == 0
        except NotImplementedError:  # neither `num_batches` nor `__len__`: Keras refuses it
            empty = False
    else:
        empty = False
    if empty:
        raise ValueError(
            "Each validation set must hold at least one sample. Received: an empty "
            f"validation set ({type(data).__name__})"
        )


def _check_finite_dataset(validation_data, validation_steps):
    """An endless dataset needs `validation_steps`, or every validation would never end."""
    import tensorflow as tf

    if (
        isinstance(validation_data, tf.data.Dataset)
        and validation_steps is None
        and int(validation_data.cardinality()) == int(tf.data.INFINITE_CARDINALITY)
    ):
        raise ValueError(
            "An infinite `validation_data` dataset needs `validation_steps`. Received: "
            "validation_data with infinite cardinality, validation_steps=None"
        )


def check_batched(dataset, model_inputs):
    """Raises when a `tf.data` validation set's elements have one axis fewer than the model's
    inputs (it would fail at the first validation, mid-training, with a layer-shape error)."""
    import tensorflow as tf

    spec = dataset.element_spec
    x_spec = spec[0] if isinstance(spec, tuple) and 1 <= len(spec) <= 3 else spec
    leaves = tf.nest.flatten(x_spec)
    if not model_inputs or len(leaves) != len(model_inputs):
        return
    pairs = list(zip(leaves, model_inputs))
    ranks = [
        (getattr(leaf, "shape", None), tuple(model_input.shape)) for leaf, model_input in pairs
    ]
    if ranks and all(
        shape is not None and shape.rank is not None and shape.rank + 1 == len(expected)
        for shape, expected in ranks
    ):
        shape, expected = ranks[0]
        raise ValueError(
            "`validation_data` must yield batches: its elements have shape "
            f"{tuple(shape)}, one axis fewer than the model's input {expected}. "
            "Call `.batch(batch_size)` (or `kf.data.bucket_by_length`) on the dataset. "
            f"Received: validation_data with element_spec={spec}"
        )


__all__ = ["check_batched", "check_monitor_modes", "named_sets", "unpack"]
