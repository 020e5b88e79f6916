"""Tests for keras_fastloop.callbacks.periodic_validation.PeriodicValidation: steps are optimizer updates, results reach stock callbacks."""

import functools
import json
import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import two_replica_strategy

import keras_fastloop as kf
from keras_fastloop.callbacks.periodic_validation import PeriodicValidation
from keras_fastloop.schedules import WarmupCosineDecayRestarts

RNG = np.random.default_rng(0)
X = RNG.normal(size=(64, 3)).astype("float32")
Y = (X @ np.array([[1.0], [2.0], [3.0]], "float32")).astype("float32")
X_VAL = RNG.normal(size=(16, 3)).astype("float32")
Y_VAL = RNG.normal(size=(16, 1)).astype("float32")


def linear_model(steps_per_execution=1, optimizer=None, loss="mse", metrics=("mae",), **dense):
    dense.setdefault("kernel_initializer", keras.initializers.GlorotUniform(seed=1))
    model = keras.Sequential([keras.Input((X.shape[1],)), keras.layers.Dense(1, **dense)])
    model.compile(
        optimizer=optimizer or keras.optimizers.SGD(0.01),
        loss=loss,
        metrics=list(metrics),
        steps_per_execution=steps_per_execution,
    )
    return model


class Recorder(keras.callbacks.Callback):
    """Keeps every batch's logs (a copy) and, optionally, the weights after it."""

    def __init__(self, keep_weights=False):
        super().__init__()
        self.keep_weights = keep_weights
        self.batches, self.logs, self.weights = [], [], []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(batch)
        self.logs.append(dict(logs))
        if self.keep_weights:
            self.weights.append(self.model.get_weights())


def forced_validation_data(values):
    """A dataset whose i-th iteration has loss values[i] against a model that outputs 0.

    `evaluate` iterates the dataset afresh each call, which calls the generator again.
    """
    remaining = iter(values)

    def generate():
        target = next(remaining)
        yield np.zeros((1, 3), "float32"), np.full((1, 1), target, "float32")

    dataset = tf.data.Dataset.from_generator(
        generate,
        output_signature=(
            tf.TensorSpec((1, 3), tf.float32),
            tf.TensorSpec((1, 1), tf.float32),
        ),
    )
    # Keras 3.15's evaluate() counts one extra, empty step on datasets of unknown
    # cardinality (the mean of one batch of loss 1.0 comes out as 0.5).
    return dataset.apply(tf.data.experimental.assert_cardinality(1))


def zero_model(**compile_kwargs):
    """Outputs exactly 0 and trains on y=0 with MAE: zero gradients, weights stay 0."""
    return linear_model(loss="mae", metrics=(), kernel_initializer="zeros", **compile_kwargs)


ZEROS_X = np.zeros((100, 3), "float32")
ZEROS_Y = np.zeros((100, 1), "float32")


