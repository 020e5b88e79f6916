"""ExcessMTL against LibMTL's `ExcessMTL`."""

import _libmtl_problem as problem
import keras
import numpy as np
import pytest
from _helpers import two_replica_strategy

from keras_fastloop import weighting

# Kernels after 6 SGD steps (3 epochs of 2 batches) with LibMTL's `ExcessMTL.backward` (main
# branch, PyTorch float32; robust_step_size=0.5) on `_libmtl_problem`'s data and initial
# kernels, and its returned `loss_weight` at the last step of each epoch.
TRUNK = [
    [-0.55484402, 1.07498384, 0.35030076, 0.22931737],
    [0.1505765, -0.177659, 0.69403189, 0.95509553],
    [0.91072053, 0.71033603, 0.10085658, -0.6147567],
]
HEAD_A = [0.03585434, 0.35323361, -0.63651174, 0.15950233]
HEAD_B = [-0.1107426, 0.973764, -0.15391184, -0.10387605]
LAST_WEIGHTS = [[0.5754261, 1.4245739], [0.6493977, 1.3506021], [0.7205327, 1.2794676]]


def test_excess_mtl_trains_as_libmtl():
    model, history = problem.train(weighting.ExcessMTL(robust_step_size=0.5))
    problem.check_weights(model, TRUNK, HEAD_A, HEAD_B)
    logged = np.stack([history["a_weight"], history["b_weight"]], axis=1)
    np.testing.assert_allclose(logged, LAST_WEIGHTS, rtol=1e-5)
    np.testing.assert_allclose(
        model.loss_weighting.committed_weights.numpy(), LAST_WEIGHTS[-1], rtol=1e-5
    )


def test_excess_mtl_first_step_keeps_equal_weights():
    x, y, _ = problem.data()
    model2 = problem.model()
    model2.compile(
        keras.optimizers.SGD(0.05), "mse", loss_weighting=weighting.ExcessMTL(robust_step_size=0.5)
    )
    first = model2.fit(x[:4], {k: v[:4] for k, v in y.items()}, batch_size=4, verbose=0).history
    assert [first["a_weight"][0], first["b_weight"][0]] == [1.0, 1.0]
    assert float(model2.loss_weighting.started.numpy()) == 1.0


def test_excess_mtl_resumes_exactly(tmp_path):
    model, _ = problem.resume(weighting.ExcessMTL(robust_step_size=0.5), tmp_path)
    problem.check_weights(model, TRUNK, HEAD_A, HEAD_B)


def test_excess_mtl_by_id_trains_and_logs():
    x, y, _ = problem.data()
    model = problem.model()
    model.compile(keras.optimizers.SGD(0.01), "mse", loss_weighting="excess_mtl")
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0).history
    for key in ("loss", "a_loss", "b_loss", "a_weight", "b_weight"):
        assert np.all(np.isfinite(history[key])), key
    assert history["a_weight"][-1] + history["b_weight"][-1] == pytest.approx(2.0, rel=1e-6)


def test_excess_mtl_bad_step_size():
    with pytest.raises(ValueError, match="Received: robust_step_size=0"):
        weighting.ExcessMTL(robust_step_size=0)


@pytest.mark.distributed
def test_excess_mtl_two_replicas_equal_libmtl():
    model, _ = problem.train(weighting.ExcessMTL(0.5), strategy=two_replica_strategy())
    problem.check_weights(model, TRUNK, HEAD_A, HEAD_B)
