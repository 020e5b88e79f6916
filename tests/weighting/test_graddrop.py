"""GradDrop against LibMTL's `GradDrop` on the same gradients and draws."""

import _libmtl_problem as problem
import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import two_replica_strategy

from keras_fastloop import weighting
from keras_fastloop.weighting.graddrop import graddrop_multipliers

# Three tasks' gradients of 6 entries and one uniform draw per entry. LibMTL's
# `GradDrop.backward` (main branch, PyTorch float32, rep_grad=True) was run on a positive
# representation of ones (sign factor 1, batch 1) whose task gradients are the rows of
# GRADS, with `torch.rand_like` returning UNIFORM; it back-propagated these sums.
GRADS = [
    [0.35, 0.82, 0.33, -1.3, 0.91, 0.45],
    [-0.54, 0.58, 0.0, 0.29, 0.03, 0.55],
    [-0.74, -0.16, -0.48, 0.6, 0.04, -0.29],
]
UNIFORM = [0.2, 0.26, 0.75, 0.28, 0.49, 0.98]
LIBMTL_SUM = {
    0.0: [0.35, 1.4, -0.48, 0.89, 0.98, -0.29],
    0.2: [0.094, 1.368, -0.414, 0.63, 0.98, -0.09],
}


@pytest.mark.parametrize("leak", [0.0, 0.2])
def test_graddrop_multipliers_match_libmtl(leak):
    g = tf.constant(GRADS)
    multipliers = graddrop_multipliers(g, tf.constant(UNIFORM), leak).numpy()
    np.testing.assert_allclose((multipliers * np.array(GRADS)).sum(0), LIBMTL_SUM[leak], atol=1e-6)
    assert set(np.unique(multipliers)) <= {np.float32(leak), 1.0}


def _step_by_hand(seed, step_index, grads):
    """The first shared variable's expected update from the stateless draw of `step_index`."""
    key = tf.constant([seed, step_index], tf.int64)
    u = tf.random.stateless_uniform(
        (grads.shape[1],), seed=tf.random.experimental.stateless_fold_in(key, 0)
    )
    m = graddrop_multipliers(tf.constant(grads), u, 0.0).numpy()
    return (m * grads).sum(0), m.mean(axis=1)


def test_graddrop_step_applies_the_mask():
    x, y, kernels = problem.data()
    model = problem.model()
    model.compile(keras.optimizers.SGD(0.1), "mse", loss_weighting=weighting.GradDrop(seed=4))
    with tf.GradientTape(persistent=True) as tape:
        pred = model(x[:4])
        losses = [keras.losses.MeanSquaredError()(y[k][:4], pred[k]) for k in "ab"]
    trunk = model.get_layer("trunk").kernel
    g = np.stack([tape.gradient(loss, trunk).numpy().ravel() for loss in losses])
    history = model.fit(x[:4], {k: v[:4] for k, v in y.items()}, batch_size=4, verbose=0).history
    update, kept = _step_by_hand(4, 0, g)
    np.testing.assert_allclose(trunk.numpy().ravel(), kernels[0].ravel() - 0.1 * update, atol=1e-6)
    np.testing.assert_allclose([history["a_weight"][0], history["b_weight"][0]], kept, atol=1e-6)
    assert int(model.loss_weighting.step.numpy()) == 1


def test_graddrop_by_id_trains_and_logs():
    x, y, _ = problem.data()
    model = problem.model()
    model.compile(keras.optimizers.SGD(0.01), "mse", loss_weighting="graddrop")
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0).history
    for key in ("loss", "a_loss", "b_loss", "a_weight", "b_weight"):
        assert np.all(np.isfinite(history[key])), key
    assert 0.0 <= history["a_weight"][-1] <= 1.0


def test_graddrop_resumes_exactly(tmp_path):
    reference, _ = problem.train(weighting.GradDrop(leak=0.1, seed=2))
    resumed, _ = problem.resume(weighting.GradDrop(leak=0.1, seed=2), tmp_path)
    for a, b in zip(reference.get_weights(), resumed.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kwargs", [{"leak": 1.5}, {"leak": -0.1}, {"seed": "x"}])
def test_graddrop_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="Received"):
        weighting.GradDrop(**kwargs)


@pytest.mark.distributed
def test_graddrop_two_replicas_equal_one():
    one, _ = problem.train(weighting.GradDrop(seed=2), epochs=1)
    two, _ = problem.train(weighting.GradDrop(seed=2), epochs=1, strategy=two_replica_strategy())
    for a, b in zip(one.get_weights(), two.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
