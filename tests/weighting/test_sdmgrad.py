"""SDMGrad: reference values from LibMTL's code (float64 and float32), logs and training."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import two_replica_strategy
from _linear_tasks import (
    built,
    check_save_and_resume,
    data,
    fit_and_check,
    head_gradient,
    run_step,
    shared_gradient,
    two_task_model,
)

from keras_fastloop import weighting
from keras_fastloop._warnings import FastloopWarning
from keras_fastloop.weighting import _solvers

# LibMTL (github median-research-group/LibMTL, LibMTL/weighting/SDMGrad.py at the current main,
# `np.alltrue` replaced by `np.all` for NumPy 2) run on the linear losses of `_linear_tasks`
# with nearly aligned tasks (`spread=0.002`; on the default problem its step size 5 sends `w` to a
# vertex at every step), 3 tasks, three parts per step, SDMGrad_lamda=0.3, SDMGrad_niter=20,
# three steps, in float64 and in float32 (torch default dtype): `w` after each `backward`, and
# the shared gradient. The two runs differ by 1.2e-5 in `w` at the first step: 20 steps of size
# 5 amplify rounding.
_W64 = [[0.6901436208, 0.1537740526, 0.1560823266], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]
_W32 = [[0.6901311874, 0.1537847519, 0.1560840607], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]
_SHARED64 = [
    [-1.67, 1.0783626492e-03, 6.6490448965e-01, 3.3198285230e-01, -1.0012315695,
     1.0021549661, 1.9982738776, 2.0010594557, 1.0001378184, -1.0010766034, 3.3601714770e-01,
     6.6582788621e-01, -1.0783626492e-03, -1.67],
    [0.668, -2.0006666667, -1.33, -1.668, 1.3326666667, -1.002, 0.0026666667, -0.0026666667,
     -1.0013333333, 1.332, -1.6633333333, -1.334, -1.9986666667, 0.668],
    [-1.336, 0.3366666667, 1.0, 0.6686666667, -0.664, 1.3353333333, -2.0013333333, -1.998,
     1.336, -0.6646666667, 0.6666666667, 1.0033333333, 0.3306666667, -1.336],
]  # fmt: skip


def test_solver_matches_libmtl_in_float64():
    w = tf.constant([1 / 3] * 3, tf.float64)
    for step in range(3):
        g = [
            np.stack([shared_gradient(step, t, p, spread=0.002) for t in range(3)]) for p in (1, 2)
        ]
        cross = tf.constant(g[0] @ g[1].T, tf.float64)
        w = _solvers.sdmgrad_weights(cross, w, 0.3, 20)
        np.testing.assert_allclose(w.numpy(), _W64[step], atol=1e-9)
        zeta = np.stack([shared_gradient(step, t, 0, spread=0.002) for t in range(3)])
        shared = (w.numpy() + 0.1) / 1.3 @ zeta
        np.testing.assert_allclose(shared, _SHARED64[step], rtol=1e-9, atol=1e-10)


def test_step_matches_libmtl_in_float32_up_to_rounding():
    method, variables = built(weighting.SDMGrad(), 3)
    for step in range(3):
        shared, heads, weights = run_step(method, variables, 3, step, parts=3, spread=0.002)
        # the float32 runs (LibMTL's and ours) both lie within 2e-5 of the float64 run
        np.testing.assert_allclose(method.w.numpy(), _W64[step], atol=2e-5)
        np.testing.assert_allclose(_W32[step], _W64[step], atol=2e-5)
        np.testing.assert_allclose(weights, (np.array(_W64[step]) + 0.1) / 1.3, atol=2e-5)
        np.testing.assert_allclose(shared, _SHARED64[step], rtol=1e-4, atol=1e-4)
        for t in range(3):  # heads: the mean of the parts' head gradients (LibMTL: their sum)
            np.testing.assert_allclose(heads[t], head_gradient(t) - 0.5, rtol=1e-6)


def test_trains_and_logs_end_to_end():
    with pytest.warns(FastloopWarning, match=r"1 step\(s\) of .* fewer than 3 samples"):
        model, history = fit_and_check("sdmgrad", batch_size=8)  # batches of 8, 8 and 2
    assert int(model.loss_weighting.whole_batches.numpy()) == 0  # reported
    np.testing.assert_allclose(np.array(history["a_weight"]) + history["b_weight"], 1, rtol=1e-5)
    fit_and_check(weighting.SDMGrad(niter=3), batch_size=6, steps_per_execution=2)


def test_save_and_resume_exactly(tmp_path):
    check_save_and_resume(tmp_path, weighting.SDMGrad(), ["w"])


@pytest.mark.distributed
def test_two_replicas_hold_the_same_state():
    strategy = two_replica_strategy()
    x, y = data()
    with strategy.scope():
        model = two_task_model()
        model.compile(keras.optimizers.SGD(0.05), "mse", loss_weighting="sdmgrad")
    history = model.fit(x, y, batch_size=6, epochs=2, verbose=0).history
    assert np.all(np.isfinite(history["a_weight"]))
    local = strategy.experimental_local_results(model.loss_weighting.w.value)
    np.testing.assert_array_equal(np.asarray(local[0]), np.asarray(local[1]))


def test_config_round_trip_and_bad_arguments():
    method = weighting.SDMGrad(lamda=0, niter=5)
    config = weighting.SDMGrad.from_config(method.get_config()).get_config()
    assert config == {"lamda": 0.0, "niter": 5}
    for bad in ({"lamda": -1}, {"niter": 0}, {"niter": 2.5}):
        with pytest.raises(ValueError, match="Received"):
            weighting.SDMGrad(**bad)
    model = two_task_model()
    model.compile("sgd", "mse", loss_weighting="sdmgrad")
    with pytest.raises(RuntimeError, match="part_losses"):
        model.loss_weighting.gradients(None, [], None, [], lambda x: x)