# --- construction ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "Exactly one of `every_n_steps` and `every_n_epochs`"),
        (dict(every_n_steps=5, every_n_epochs=1), "Exactly one of"),
        (dict(every_n_steps=0), "`every_n_steps` must be None or an integer > 0"),
        (dict(every_n_steps=-3), "`every_n_steps` must be"),
        (dict(every_n_steps=2.0), "`every_n_steps` must be"),
        (dict(every_n_steps=True), "`every_n_steps` must be"),
        (dict(every_n_epochs=0), "`every_n_epochs` must be"),
        (dict(every_n_steps=5, validation_steps=0), "`validation_steps` must be"),
        (dict(every_n_steps=5, batch_size=-1), "`batch_size` must be"),
        (dict(every_n_steps=5, validate_at_end="yes"), "`validate_at_end` must be a bool"),
        (dict(every_n_steps=5, verbose=2), "`verbose` must be 0 or 1"),
        (dict(every_n_steps=5, callbacks=["EarlyStopping"]), "`callbacks` must be a list"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        PeriodicValidation((X_VAL, Y_VAL), **kwargs)
    assert "Received:" in str(info.value)


def test_missing_or_malformed_validation_data():
    with pytest.raises(ValueError, match="Received: validation_data=None"):
        PeriodicValidation(None, every_n_steps=5)
    with pytest.raises(ValueError, match="Received: validation_data of length 4"):
        PeriodicValidation((X_VAL, Y_VAL, Y_VAL, Y_VAL), every_n_steps=5)


# --- training metrics are not disturbed ----------------------------------------------------


def _fit(callbacks, steps_per_execution=1, epochs=2):
    keras.utils.set_random_seed(5)  # same shuffling in every run
    model = linear_model(steps_per_execution)
    recorder = Recorder()
    history = model.fit(
        X,
        Y,
        batch_size=4,
        epochs=epochs,
        shuffle=True,
        verbose=0,
        callbacks=[*callbacks, recorder],
    )
    return model, history.history, recorder


@functools.cache
def _plain_run(steps_per_execution=1):
    """Epoch history, batch logs and final weights of a run without validation."""
    model, history, recorder = _fit([], steps_per_execution)
    return history, recorder.logs, model.get_weights()


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_training_logs_identical_with_and_without_validation(steps_per_execution):
    plain, plain_batch_logs, plain_weights = _plain_run(steps_per_execution)
    validation = PeriodicValidation((X_VAL, Y_VAL), every_n_steps=3)
    model, logged, batches = _fit([validation], steps_per_execution)

    assert len(validation.history) >= 8  # it really validated mid-epoch, many times
    assert {key: logged[key] for key in plain} == plain  # epoch loss/mae identical
    assert set(logged) == {"loss", "mae", "val_loss", "val_mae"}
    for plain_logs, logs in zip(plain_batch_logs, batches.logs, strict=True):
        assert {key: logs[key] for key in plain_logs} == plain_logs
    for plain_weight, weight in zip(plain_weights, model.get_weights(), strict=True):
        np.testing.assert_array_equal(plain_weight, weight)


def test_naive_mid_epoch_evaluate_would_disturb_training_logs():
    """The comparison above can fail: a bare `evaluate()` mid-epoch changes `loss`."""

    class NaiveValidation(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch % 3 == 2:
                self.model.evaluate(X_VAL, Y_VAL, verbose=0)

    plain = _plain_run()[0]
    _, disturbed, _ = _fit([NaiveValidation()])
    assert disturbed["loss"] != plain["loss"]


# --- when validation runs ------------------------------------------------------------------


@pytest.mark.parametrize(
    "steps_per_execution, every_n_steps, expected_steps",
    [
        (1, 8, [8, 16, 24, 32, 40, 48, 56, 64]),
        (1, 10, [10, 20, 30, 40, 50, 60]),
        (4, 8, [8, 16, 24, 32, 40, 48, 56, 64]),
        (4, 10, [12, 20, 32, 40, 52, 60]),  # first execution boundary at or after 10k
        (16, 8, [16, 32, 48, 64]),  # one validation per execution, not two
        (16, 10, [16, 32, 48, 64]),
    ],
)
def test_steps_per_execution(steps_per_execution, every_n_steps, expected_steps):
    model = linear_model(steps_per_execution)
    validation = PeriodicValidation((X_VAL, Y_VAL), every_n_steps=every_n_steps)
    recorder = Recorder(keep_weights=True)
    model.fit(X, Y, batch_size=1, epochs=1, shuffle=False, verbose=0,
              callbacks=[validation, recorder])  # fmt: skip

    assert [entry["step"] for entry in validation.history] == expected_steps
    # Batch callbacks fire once per execution, with the last batch's index.
    validated_batches = [
        b for b, logs in zip(recorder.batches, recorder.logs) if "val_loss" in logs
    ]
    assert [b + 1 for b in validated_batches] == expected_steps
    # Every result belongs to the weights after the recorded step (NumPy reference).
    for entry in validation.history:
        kernel, bias = recorder.weights[recorder.batches.index(entry["step"] - 1)]
        error = X_VAL.astype("float64") @ kernel + bias - Y_VAL
        assert entry["val_loss"] == pytest.approx(np.mean(error**2), rel=1e-5)
        assert entry["val_mae"] == pytest.approx(np.mean(np.abs(error)), rel=1e-5)


def test_c12_gradient_accumulation_counts_updates():
    """Accumulation 4, validation every 10 updates, 100 micro-batches: after updates 10, 20."""
    accumulation = 4
    schedule = WarmupCosineDecayRestarts(
        0.0,
        first_decay_steps=10,
        warmup_target=0.01,
        warmup_steps=0,
        gradient_accumulation_steps=accumulation,
    )
    # x = (1, 1, 1), y = 1000 > prediction 3w: d|y - 3w| / dw_i = -1, so every update
    # moves each weight by exactly the learning rate it used.
    model = linear_model(
        optimizer=keras.optimizers.SGD(schedule, gradient_accumulation_steps=accumulation),
        loss="mae",
        metrics=(),
        use_bias=False,
        kernel_initializer="zeros",
    )
    x = np.ones((100, 3), "float32")
    y = np.full((100, 1), 1000.0, "float32")
    validation = PeriodicValidation((x[:4], y[:4]), every_n_steps=10)
    recorder = Recorder(keep_weights=True)
    model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0,
              callbacks=[validation, recorder])  # fmt: skip

    assert int(model.optimizer.iterations) == 25
    assert [entry["step"] for entry in validation.history] == [10, 20]
    validated_batches = [
        b for b, logs in zip(recorder.batches, recorder.logs) if "val_loss" in logs
    ]
    assert validated_batches == [39, 79]  # right after the 10th and 20th full cycles
    w = np.array([weights[0][0, 0] for weights in recorder.weights], "float64")
    # Weights move only at the end of an accumulation cycle.
    moved = np.nonzero(np.diff(np.concatenate([[0.0], w])))[0]
    np.testing.assert_array_equal(moved, np.arange(3, 100, 4))
    # Validation saw the weights after update 10 / 20: val MAE = 1000 - 3w.
    assert validation.history[0]["val_loss"] == pytest.approx(1000 - 3 * w[39], rel=1e-7)
    assert validation.history[1]["val_loss"] == pytest.approx(1000 - 3 * w[79], rel=1e-7)
    # The update size is the rate used: update u used SGDR(u - 1); restart after update 10.
    deltas = np.diff(np.concatenate([[0.0], w[3::4]]))
    reference = keras.optimizers.schedules.CosineDecayRestarts(0.01, 10)
    expected = [float(reference(u - 1)) for u in range(1, 26)]
    np.testing.assert_allclose(deltas, expected, rtol=2e-3, atol=1e-7)
    assert np.all(np.diff(deltas[:10]) < 0)  # one decaying period of 10 updates ...
    assert deltas[10] == pytest.approx(0.01, rel=1e-3)  # ... then the restart


def test_c12_schedule_without_conversion_restarts_after_10_micro_batches():
    """Keras feeds schedules the micro-batch count: the pitfall the conversion avoids."""
    schedule = WarmupCosineDecayRestarts(
        0.0, first_decay_steps=10, warmup_target=0.01, warmup_steps=0
    )
    optimizer = keras.optimizers.SGD(schedule, gradient_accumulation_steps=4)
    variable = keras.Variable(np.zeros(1, "float32"))
    optimizer.build([variable])
    rates = []
    for _ in range(12):
        rates.append(float(optimizer.learning_rate))
        optimizer.apply([keras.ops.ones(1)], [variable])
    assert int(optimizer.iterations) == 3  # three updates ...
    assert rates[10] == pytest.approx(0.01)  # ... yet the schedule already restarted


# --- step-gated results reach EarlyStopping / ModelCheckpoint / ReduceLROnPlateau -------


def _c13_callbacks(tmp_path):
    best = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "best.keras"), monitor="val_loss", save_best_only=True
    )
    per_round = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "step-{step}.keras"), monitor="val_loss", save_best_only=True
    )
    early_stopping = keras.callbacks.EarlyStopping(monitor="val_loss", patience=2)
    reduce_lr = keras.callbacks.ReduceLROnPlateau(
        monitor="val_loss", patience=1, factor=0.5, min_delta=0
    )
    return best, per_round, early_stopping, reduce_lr


