"""The step's logs tell the truth: step statistics only the stages write, any metric result kind,
a routine loss-scale overflow never logged as a NaN loss, and `minimize` misuse refused.

References: hand-written `GradientTape` loops (`tf.linalg.global_norm` of each batch's
gradient), `keras.Model` (with `LossScaleOptimizer` under `mixed_float16`), and the patterns of
the keras-io guides "Customizing what happens in fit()" and "Training & evaluation with the
built-in methods". Synthetic tensors throughout.
"""

import csv
import pathlib
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_fastloop as kf

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide.md"


def data(n=64, d=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32") * 10
    y = (x @ rng.normal(size=(d, 1)) + 5).astype("float32")
    return x, y


def guide_model(base, use_stages=True, seed=3):
    """The Keras guide's step, its metrics loop included (every metric not named "loss")."""

    class Guide(base):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            if use_stages:
                self.fastloop_step.minimize(loss, self.trainable_variables, tape)
            else:
                grads = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply(grads, self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    inputs = keras.Input((3,))
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed))
    return Guide(inputs, dense(inputs))


def hand_norms(model, x, y, batch_size, epochs, lr, clip=None):
    """Per-epoch means of `tf.linalg.global_norm` of each batch's MSE gradient, with SGD
    updates (clipped by global norm when `clip`) applied to a copy of `model`'s weights."""
    variables = [tf.Variable(w) for w in model.get_weights()]
    means = []
    for _ in range(epochs):
        norms = []
        for i in range(0, len(x), batch_size):
            xb, yb = x[i : i + batch_size], y[i : i + batch_size]
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(xb @ variables[0] + variables[1] - yb))
            grads = tape.gradient(loss, variables)
            norm = tf.linalg.global_norm(grads)
            norms.append(float(norm))
            if clip is not None:
                grads, _ = tf.clip_by_global_norm(grads, clip, use_norm=norm)
            for v, g in zip(variables, grads):
                v.assign_sub(lr * g)
        means.append(np.mean(norms))
    return means, [v.numpy() for v in variables]


# ------------------------------------------------------------------------------- item 2


@pytest.mark.parametrize("steps_per_execution", [1, 2, "auto"])
def test_guide_step_logs_the_true_mean_grad_norm_to_stock_callbacks(tmp_path, steps_per_execution):
    x, y = data()
    model = guide_model(kf.OptimizedModel)
    means, _ = hand_norms(model, x, y, batch_size=16, epochs=2, lr=0.01)
    model.compile(
        keras.optimizers.SGD(0.01),
        "mse",
        log_metrics=["grad_norm"],
        steps_per_execution=steps_per_execution,
    )
    assert "grad_norm" not in [m.name for m in model.metrics]
    path, batches = tmp_path / "log.csv", []
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        shuffle=False,
        verbose=2,
        callbacks=[
            keras.callbacks.CSVLogger(str(path)),
            keras.callbacks.TensorBoard(str(tmp_path / "tb")),
            keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: batches.append(logs)),
        ],
    )
    np.testing.assert_allclose(history.history["grad_norm"], means, rtol=1e-5)
    rows = list(csv.DictReader(path.open()))
    np.testing.assert_allclose([float(r["grad_norm"]) for r in rows], means, rtol=1e-5)
    assert batches and all("grad_norm" in logs for logs in batches)  # what the progress bar reads
    written = [
        float(tf.make_ndarray(value.tensor))
        for event_file in sorted((tmp_path / "tb" / "train").glob("events.out.tfevents.*"))
        for event in tf.compat.v1.train.summary_iterator(str(event_file))
        for value in event.summary.value
        if value.tag == "epoch_grad_norm"
    ]
    np.testing.assert_allclose(written, means, rtol=1e-5)
    logs = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    assert set(logs) == {"loss"}


def test_step_that_never_minimizes_logs_no_grad_norm():
    x, y = data()
    model = guide_model(kf.OptimizedModel, use_stages=False)
    model.compile(keras.optimizers.SGD(0.01), "mse", log_metrics=["grad_norm"])
    with pytest.warns(kf.FastloopWarning, match="never calls the step's stages"):
        history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert set(history.history) == {"loss"}


