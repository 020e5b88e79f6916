"""Skipped steps are never silent: the skip report's `FastloopWarning`.

References: the count and first step are hand-computed from which batches hold an `inf`; the
first variable is the first of `model.trainable_variables` whose gradient on the bad batch,
computed by a plain `tf.GradientTape`, is not finite.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import fresh_user_data, fresh_user_mlp, two_replica_strategy

import keras_fastloop as kf

BATCH = 8  # 64 samples: 8 batches per epoch


def _bad_data(bad_batches=(2, 5)):
    x, y = fresh_user_data()
    x = x.copy()
    for i in bad_batches:
        x[i * BATCH + 1, 4] = np.inf
    return x, y


def _first_bad_variable(model, x, y):
    """Reference: the first trainable variable whose gradient on (x, y) is not finite."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    for g, v in zip(grads, model.trainable_variables):
        if not np.all(np.isfinite(g.numpy())):
            return v.path
    return None


def _fit(model, x, y, epochs=1, steps_per_execution=1):
    model.compile("sgd", "sparse_categorical_crossentropy", steps_per_execution=steps_per_execution)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return [w for w in caught if issubclass(w.category, kf.FastloopWarning)]


@pytest.mark.parametrize("steps_per_execution", [1, "auto"])
def test_default_compile_warns_once_with_count_step_and_variable(steps_per_execution):
    x, y = _bad_data((2, 5))
    model = fresh_user_mlp()
    expected = _first_bad_variable(model, x[2 * BATCH : 3 * BATCH], y[2 * BATCH : 3 * BATCH])
    assert expected == model.trainable_variables[0].path  # the inf enters the first kernel
    caught = _fit(model, x, y, steps_per_execution=steps_per_execution)
    assert len(caught) == 1
    message = str(caught[0].message)
    # batches 0, 1 applied, so the first skipped one would have been optimizer step 2
    assert message.startswith(
        "2 training steps skipped for a non-finite loss or gradient in epoch 1"
    )
    assert "the first at optimizer step 2" in message
    assert f"'{expected}'" in message
    assert int(model.skipped_steps.numpy()) == 2
    assert int(model.optimizer.iterations.numpy()) == 6


def test_clean_run_does_not_warn():
    x, y = fresh_user_data()
    caught = _fit(fresh_user_mlp(), x, y, epochs=2)
    assert caught == []


def test_at_most_once_per_epoch_and_only_epochs_with_skips():
    x, y = _bad_data((1, 3, 6))
    model = fresh_user_mlp()
    model.compile("sgd", "sparse_categorical_crossentropy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        model.fit(*fresh_user_data(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    messages = [str(w.message) for w in caught if issubclass(w.category, kf.FastloopWarning)]
    assert len(messages) == 2  # epochs 1 and 2 of the first fit; the clean fit says nothing
    assert messages[0].startswith("3 training steps skipped") and "in epoch 1" in messages[0]
    assert "the first at optimizer step 1" in messages[0]
    # epoch 2 starts after 5 applied updates; its first bad batch is its batch 1
    assert "in epoch 2" in messages[1] and "the first at optimizer step 6" in messages[1]
    assert "(6 so far)" in messages[1]


@pytest.mark.distributed
def test_mirrored_strategy_reports_as_one_replica():
    x, y = _bad_data((2, 5))
    one = fresh_user_mlp()
    reference = _fit(one, x, y)
    with two_replica_strategy().scope():
        model = fresh_user_mlp()
        caught = _fit(model, x, y)
    assert len(caught) == 1
    expected = str(reference[0].message).replace(
        one.trainable_variables[0].path, model.trainable_variables[0].path
    )
    assert str(caught[0].message) == expected
    assert int(model.skipped_steps.numpy()) == 2


def _scaled_model(initial_scale):
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = fresh_user_mlp()
        keras.utils.set_random_seed(0)
        i = keras.Input((8,))
        h = keras.layers.Dense(16, activation="relu")(i)
        o = keras.layers.Activation("softmax", dtype="float32")(keras.layers.Dense(3)(h))
        model = kf.OptimizedModel(i, o)
    finally:
        keras.config.set_dtype_policy("float32")
    model.compile(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=initial_scale),
        "sparse_categorical_crossentropy",
    )
    return model


def test_overflow_only_epoch_is_labelled_as_expected():
    x, y = fresh_user_data()
    model = _scaled_model(2.0**40)  # float16 gradients overflow until the scale is halved
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    messages = [str(w.message) for w in caught if issubclass(w.category, kf.FastloopWarning)]
    overflows = int(model.skipped_steps.numpy())
    assert overflows > 0
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0 ** (40 - overflows)
    assert len(messages) == 1
    assert messages[0].startswith("Loss-scale overflows only in epoch 1")
    assert f"{overflows} loss-scale overflow" in messages[0]
    assert "non-finite data" in messages[0] and "expected" in messages[0]


def test_overflows_and_bad_data_are_counted_apart():
    x, y = _bad_data((6,))
    model = _scaled_model(2.0**40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    messages = [str(w.message) for w in caught if issubclass(w.category, kf.FastloopWarning)]
    total = int(model.skipped_steps.numpy())
    assert len(messages) == 1
    assert messages[0].startswith("1 training step skipped for a non-finite")
    assert f"Besides, {total - 1} loss-scale overflow" in messages[0]


def test_train_on_batch_warns_when_its_step_is_skipped():
    x, y = _bad_data((1,))
    model = fresh_user_mlp()
    model.compile("sgd", "sparse_categorical_crossentropy")
    model.train_on_batch(x[:BATCH], y[:BATCH])  # clean: no warning (an error in tests)
    with pytest.warns(kf.FastloopWarning, match="1 training step skipped .* this train_on_batch"):
        model.train_on_batch(x[BATCH : 2 * BATCH], y[BATCH : 2 * BATCH])
    model.train_on_batch(x[:BATCH], y[:BATCH])  # the report was reset
    assert int(model.skipped_steps.numpy()) == 1
