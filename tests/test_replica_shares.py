"""Replicas with unequal shares of the loss denominator (a smaller last batch, unevenly masked tokens).

Each replica's Keras loss divides by its own denominator (samples, real tokens under a mask, or
the sum of its sample weights); OptimizedModel weights it by `R * D_r / D` (one all-reduce),
so 1 and 2 replicas agree for any split of the global batch (keras_fastloop/_step/loss_shares.py).
Reference: the 1-replica run on the same global batches, and hand-computed values.
"""

import _helpers
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_fastloop as kf

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # integration: the slow job

BATCH = 8
SAMPLES = 11  # global batches of 8 and 3; the last one is split 2/1 across 2 replicas


def _data(n=SAMPLES):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = {
        "a": (x @ rng.normal(size=(4, 1)) * 5.0).astype("float32"),
        "b": (rng.normal(size=(n, 1)) * 3.0).astype("float32"),
    }
    sw = rng.uniform(0.1, 2.0, size=(n,)).astype("float32")
    return x, y, sw


def _build(cls):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh", name="shared")(inputs)
    return cls(
        inputs, {"a": keras.layers.Dense(1, name="a")(h), "b": keras.layers.Dense(1, name="b")(h)}
    )


def _train(strategy, loss=None, sample_weights=True, cls=kf.OptimizedModel, **kwargs):
    x, y, sw = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y, sw) if sample_weights else (x, y))
    dataset = dataset.batch(BATCH)
    with strategy.scope():
        model = _build(cls)
        model.compile(
            keras.optimizers.SGD(0.05, momentum=0.9),
            loss or {"a": "mse", "b": "mse"},
            # adaptive weighting methods set their own weights (and refuse loss_weights)
            loss_weights=None if kwargs.get("loss_weighting") else {"a": 1.0, "b": 0.5},
            **kwargs,
        )
    history = model.fit(dataset, validation_data=dataset, epochs=2, verbose=0)
    return history.history, [w.numpy() for w in model.weights]


def _mse(reduction):
    return {
        "a": keras.losses.MeanSquaredError(reduction=reduction),
        "b": keras.losses.MeanSquaredError(reduction=reduction),
    }


CASES = {
    "mean": {},
    "no_sample_weight": {"sample_weights": False},
    "mean_with_sample_weight": {"loss": _mse("mean_with_sample_weight")},
    "sum": {"loss": _mse("sum")},
    "micro_batches": {"micro_batch_size": 2},
    "micro_batches_mean_with_sample_weight": {
        "micro_batch_size": 2,
        "loss": _mse("mean_with_sample_weight"),
    },
    "famo": {"loss_weighting": "famo"},
    "uw": {"loss_weighting": "uw"},
    "mgda": {"loss_weighting": "mgda"},
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_last_batch_split_two_one_matches_one_replica(case):
    strategy = _helpers.two_replica_strategy()
    one = _train(tf.distribute.get_strategy(), **CASES[case])
    two = _train(strategy, **CASES[case])
    (h1, w1), (h2, w2) = one, two
    keys = ["loss", "a_loss", "b_loss", "val_loss", "val_a_loss", "val_b_loss"]
    keys += [k for k in h1 if k in ("objective", "a_weight", "b_weight")]
    for key in keys:
        np.testing.assert_allclose(h2[key], h1[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for a, b in zip(w1, w2):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_plain_keras_differs_on_the_split_batch():
    """Documents the error corrected above: keras.Model averages the replicas' means."""
    strategy = _helpers.two_replica_strategy()
    _, w1 = _train(tf.distribute.get_strategy(), cls=keras.Model)
    _, w2 = _train(strategy, cls=keras.Model)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(w1, w2)) > 1e-3


# --------------------------------------------------------------------- masked per-token loss


class NegativeDot(keras.losses.Loss):
    """Per-token loss `-<t, p>` (linear: its gradient is `-t`, whatever the weights)."""

    def call(self, y_true, y_pred):
        return -keras.ops.sum(y_true * y_pred, axis=-1)


def _masked_run(strategy, cls=kf.OptimizedModel, **kwargs):
    """Token 1's embedding after one SGD(1.0) step on 2 sequences with 1 and 3 real tokens.

    Targets `t_A = [0, -1, 1]` (sequence A's one token), `t_B = [0, 1, -1]` (B's three).
    Global mean over the 4 real tokens: `grad = -(t_A + 3 t_B) / 4 = [0, -0.5, 0.5]`, so
    `e_1 = [1, 0, 0] - grad = [1, 0.5, -0.5]`. Averaging the replicas' own means instead gives
    `-(t_A / 1 + 3 t_B / 3) / 2 = 0`: `e_1` stays `[1, 0, 0]`.
    """
    ids = np.array([[1, 0, 0, 0], [1, 1, 1, 0]], "int32")
    t_a, t_b = [0.0, -1.0, 1.0], [0.0, 1.0, -1.0]
    y = np.array([[t_a, t_a, t_a, t_a], [t_b, t_b, t_b, t_a]], "float32")
    with strategy.scope():
        inputs = keras.Input((4,), dtype="int32")
        embedding = keras.layers.Embedding(2, 3, mask_zero=True, name="embedding")
        model = cls(inputs, embedding(inputs))
        embedding.embeddings.assign(np.array([[9.0, 9.0, 9.0], [1.0, 0.0, 0.0]], "float32"))
        model.compile(keras.optimizers.SGD(1.0), NegativeDot(), **kwargs)
    model.fit(tf.data.Dataset.from_tensor_slices((ids, y)).batch(2), verbose=0)
    return embedding.embeddings.numpy()


@pytest.mark.parametrize("micro_batch_size", [None, 1], ids=["full_batch", "micro_batches"])
def test_masked_tokens_one_and_three_on_two_replicas(micro_batch_size):
    strategy = _helpers.two_replica_strategy()
    expected = np.array([[9.0, 9.0, 9.0], [1.0, 0.5, -0.5]], "float32")
    one = _masked_run(tf.distribute.get_strategy(), micro_batch_size=micro_batch_size)
    two = _masked_run(strategy, micro_batch_size=micro_batch_size)
    np.testing.assert_allclose(one, expected, atol=1e-6)
    np.testing.assert_allclose(two, expected, atol=1e-6)


def test_masked_tokens_plain_keras_stays_put():
    strategy = _helpers.two_replica_strategy()
    np.testing.assert_allclose(
        _masked_run(strategy, cls=keras.Model)[1], [1.0, 0.0, 0.0], atol=1e-6
    )