def test_c13_early_stopping_and_checkpoint_act_on_step_gated_results(tmp_path):
    best, per_round, early_stopping, reduce_lr = _c13_callbacks(tmp_path)
    model = zero_model(optimizer=keras.optimizers.SGD(0.1))
    validation = PeriodicValidation(
        forced_validation_data([1.0, 0.9, 0.95, 0.97]),
        every_n_steps=25,
        callbacks=[best, per_round, early_stopping, reduce_lr],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            ZEROS_X, ZEROS_Y, batch_size=1, epochs=1, verbose=0, callbacks=[validation]
        )
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "not available" in m or "only with" in m], messages

    assert [e["step"] for e in validation.history] == [25, 50, 75, 100]
    np.testing.assert_allclose([e["val_loss"] for e in validation.history], [1.0, 0.9, 0.95, 0.97])
    # The best checkpoint is the one from the 2nd validation (step 50).
    assert int(keras.saving.load_model(tmp_path / "best.keras").optimizer.iterations) == 50
    # `{step}` in the file name: one file per improving validation (steps 25 and 50).
    assert sorted(os.listdir(tmp_path)) == ["best.keras", "step-25.keras", "step-50.keras"]
    # patience=2: no improvement at the 3rd and 4th validation -> stop after the 4th, in the
    # first (0-based: 0) training epoch, which stock EarlyStopping alone would never do.
    assert early_stopping.stopped_epoch == 0
    assert early_stopping.best_epoch == 0
    assert model.stop_training
    # ReduceLROnPlateau(patience=1) halved the rate after the 3rd and the 4th validation.
    assert float(model.optimizer.learning_rate) == pytest.approx(0.025)
    # History gets the epoch's latest validation result.
    assert history.history["val_loss"] == [pytest.approx(0.97)]


