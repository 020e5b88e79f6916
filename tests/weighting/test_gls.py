"""GLS against LibMTL's `GLS` and its own equations."""

import _libmtl_problem as problem
import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import two_replica_strategy

from keras_fastloop import weighting

# Kernels after 6 SGD steps (3 epochs of 2 batches) with LibMTL 1.1.6's `GLS.backward`
# (PyTorch float32) on `_libmtl_problem`'s data and initial kernels.
TRUNK = [
    [-0.60784519, 0.80563116, 0.58592594, 0.35941789],
    [0.13895935, -0.16346365, 0.73615783, 0.95952857],
    [0.89909774, 0.69348472, 0.11923575, -0.58040816],
]
HEAD_A = [0.07381094, 0.41971993, -0.64279747, 0.09445258]
HEAD_B = [0.12942761, 0.43526116, -0.4868674, -0.23644073]
# dObjective/dL_i of LibMTL's objective at the last step (the weights it applies)
LAST_WEIGHTS = [3.1724495887756348, 0.07880345731973648]


def test_gls_objective_and_weights_by_hand():
    method = weighting.GLS()
    method.task_names = ["a", "b", "c"]
    losses = [tf.constant(v) for v in (2.0, 0.5, 4.0)]
    with tf.GradientTape() as tape:
        tape.watch(losses)
        objective, weights = method.combine(losses)
    mean = (2.0 * 0.5 * 4.0) ** (1 / 3)
    np.testing.assert_allclose(float(objective), mean, rtol=1e-6)
    expected = mean / (3 * np.array([2.0, 0.5, 4.0]))
    np.testing.assert_allclose(weights.numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose([g.numpy() for g in tape.gradient(objective, losses)], expected)


def test_gls_trains_as_libmtl():
    model, history = problem.train(weighting.GLS())
    problem.check_weights(model, TRUNK, HEAD_A, HEAD_B)
    # the logged weights are the applied ones (last step of the epoch)
    np.testing.assert_allclose(
        [history["a_weight"][-1], history["b_weight"][-1]], LAST_WEIGHTS, rtol=1e-5
    )
    np.testing.assert_allclose(model.loss_weighting.weights.numpy(), LAST_WEIGHTS, rtol=1e-5)


def test_gls_by_id_trains_and_logs():
    x, y, _ = problem.data()
    model = problem.model()
    model.compile(keras.optimizers.SGD(0.01), "mse", loss_weighting="gls")
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0).history
    for key in ("loss", "a_loss", "b_loss", "a_weight", "b_weight"):
        assert np.all(np.isfinite(history[key])), key
    # prod_i w_i = G^T / (T^T prod_i L_i) = 1 / T^T
    assert history["a_weight"][-1] * history["b_weight"][-1] == pytest.approx(0.25, rel=1e-5)


@pytest.mark.distributed
def test_gls_two_replicas_equal_libmtl():
    model, _ = problem.train(weighting.GLS(), strategy=two_replica_strategy())
    problem.check_weights(model, TRUNK, HEAD_A, HEAD_B)
