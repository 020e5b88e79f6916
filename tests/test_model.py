"""OptimizedModel: equivalence with keras.Model.fit, guards, logs, errors and saving."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import EXPECT_SKIP_WARNINGS, fresh_user_data

import keras_fastloop as kf

pytestmark = EXPECT_SKIP_WARNINGS


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
    # the skipped step is not recorded: an epoch with no applied step reads NaN, never 0.0
    assert np.isnan(h.history["grad_norm"][0]) and np.isnan(h.history["loss"][0])
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
        ({"gradient_clipping": -1.0}, ValueError, "Received: gradient_clipping=-1.0"),
        ({"gradient_clipping": "big"}, ValueError, "Unknown `gradient_clipping` id"),
        ({"gradient_clipping": [1.0]}, TypeError, "gradient_clipping"),
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
    assert isinstance(loaded.gradient_clipping, kf.clipping.AutoClip)
    assert loaded.gradient_clipping.percentile == 25.0
    np.testing.assert_array_equal(
        loaded.gradient_clipping.history.numpy(), model.gradient_clipping.history.numpy()
    )
    assert int(loaded.gradient_clipping.count.numpy()) == 6
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


def test_model_keeps_two_attributes_beyond_keras_model_during_fit():
    """Beside what keras.Model holds, the model keeps its step and the step's state (which
    Keras' saving walks), at compile and during `fit` (with features and "auto" on)."""

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.during = set(vars(self.model))

    x, y = np.zeros((32, 6), "float32"), np.zeros((32,), "int64")
    during, after = [], []
    for cls, options in [
        (keras.Model, {}),
        (kf.OptimizedModel, {"gradient_clipping": 1.0, "steps_per_execution": "auto"}),
    ]:
        model, record = mlp(cls), Record()
        model.compile("sgd", "sparse_categorical_crossentropy", **options)
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[record])
        during.append(record.during)
        after.append(set(vars(model)))
    assert during[1] - during[0] == {"_fastloop_step", "_fastloop_state"}
    assert after[1] - after[0] == {"_fastloop_step", "_fastloop_state"}


# ============================ the step's semantics: sample and class weights, reductions, loss scaling


