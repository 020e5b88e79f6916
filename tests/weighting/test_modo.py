"""MoDo: reference values from LibMTL's code, the batch's three parts, logs and training."""

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
    two_task_model,
)

from keras_fastloop import weighting
from keras_fastloop._step.objective import part_losses
from keras_fastloop._warnings import FastloopWarning
from keras_fastloop.weighting import _solvers

# LibMTL (github median-research-group/LibMTL, LibMTL/weighting/MoDo.py at the current main)
# run on the linear losses of `_linear_tasks` (3 tasks, three parts per step as LibMTL's three
# samples, float32), three steps: the lambda it returned and the shared gradient after each
# `backward`. First LibMTL's defaults, then MoDo_gamma=0.05, MoDo_rho=0 (reaches the boundary).
_DEFAULTS = [
    ([0.3314074278, 0.3352592885, 0.3333333433],
     [1.3333334923, 0.3346172869, -0.2280000001, 1.1066173315, -0.0032098889, -0.6685926318,
      0.5632593036, -0.6660247445, 0.0019259155, -0.3301234841, -0.2260740697, 0.330765456,
      1.332049489, 1.3333334923]),
    ([0.32997334, 0.3342645764, 0.3357620537],
     [-0.6666666269, -0.2329230011, 0.6743849516, 0.5566084385, -0.5546789169, 0.2309934497,
      -0.0019295663, 1.6685962677, -0.5643267632, 0.5546789169, -0.7747952342, -0.2194160223,
      -0.6705257893, -0.6666666269]),
    ([0.3253458738, 0.3339123428, 0.3407418132],
     [1.6666667461, 0.676930666, 0.0970266461, 0.0307918787, 0.3076734245, -0.3487293124,
      -0.5285841227, -0.3282013535, 0.3487293124, 0.0256598592, 0.1124225855, 0.6461387277,
      0.2465706468, 1.6666667461]),
]  # fmt: skip
_BOUNDARY = [
    ([0.2370370179, 0.4296296239, 0.3333333135],
     [1.3333332539, 0.3975308537, -0.5111111403, 0.8864196539, -0.1604938209, -0.7629629374,
      0.9407407045, -0.6345678568, 0.0962962955, -0.1728395224, -0.4148148298, 0.2049382329,
      1.2691357136, 1.3333332539]),
    ([0.1903155148, 0.3026611805, 0.5070233345],
     [-0.6666666865, -0.6308276057, 1.0889437199, 0.4363145828, -0.3307453394, 0.5252583027,
      -0.1055692732, 1.7722359896, -0.8585916758, 0.3307453394, -0.7914495468, 0.1081572771,
      -0.877805233, -0.6666666865]),
    ([0.0, 0.2399623692, 0.7600376606],
     [1.6666666269, 1.1733585596, -0.3199498355, 1.5200753212, -0.9333961606, -1.0933710337,
      1.0401506424, -0.0799874589, 1.0933710337, 1.2667293549, 0.4400878251, -0.3467168808,
      1.1599749327, 1.6666666269]),
]  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, expected", [({}, _DEFAULTS), ({"gamma": 0.05, "rho": 0.0}, _BOUNDARY)]
)
def test_matches_libmtl_over_three_steps(kwargs, expected):
    method, variables = built(weighting.MoDo(**kwargs), 3)
    for step, (expected_lambda, expected_shared) in enumerate(expected):
        shared, heads, weights = run_step(method, variables, 3, step, parts=3, scale=4.0)
        np.testing.assert_allclose(weights, expected_lambda, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(shared, expected_shared, rtol=1e-5, atol=1e-6)
        for t in range(3):  # heads: the mean of the three parts' head gradients
            np.testing.assert_allclose(heads[t], head_gradient(t) - 0.5, rtol=1e-6)
    np.testing.assert_allclose(method.lambd.numpy(), expected[-1][0], rtol=1e-5, atol=1e-7)


def test_step_splits_the_batch_into_three_consecutive_parts():
    """One `train_on_batch` of 7 samples (parts of 2, 2 and 3) against slices taken by hand."""
    x, y = data(7)
    model = two_task_model()
    gamma, rho = 0.5, 0.1
    model.compile(keras.optimizers.SGD(0.1), "mse", loss_weighting=weighting.MoDo(gamma, rho))
    before = [v.numpy() for v in model.trainable_variables]
    mse = keras.losses.MeanSquaredError()
    part_grads = []
    for lo, hi in ((0, 2), (2, 4), (4, 7)):
        with tf.GradientTape(persistent=True) as tape:
            pred = model(x[lo:hi])
            losses = [mse(y[k][lo:hi], pred[k]) for k in ("a", "b")]
        part_grads.append([tape.gradient(loss, model.trainable_variables) for loss in losses])
    shared = range(4)  # trunk and trunk2, kernels and biases

    def flat(p, t):
        return np.concatenate([part_grads[p][t][k].numpy().ravel() for k in shared])

    cross = np.array([[flat(0, i) @ flat(1, j) for j in range(2)] for i in range(2)])
    lam = _solvers.project_to_simplex(np.full(2, 0.5) - gamma * (cross @ [0.5, 0.5] + rho * 0.5))
    lam = lam.numpy()
    logs = model.train_on_batch(x, y, return_dict=True)
    np.testing.assert_allclose([logs["a_weight"], logs["b_weight"]], lam, rtol=1e-5)
    after = [v.numpy() for v in model.trainable_variables]
    for k in range(len(after)):
        if k in shared:
            expected = sum(lam[t] * part_grads[2][t][k].numpy() for t in range(2))
        else:  # head of one task: the mean of its three parts' gradients
            expected = sum(
                g[k].numpy() for p in range(3) for g in part_grads[p] if g[k] is not None
            )
            expected = expected / 3
        np.testing.assert_allclose(after[k], before[k] - 0.1 * expected, rtol=1e-5, atol=1e-6)


def test_part_losses_of_a_small_batch_use_it_whole():
    x, y = data(2)
    model = two_task_model()
    model.compile("sgd", "mse")
    terms = model._compile_loss.evaluate(y, model(x), None)
    parts = part_losses(terms, 3)
    for part in parts:
        np.testing.assert_allclose([float(v) for v in part], [float(t.value) for t in terms])


def test_trains_and_logs_end_to_end():
    with pytest.warns(FastloopWarning, match=r"1 step\(s\) of .* fewer than 3 samples"):
        model, history = fit_and_check("modo", batch_size=8)  # batches of 8, 8 and 2
    assert int(model.loss_weighting.whole_batches.numpy()) == 0  # reported
    np.testing.assert_allclose(np.array(history["a_weight"]) + history["b_weight"], 1, rtol=1e-6)
    fit_and_check(weighting.MoDo(gamma=0.1), batch_size=6, steps_per_execution=2)


def test_save_and_resume_exactly(tmp_path):
    check_save_and_resume(tmp_path, weighting.MoDo(gamma=0.1), ["lambd"])


@pytest.mark.slow
@pytest.mark.distributed
def test_two_replicas_hold_the_same_state():
    strategy = two_replica_strategy()
    x, y = data()
    with strategy.scope():
        model = two_task_model()
        model.compile(keras.optimizers.SGD(0.05), "mse", loss_weighting=weighting.MoDo(0.1))
    history = model.fit(x, y, batch_size=6, epochs=2, verbose=0).history
    assert np.all(np.isfinite(history["a_weight"]))
    local = strategy.experimental_local_results(model.loss_weighting.lambd.value)
    np.testing.assert_array_equal(np.asarray(local[0]), np.asarray(local[1]))
    assert not np.allclose(np.asarray(local[0]), 0.5)


def test_config_round_trip_and_bad_arguments():
    method = weighting.MoDo(gamma=0.01, rho=0)
    config = weighting.MoDo.from_config(method.get_config()).get_config()
    assert config == {"gamma": 0.01, "rho": 0.0}
    for bad in ({"gamma": 0}, {"rho": -1}, {"gamma": "x"}):
        with pytest.raises(ValueError, match="Received"):
            weighting.MoDo(**bad)
