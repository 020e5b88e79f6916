"""EMA validation, named validation sets, steps_per_execution and float8 in pairs, and bad input.

Each test states a reference: keras.Model / Keras' own callback, a hand-computed EMA, or
`model.evaluate`; refusals must come before the first training step.
"""

import _helpers
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_fastloop as kf
from keras_fastloop import _keras_internals
from keras_fastloop.callbacks import EMAValidation, PeriodicValidation, use_ema_warmup

RNG = np.random.default_rng(7)
X = RNG.normal(size=(64, 3)).astype("float32")
Y = (X @ RNG.normal(size=(3, 2)) + 0.3).astype("float32")
X_EASY = RNG.normal(size=(16, 3)).astype("float32")
Y_EASY = (X_EASY @ RNG.normal(size=(3, 2))).astype("float32")
X_HARD = RNG.normal(size=(16, 3)).astype("float32")
Y_HARD = RNG.normal(size=(16, 2)).astype("float32")


def make_model(cls=kf.OptimizedModel, use_ema=True, momentum=0.9):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((3,))
    model = cls(inputs, keras.layers.Dense(2)(inputs))
    model.compile(keras.optimizers.SGD(0.05, use_ema=use_ema, ema_momentum=momentum), "mse")
    return model


def fit(model, callbacks, epochs=3, **kwargs):
    return model.fit(
        X, Y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks, **kwargs
    )


class CountBatches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1


# --- EMA validation drives callbacks that then act on the raw weights -------------------------


def test_periodic_validation_ema_checkpoint_holds_the_weights_it_scored(tmp_path):
    path = str(tmp_path / "best.weights.h5")
    checkpoint = keras.callbacks.ModelCheckpoint(
        path, monitor="val_hard_loss", mode="min", save_best_only=True, save_weights_only=True
    )
    validation = PeriodicValidation(
        {"easy": (X_EASY, Y_EASY), "hard": (X_HARD, Y_HARD)},
        every_n_steps=2,
        ema=True,
        callbacks=[checkpoint],
    )
    fit(make_model(), [validation])
    best = min(record["val_hard_loss"] for record in validation.history)
    restored = make_model()
    restored.load_weights(path)
    np.testing.assert_allclose(restored.evaluate(X_HARD, Y_HARD, verbose=0), best, rtol=1e-6)


def test_periodic_validation_ema_early_stopping_restores_the_scored_weights():
    early_stopping = keras.callbacks.EarlyStopping(
        monitor="val_hard_loss", mode="min", patience=100, restore_best_weights=True
    )
    validation = PeriodicValidation(
        {"easy": (X_EASY, Y_EASY), "hard": (X_HARD, Y_HARD)},
        every_n_steps=2,
        ema=True,
        callbacks=[early_stopping],
    )
    model = make_model()
    fit(model, [validation])
    best = min(record["val_hard_loss"] for record in validation.history)
    np.testing.assert_allclose(model.evaluate(X_HARD, Y_HARD, verbose=0), best, rtol=1e-6)


def test_ema_validation_checkpoint_holds_the_weights_it_scored_as_keras_does(tmp_path):
    def best_and_checkpoint_loss(cls, swap, name):
        path = str(tmp_path / f"{name}.weights.h5")
        checkpoint = keras.callbacks.ModelCheckpoint(
            path, monitor="val_loss", mode="min", save_best_only=True, save_weights_only=True
        )
        history = fit(make_model(cls), [swap, checkpoint], validation_data=(X_HARD, Y_HARD))
        restored = make_model(cls)
        restored.load_weights(path)
        return min(history.history["val_loss"]), restored.evaluate(X_HARD, Y_HARD, verbose=0)

    keras_best, keras_checkpoint = best_and_checkpoint_loss(
        keras.Model, keras.callbacks.SwapEMAWeights(swap_on_epoch=True), "keras"
    )
    np.testing.assert_allclose(keras_checkpoint, keras_best, rtol=1e-6)  # Keras' behaviour
    best, checkpoint = best_and_checkpoint_loss(
        kf.OptimizedModel, EMAValidation(swap_on_epoch=True), "ours"
    )
    np.testing.assert_allclose(best, keras_best, rtol=1e-6)
    np.testing.assert_allclose(checkpoint, best, rtol=1e-6)


