"""Several named validation sets in `PeriodicValidation` (keras#15757): every key equal to
`model.evaluate` on its set under `steps_per_execution` (4, "auto") and two replicas, beside
`fit(validation_data=...)`. Bad input: tests/test_periodic_validation.py."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import WeightsByStep, two_replica_strategy

import keras_fastloop as kf
from keras_fastloop.callbacks.periodic_validation import PeriodicValidation

RNG = np.random.default_rng(3)
X = RNG.normal(size=(64, 3)).astype("float32")
Y = (X @ np.array([[1.0], [2.0], [3.0]], "float32")).astype("float32")
X_EASY = RNG.normal(size=(16, 3)).astype("float32")
Y_EASY = (X_EASY @ np.array([[1.0], [2.0], [3.0]], "float32")).astype("float32")
X_HARD = RNG.normal(size=(24, 3)).astype("float32") * 3
Y_HARD = RNG.normal(size=(24, 1)).astype("float32")


def hard_dataset():
    return tf.data.Dataset.from_tensor_slices((X_HARD, Y_HARD)).batch(6)


def make_model(cls=keras.Model, steps_per_execution=1, metrics=("mae",)):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,))
    model = cls(inputs, keras.layers.Dense(1)(inputs))
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss="mse",
        metrics=list(metrics),
        steps_per_execution=steps_per_execution,
    )
    return model


def reference(weights, x, y=None):
    """`model.evaluate` of a fresh model holding `weights`."""
    model = make_model()
    model.set_weights(weights)
    return model.evaluate(x, y, verbose=0, return_dict=True)


def check_against_evaluate(validation, recorder):
    for entry in validation.history:
        weights = recorder.weights[entry["step"]]
        easy = reference(weights, X_EASY, Y_EASY)
        hard = reference(weights, hard_dataset())
        assert entry["val_easy_loss"] == pytest.approx(easy["loss"], rel=1e-6)
        assert entry["val_easy_mae"] == pytest.approx(easy["mae"], rel=1e-6)
        assert entry["val_hard_loss"] == pytest.approx(hard["loss"], rel=1e-6)
        assert entry["val_hard_mae"] == pytest.approx(hard["mae"], rel=1e-6)
        assert entry["val_easy_loss"] != pytest.approx(entry["val_hard_loss"], rel=1e-3)


@pytest.mark.parametrize(
    "cls, steps_per_execution, expected_steps",
    [
        (keras.Model, 4, [8, 12, 20, 24, 32]),  # execution boundaries at or after 6k
        (kf.OptimizedModel, "auto", [6, 12, 18, 24, 30]),  # executions end at the events
    ],
)
def test_named_sets_log_their_own_keys_equal_to_evaluate(cls, steps_per_execution, expected_steps):
    model = make_model(cls, steps_per_execution)
    validation = PeriodicValidation(
        {"easy": (X_EASY, Y_EASY), "hard": hard_dataset()}, every_n_steps=6
    )
    recorder = WeightsByStep()
    history = model.fit(
        X, Y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[validation, recorder]
    )
    assert [entry["step"] for entry in validation.history] == expected_steps
    keys = {"val_easy_loss", "val_easy_mae", "val_hard_loss", "val_hard_mae"}
    assert set(validation.history[0]) == {"step", "epoch", *keys}
    assert set(history.history) == {"loss", "mae", *keys}
    check_against_evaluate(validation, recorder)


def test_fit_validation_data_keeps_its_keras_meaning():
    def run(callbacks):
        model = make_model()
        return model.fit(
            X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False,
            validation_data=(X_EASY, Y_EASY), callbacks=callbacks,
        ).history  # fmt: skip

    plain = run([])
    validation = PeriodicValidation({"hard": hard_dataset()}, every_n_epochs=1)
    both = run([validation])
    assert {key: both[key] for key in plain} == plain  # val_loss / val_mae: Keras' set
    assert both["val_hard_loss"] == [entry["val_hard_loss"] for entry in validation.history]
    assert both["val_hard_loss"] != plain["val_loss"]


@pytest.mark.distributed
def test_named_sets_under_two_replicas_match_evaluate():
    strategy = two_replica_strategy()
    with strategy.scope():
        model = make_model()
    validation = PeriodicValidation(
        {"easy": (X_EASY, Y_EASY), "hard": hard_dataset()}, every_n_steps=3
    )
    recorder = WeightsByStep()
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0, shuffle=False,
              callbacks=[validation, recorder])  # fmt: skip
    assert [entry["step"] for entry in validation.history] == [3, 6]
    check_against_evaluate(validation, recorder)