def test_c13_early_stopping_stops_in_the_middle_of_a_long_epoch(tmp_path):
    _, _, early_stopping, _ = _c13_callbacks(tmp_path)
    model = zero_model()
    validation = PeriodicValidation(
        forced_validation_data([1.0, 0.9, 0.95, 0.97]),
        every_n_steps=25,
        callbacks=[early_stopping],
    )
    model.fit(
        np.zeros((200, 3), "float32"),
        np.zeros((200, 1), "float32"),
        batch_size=1,
        epochs=3,
        verbose=0,
        callbacks=[validation],
    )
    assert int(model.optimizer.iterations) == 100  # of 600 planned
    assert len(validation.history) == 4


def test_driven_callbacks_report_the_training_epoch_and_the_step(tmp_path, capsys):
    csv_path = tmp_path / "log.csv"
    checkpoint = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "best.keras"), monitor="val_loss", save_best_only=True, verbose=1
    )
    # 100 steps per epoch, validation every 40: steps 40, 80 (epoch 0), 120, 160, 200 (epoch 1).
    validation = PeriodicValidation(
        forced_validation_data([1.0, 0.9, 0.8, 0.7, 0.6]),
        every_n_steps=40,
        callbacks=[keras.callbacks.CSVLogger(str(csv_path)), checkpoint],
    )
    zero_model().fit(ZEROS_X, ZEROS_Y, batch_size=1, epochs=2, verbose=0, callbacks=[validation])
    with open(csv_path) as f:
        rows = [line.strip().split(",") for line in f]
    header, rows = rows[0], rows[1:]
    column = {name: [row[header.index(name)] for row in rows] for name in ("epoch", "step")}
    assert column == {
        "epoch": ["0", "0", "1", "1", "1"],
        "step": ["40", "80", "120", "160", "200"],
    }
    np.testing.assert_allclose(
        [float(row[header.index("val_loss")]) for row in rows], [1.0, 0.9, 0.8, 0.7, 0.6]
    )
    printed = [line for line in capsys.readouterr().out.splitlines() if "improved" in line]
    assert [line.split(":")[0].strip() for line in printed] == ["Epoch 1"] * 2 + ["Epoch 2"] * 3
    assert [e["epoch"] for e in validation.history] == [0, 0, 1, 1, 1]