def test_default_step_grad_norm_still_logged_and_reset_each_epoch():
    x, y = data()
    inputs = keras.Input((3,))
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(3))
    model = kf.OptimizedModel(inputs, dense(inputs))
    means, weights = hand_norms(model, x, y, batch_size=16, epochs=2, lr=0.01, clip=50.0)
    model.compile(keras.optimizers.SGD(0.01), "mse", gradient_clipping=50.0)
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["grad_norm"], means, rtol=1e-5)
    for a, b in zip(weights, model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def guide_block():
    """The python block of docs/guide.md's custom-step section, exactly as printed."""
    section = GUIDE.read_text().split("## Your own `train_step`")[1].split("\n## ")[0]
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1
    return blocks[0]


def test_guide_custom_step_section_runs_as_printed_and_logs_the_true_grad_norm():
    block = guide_block()
    assert "for metric in self.metrics:" in block and "update_state(y, y_pred)" in block
    keras.utils.set_random_seed(0)
    namespace = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", kf.FastloopWarning)
        exec(compile(block, str(GUIDE), "exec"), namespace)
    model, history, x, y = (namespace[k] for k in ("model", "history", "x", "y"))
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    reference = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    means, weights = hand_norms(reference, x, y, batch_size=16, epochs=2, lr=0.01, clip=1.0)
    np.testing.assert_allclose(history.history["grad_norm"], means, rtol=1e-5)
    for a, b in zip(weights, model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------- item 3


def _minimize_model(misuse):
    class Misused(kf.OptimizedModel):
        def train_step(self, data):
            x, y = data
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            with tf.GradientTape() as tape:
                if misuse != "outside":
                    loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            optimizer = {"string": "adam", "loss": keras.losses.MeanSquaredError()}.get(misuse)
            self.fastloop_step.minimize(loss, self.trainable_variables, tape, optimizer)
            return {"loss": loss}

    inputs = keras.Input((3,))
    return Misused(inputs, keras.layers.Dense(1)(inputs))


@pytest.mark.parametrize(
    "misuse, error, match",
    [
        ("outside", ValueError, "No gradients provided for any variable.*Received: variables="),
        ("string", TypeError, "Optimizer. instance.*Received: optimizer='adam'"),
        ("loss", TypeError, "Optimizer. instance.*Received: optimizer=<.*mean_squared_error"),
    ],
)
def test_minimize_misuse_fails_clearly_before_any_update(misuse, error, match):
    x, y = data(n=16)
    model = _minimize_model(misuse)
    model.compile(keras.optimizers.SGD(0.01), "mse")
    before = model.get_weights()
    with pytest.raises(error, match=match):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_apply_gradients_checks_its_arguments():
    inputs = keras.Input((3,))
    model = kf.OptimizedModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(keras.optimizers.SGD(0.01), "mse")
    step, variables = model.fastloop_step, model.trainable_variables
    with pytest.raises(ValueError, match="one gradient per variable.*Received: len"):
        step.apply_gradients([tf.zeros((3, 1))], variables)
    with pytest.raises(ValueError, match="No gradients provided"):
        step.apply_gradients([None, None], variables)
    with pytest.raises(TypeError, match="Received: optimizer='sgd'"):
        step.apply_gradients([None, None], variables, optimizer="sgd")


# ------------------------------------------------------------------------------- item 5


class CategoricalTruePositives(keras.metrics.Metric):
    """The keras-io guide's metric: `result()` returns its variable."""

    def __init__(self, name="categorical_true_positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_variable(shape=(), name="ctp", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = keras.ops.reshape(keras.ops.argmax(y_pred, axis=1), (-1, 1))
        values = keras.ops.cast(y_true, "int32") == keras.ops.cast(y_pred, "int32")
        values = keras.ops.cast(values, "float32")
        if sample_weight is not None:
            values = keras.ops.multiply(values, keras.ops.cast(sample_weight, "float32"))
        self.true_positives.assign_add(keras.ops.sum(values))

    def result(self):
        return self.true_positives

    def reset_state(self):
        self.true_positives.assign(0.0)


class ActivityRegularization(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(keras.ops.sum(inputs) * 0.1)
        return inputs


def classifier(base):
    inputs = keras.Input((8,), name="digits")
    x = keras.layers.Dense(16, activation="relu", name="dense_1")(inputs)
    x = ActivityRegularization()(x)
    outputs = keras.layers.Dense(4, activation="softmax", name="predictions")(x)
    return base(inputs, outputs)


@pytest.mark.parametrize("features", [{}, {"log_metrics": ["grad_norm"], "nonfinite": "raise"}])
def test_built_in_methods_guide_metric_patterns_log_as_keras_model(features):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.integers(0, 4, size=(64, 1))
    runs = []
    for base, options in ((keras.Model, {}), (kf.OptimizedModel, features)):
        keras.utils.set_random_seed(1)
        model = classifier(base)
        model.compile(
            optimizer=keras.optimizers.RMSprop(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(),
            metrics=[CategoricalTruePositives(), keras.metrics.SparseCategoricalAccuracy()],
            **options,
        )
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        runs.append(history.history)
    reference, ours = runs
    ours = {k: v for k, v in ours.items() if k != "grad_norm"}
    assert set(ours) == set(reference)
    for key in reference:
        np.testing.assert_allclose(ours[key], reference[key], rtol=1e-5, err_msg=key)


def test_epoch_logs_handle_every_value_kind():
    inputs = keras.Input((3,))
    model = kf.OptimizedModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(keras.optimizers.SGD(0.01), "mse")
    step = model.fastloop_step
    variable = keras.Variable(2.0)
    values = {
        "tensor": tf.constant(1.0),
        "variable": variable,
        "numpy": np.float32(3.0),
        "array": np.array([4.0]),
        "float": 5.0,
        "int": 6,
        "int_tensor": tf.constant(7),
    }
    step.skipped_in_epoch.assign(1)  # every step skipped for a non-finite value: NaN
    logs = step.epoch_logs(values)
    for key in ("tensor", "variable", "numpy", "array", "float"):
        assert np.all(np.isnan(np.asarray(logs[key]))), key
    assert logs["int"] == 6 and int(logs["int_tensor"]) == 7
    step.applied_in_epoch.assign(1)
    logs = step.epoch_logs(values)
    assert [float(np.asarray(logs[k]).ravel()[0]) for k in ("tensor", "variable", "float")] == [
        1.0,
        2.0,
        5.0,
    ]


# ------------------------------------------------------------------------------- item 6


@pytest.fixture
def mixed_float16():
    keras.config.set_dtype_policy("mixed_float16")
    yield
    keras.config.set_dtype_policy("float32")


def _mixed_model(base):
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, kernel_initializer=keras.initializers.GlorotUniform(1))(inputs)
    outputs = keras.layers.Dense(
        1, dtype="float32", kernel_initializer=keras.initializers.GlorotUniform(2)
    )(hidden)
    return base(inputs, outputs)


def test_routine_overflow_in_a_one_step_epoch_is_not_a_nan_loss(mixed_float16):
    x, y = data(n=8)
    runs = []
    for base, options in ((keras.Model, {}), (kf.OptimizedModel, {"nonfinite": "skip"})):
        model = _mixed_model(base)
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(1e-3), initial_scale=2.0**60
        )
        model.compile(optimizer, "mse", **options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(
                x,
                y,
                batch_size=8,
                epochs=2,
                shuffle=False,
                verbose=0,
                callbacks=[keras.callbacks.TerminateOnNaN()],
            )
        runs.append((history.history, float(model.optimizer.dynamic_scale.numpy()), caught))
    (reference, ref_scale, _), (ours, scale, caught) = runs
    assert len(reference["loss"]) == 2  # Keras trains on: the overflow is routine
    assert np.all(np.isfinite(reference["loss"]))
    assert scale == ref_scale < 2.0**60
    np.testing.assert_allclose(ours["loss"], reference["loss"], rtol=1e-3)
    said = [str(w.message) for w in caught if issubclass(w.category, kf.FastloopWarning)]
    assert any("overflow" in m.lower() for m in said), said


def test_nonfinite_loss_in_an_all_skipped_epoch_is_still_nan(mixed_float16):
    x, y = data(n=8)
    y = y.copy()
    y[0, 0] = np.nan
    model = _mixed_model(kf.OptimizedModel)
    model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3)), "mse")
    with pytest.warns(kf.FastloopWarning, match="skipped"):
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert np.isnan(history.history["loss"][0])
