"""Embedding gradients (`tf.IndexedSlices` with repeated ids) under clipping.

The model is an `Embedding(3, 1)` (zeros) whose 4 looked-up values are summed by a frozen
`Dense` of ones, trained with SGD(1.0) on `mse`. With ids `[0, 0, 0, 0]` and target `-3`
every looked-up row gets the same gradient `g`, so the raw slices hold 4 rows of `g` for id 0
(norm `2 |g|`) while the true gradient of row 0 is `4 g` (norm `4 |g|`). One sample:
`g = 2 * (0 - (-3)) = 6`: true norm 24, raw norm 12. Two identical samples (mean over the
batch): `g = 3` over 8 rows, true norm 24 again (raw norm 8.49). After a step, row 0 moves by
`-clipped gradient` (SGD, learning rate 1).
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import EXPECT_SKIP_WARNINGS, two_replica_strategy

import keras_fastloop as kf
from keras_fastloop import clipping

pytestmark = EXPECT_SKIP_WARNINGS

IDS = np.zeros((2, 4), "int32")
TARGET = np.full((2, 1), -3.0, "float32")


def embedding_model(cls=kf.OptimizedModel, vocab=3, dim=1, initializer="zeros"):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,), dtype="int32")
    rows = keras.layers.Embedding(vocab, dim, embeddings_initializer=initializer, name="emb")(
        inputs
    )
    flat = keras.layers.Flatten()(rows)
    out = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", trainable=False)(flat)
    return cls(inputs, out)


def test_minimal_case_raw_slices_have_half_the_norm():
    """The issue's figures: the raw IndexedSlices norm is 12, the gradient's norm is 24."""
    model = embedding_model(keras.Model)
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(TARGET[:1], model(IDS[:1]))
    (grad,) = tape.gradient(loss, model.trainable_variables)
    assert isinstance(grad, tf.IndexedSlices)
    assert float(tf.linalg.global_norm([grad])) == pytest.approx(12.0)
    dense = tf.convert_to_tensor(grad).numpy()
    np.testing.assert_array_equal(dense, [[24.0], [0.0], [0.0]])
    unique = clipping.deduplicate(grad)
    assert isinstance(unique, tf.IndexedSlices)
    assert float(tf.linalg.global_norm([unique])) == pytest.approx(24.0)
    np.testing.assert_array_equal(tf.convert_to_tensor(unique).numpy(), dense)


def test_minimal_case_logs_24_and_clips_the_update_to_norm_1():
    model = embedding_model()
    model.compile(keras.optimizers.SGD(1.0), "mse", gradient_clipping=1.0)
    history = model.fit(IDS[:1], TARGET[:1], batch_size=1, epochs=1, verbose=0)
    assert history.history["grad_norm"] == [pytest.approx(24.0)]
    (table,) = model.get_weights()[:1]
    np.testing.assert_allclose(table, [[-1.0], [0.0], [0.0]], rtol=1e-6)
    assert np.linalg.norm(table) == pytest.approx(1.0)


@contextlib.contextmanager
def no_scope():
    yield


PATHS = ["plain", "micro_batched", "two_replicas"]


def train_path(path, clipper, epochs=1):
    strategy = two_replica_strategy() if path == "two_replicas" else None
    with strategy.scope() if strategy else no_scope():
        model = embedding_model()
        model.compile(
            keras.optimizers.SGD(1.0),
            "mse",
            gradient_clipping=clipper,
            micro_batch_size=1 if path == "micro_batched" else None,
        )
    history = model.fit(IDS, TARGET, batch_size=2, epochs=epochs, shuffle=False, verbose=0)
    return model, history


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("make", [lambda: clipping.ClipByGlobalNorm(1.0), lambda: 1.0])
def test_global_norm_clipping_is_the_same_on_every_path(path, make):
    model, history = train_path(path, make())
    assert history.history["grad_norm"] == [pytest.approx(24.0)]
    np.testing.assert_allclose(model.get_weights()[0], [[-1.0], [0.0], [0.0]], rtol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_clip_by_norm_is_the_same_on_every_path(path):
    model, history = train_path(path, clipping.ClipByNorm(1.0))
    assert history.history["grad_norm"] == [pytest.approx(24.0)]
    np.testing.assert_allclose(model.get_weights()[0], [[-1.0], [0.0], [0.0]], rtol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_autoclip_history_is_the_same_on_every_path(path):
    # Step 1: norm 24, threshold 24 (one value) -> row 0 = -24. Step 2: prediction -96 per
    # sample, g = -93 over 8 rows: norm 744; median of [24, 744] = 384 -> row 0 = -24 + 384.
    clipper = clipping.AutoClip(percentile=50.0, history_size=4)
    model, history = train_path(path, clipper, epochs=2)
    assert history.history["grad_norm"] == [pytest.approx(24.0), pytest.approx(744.0)]
    np.testing.assert_allclose(clipper.history.numpy(), [24.0, 744.0, 0.0, 0.0], rtol=1e-6)
    assert int(clipper.count.numpy()) == 2
    np.testing.assert_allclose(model.get_weights()[0], [[360.0], [0.0], [0.0]], rtol=1e-6)


def numpy_agc(grad, weight, clip_factor, eps):
    """AGC (Brock et al., 2021) on the dense gradient of an (rows, units) table, unit = column."""
    g_norm = np.sqrt(np.sum(grad**2, axis=0, keepdims=True))
    w_norm = np.maximum(np.sqrt(np.sum(weight**2, axis=0, keepdims=True)), eps)
    max_norm = clip_factor * w_norm
    return np.where(g_norm > max_norm, grad * max_norm / np.maximum(g_norm, 1e-6), grad)


@pytest.mark.parametrize("clip_factor", [0.01, 100.0])
def test_agc_on_indexed_slices_matches_the_dense_rule_and_stays_sparse(clip_factor):
    rng = np.random.default_rng(0)
    weight = keras.Variable(rng.normal(size=(6, 3)).astype("float32"))
    values = rng.normal(size=(5, 3)).astype("float32")
    raw = tf.IndexedSlices(tf.constant(values), tf.constant([4, 1, 4, 4, 0]), tf.constant([6, 3]))
    unique = clipping.deduplicate(raw)
    dense = tf.convert_to_tensor(raw).numpy()
    agc = clipping.AdaptiveGradientClipping(clip_factor=clip_factor, eps=1e-3)
    (got,) = agc([unique], [weight], tf.linalg.global_norm([unique]))
    assert isinstance(got, tf.IndexedSlices)
    expected = numpy_agc(dense, weight.numpy(), clip_factor, 1e-3)
    np.testing.assert_allclose(tf.convert_to_tensor(got).numpy(), expected, rtol=1e-5, atol=1e-7)
    (dense_got,) = agc([tf.constant(dense)], [weight], None)
    np.testing.assert_allclose(dense_got.numpy(), expected, rtol=1e-5, atol=1e-7)


def test_clip_by_value_on_indexed_slices_clips_the_summed_rows_and_stays_sparse():
    raw = tf.IndexedSlices(
        tf.constant([[0.6], [0.6], [-0.2]]), tf.constant([2, 2, 0]), tf.constant([3, 1])
    )
    unique = clipping.deduplicate(raw)
    (got,) = clipping.ClipByValue(1.0)([unique], [None], None)
    assert isinstance(got, tf.IndexedSlices)
    np.testing.assert_allclose(tf.convert_to_tensor(got).numpy(), [[-0.2], [0.0], [1.0]])


# --------------------------------------------------- pair: clipping x micro-batching x embedding


def text_model(cls=kf.OptimizedModel):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((6,), dtype="int32")
    rows = keras.layers.Embedding(7, 3, name="emb")(inputs)
    pooled = keras.layers.GlobalAveragePooling1D()(rows)
    return cls(inputs, keras.layers.Dense(1, name="head")(pooled))


def text_data(num_batches, batch=4, bad_batches=()):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 3, size=(num_batches * batch, 6)).astype("int32")  # many repeats
    y = rng.normal(size=(num_batches * batch, 1)).astype("float32") * 4.0
    for i in bad_batches:
        y[i * batch + 1] = np.nan
    return ids, y


@pytest.mark.parametrize(
    "clipper",
    [
        lambda: clipping.ClipByGlobalNorm(0.05),
        lambda: clipping.ClipByNorm(0.05),
        lambda: clipping.AutoClip(percentile=25.0, history_size=16),
        lambda: clipping.AdaptiveGradientClipping(clip_factor=0.02),
    ],
)
def test_micro_batching_does_not_change_clipped_training_of_an_embedding(clipper):
    """Same weights, grad_norm and skipped steps with and without micro-batches, a NaN batch in."""
    ids, y = text_data(6, bad_batches=(2,))
    runs = []
    for micro in (None, 1, 3):
        model = text_model()
        clip = clipper()
        model.compile(
            keras.optimizers.SGD(0.5), "mse", gradient_clipping=clip, micro_batch_size=micro
        )
        history = model.fit(ids, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        runs.append((model, history, clip))
    (full, full_history, full_clip), *others = runs
    assert int(full.skipped_steps.numpy()) == 2
    assert all(np.isfinite(full_history.history["loss"]))
    for model, history, clip in others:
        assert int(model.skipped_steps.numpy()) == 2
        np.testing.assert_allclose(
            history.history["grad_norm"], full_history.history["grad_norm"], rtol=1e-5
        )
        np.testing.assert_allclose(history.history["loss"], full_history.history["loss"], rtol=1e-5)
        for got, expected in zip(model.get_weights(), full.get_weights()):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        if isinstance(clip, clipping.AutoClip):
            np.testing.assert_allclose(clip.history.numpy(), full_clip.history.numpy(), rtol=1e-5)


def test_clipped_embedding_run_without_the_nan_batch_is_the_same():
    ids, y = text_data(6, bad_batches=(2,))
    keep = np.r_[0:8, 12:24]
    results = []
    for data in ((ids, y), (ids[keep], y[keep])):
        model = text_model()
        model.compile(keras.optimizers.Adam(0.05), "mse", gradient_clipping=0.05)
        history = model.fit(*data, batch_size=4, epochs=1, shuffle=False, verbose=0)
        results.append((model, history))
    (faulty, faulty_history), (clean, clean_history) = results
    assert int(faulty.skipped_steps.numpy()) == 1
    np.testing.assert_allclose(
        faulty_history.history["loss"], clean_history.history["loss"], rtol=1e-6
    )
    for got, expected in zip(faulty.get_weights(), clean.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