def test_early_stopping_does_not_stop_at_the_first_validation_below_baseline():
    # Keras' EarlyStopping never stops at the first epoch end; the first validation keeps that.
    early_stopping = keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, baseline=0.5)
    validation = PeriodicValidation(
        forced_validation_data([1.0, 1.0]), every_n_steps=25, callbacks=[early_stopping]
    )
    zero_model().fit(ZEROS_X, ZEROS_Y, batch_size=1, epochs=1, verbose=0, callbacks=[validation])
    assert [e["step"] for e in validation.history] == [25, 50]  # stopped after the second
    assert early_stopping.stopped_epoch == 0 and early_stopping.model.stop_training


def test_unbatched_validation_dataset_is_rejected_when_fit_starts():
    unbatched = tf.data.Dataset.from_tensor_slices((X_VAL, Y_VAL))
    model = linear_model()
    validation = PeriodicValidation(unbatched, every_n_steps=1000)
    with pytest.raises(ValueError, match=r"must yield batches.*\(3,\).*\(None, 3\)"):
        model.fit(X, Y, batch_size=16, epochs=1, verbose=0, callbacks=[validation])
    assert int(model.optimizer.iterations) == 0  # before any training step
    # The same data batched trains and validates.
    batched = PeriodicValidation(unbatched.batch(8), every_n_steps=2)
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0, callbacks=[batched])
    assert [e["step"] for e in batched.history] == [2, 4]


def test_stock_callback_passed_to_fit_sees_latest_result_at_epoch_end():
    early_stopping = keras.callbacks.EarlyStopping(monitor="val_loss", patience=0)
    model = zero_model()
    # Two validations per epoch; epoch-level values are each epoch's second one.
    validation = PeriodicValidation(
        forced_validation_data([1.0, 0.5, 0.8, 0.7, 0.9, 0.9]), every_n_steps=50
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            ZEROS_X, ZEROS_Y, batch_size=1, epochs=3, verbose=0,
            callbacks=[validation, early_stopping],
        )  # fmt: skip
    assert not [w for w in caught if "not available" in str(w.message)]
    np.testing.assert_allclose(history.history["val_loss"], [0.5, 0.7])
    assert early_stopping.stopped_epoch == 1  # 0.7 > 0.5 with patience 0


# --- epochs, end-of-training validation, validation_steps ---------------------------------


def test_every_n_epochs_with_and_without_validate_at_end():
    model = linear_model()
    plain = PeriodicValidation((X_VAL, Y_VAL), every_n_epochs=2)
    at_end = PeriodicValidation((X_VAL, Y_VAL), every_n_epochs=2, validate_at_end=True)
    history = model.fit(X, Y, batch_size=16, epochs=5, verbose=0, callbacks=[plain, at_end])
    for validation, expected_epochs in ((plain, [1, 3]), (at_end, [1, 3, 4])):
        assert [e["epoch"] for e in validation.history] == expected_epochs
        assert [e["step"] for e in validation.history] == [4 * (e + 1) for e in expected_epochs]
    # Epoch logs carry the latest result; both callbacks wrote the same key, last one wins.
    assert history.history["val_loss"] == [e["val_loss"] for e in at_end.history]
    assert [e["val_loss"] for e in plain.history] == [e["val_loss"] for e in at_end.history][:2]
    assert len(history.history["loss"]) == 5


def test_validate_at_end_in_step_mode():
    model = linear_model()
    plain = PeriodicValidation((X_VAL, Y_VAL), every_n_steps=25)
    at_end = PeriodicValidation((X_VAL, Y_VAL), every_n_steps=25, validate_at_end=True)
    model.fit(X[:30], Y[:30], batch_size=1, epochs=1, verbose=0, callbacks=[plain, at_end])
    assert [e["step"] for e in plain.history] == [25]
    assert [e["step"] for e in at_end.history] == [25, 30]


