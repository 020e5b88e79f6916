"""Cases C1-C9 of shared/cases/CASES.md, each with its exact value, on OptimizedModel."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_fastloop as kf


class ScalarModel(kf.OptimizedModel):
    """One scalar weight ``w`` (init 1.0); the output is ``w`` broadcast to the batch."""

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
    bad = _c7_model("mixed_float16").predict(x, verbose=0)
    assert not np.all(np.isfinite(bad))


# ------------------------------------------------------------------------------------ clipping


class TwoVars(kf.OptimizedModel):
    """Two 2-vectors whose loss gradients are [3, 0] and [0, 4] (global norm 5)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.a = self.add_weight(shape=(2,), initializer="zeros", name="a")
        self.b = self.add_weight(shape=(2,), initializer="zeros", name="b")

    def call(self, x):
        return (
            tf.zeros_like(x[:, :1])
            + keras.ops.sum(self.a * [3.0, 0.0])
            + keras.ops.sum(self.b * [0.0, 4.0])
        )


def _update_after_one_step(gradient_clipping, optimizer=None, scale=None):
    model = TwoVars()
    opt = optimizer or keras.optimizers.SGD(1.0)
    if scale is not None:
        opt = keras.optimizers.LossScaleOptimizer(opt, initial_scale=scale)
    model.compile(opt, loss=identity_loss, gradient_clipping=gradient_clipping)
    model.fit(np.zeros((1, 1), "float32"), np.zeros((1, 1), "float32"), verbose=0)
    return -model.a.numpy(), -model.b.numpy()


@pytest.mark.parametrize(
    "clip, expected_a, expected_b",
    [
        (kf.clipping.ClipByGlobalNorm(1.0), [0.6, 0.0], [0.0, 0.8]),
        (1.0, [0.6, 0.0], [0.0, 0.8]),
        (kf.clipping.ClipByNorm(1.0), [1.0, 0.0], [0.0, 1.0]),
        (kf.clipping.ClipByValue(1.0), [1.0, 0.0], [0.0, 1.0]),
        (None, [3.0, 0.0], [0.0, 4.0]),
        (1e9, [3.0, 0.0], [0.0, 4.0]),
    ],
)
def test_c8_clipping_values(clip, expected_a, expected_b):
    a, b = _update_after_one_step(clip)
    np.testing.assert_allclose(a, expected_a, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(b, expected_b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("true_norm_factor, expected_norm", [(0.1, 0.5), (1.0, 1.0)])
def test_c9_clip_after_unscaling(true_norm_factor, expected_norm):
    # Gradients [3, 0], [0, 4] times 0.1 have norm 0.5; times 1 norm 5 -> clipped to 1.0.
    model = TwoVars()
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=1024)
    model.compile(
        opt,
        loss=lambda yt, yp: true_norm_factor * identity_loss(yt, yp),
        gradient_clipping=kf.clipping.ClipByGlobalNorm(1.0),
    )
    h = model.fit(np.zeros((1, 1), "float32"), np.zeros((1, 1), "float32"), verbose=0)
    update = np.concatenate([model.a.numpy(), model.b.numpy()])
    assert np.linalg.norm(update) == pytest.approx(expected_norm, rel=1e-3)
    assert h.history["grad_norm"][0] == pytest.approx(5 * true_norm_factor, rel=1e-3)
    if true_norm_factor == 1.0:  # the same update as without loss scaling
        a, b = _update_after_one_step(kf.clipping.ClipByGlobalNorm(1.0))
        np.testing.assert_allclose(-update, np.concatenate([a, b]), rtol=1e-3)
