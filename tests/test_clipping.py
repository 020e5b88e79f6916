"""Clippers against NumPy references (AGC unit-wise, AutoClip percentile history)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import fresh_user_data, fresh_user_mlp

import keras_fastloop as kf
from keras_fastloop import clipping


def norm(grads):
    return tf.linalg.global_norm(grads)


def test_agc_matches_numpy_unitwise_rule():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(5, 3)).astype("float32")
    b = np.array([0.0, 0.0, 0.5], "float32")
    gw = rng.normal(size=(5, 3)).astype("float32") * np.array([0.001, 1.0, 10.0], "float32")
    gb = np.array([1e-6, 1.0, 0.001], "float32")
    agc = clipping.AdaptiveGradientClipping(clip_factor=0.05, eps=1e-3)
    out = agc([tf.constant(gw), tf.constant(gb)], [tf.constant(w), tf.constant(b)], None)

    def reference(g, p, axis):
        p_norm = np.maximum(np.sqrt(np.sum(p**2, axis=axis, keepdims=axis is not None)), 1e-3)
        g_norm = np.sqrt(np.sum(g**2, axis=axis, keepdims=axis is not None))
        max_norm = 0.05 * p_norm
        return np.where(g_norm > max_norm, g * max_norm / g_norm, g)

    np.testing.assert_allclose(out[0].numpy(), reference(gw, w, 0), rtol=1e-5)
    np.testing.assert_allclose(out[1].numpy(), reference(gb, b, None), rtol=1e-5)
    # Column 0 is under its threshold and left alone; column 2 is clipped to 0.05 * |w_2|.
    np.testing.assert_array_equal(out[0].numpy()[:, 0], gw[:, 0])
    assert np.linalg.norm(out[0].numpy()[:, 2]) == pytest.approx(
        0.05 * np.linalg.norm(w[:, 2]), rel=1e-5
    )


def test_autoclip_threshold_is_numpy_percentile_of_history():
    owner = keras.layers.Layer()
    clip = clipping.AutoClip(percentile=30.0, history_size=4)
    clip.build(owner)
    norms = [5.0, 1.0, 3.0, np.inf, 2.0, 10.0, 4.0]
    history = []
    for n in norms:
        threshold = float(clip.threshold(tf.constant(n, "float32")))
        if np.isfinite(n):
            history.append(n)
        expected = np.percentile(history[-4:], 30.0)
        assert threshold == pytest.approx(expected, rel=1e-6), (n, history)
    assert int(clip.count.numpy()) == 6


def test_autoclip_clips_global_norm_at_threshold():
    owner = keras.layers.Layer()
    clip = clipping.AutoClip(percentile=50.0)
    clip.build(owner)
    g1 = [tf.constant([3.0, 0.0]), tf.constant([0.0, 4.0])]
    out = clip(g1, [None, None], norm(g1))  # history [5] -> threshold 5: unchanged
    np.testing.assert_allclose(norm(out), 5.0, rtol=1e-6)
    g2 = [tf.constant([30.0, 0.0]), tf.constant([0.0, 40.0])]
    out = clip(g2, [None, None], norm(g2))  # history [5, 50] -> median 27.5
    np.testing.assert_allclose(norm(out), 27.5, rtol=1e-6)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: clipping.ClipByGlobalNorm(0.0), "clipnorm"),
        (lambda: clipping.ClipByNorm(-1), "clipnorm"),
        (lambda: clipping.ClipByValue(True), "clipvalue"),
        (lambda: clipping.AdaptiveGradientClipping(clip_factor=0), "clip_factor"),
        (lambda: clipping.AdaptiveGradientClipping(eps=-1e-3), "eps"),
        (lambda: clipping.AutoClip(percentile=0), "percentile"),
        (lambda: clipping.AutoClip(percentile=101), "percentile"),
        (lambda: clipping.AutoClip(history_size=0), "history_size"),
    ],
)
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match) as info:
        make()
    assert "Received" in str(info.value)


@pytest.mark.parametrize(
    "clipper",
    [
        clipping.ClipByGlobalNorm(2.0),
        clipping.ClipByNorm(1.5),
        clipping.ClipByValue(0.3),
        clipping.AdaptiveGradientClipping(0.02, 1e-4),
        clipping.AutoClip(20.0, 100),
    ],
)
def test_serialization_round_trip(clipper):
    config = keras.saving.serialize_keras_object(clipper)
    restored = keras.saving.deserialize_keras_object(config, safe_mode=True)
    assert type(restored) is type(clipper) and restored.get_config() == clipper.get_config()
    assert clipping.get(config).get_config() == clipper.get_config()


def test_huge_threshold_equals_no_clipping():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    weights = []
    for clip in (None, 1e9, clipping.ClipByNorm(1e9), clipping.AdaptiveGradientClipping(1e9)):
        keras.utils.set_random_seed(0)
        i = keras.Input((5,))
        model = kf.OptimizedModel(
            i, keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(i))
        )
        model.compile(keras.optimizers.Adam(1e-2), "mse", gradient_clipping=clip)
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        weights.append(model.get_weights())
    for other in weights[1:]:
        for a, b in zip(weights[0], other):
            np.testing.assert_allclose(a, b, atol=1e-6)


# ================================ clipping in the step: the three kinds, after unscaling


def identity_loss(y_true, y_pred):
    """loss = y_pred (per sample), so d loss / d w == 1."""
    return keras.ops.mean(y_pred, axis=-1) + 0.0 * keras.ops.mean(y_true, axis=-1)


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


def test_autoclip_zero_gradient_batches_do_not_write_nan():
    x, y = fresh_user_data()
    sw = np.ones(64, "float32")
    sw[:16] = 0.0  # the first batch has a zero gradient: AutoClip's first threshold is 0
    model = fresh_user_mlp()
    model.compile(
        "sgd",
        "sparse_categorical_crossentropy",
        gradient_clipping=kf.clipping.AutoClip(),
        log_metrics=["grad_norm", "skipped_steps"],
    )
    history = model.fit(x, y, sample_weight=sw, batch_size=16, shuffle=False, epochs=2, verbose=0)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["skipped_steps"][-1] == 0


def test_get_resolves_like_keras_losses_get():
    """One behaviour for `clipping.get` and `weighting.get` (as `keras.losses.get`)."""
    assert clipping.get(None) is None and kf.weighting.get(None) is None
    assert isinstance(clipping.get("auto_clip"), clipping.AutoClip)
    assert isinstance(clipping.get("AutoClip"), clipping.AutoClip)
    assert isinstance(clipping.get("autoclip"), clipping.AutoClip)
    agc = clipping.get("adaptive_gradient_clipping")
    assert isinstance(agc, clipping.AdaptiveGradientClipping) and agc.clip_factor == 0.01
    by_norm = clipping.get(np.float32(2.0))
    assert isinstance(by_norm, clipping.ClipByGlobalNorm) and by_norm.clipnorm == 2.0
    clipper = clipping.ClipByNorm(1.0)
    assert clipping.get(clipper) is clipper
    assert isinstance(kf.weighting.get("uw"), kf.weighting.UncertaintyWeighting)
    with pytest.raises(ValueError, match=r"needs its threshold.*ClipByGlobalNorm\(clipnorm\)"):
        clipping.get("clip_by_global_norm")
    with pytest.raises(ValueError, match=r"needs its threshold.*ClipByValue\(clipvalue\)"):
        clipping.get("ClipByValue")
    with pytest.raises(ValueError, match=r"Unknown `gradient_clipping` id.*Received: gradient_cl"):
        clipping.get("autoclipp")
    with pytest.raises(ValueError, match="Unknown `loss_weighting` id"):
        kf.weighting.get("uww")
    with pytest.raises(TypeError, match="Received: gradient_clipping=True"):
        clipping.get(True)


def test_string_clipping_id_in_compile():
    inputs = keras.Input((2,))
    model = kf.OptimizedModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse", gradient_clipping="auto_clip")
    assert isinstance(model.gradient_clipping, clipping.AutoClip)
    model.compile("sgd", "mse", loss_weighting=None)  # None: Keras' fixed loss_weights
    assert isinstance(model.loss_weighting, kf.weighting.Static)


def test_a_bad_number_names_gradient_clipping_not_the_inner_clipnorm():
    with pytest.raises(ValueError, match=r"gradient_clipping.*Received: gradient_clipping=-1$"):
        clipping.get(-1)
    with pytest.raises(ValueError, match="Received: gradient_clipping=inf"):
        clipping.get(float("inf"))