def test_validation_steps_caps_the_evaluation():
    targets = np.arange(1, 11, dtype="float32").reshape(10, 1)  # one batch per value
    val_ds = tf.data.Dataset.from_tensor_slices((np.zeros((10, 3), "float32"), targets)).batch(1)
    model = zero_model()
    capped = PeriodicValidation(val_ds, every_n_steps=10, validation_steps=3)
    full = PeriodicValidation(val_ds, every_n_steps=10)
    model.fit(ZEROS_X[:10], ZEROS_Y[:10], batch_size=1, verbose=0, callbacks=[capped, full])
    # MAE of a model that outputs 0 is the mean target of the batches seen.
    assert capped.history[0]["val_loss"] == pytest.approx(2.0)
    assert full.history[0]["val_loss"] == pytest.approx(5.5)


def test_tuple_validation_data_with_sample_weight():
    model = zero_model()
    targets = np.array([[1.0], [3.0]], "float32")
    weights = np.array([1.0, 0.0], "float32")
    validation = PeriodicValidation(
        (np.zeros((2, 3), "float32"), targets, weights), every_n_steps=5
    )
    model.fit(ZEROS_X[:5], ZEROS_Y[:5], batch_size=1, verbose=0, callbacks=[validation])
    # Keras' default reduction divides the weighted sum by the number of samples.
    assert validation.history[0]["val_loss"] == pytest.approx(0.5)


# --- resumable state -------------------------------------------------------------------------


def test_state_resumes_counters_and_driven_callbacks():
    model = zero_model()
    forced = forced_validation_data([1.0, 1.2])
    early_stopping = keras.callbacks.EarlyStopping(monitor="val_loss", patience=5)
    validation = PeriodicValidation(forced, every_n_steps=25, callbacks=[early_stopping])
    model.fit(ZEROS_X[:30], ZEROS_Y[:30], batch_size=1, verbose=0, callbacks=[validation])
    state = json.loads(json.dumps(validation.get_state()))  # JSON-compatible
    assert state["last_validated_step"] == 25
    assert state["callbacks"] == [{"best": 1.0, "wait": 0, "best_epoch": 0, "stopped_epoch": 0}]

    resumed_es = keras.callbacks.EarlyStopping(monitor="val_loss", patience=5)
    resumed = PeriodicValidation(forced, every_n_steps=25, callbacks=[resumed_es])
    resumed.set_state(state)
    model.fit(ZEROS_X[:30], ZEROS_Y[:30], batch_size=1, verbose=0, callbacks=[resumed])
    assert int(model.optimizer.iterations) == 60
    assert [e["step"] for e in resumed.history] == [25, 50]  # step 25 not repeated
    assert resumed_es.best == pytest.approx(1.0)  # 1.2 was no improvement on the restored best
    assert resumed_es.wait == 1

    with pytest.raises(ValueError, match="drives 0"):
        PeriodicValidation(forced, every_n_steps=25).set_state(state)
    with pytest.raises(ValueError, match="missing keys"):
        resumed.set_state({})


# --- distribution ----------------------------------------------------------------------------


@pytest.mark.distributed
def test_training_logs_identical_under_mirrored_strategy():
    strategy = two_replica_strategy()

    def run(callbacks):
        keras.utils.set_random_seed(5)
        with strategy.scope():
            model = linear_model()
        return model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=callbacks).history

    plain = run([])
    validation = PeriodicValidation((X_VAL, Y_VAL), every_n_steps=3)
    logged = run([validation])
    assert len(validation.history) == 2
    assert {key: logged[key] for key in plain} == plain


def test_periodic_validation_takes_a_single_callback():
    x, y = np.zeros((8, 2), "float32"), np.zeros((8, 1), "float32")
    stop = keras.callbacks.EarlyStopping(patience=1)
    pv = PeriodicValidation((x, y), every_n_steps=2, callbacks=stop)
    assert pv.callbacks == [stop]


# ------------------------------------ validation data that could never be evaluated (review)


def _arrays(n=16):
    x = np.random.default_rng(0).random((n, 4)).astype("float32")
    return x, x[:, :1]


