"""DB-MTL against LibMTL's `DB_MTL`."""

import _libmtl_problem as problem
import keras
import numpy as np
import pytest
from _helpers import EXPECT_SKIP_WARNINGS, two_replica_strategy

from keras_fastloop import weighting

# Kernels after 6 SGD steps (3 epochs of 2 batches) with LibMTL's `DB_MTL.backward` (main
# branch, PyTorch float32; DB_beta=0.9, DB_beta_sigma=0.5) on `_libmtl_problem`'s data and
# initial kernels.
TRUNK = [
    [-0.59739119, 0.82047248, 0.56043917, 0.32318571],
    [0.14234518, -0.15401284, 0.71735656, 0.95339423],
    [0.89788324, 0.67553687, 0.14356381, -0.58493733],
]
HEAD_A = [0.11159804, 0.38848126, -0.66795135, 0.0605445]
HEAD_B = [0.05243481, 0.48323801, -0.41270992, -0.15837684]


def _method():
    return weighting.DBMTL(beta=0.9, beta_sigma=0.5)


def test_db_mtl_trains_as_libmtl():
    model, history = problem.train(_method())
    problem.check_weights(model, TRUNK, HEAD_A, HEAD_B)
    method = model.loss_weighting
    assert float(method.step.numpy()) == 6.0
    # logged: alpha = max_j |m_j| / |m_i|, from the committed running averages
    norms = np.sqrt([sum(np.sum(b.numpy()[i] ** 2) for _, b, _ in method._buffers) for i in (0, 1)])
    np.testing.assert_allclose(
        [history["a_weight"][-1], history["b_weight"][-1]], norms.max() / norms, rtol=1e-5
    )


def test_db_mtl_resumes_exactly(tmp_path):
    model, _ = problem.resume(_method(), tmp_path)
    problem.check_weights(model, TRUNK, HEAD_A, HEAD_B)


def test_db_mtl_by_id_trains_and_logs():
    x, y, _ = problem.data()
    model = problem.model()
    model.compile(keras.optimizers.SGD(0.01), "mse", loss_weighting="db_mtl")
    history = model.fit(x, y, batch_size=4, epochs=1, verbose=0).history
    for key in ("loss", "a_loss", "b_loss", "a_weight", "b_weight"):
        assert np.all(np.isfinite(history[key])), key
    assert min(history["a_weight"][-1], history["b_weight"][-1]) == pytest.approx(1.0)


@pytest.mark.parametrize("kwargs", [{"beta": 1.0}, {"beta": -0.1}, {"beta_sigma": -1.0}])
def test_db_mtl_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="Received"):
        weighting.DBMTL(**kwargs)


@pytest.mark.distributed
def test_db_mtl_two_replicas_equal_libmtl():
    model, _ = problem.train(_method(), strategy=two_replica_strategy())
    problem.check_weights(model, TRUNK, HEAD_A, HEAD_B)


@EXPECT_SKIP_WARNINGS[0]
def test_db_mtl_skipped_step_leaves_the_averages():
    x, y, _ = problem.data()
    model = problem.model()
    model.compile(keras.optimizers.SGD(0.05), "mse", loss_weighting=_method())
    first = {k: v[:4] for k, v in y.items()}
    model.fit(x[:4], first, batch_size=4, verbose=0)
    method = model.loss_weighting
    before = [b.numpy() for _, b, _ in method._buffers]
    bad = x[:4].copy()
    bad[0, 0] = np.nan
    model.fit(bad, first, batch_size=4, verbose=0)
    assert int(model.skipped_steps) == 1
    for b, (_, current, _) in zip(before, method._buffers):
        np.testing.assert_array_equal(current.numpy(), b)
    assert float(method.step.numpy()) == 1.0


def test_db_mtl_needs_the_variables_when_built():
    from keras_fastloop._step.state import StepState

    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Activation("linear")(inputs))
    with pytest.raises(ValueError, match=r"build the model first .*Received: a model without"):
        weighting.DBMTL().build(model, StepState(), ["a", "b"], [1.0, 1.0])
