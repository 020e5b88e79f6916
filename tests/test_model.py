"""OptimizedModel: equivalence with keras.Model.fit, guards, logs, errors and saving."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_fastloop as kf


def mlp(cls, seed=0, regularize=False, outputs="single"):
    keras.utils.set_random_seed(seed)
    reg = keras.regularizers.L2(1e-2) if regularize else None
    i = keras.Input((6,))
    h = keras.layers.Dense(16, activation="relu", kernel_regularizer=reg)(i)
    if outputs == "single":
        return cls(i, keras.layers.Dense(3, activation="softmax")(h))
    heads = [
        keras.layers.Dense(3, activation="softmax", name="cls")(h),
        keras.layers.Dense(1, name="reg")(h),
    ]
    return cls(i, heads if outputs == "list" else {"cls": heads[0], "reg": heads[1]})


def data(n=96):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 6)).astype("float32")
    return x, rng.integers(0, 3, n), rng.normal(size=(n, 1)).astype("float32")


def fit_both(
    outputs="single",
    regularize=False,
    optimizer=lambda: keras.optimizers.Adam(1e-2),
    epochs=2,
    **fit,
):
    x, y_cls, y_reg = data()
    if outputs == "single":
        y, loss, weights = y_cls, "sparse_categorical_crossentropy", None
    elif outputs == "list":
        y, loss, weights = [y_cls, y_reg], ["sparse_categorical_crossentropy", "mse"], [1.0, 0.3]
    else:
        y = {"cls": y_cls, "reg": y_reg}
        loss, weights = (
            {"cls": "sparse_categorical_crossentropy", "reg": "mse"},
            {"cls": 1.0, "reg": 0.3},
        )
    runs = []
    for cls in (keras.Model, kf.OptimizedModel):
        model = mlp(cls, regularize=regularize, outputs=outputs)
        model.compile(optimizer(), loss, loss_weights=weights, metrics=None)
        h = model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, shuffle=False, **fit)
        runs.append((h.history, model.get_weights(), model))
    return runs


@pytest.mark.parametrize("outputs", ["single", "list", "dict"])
@pytest.mark.parametrize("regularize", [False, True])
def test_features_off_equals_keras_fit(outputs, regularize):
    (h_ref, w_ref, _), (h, w, _) = fit_both(outputs, regularize)
    for key, values in h_ref.items():
        np.testing.assert_allclose(values, h[key], atol=1e-6, err_msg=key)
    for a, b in zip(w_ref, w):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert set(h) == set(h_ref)  # features off: exactly keras.Model's keys


def test_features_off_equals_keras_fit_with_steps_per_execution_and_validation():
    x, y, _ = data()
    runs = []
    for cls in (keras.Model, kf.OptimizedModel):
        model = mlp(cls)
        model.compile(
            keras.optimizers.SGD(0.1, momentum=0.9),
            "sparse_categorical_crossentropy",
            metrics=["accuracy"],
            steps_per_execution=4,
        )
        h = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, validation_split=0.25)
        runs.append((h.history, model.get_weights()))
    for key, values in runs[0][0].items():
        np.testing.assert_allclose(values, runs[1][0][key], atol=1e-6, err_msg=key)
    for a, b in zip(runs[0][1], runs[1][1]):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_subclassed_model_trains():
    class Net(kf.OptimizedModel):
        def __init__(self):
            super().__init__()
            self.d1 = keras.layers.Dense(8, activation="relu")
            self.d2 = keras.layers.Dense(3, activation="softmax")

        def call(self, x):
            return self.d2(self.d1(x))

    x, y, _ = data()
    model = Net()
    model.compile("adam", "sparse_categorical_crossentropy", gradient_clipping=1.0)
    h = model.fit(x, y, epochs=3, verbose=0)
    assert h.history["loss"][-1] < h.history["loss"][0]
    # Functional use in the same process does not break subclassing (and vice versa).
    mlp(kf.OptimizedModel).compile("sgd", "sparse_categorical_crossentropy")
    assert isinstance(Net(), kf.OptimizedModel)


class InfWhenFlagged(keras.layers.Layer):
    """Identity, except NaN for batches holding a value > 100."""

    def call(self, x):
        factor = keras.ops.where(keras.ops.max(x) > 100.0, float("nan"), 1.0)
        return x * keras.ops.cast(factor, x.dtype)


def test_nonfinite_gradient_skips_whole_update_without_loss_scaling():
    keras.utils.set_random_seed(0)
    i = keras.Input((6,))
    h = keras.layers.Dense(6)(InfWhenFlagged()(i))
    model = kf.OptimizedModel(i, keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.Adam(1e-2), "mse", log_metrics=["grad_norm", "skipped_steps"])
    x, _, y = data(32)
    model.fit(x, y, batch_size=32, verbose=0)  # one good step: Adam's slots exist
    weights = [w.copy() for w in model.get_weights()]
    slots = [v.numpy().copy() for v in model.optimizer.variables]
    bad_x = x.copy()
    bad_x[0, 0] = 1e6
    h = model.fit(bad_x, y, batch_size=32, verbose=0)
    assert h.history["skipped_steps"] == [1.0]
    assert h.history["grad_norm"] == [0.0]  # the skipped step is not recorded
    assert h.history["loss"] == [0.0]  # ... nor is its NaN loss
    for a, b in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, v in zip(slots, model.optimizer.variables):
        np.testing.assert_array_equal(a, v.numpy())
    assert int(model.optimizer.iterations.numpy()) == 1
    h = model.fit(x, y, batch_size=32, verbose=0)  # training resumes
    assert int(model.optimizer.iterations.numpy()) == 2
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def test_unconnected_variables_are_left_out_with_one_warning():
    i = keras.Input((6,))
    unused = keras.layers.Dense(2, name="unused_head")
    used = keras.layers.Dense(1, name="used")(i)
    _ = unused(i)
    model = kf.OptimizedModel(i, used)
    model.unused_head = unused  # tracked, trainable, not on the loss path
    model.compile(keras.optimizers.SGD(0.1), "mse")
    assert len(model.trainable_variables) == 4
    before = unused.get_weights()
    x, _, y = data(32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    messages = [str(w.message) for w in caught if "get no gradient" in str(w.message)]
    assert len(messages) == 1
    assert "unused_head/kernel" in messages[0] and "unused_head/bias" in messages[0]
    for a, b in zip(before, unused.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_logs_carry_grad_norm_that_matches_numpy():
    x, y, _ = data(16)
    model = mlp(kf.OptimizedModel)
    model.compile(
        keras.optimizers.SGD(0.0), "sparse_categorical_crossentropy", gradient_clipping=1e9
    )
    with tf.GradientTape() as tape:
        loss = keras.losses.SparseCategoricalCrossentropy()(y, model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    expected = np.sqrt(sum(float(np.sum(g.numpy() ** 2)) for g in grads))
    h = model.fit(x, y, batch_size=16, verbose=0)
    assert h.history["grad_norm"][0] == pytest.approx(expected, rel=1e-5)


def test_clipping_set_twice_is_rejected():
    model = mlp(kf.OptimizedModel)
    with pytest.raises(ValueError, match="clipping is set twice.*global_clipnorm=1.0"):
        model.compile(keras.optimizers.Adam(global_clipnorm=1.0), "mse", gradient_clipping=2.0)
    with pytest.raises(ValueError, match="clipnorm=0.5"):
        model.compile(
            keras.optimizers.SGD(clipnorm=0.5),
            "mse",
            gradient_clipping=kf.clipping.ClipByValue(1.0),
        )
    model.compile(keras.optimizers.Adam(global_clipnorm=1.0), "mse")  # one place only: fine


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"gradient_clipping": -1.0}, ValueError, "clipnorm"),
        ({"gradient_clipping": "big"}, TypeError, "gradient_clipping"),
        ({"nonfinite": "ignore"}, ValueError, "nonfinite"),
        ({"micro_batch_size": 0}, ValueError, "micro_batch_size"),
        ({"loss_weighting": "nope"}, ValueError, "loss_weighting"),
        ({"loss": None, "loss_weighting": "ew"}, ValueError, "loss"),
        ({"loss": None, "micro_batch_size": 4}, ValueError, "micro_batch_size"),
        ({"loss_weights": [1.0, 2.0]}, ValueError, "loss_weights"),
    ],
)
def test_bad_compile_arguments_raise_clear_errors(kwargs, error, match):
    model = mlp(kf.OptimizedModel)
    args = {"optimizer": "sgd", "loss": "sparse_categorical_crossentropy", **kwargs}
    with pytest.raises(error, match=match) as info:
        model.compile(**args)
    assert "Received" in str(info.value)


def test_save_and_load_restore_training_configuration(tmp_path):
    x, y, _ = data()
    model = mlp(kf.OptimizedModel)
    model.compile(
        keras.optimizers.Adam(1e-2),
        "sparse_categorical_crossentropy",
        metrics=["accuracy"],
        gradient_clipping=kf.clipping.AutoClip(percentile=25.0),
    )
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert type(loaded).__name__ == "OptimizedModel" and isinstance(loaded, kf.OptimizedModel)
    assert isinstance(loaded._gradient_clipping, kf.clipping.AutoClip)
    assert loaded._gradient_clipping.percentile == 25.0
    np.testing.assert_array_equal(
        loaded._gradient_clipping.history.numpy(), model._gradient_clipping.history.numpy()
    )
    assert int(loaded._gradient_clipping.count.numpy()) == 6
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
    # Training continues identically from the loaded model.
    h1 = model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    h2 = loaded.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], atol=1e-6)


def test_step_state_is_not_in_model_weights_but_is_saved(tmp_path):
    keras_model = mlp(keras.Model)
    model = mlp(kf.OptimizedModel)
    model.compile("sgd", "sparse_categorical_crossentropy")
    assert len(model.weights) == len(keras_model.weights)
    model.set_weights(keras_model.get_weights())
    model.skipped_steps.assign(7)
    model.save_weights(tmp_path / "w.weights.h5")
    other = mlp(kf.OptimizedModel)
    other.compile("sgd", "sparse_categorical_crossentropy")
    other.load_weights(tmp_path / "w.weights.h5")
    assert int(other.skipped_steps.numpy()) == 7