@pytest.mark.parametrize(
    "make",
    [
        lambda x, y: (x, y[:5]),
        lambda x, y: (x, y, np.ones(3, "float32")),
        lambda x, y: ({"a": x, "b": x[:7]}, y),
    ],
    ids=["short_y", "short_sample_weight", "short_input_of_a_dict"],
)
def test_arrays_of_different_lengths_are_refused_at_construction(make):
    x, y = _arrays()
    with pytest.raises(ValueError, match=r"same number of samples\. Received: sizes"):
        PeriodicValidation(make(x, y), every_n_steps=2)


def test_an_infinite_dataset_needs_validation_steps():
    x, y = _arrays()
    endless = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()
    with pytest.raises(ValueError, match="infinite .*validation_steps=None"):
        PeriodicValidation(endless, every_n_steps=2)
    PeriodicValidation(endless, every_n_steps=2, validation_steps=2)  # bounded: fine


@pytest.mark.parametrize("inputs_only", [lambda x: (x,), lambda x: x], ids=["tuple", "array"])
def test_inputs_without_targets_fail_before_the_first_step(inputs_only):
    x, y = _arrays()
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = kf.OptimizedModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse")
    callback = PeriodicValidation(inputs_only(x), every_n_steps=2)
    with pytest.raises(ValueError, match="needs targets.*Received: validation_data with inputs"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[callback])
    assert int(model.optimizer.iterations) == 0


# ------------------------------------------------------------------ several named sets


def test_named_sets_log_each_set_as_evaluate_gives_it():
    """Each named set's logs equal `model.evaluate` on that set at the validated weights."""
    x_easy, y_easy = X_VAL[:8], X_VAL[:8] @ np.array([[1.0], [2.0], [3.0]], "float32")
    hard = tf.data.Dataset.from_tensor_slices((X_VAL, Y_VAL)).batch(4)
    model = linear_model()
    recorder = Recorder(keep_weights=True)
    validation = PeriodicValidation(
        {"easy": (x_easy, y_easy), "hard": hard}, every_n_steps=4, batch_size=4
    )
    model.fit(
        X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[recorder, validation]
    )
    assert [e["step"] for e in validation.history] == [4, 8]
    reference = linear_model()
    for entry in validation.history:
        assert set(entry) == {
            "step",
            "epoch",
            "val_easy_loss",
            "val_easy_mae",
            "val_hard_loss",
            "val_hard_mae",
        }
        reference.set_weights(recorder.weights[entry["step"] - 1])
        easy = reference.evaluate(x_easy, y_easy, batch_size=4, verbose=0, return_dict=True)
        hard_logs = reference.evaluate(hard, verbose=0, return_dict=True)
        for name, logs in (("easy", easy), ("hard", hard_logs)):
            for metric, value in logs.items():
                assert entry[f"val_{name}_{metric}"] == pytest.approx(value, rel=1e-6)


def test_stock_callbacks_act_on_one_named_set(tmp_path):
    """ModelCheckpoint and EarlyStopping monitor `val_hard_loss`, not the easy set's loss."""
    model = zero_model(optimizer=keras.optimizers.SGD(0.1))
    best = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "best.keras"), monitor="val_hard_loss", mode="min", save_best_only=True
    )
    early_stopping = keras.callbacks.EarlyStopping(monitor="val_hard_loss", mode="min", patience=2)
    validation = PeriodicValidation(
        {
            "easy": forced_validation_data([3.0, 2.0, 1.0, 0.5]),  # keeps improving
            "hard": forced_validation_data([1.0, 0.9, 0.95, 0.97]),  # best at the 2nd
        },
        every_n_steps=25,
        callbacks=[best, early_stopping],
    )
    model.fit(ZEROS_X, ZEROS_Y, batch_size=1, epochs=1, verbose=0, callbacks=[validation])
    assert [e["step"] for e in validation.history] == [25, 50, 75, 100]
    np.testing.assert_allclose([e["val_easy_loss"] for e in validation.history], [3, 2, 1, 0.5])
    assert int(keras.saving.load_model(tmp_path / "best.keras").optimizer.iterations) == 50
    assert model.stop_training and early_stopping.stopped_epoch == 0