# --- use_ema_warmup on an optimizer whose train function is already traced ---------------------


def test_use_ema_warmup_between_two_fits_acts():
    model = make_model(momentum=0.999)
    recorder = _helpers.WeightsByStep(trainable_only=True)
    fit(model, [recorder], epochs=1)
    first_steps = max(recorder.weights)
    use_ema_warmup(model.optimizer)
    fit(model, [recorder], epochs=1)
    averages = None
    for step in sorted(recorder.weights):
        t = step - 1
        decay = 0.999 if step <= first_steps else min(0.999, (1 + t) / (10 + t))
        weights = [w.astype("float64") for w in recorder.weights[step]]
        if averages is None:
            averages = weights
        else:
            averages = [decay * a + (1 - decay) * w for a, w in zip(averages, weights)]
    got = [keras.ops.convert_to_numpy(a) for _, a in _keras_internals.ema_pairs(model.optimizer)]
    for g, want in zip(got, averages):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


# --- named validation sets: errors before training, nothing silent ---------------------------


def two_outputs():
    keras.utils.set_random_seed(2)
    inputs = keras.Input((3,))
    model = kf.OptimizedModel(
        inputs,
        {
            "b": keras.layers.Dense(2, name="b")(inputs),
            "c": keras.layers.Dense(2, name="c")(inputs),
        },
    )
    model.compile("sgd", {"b": "mse", "c": "mse"})
    return model


def test_named_set_and_output_key_clash_is_refused_before_training():
    y = {"b": Y_HARD, "c": Y_HARD}
    validation = PeriodicValidation({"a": (X_HARD, y), "a_b": (X_HARD, y)}, every_n_steps=5)
    counter = CountBatches()
    with pytest.raises(ValueError, match="val_a_b_loss"):
        two_outputs().fit(
            X, {"b": Y, "c": Y}, batch_size=8, verbose=0, callbacks=[counter, validation]
        )
    assert counter.count == 0


def test_validation_set_that_yields_nothing_is_not_silent():
    empty = tf.data.Dataset.from_tensor_slices((X_HARD, Y_HARD)).filter(lambda x, y: False).batch(4)
    validation = PeriodicValidation({"hard": empty}, every_n_steps=2)
    with pytest.raises(ValueError, match="at least one batch; the set 'hard' yielded none"):
        fit(make_model(use_ema=False), [validation], epochs=1)


def test_named_set_given_as_a_list_is_a_set():
    model = make_model(use_ema=False)
    validation = PeriodicValidation({"hard": [X_HARD, Y_HARD]}, every_n_steps=4)
    fit(model, [validation], epochs=1)
    reference = make_model(use_ema=False)
    reference.set_weights(model.get_weights())  # at step 8, the last validation
    np.testing.assert_allclose(
        validation.history[-1]["val_hard_loss"],
        reference.evaluate(X_HARD, Y_HARD, verbose=0),
        rtol=1e-6,
    )


# --- steps_per_execution under MirroredStrategy ---------------------------------------------


@pytest.mark.distributed
def test_integer_steps_per_execution_under_mirrored_is_refused_at_compile():
    strategy = _helpers.two_replica_strategy()
    with strategy.scope():
        inputs = keras.Input((3,))
        model = kf.OptimizedModel(inputs, keras.layers.Dense(2)(inputs))
        with pytest.raises(ValueError, match=r"keras#19246.*Received: steps_per_execution=4"):
            model.compile("sgd", "mse", steps_per_execution=4)
        model.compile("sgd", "mse", steps_per_execution="auto")  # accepted: it stays at 1
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)


# --- float8 layers with the optimizer's EMA ------------------------------------------------