class ScalarModel(kf.OptimizedModel):
    """One scalar weight `w` (init 1.0); the output is `w` broadcast to the batch."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.w = self.add_weight(shape=(), initializer="ones", name="w")

    def call(self, x):
        return tf.zeros_like(x[:, :1]) + self.w


def identity_loss(y_true, y_pred):
    """loss = y_pred (per sample), so d loss / d w == 1."""
    return keras.ops.mean(y_pred, axis=-1) + 0.0 * keras.ops.mean(y_true, axis=-1)


def dense_model(cls, units=1, seed=0, inputs=4):
    keras.utils.set_random_seed(seed)
    i = keras.Input((inputs,))
    o = keras.layers.Dense(units, kernel_initializer="glorot_uniform")(i)
    return cls(i, o)


# ------------------------------------------------------------------------------ step semantics


def test_c1_class_weight_zero_for_the_only_class_freezes_weights():
    x = np.random.rand(8, 4).astype("float32")
    y = np.zeros((8,), "int32")  # all class 0
    keras.utils.set_random_seed(0)
    i = keras.Input((4,))
    model = kf.OptimizedModel(i, keras.layers.Dense(2, activation="softmax")(i))
    model.compile(keras.optimizers.SGD(0.5), "sparse_categorical_crossentropy")
    before = [w.copy() for w in model.get_weights()]
    history = model.fit(x, y, class_weight={0: 0.0, 1: 1.0}, batch_size=8, epochs=1, verbose=0)
    assert history.history["loss"][0] == 0.0
    for b, a in zip(before, model.get_weights()):
        np.testing.assert_array_equal(b, a)


def test_c2_weighted_reductions():
    y = np.array([[1.0], [2.0]], "float32")
    p = np.array([[2.0], [3.0]], "float32")
    sw = np.array([[0.0], [1.0]], "float32")
    assert float(keras.losses.MeanAbsoluteError()(y, p, sw)) == pytest.approx(0.5)
    mean_sw = keras.losses.MeanAbsoluteError(reduction="mean_with_sample_weight")
    assert float(mean_sw(y, p, sw)) == pytest.approx(1.0)
    assert float(mean_sw(y, p, np.zeros_like(sw))) == 0.0


def test_c2_sample_weight_in_fit_matches_keras_model():
    x = np.random.rand(32, 4).astype("float32")
    y = np.random.rand(32, 1).astype("float32")
    sw = np.random.rand(32).astype("float32")
    results = []
    for cls in (keras.Model, kf.OptimizedModel):
        model = dense_model(cls)
        model.compile(keras.optimizers.SGD(0.1), "mae")
        h = model.fit(x, y, sample_weight=sw, batch_size=8, epochs=2, verbose=0, shuffle=False)
        results.append((h.history["loss"], model.get_weights()))
    np.testing.assert_allclose(results[0][0], results[1][0], atol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_allclose(a, b, atol=1e-6)


def two_output_model(cls):
    keras.utils.set_random_seed(3)
    i = keras.Input((4,))
    h = keras.layers.Dense(8, activation="tanh")(i)
    outputs = {"a": keras.layers.Dense(1, name="a")(h), "b": keras.layers.Dense(1, name="b")(h)}
    return cls(i, outputs)


def test_c3_multi_output_dict_logs_unweighted_task_losses():
    x = np.random.rand(64, 4).astype("float32")
    y = {
        "a": np.random.rand(64, 1).astype("float32"),
        "b": 3 * np.random.rand(64, 1).astype("float32"),
    }
    model = two_output_model(kf.OptimizedModel)
    model.compile(
        keras.optimizers.SGD(0.01),
        loss={"a": "mse", "b": "mse"},
        loss_weights={"a": 1.0, "b": 0.5},
        metrics={"a": ["mae"], "b": "mse"},
    )
    logs = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    assert logs["loss"] == pytest.approx(logs["a_loss"] + 0.5 * logs["b_loss"], abs=1e-6)
    pred = model.predict(x, verbose=0)
    assert logs["a_loss"] == pytest.approx(float(np.mean((pred["a"] - y["a"]) ** 2)), rel=1e-5)
    history = model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    assert set(history.history) == {"a_loss", "b_loss", "a_mae", "b_mse", "loss"}
    h = history.history
    assert h["loss"][0] == pytest.approx(h["a_loss"][0] + 0.5 * h["b_loss"][0], abs=1e-6)


def test_c3_matches_keras_loss_weights_over_training():
    x = np.random.rand(64, 4).astype("float32")
    y = {"a": np.random.rand(64, 1).astype("float32"), "b": np.random.rand(64, 1).astype("float32")}
    out = []
    for cls in (keras.Model, kf.OptimizedModel):
        model = two_output_model(cls)
        model.compile(
            keras.optimizers.SGD(0.05), {"a": "mse", "b": "mse"}, loss_weights={"a": 1.0, "b": 0.5}
        )
        h = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        out.append((h.history, model.get_weights()))
    for key in ("loss", "a_loss", "b_loss"):
        np.testing.assert_allclose(out[0][0][key], out[1][0][key], atol=1e-6)
    for a, b in zip(out[0][1], out[1][1]):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_c4_evaluate_reports_mean_over_batches():
    # Batches of 2 whose loss (= mean of y_pred over the batch, w = 0) are 1, 2 and 3.
    model = ScalarModel()
    model.compile(
        keras.optimizers.SGD(0.0), loss=lambda yt, yp: keras.ops.mean(yt, axis=-1) + 0 * yp[:, 0]
    )
    x = np.zeros((6, 1), "float32")
    y = np.array([[1], [1], [2], [2], [3], [3]], "float32")
    assert model.evaluate(x, y, batch_size=2, verbose=0) == pytest.approx(2.0)
    # Uneven batch sizes: the mean is sample-weighted, as keras.Model.evaluate reports it.
    y2 = np.array([[1], [1], [1], [4]], "float32")
    assert model.evaluate(x[:4], y2, batch_size=3, verbose=0) == pytest.approx(7.0 / 4.0)


# ------------------------------------------------------------------------------ mixed precision


def test_c5_loss_scale_optimizer_single_scaling():
    model = ScalarModel()
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1024)
    model.compile(opt, loss=identity_loss)
    h = model.fit(np.zeros((1, 1), "float32"), np.zeros((1, 1), "float32"), epochs=1, verbose=0)
    assert model.w.numpy() == np.float32(
        0.9
    )  # forgetting scale_loss or unscaling twice: 0.99990234
    assert h.history["loss"][0] == 1.0
    assert h.history["loss_scale"][0] == 1024.0


def test_c5_mixed_float16_wraps_optimizer():
    keras.config.set_dtype_policy("mixed_float16")
    i = keras.Input((4,))
    model = kf.OptimizedModel(i, keras.layers.Dense(1, dtype="float32")(keras.layers.Dense(4)(i)))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)


class InfOnce(keras.layers.Layer):
    """Multiplies by w; the loss gradient is inf on the batches flagged in x[:, 1]."""

    def call(self, x):
        flag = x[:, 1:2]
        return x[:, :1] * tf.where(flag > 0, tf.constant(np.inf, x.dtype), 1.0)


def test_c6_dynamic_scale_skips_inf_step_and_regrows():
    model = ScalarModel()
    opt = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2.0**15, dynamic_growth_steps=2
    )

    def loss(y_true, y_pred):
        # Gradient wrt w is y_true[:, 0]: 1e35 on the first batch (a finite loss whose
        # scaled gradient, 1e35 * 2**15, overflows float32), 1 afterwards.
        return keras.ops.mean(y_pred * y_true, axis=-1)

    model.compile(opt, loss=loss)
    y = np.array([[1e35], [1.0], [1.0]], "float32")
    h = model.fit(np.zeros((3, 1), "float32"), y, batch_size=1, epochs=1, verbose=0, shuffle=False)
    del h
    assert int(model.optimizer.iterations.numpy()) == 2
    assert float(model.optimizer.dynamic_scale.numpy()) == 2.0**15
    assert int(model.skipped_steps.numpy()) == 1
    # Only the two finite steps moved w: 1 - 2 * 0.1.
    assert float(model.w.numpy()) == pytest.approx(0.8, abs=1e-7)


def test_c6_inf_step_halves_scale_and_leaves_variables():
    model = ScalarModel()
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.1), initial_scale=2.0**15)
    model.compile(opt, loss=lambda yt, yp: keras.ops.mean(yp * yt, axis=-1))
    model.fit(np.zeros((1, 1), "float32"), np.ones((1, 1), "float32"), verbose=0)  # builds Adam
    slots = [v.numpy().copy() for v in model.optimizer.variables]
    w = float(model.w.numpy())
    scale = float(model.optimizer.dynamic_scale.numpy())
    # finite loss (1e35), overflowing scaled gradient
    model.fit(np.zeros((1, 1), "float32"), np.full((1, 1), 1e35, "float32"), verbose=0)
    assert float(model.w.numpy()) == w
    assert float(model.optimizer.dynamic_scale.numpy()) == scale / 2
    after = {v.path: v.numpy() for v in model.optimizer.variables}
    for v, before in zip(model.optimizer.variables, slots):
        if "scale" in v.path or "step_counter" in v.path:
            continue
        np.testing.assert_array_equal(after[v.path], before)


def _c7_model(output_dtype):
    i = keras.Input((4,))
    h = keras.layers.Dense(4, kernel_initializer="ones")(i)  # float16 compute: values 4
    logits = keras.layers.Dense(
        3, kernel_initializer=keras.initializers.Constant(4375.0), dtype=output_dtype
    )(h)
    mask = keras.ops.convert_to_tensor([0.0, 0.0, 1.0])
    masked = keras.layers.Lambda(
        lambda t: t - 1e9 * keras.ops.cast(mask, t.dtype), dtype=output_dtype
    )(logits)
    out = keras.layers.Activation("softmax", dtype=output_dtype)(masked)
    model = kf.OptimizedModel(i, out)
    model.compile(keras.optimizers.SGD(1e-9), "sparse_categorical_crossentropy")
    return model


def test_c7_float32_output_under_mixed_float16():
    keras.config.set_dtype_policy("mixed_float16")
    x = np.ones((4, 4), "float32")  # logits 7e4 (float16 max is 65504) and a -1e9 mask constant
    model = _c7_model("float32")
    probs = model.predict(x, verbose=0)
    assert probs.dtype == np.float32
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, atol=1e-3)
    assert np.isfinite(model.evaluate(x, np.zeros(4), verbose=0))
    # The same model with its head in float16 overflows: the fault the float32 output avoids.
    with pytest.warns(UserWarning, match=r"not float32 .*\['activation"):  # said at compile
        bad_model = _c7_model("mixed_float16")
    bad = bad_model.predict(x, verbose=0)
    assert not np.all(np.isfinite(bad))


# ------------------------------------------------------- faults found by a fresh user


def test_missing_target_key_is_a_clear_error():
    keras.utils.set_random_seed(0)
    i = keras.Input((8,))
    h = keras.layers.Dense(4)(i)
    model = kf.OptimizedModel(
        i,
        {"cls": keras.layers.Dense(3, name="cls")(h), "reg": keras.layers.Dense(1, name="reg")(h)},
    )
    model.compile("sgd", {"cls": "sparse_categorical_crossentropy", "reg": "mse"})
    x, y = fresh_user_data()
    with pytest.raises(
        ValueError, match=r"no entry for output 'reg'.*Received: keys=\['cls', 'regg'\]"
    ):
        model.fit(x, {"cls": y, "regg": np.zeros((64, 1))}, verbose=0)