def test_one_set_keeps_the_val_keys_and_fit_validation_data_keeps_its_meaning():
    """Both log `val_loss`: the epoch logs keep fit's (on its own data), said once."""
    model = linear_model()
    validation = PeriodicValidation((X_VAL, Y_VAL), every_n_steps=4, validate_at_end=True)
    with pytest.warns(kf.FastloopWarning, match=r"already logs \['val_loss', 'val_mae'\]"):
        history = model.fit(
            X,
            Y,
            batch_size=8,
            epochs=2,
            verbose=0,
            validation_data=(X[:16], Y[:16]),
            callbacks=[validation],
        )
    assert set(validation.history[0]) == {"step", "epoch", "val_loss", "val_mae"}
    fits = model.evaluate(X[:16], Y[:16], verbose=0, return_dict=True)
    ours = model.evaluate(X_VAL, Y_VAL, verbose=0, return_dict=True)
    assert history.history["val_loss"][-1] == pytest.approx(fits["loss"], rel=1e-6)
    assert validation.history[-1]["val_loss"] == pytest.approx(ours["loss"], rel=1e-6)


@pytest.mark.parametrize("optimized", [False, True], ids=["keras.Sequential", "Optimized"])
def test_a_key_of_the_training_logs_is_refused_before_it_is_overwritten(optimized):
    model = linear_model(metrics=(keras.metrics.MeanAbsoluteError(name="val_loss"),))
    if optimized:  # its metrics are built before the first step: refused before training
        model = kf.optimized(model)
    validation = PeriodicValidation((X_VAL, Y_VAL), every_n_steps=4)
    batches = []
    counter = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: batches.append(b))
    with pytest.raises(ValueError, match=r"differ from the training logs' keys.*\['val_loss'\]"):
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[counter, validation])
    assert validation.history == []
    assert len(batches) == (0 if optimized else 4)


class EmptyPyDataset(keras.utils.PyDataset):
    def __len__(self):
        return 0

    def __getitem__(self, index):
        raise IndexError(index)


@pytest.mark.parametrize(
    "validation_data, message",
    [
        ({}, "at least one validation set"),
        ({"easy": (X_VAL[:0], Y_VAL[:0])}, "at least one sample"),
        ({"": (X_VAL, Y_VAL)}, "letters, digits and underscores"),
        ({"a b": (X_VAL, Y_VAL)}, "letters, digits and underscores"),
        ({3: (X_VAL, Y_VAL)}, "letters, digits and underscores"),
        ((X_VAL[:0], Y_VAL[:0]), "at least one sample"),
        (tf.data.Dataset.from_tensor_slices((X_VAL, Y_VAL)).take(0).batch(2), "at least one"),
        (EmptyPyDataset(), r"at least one sample.*\(EmptyPyDataset\)"),
        ({"easy": (X_VAL, Y_VAL), "hard": X_VAL}, r"\['hard'\] are not.*Received: validation"),
        ({"easy": (X_VAL, Y_VAL), "hard": EmptyPyDataset()}, "at least one sample"),
    ],
)
def test_bad_validation_sets(validation_data, message):
    with pytest.raises(ValueError, match=message):
        PeriodicValidation(validation_data, every_n_steps=1)


def test_named_sets_whose_keys_would_clash_fail_before_logging():
    model = linear_model(metrics=())
    model.compile(optimizer="sgd", loss="mse", metrics=[keras.metrics.MeanAbsoluteError("b_loss")])
    validation = PeriodicValidation({"a": (X_VAL, Y_VAL), "a_b": (X_VAL, Y_VAL)}, every_n_steps=4)
    with pytest.raises(ValueError, match="val_a_b_loss"):
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0, callbacks=[validation])
    assert validation.history == []


def test_a_named_set_monitored_in_auto_mode_fails_at_construction():
    checkpoint = keras.callbacks.ModelCheckpoint("best.keras", monitor="val_hard_loss")
    with pytest.raises(ValueError, match="mode='min'.*Received: monitor='val_hard_loss'"):
        PeriodicValidation({"hard": (X_VAL, Y_VAL)}, every_n_steps=1, callbacks=[checkpoint])
