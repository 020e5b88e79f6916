"""Masked per-token losses with per-token sample weights on 2 replicas: the global token mean, by hand.

Each replica holds a different number of real (unmasked) tokens. The reference is NumPy: the
loss `-<t, e>` is linear in the embedding `e`, so each step's gradient is a weighted sum of
targets, whatever the weights. keras.Model averages the replicas' own means (keras#15323,
tensorflow#26784); OptimizedModel divides by the global batch's denominator, also with
micro-batches and when a step is skipped for one replica's non-finite value.
"""

import _helpers
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_fastloop as kf

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # integration: the slow job

VOCAB, DIM, LENGTH, BATCH = 3, 3, 4, 4
# Three global batches of 4 sequences (id 0 is padding); replica 0 takes sequences 0-1,
# replica 1 sequences 2-3: 3 and 7, 4 and 2, 5 and 3 real tokens.
IDS = np.array(
    [
        [[1, 0, 0, 0], [2, 1, 0, 0], [1, 2, 2, 0], [2, 2, 1, 1]],
        [[2, 2, 1, 0], [1, 0, 0, 0], [1, 2, 0, 0], [0, 0, 0, 0]],
        [[1, 2, 1, 2], [1, 0, 0, 0], [2, 0, 0, 0], [1, 1, 0, 0]],
    ],
    "int32",
)
INITIAL = np.array([[9.0, 9.0, 9.0], [1.0, 0.0, -1.0], [0.5, 2.0, 0.0]], "float32")


class NegativeDot(keras.losses.Loss):
    """Per-token loss `-<t, p>` (linear: its gradient is `-t`, whatever the weights)."""

    def call(self, y_true, y_pred):
        return -keras.ops.sum(y_true * y_pred, axis=-1)


def _data():
    rng = np.random.default_rng(7)
    targets = rng.normal(size=IDS.shape + (DIM,)).astype("float32")
    weights = rng.uniform(0.5, 2.0, size=IDS.shape).astype("float32")  # one per token
    return targets, weights


def _denominator(ids, weights, reduction):
    real = (ids != 0).astype("float64")
    if reduction == "mean_with_sample_weight":
        return float(np.sum(real * weights))
    return float(np.sum(real))


def _token_sums(ids, targets, weights):
    """`sum over real tokens of id j of w * t`, one row per id (row 0: padding, zero)."""
    sums = np.zeros((VOCAB, DIM))
    for s in range(ids.shape[0]):
        for p in range(LENGTH):
            if ids[s, p]:
                sums[ids[s, p]] += weights[s, p] * targets[s, p]
    return sums


def hand_global_mean(applied, reduction, lr=1.0):
    """The embedding and the epoch's mean loss after SGD(lr) on the `applied` batches, each
    batch's loss divided by its global denominator (the 1-replica Keras loss)."""
    targets, weights = _data()
    e = INITIAL.astype("float64")
    losses = []
    for b in applied:
        sums = _token_sums(IDS[b], targets[b], weights[b])
        d = _denominator(IDS[b], weights[b], reduction)
        losses.append(-np.sum(sums * e) / d)
        e = e + lr * sums / d  # gradient of -sum(w <t, e>) / d
    return e, float(np.mean(losses))


def hand_mean_of_replica_means(applied, reduction, lr=1.0):
    """The same with keras.Model's loss on 2 replicas: each replica's own mean, then their mean."""
    targets, weights = _data()
    e = INITIAL.astype("float64")
    for b in applied:
        grad = np.zeros_like(e)
        for r in (slice(0, 2), slice(2, 4)):
            ids, t, w = IDS[b][r], targets[b][r], weights[b][r]
            grad -= _token_sums(ids, t, w) / _denominator(ids, w, reduction) / 2
        e = e - lr * grad
    return e


def _train(strategy, reduction, cls=kf.OptimizedModel, targets=None, **compile_kwargs):
    default_targets, weights = _data()
    targets = default_targets if targets is None else targets
    dataset = tf.data.Dataset.from_tensor_slices(
        (IDS.reshape(-1, LENGTH), targets.reshape(-1, LENGTH, DIM), weights.reshape(-1, LENGTH))
    ).batch(BATCH)
    with strategy.scope():
        inputs = keras.Input((LENGTH,), dtype="int32")
        embedding = keras.layers.Embedding(VOCAB, DIM, mask_zero=True, name="embedding")
        model = cls(inputs, embedding(inputs))
        embedding.embeddings.assign(INITIAL)
        model.compile(keras.optimizers.SGD(1.0), NegativeDot(reduction=reduction), **compile_kwargs)
    history = model.fit(dataset, epochs=1, shuffle=False, verbose=0)
    return embedding.embeddings.numpy(), history.history


REDUCTIONS = ["sum_over_batch_size", "mean_with_sample_weight"]
MICRO = [None, 1]


def test_the_hand_references_differ():
    """The data makes the two hand formulas differ, so the tests below can tell them apart."""
    for reduction in REDUCTIONS:
        ours, _ = hand_global_mean([0, 1, 2], reduction)
        keras_value = hand_mean_of_replica_means([0, 1, 2], reduction)
        assert np.max(np.abs(ours - keras_value)) > 0.1


@pytest.mark.parametrize("micro_batch_size", MICRO, ids=["full_batch", "micro_batches"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_two_replicas_give_the_global_token_mean(reduction, micro_batch_size):
    strategy = _helpers.two_replica_strategy()
    embeddings, history = _train(strategy, reduction, micro_batch_size=micro_batch_size)
    expected, loss = hand_global_mean([0, 1, 2], reduction)
    np.testing.assert_allclose(embeddings, expected, atol=1e-5)
    np.testing.assert_allclose(history["loss"][0], loss, rtol=1e-5)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_keras_model_gives_the_mean_of_replica_means(reduction):
    strategy = _helpers.two_replica_strategy()
    embeddings, _ = _train(strategy, reduction, cls=keras.Model)
    np.testing.assert_allclose(
        embeddings, hand_mean_of_replica_means([0, 1, 2], reduction), atol=1e-5
    )


@_helpers.EXPECT_SKIP_WARNINGS[0]
@_helpers.EXPECT_SKIP_WARNINGS[1]
@pytest.mark.parametrize("micro_batch_size", MICRO, ids=["full_batch", "micro_batches"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_step_skipped_on_one_replica_leaves_the_global_mean_of_the_others(
    reduction, micro_batch_size
):
    """Batch 1 has a NaN target on a real token of replica 1 only: both replicas skip it, and
    the embedding and the epoch's loss are the global token mean of batches 0 and 2."""
    strategy = _helpers.two_replica_strategy()
    targets, _ = _data()
    targets = targets.copy()
    targets[1, 2, 1] = np.nan  # sequence 2 (replica 1), its second real token
    embeddings, history = _train(
        strategy,
        reduction,
        targets=targets,
        nonfinite="skip",
        log_metrics=["skipped_steps"],
        micro_batch_size=micro_batch_size,
    )
    expected, loss = hand_global_mean([0, 2], reduction)
    np.testing.assert_allclose(embeddings, expected, atol=1e-5)
    np.testing.assert_allclose(history["loss"][0], loss, rtol=1e-5)
    assert history["skipped_steps"][0] == 1
