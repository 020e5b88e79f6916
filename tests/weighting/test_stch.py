"""STCH against LibMTL's `STCH` and its own equations."""

import _libmtl_problem as problem
import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import two_replica_strategy

from keras_fastloop import weighting

# Kernels after 6 SGD steps (3 epochs of 2 batches) with LibMTL's `STCH.backward` (main
# branch, PyTorch float32; STCH_mu=0.5, STCH_warmup_epoch=1, `epoch` set to 0, 1, 2) on
# `_libmtl_problem`'s data and initial kernels.
TRUNK = [
    [-0.59006238, 0.83882564, 0.50607115, 0.33319134],
    [0.14695103, -0.14437753, 0.69098133, 0.95497698],
    [0.8980754, 0.68671161, 0.12447219, -0.58210593],
]
HEAD_A = [0.04852948, 0.42037451, -0.57888246, 0.15260737]
HEAD_B = [0.08024164, 0.50837868, -0.42618981, -0.18534794]
# dObjective/dL_i of LibMTL's objective at the last step of each epoch
LAST_WEIGHTS = [
    [4.271616458892822, 0.11856905370950699],
    [3.736753463745117, 0.13766567409038544],
    [1.285871982574463, 0.24095872044563293],
]


def _method(**kwargs):
    method = weighting.STCH(**kwargs)
    method.task_names = ["a", "b"]
    return method


def test_stch_weights_by_hand():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    from keras_fastloop._step.state import StepState

    method = weighting.STCH(mu=0.5, warmup_epochs=0)
    method.build(model, StepState(), ["a", "b"], [1.0, 1.0])
    losses = [tf.constant(2.0), tf.constant(0.5)]
    objective, weights = method.combine(losses)  # warmup: sum log L
    np.testing.assert_allclose(float(objective), np.log(2.0) + np.log(0.5), atol=1e-6)
    np.testing.assert_allclose(weights.numpy(), [0.5, 2.0], rtol=1e-6)
    method.update(losses)
    method.update([tf.constant(4.0), tf.constant(1.5)])
    method.end_epoch()  # nadir = [3, 1]
    np.testing.assert_allclose(method.nadir.numpy(), [3.0, 1.0])
    with tf.GradientTape() as tape:
        tape.watch(losses)
        objective, weights = method.combine(losses)
    u = np.log(np.array([2.0, 0.5]) / [3.0, 1.0])
    np.testing.assert_allclose(float(objective), 2 * 0.5 * np.log(np.exp(u / 0.5).sum()), 1e-6)
    softmax = np.exp(u / 0.5) / np.exp(u / 0.5).sum()
    expected = 2 * softmax / np.array([2.0, 0.5])
    np.testing.assert_allclose(weights.numpy(), expected, rtol=1e-5)
    np.testing.assert_allclose(
        [g.numpy() for g in tape.gradient(objective, losses)], expected, 1e-5
    )
    method.end_epoch()  # no applied update: not counted
    assert int(method.epochs.numpy()) == 1


def test_stch_trains_as_libmtl():
    model, history = problem.train(weighting.STCH(mu=0.5, warmup_epochs=1))
    problem.check_weights(model, TRUNK, HEAD_A, HEAD_B)
    logged = np.stack([history["a_weight"], history["b_weight"]], axis=1)
    np.testing.assert_allclose(logged, LAST_WEIGHTS, rtol=1e-5)
    method = model.loss_weighting
    assert int(method.epochs.numpy()) == 3
    # the nadir point is the mean loss of epoch 1 (two batches of equal size)
    np.testing.assert_allclose(
        method.nadir.numpy(), [history["a_loss"][1], history["b_loss"][1]], rtol=1e-5
    )


def test_stch_resumes_exactly(tmp_path):
    model, _ = problem.resume(weighting.STCH(mu=0.5, warmup_epochs=1), tmp_path)
    problem.check_weights(model, TRUNK, HEAD_A, HEAD_B)


def test_stch_by_id_trains_and_logs():
    x, y, _ = problem.data()
    model = problem.model()
    model.compile(keras.optimizers.SGD(0.01), "mse", loss_weighting="stch")
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0).history
    for key in ("loss", "a_loss", "b_loss", "a_weight", "b_weight"):
        assert np.all(np.isfinite(history[key])), key
    assert model.loss_weighting.get_config() == {"mu": 1.0, "warmup_epochs": 4}


@pytest.mark.parametrize("kwargs", [{"mu": 0.0}, {"warmup_epochs": -1}, {"warmup_epochs": 1.5}])
def test_stch_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="Received"):
        weighting.STCH(**kwargs)


@pytest.mark.distributed
def test_stch_two_replicas_equal_libmtl():
    strategy = two_replica_strategy()
    model, _ = problem.train(weighting.STCH(mu=0.5, warmup_epochs=1), strategy=strategy)
    problem.check_weights(model, TRUNK, HEAD_A, HEAD_B)
