"""float8 layers (`model.quantize("float8")`): their scale and amax-history variables.

Keras marks them `overwrite_with_gradient=True`: their "gradient" is their new value and the
optimizer assigns it. The step must leave them out of the norm, clipping and the non-finite check,
and combine them by maximum across micro-batches and replicas. References: `keras.Model` on one
replica (same initial weights and batches), and the clipped norm computed by hand.
"""

import warnings

import _helpers
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_fastloop as kf

BATCH = 8


def _model(cls, use_bias=False):
    """Two float8 Dense layers. Without bias by default: Keras' float8 Dense casts a float32
    bias through bfloat16, so the bias gradient is rounded to bfloat16, and a sum of rounded
    micro-batch (or replica) parts differs from the rounded whole (by bfloat16's precision)."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activation="tanh", use_bias=use_bias, name="h")(inputs)
    model = cls(inputs, keras.layers.Dense(1, use_bias=use_bias, name="o")(h))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Layer InputLayer does not have a `quantize` method")
        model.quantize("float8")
    return model


def _data(batches=3):
    """Batches whose second half has 4x larger inputs: each half has its own amax."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * BATCH, 4)).astype("float32")
    x.reshape(batches, BATCH, 4)[:, BATCH // 2 :] *= 4.0
    y = (np.tanh(x @ rng.normal(size=(4, 1))) + 0.1 * rng.normal(size=(len(x), 1))).astype(
        "float32"
    )
    return x, y


def _train(cls, optimizer=None, strategy=None, data=None, use_bias=False, **compile_kwargs):
    strategy = strategy or tf.distribute.get_strategy()
    x, y = data or _data()
    with strategy.scope():
        model = _model(cls, use_bias)
        model.compile(optimizer or keras.optimizers.SGD(0.1), "mse", **compile_kwargs)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model, history.history


def _overwritten(model):
    return [v for v in model.trainable_variables if v.overwrite_with_gradient]


def _assert_same_weights(model, reference, atol=1e-6):
    assert len(_overwritten(reference)) == 12  # 2 layers x (3 scales + 3 amax histories)
    for ours, theirs in zip(model.weights, reference.weights):
        assert ours.path == theirs.path
        np.testing.assert_allclose(
            ours.numpy(), theirs.numpy(), atol=atol, rtol=1e-5, err_msg=ours.path
        )


def test_float8_dense_matches_keras_model():
    reference, _ = _train(keras.Model, use_bias=True)
    model, _ = _train(kf.OptimizedModel, use_bias=True)
    _assert_same_weights(model, reference, atol=0)
    assert np.max(reference.get_layer("h").inputs_amax_history.numpy()) > 0  # they were updated


def test_loss_scale_optimizer_matches_keras_model():
    reference, _ = _train(
        keras.Model, keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    )
    model, _ = _train(
        kf.OptimizedModel, keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    )
    _assert_same_weights(model, reference)


def test_micro_batches_take_the_maximum():
    """Summed over 2 micro-batches the scales would double and the amax be a sum."""
    reference, _ = _train(keras.Model)
    model, _ = _train(kf.OptimizedModel, micro_batch_size=BATCH // 2)
    _assert_same_weights(model, reference)


def _hand_norm_of_first_step():
    """Global norm of the first batch's gradient of the ordinary variables, by GradientTape."""
    x, y = _data()
    model = _model(keras.Model, use_bias=True)
    ordinary = [v for v in model.trainable_variables if not v.overwrite_with_gradient]

    @tf.function  # Keras' float8 custom gradient is written for graph mode
    def norm():
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(y[:BATCH], model(x[:BATCH], training=True))
            loss = tf.reduce_mean(loss)
        return tf.linalg.global_norm(tape.gradient(loss, ordinary))

    return float(norm())


def test_clipping_norm_leaves_them_out():
    norm = _hand_norm_of_first_step()
    clip = norm / 2  # the first step is clipped
    reference, _ = _train(
        keras.Model, keras.optimizers.SGD(0.1, global_clipnorm=clip), use_bias=True
    )
    model, history = _train(
        kf.OptimizedModel,
        data=tuple(a[:BATCH] for a in _data()),
        use_bias=True,
        gradient_clipping=clip,
        log_metrics=["grad_norm"],
    )
    np.testing.assert_allclose(history["grad_norm"][0], norm, rtol=1e-5)
    model, _ = _train(kf.OptimizedModel, gradient_clipping=clip, use_bias=True)
    _assert_same_weights(model, reference)


@_helpers.EXPECT_SKIP_WARNINGS[0]
@_helpers.EXPECT_SKIP_WARNINGS[1]
def test_skipped_step_leaves_them_unchanged():
    """A batch with a NaN target is skipped whole: as if it was not in the data."""
    x, y = _data()
    bad_y = y.copy()
    bad_y[BATCH + 1] = np.nan
    model, _ = _train(kf.OptimizedModel, data=(x, bad_y), nonfinite="skip", use_bias=True)
    keep = np.r_[0:BATCH, 2 * BATCH : 3 * BATCH]
    reference, _ = _train(keras.Model, data=(x[keep], y[keep]), use_bias=True)
    _assert_same_weights(model, reference)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_replicas_match_one_replica():
    """Each replica holds one half of every batch (small and large inputs): the amax is the
    maximum over both, as on one replica. keras.Model keeps one replica's own value."""
    strategy = _helpers.two_replica_strategy()
    reference, _ = _train(keras.Model)
    model, _ = _train(kf.OptimizedModel, strategy=strategy, micro_batch_size=2)
    _assert_same_weights(model, reference)
    model, _ = _train(kf.OptimizedModel, strategy=strategy)
    _assert_same_weights(model, reference)
    keras_two, _ = _train(keras.Model, strategy=strategy)
    amax = keras_two.get_layer("h").inputs_amax_history.numpy()
    assert not np.allclose(amax, reference.get_layer("h").inputs_amax_history.numpy())


def test_gradient_based_weighting_is_refused_at_compile():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activation="tanh", name="h")(inputs)
    model = kf.OptimizedModel(
        inputs, {"a": keras.layers.Dense(1, name="a")(h), "b": keras.layers.Dense(1, name="b")(h)}
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Layer InputLayer does not have a `quantize` method")
        model.quantize("float8")
    with pytest.raises(ValueError, match=r"combines per-task gradients.*loss_weighting='pcgrad'"):
        model.compile("sgd", {"a": "mse", "b": "mse"}, loss_weighting="pcgrad")
    assert not model.compiled
    model.compile("sgd", {"a": "mse", "b": "mse"}, loss_weighting="uw")  # loss-based: accepted


def _hand_sam(rho, batches):
    """SAM by GradientTape on the float8 model: `e` from the ordinary gradients only; the
    scales and amax histories get the values of the unperturbed pass (the update's own)."""
    x, y = _data(batches)
    model = _model(keras.Model)
    optimizer = keras.optimizers.SGD(0.1)
    variables = model.trainable_variables
    optimizer.build(variables)

    def gradient(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(yb, model(xb, training=True)))
        return tape.gradient(loss, variables)

    @tf.function
    def step(xb, yb):
        first = gradient(xb, yb)
        ordinary = [(g, v) for g, v in zip(first, variables) if not v.overwrite_with_gradient]
        norm = tf.linalg.global_norm([g for g, _ in ordinary])
        saved = [tf.identity(v) for _, v in ordinary]
        for g, v in ordinary:
            v.assign_add(rho * g / (norm + 1e-12))
        second = gradient(xb, yb)
        for (_, v), w in zip(ordinary, saved):
            v.assign(w)
        update = [
            g1 if v.overwrite_with_gradient else g2 for g1, g2, v in zip(first, second, variables)
        ]
        optimizer.apply(update, variables)

    for i in range(batches):
        step(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH])
    return model


def test_sam_perturbs_only_ordinary_variables():
    """SAM's `e` and second pass leave the scales and amax histories to the first pass."""
    reference = _hand_sam(0.05, 3)
    model, _ = _train(kf.OptimizedModel, sam_rho=0.05)
    _assert_same_weights(model, reference)
    plain, _ = _train(kf.OptimizedModel)
    assert not np.allclose(model.get_layer("h").kernel.numpy(), plain.get_layer("h").kernel.numpy())


def test_use_ema_is_refused_at_compile():
    """Keras keeps no average for the scales and amax histories and `fit` fails at its end,
    after training (keras.Model too): refused before training, the model left uncompiled."""
    model = _model(kf.OptimizedModel)
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1, use_ema=True))
    with pytest.raises(ValueError, match=r"use_ema=True.*Received: optimizer=SGD\(use_ema=True\)"):
        model.compile(optimizer, "mse")
    assert not model.compiled
    model.compile(keras.optimizers.SGD(0.1), "mse")  # without the average: accepted
