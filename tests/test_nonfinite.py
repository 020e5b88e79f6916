"""Fault injection for ``compile(nonfinite="skip"|"raise"|"terminate")`` (keras_fastloop.guards).

The model has two outputs fed by disjoint input columns, with one loss each. A NaN written into
input column 3 of one sample makes the total loss NaN but, since the gradient of a sum is 1 for
each term, only the variables of output ``b`` get non-finite gradients: the first such variable
is ``b``'s kernel, not the model's first variable. References are runs on the same data with the
faulty batch removed (``skip``) or cut at the fault (``terminate``).
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_fastloop as kf
from keras_fastloop import guards

BATCH = 2


def make_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    a = keras.layers.Dense(1, name="a")(keras.layers.Lambda(lambda t: t[:, :2])(inputs))
    b = keras.layers.Dense(1, name="b")(keras.layers.Lambda(lambda t: t[:, 2:])(inputs))
    return kf.OptimizedModel(inputs, {"a": a, "b": b})


def make_data(num_batches, bad_batches=()):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(num_batches * BATCH, 4)).astype("float32")
    y = {"a": x[:, :1] - x[:, 1:2], "b": x[:, 2:3] * 2.0}
    for i in bad_batches:
        x[i * BATCH, 3] = np.nan
    return x, y


def keep_batches(x, y, batches):
    rows = np.concatenate([np.arange(i * BATCH, (i + 1) * BATCH) for i in batches])
    return x[rows], {k: v[rows] for k, v in y.items()}


def train(x, y, nonfinite="skip", steps_per_execution=1, callbacks=None):
    model = make_model()
    model.compile(
        keras.optimizers.Adam(0.05),
        {"a": "mse", "b": "mse"},
        nonfinite=nonfinite,
        steps_per_execution=steps_per_execution,
        log_metrics=["skipped_steps"],
    )
    history = model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks
    )
    return model, history


def assert_finite(model):
    for variable in model.weights + model.optimizer.variables:
        value = np.asarray(variable.numpy())
        if value.dtype.kind == "f":
            assert np.all(np.isfinite(value)), variable.path


def assert_same_weights(model, reference):
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_skip_drops_exactly_the_faulty_updates(steps_per_execution):
    x, y = make_data(8, bad_batches=(2, 5))
    model, history = train(x, y, "skip", steps_per_execution)
    assert int(model.skipped_steps.numpy()) == 2
    assert int(model.optimizer.iterations.numpy()) == 6
    assert history.history["skipped_steps"][-1] == 2
    assert_finite(model)
    reference, _ = train(*keep_batches(x, y, [0, 1, 3, 4, 6, 7]), "skip", steps_per_execution)
    assert int(reference.skipped_steps.numpy()) == 0
    assert_same_weights(model, reference)


def test_raise_names_step_and_first_nonfinite_variable():
    x, y = make_data(6, bad_batches=(3,))
    model = make_model()
    model.compile(keras.optimizers.Adam(0.05), {"a": "mse", "b": "mse"}, nonfinite="raise")
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    message = str(info.value)
    assert re.search(r"optimizer step\D{0,20}\b3\b", message), message
    b_kernel = next(v.path for v in model.trainable_variables if v.path.startswith("b/"))
    assert "first variable with a non-finite gradient" in message
    assert b_kernel in message
    assert not any(v.path in message for v in model.trainable_variables if v.path.startswith("a/"))
    # No update from the faulty step: the weights are those after the 3 good batches.
    assert int(model.optimizer.iterations.numpy()) == 3
    assert_finite(model)
    reference, _ = train(*keep_batches(x, y, [0, 1, 2]))
    assert_same_weights(model, reference)


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_terminate_stops_and_keeps_last_good_weights(steps_per_execution):
    # Fault in batch 5: with steps_per_execution=4 in the middle of the block 4..7, whose
    # later batches (6, 7) must not be applied either.
    x, y = make_data(12, bad_batches=(5,))
    seen = []
    recorder = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(b))
    model, history = train(x, y, "terminate", steps_per_execution, callbacks=[recorder])
    assert model.stop_training
    assert max(seen) < 11  # stopped before the end of the epoch
    assert int(model.optimizer.iterations.numpy()) == 5
    assert_finite(model)
    reference, _ = train(*keep_batches(x, y, range(5)))
    assert_same_weights(model, reference)
    assert history.history  # the epoch ended cleanly (logs recorded)


def test_no_nan_in_weights_after_any_fault():
    x, y = make_data(6, bad_batches=(0, 2, 5))
    y["a"][3] = np.inf  # a second kind of fault, in the other task
    for policy in ("skip", "terminate"):
        model, _ = train(x, y, policy)
        assert_finite(model)
    model = make_model()
    model.compile("adam", {"a": "mse", "b": "mse"}, nonfinite="raise")
    with pytest.raises(tf.errors.InvalidArgumentError):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_finite(model)


def test_warning_when_skip_rate_is_high():
    num = guards.SKIP_RATE_WINDOW
    x, y = make_data(num, bad_batches=range(0, num, 2))  # half of the batches
    with pytest.warns(UserWarning, match="had non-finite gradients and were skipped"):
        model, _ = train(x, y, "skip")
    assert int(model.skipped_steps.numpy()) == num // 2
    assert_finite(model)


def test_no_warning_when_skip_rate_is_low():
    num = guards.SKIP_RATE_WINDOW
    x, y = make_data(num, bad_batches=(7,))
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = train(x, y, "skip")
    assert not [w for w in caught if "were skipped" in str(w.message)]
    assert int(model.skipped_steps.numpy()) == 1


# ----------------------------------- faults found by a fresh user (were tests/test_regressions.py)


def _fresh_user_mlp():
    keras.utils.set_random_seed(0)
    i = keras.Input((8,))
    return kf.OptimizedModel(
        i, keras.layers.Dense(3, activation="softmax")(keras.layers.Dense(16, activation="relu")(i))
    )


def _fresh_user_data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 3, 64)


def test_terminate_stops_one_fit_only_and_says_so(capsys):
    x, y = _fresh_user_data()
    bad = x.copy()
    bad[20, 3] = np.nan
    model = _fresh_user_mlp()
    model.compile("sgd", "sparse_categorical_crossentropy", nonfinite="terminate")
    model.fit(bad, y, batch_size=16, shuffle=False, verbose=0)
    assert "terminating training" in capsys.readouterr().out
    assert int(model.optimizer.iterations.numpy()) == 1
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)  # clean data trains again
    assert int(model.optimizer.iterations.numpy()) == 1 + 8


def test_skip_warning_on_small_epochs():
    x, y = _fresh_user_data()
    model = _fresh_user_mlp()
    model.compile("sgd", lambda yt, yp: keras.ops.mean(yp, axis=-1) * np.nan)
    with pytest.warns(UserWarning, match="were skipped"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
