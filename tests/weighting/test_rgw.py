"""RGW against LibMTL's `RGW` (tag v1.1.6) fed the same random numbers."""

import _libmtl_problem as problem
import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import two_replica_strategy

from keras_fastloop import weighting

# Kernels after 6 SGD steps (3 epochs of 2 batches) with LibMTL v1.1.6's `RGW.backward`
# (PyTorch float32) on `_libmtl_problem`'s data and initial kernels, its `torch.randn(2)` at
# step t replaced by `tf.random.stateless_normal((2,), seed=[3, t])` (RGW(seed=3)'s draws).
TRUNK = [
    [-0.58683455, 0.96318007, 0.48065233, 0.29772958],
    [0.14424986, -0.14851765, 0.70089543, 0.96057093],
    [0.90135199, 0.6902712, 0.14726792, -0.60490173],
]
HEAD_A = [0.04268934, 0.40202984, -0.62066382, 0.14840735]
HEAD_B = [-0.0977481, 0.93129069, -0.1394026, -0.08193371]


def _draws(seed, steps):
    z = [tf.random.stateless_normal((2,), seed=tf.constant([seed, t], tf.int64)) for t in steps]
    return np.array([np.exp(v) / np.exp(v).sum() for v in z])


def test_rgw_trains_as_libmtl():
    model, history = problem.train(weighting.RGW(seed=3))
    problem.check_weights(model, TRUNK, HEAD_A, HEAD_B)
    logged = np.stack([history["a_weight"], history["b_weight"]], axis=1)
    np.testing.assert_allclose(logged, _draws(3, [1, 3, 5]), rtol=1e-5)  # each epoch's last
    assert int(model.loss_weighting.step.numpy()) == 6


def test_rgw_resumes_exactly(tmp_path):
    model, _ = problem.resume(weighting.RGW(seed=3), tmp_path)
    problem.check_weights(model, TRUNK, HEAD_A, HEAD_B)


def test_rgw_by_id_follows_keras_seed():
    x, y, _ = problem.data()
    runs = []
    for _ in range(2):
        keras.utils.set_random_seed(5)
        model = problem.model()
        model.compile(keras.optimizers.SGD(0.01), "mse", loss_weighting="rgw")
        runs.append(model.fit(x, y, batch_size=4, epochs=1, verbose=0).history)
    assert runs[0]["a_weight"] == runs[1]["a_weight"]
    assert np.isfinite(runs[0]["loss"][-1])
    assert runs[0]["a_weight"][-1] + runs[0]["b_weight"][-1] == pytest.approx(1.0, rel=1e-6)


@pytest.mark.distributed
def test_rgw_two_replicas_equal_libmtl():
    model, _ = problem.train(weighting.RGW(seed=3), strategy=two_replica_strategy())
    problem.check_weights(model, TRUNK, HEAD_A, HEAD_B)
