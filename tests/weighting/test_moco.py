"""MoCo: reference values from LibMTL's code, state, logs and training."""

import keras
import numpy as np
import pytest
from _helpers import two_replica_strategy
from _linear_tasks import (
    built,
    check_save_and_resume,
    data,
    fit_and_check,
    head_gradient,
    run_step,
    two_replicas_equal_one,
)

from keras_fastloop import OptimizedModel, weighting

# LibMTL (github median-research-group/LibMTL, LibMTL/weighting/MoCo.py at the current main)
# run on the linear losses of `_linear_tasks` (3 tasks, float32), three steps: the lambda it
# returned and the shared gradient after each `backward`. First with LibMTL's defaults, then
# with MoCo_beta=0.3, MoCo_beta_sigma=0, MoCo_gamma=20, MoCo_rho=0.2 (lambda moves visibly).
_DEFAULTS = [
    ([0.3339965641, 0.3338161111, 0.332187295],
     [-0.1332976371, -0.0005501285, -0.0063270889, -0.0335367434, 0.0032890057, 0.038069725,
      -0.0850616992, 0.0584021658, -0.0221265405, -0.0386198461, 0.086855799, 0.035031639,
      0.0005501285, -0.1332976371]),
    ([0.333837837, 0.3338185251, 0.3323436379],
     [-3.5355199128e-02, -1.3301517814e-02, 2.2193439305e-02, 9.5455832779e-03,
      7.1265578270e-02, 5.5401187390e-02, 4.0401730686e-02, -5.7637263089e-02,
      -4.6411678195e-02, 8.9779496193e-06, 1.0115920007e-01, -2.7735924348e-02,
      3.8712751120e-02, -3.5355199128e-02]),
    ([0.3337995112, 0.333462894, 0.3327376246],
     [-0.104820624, 0.0079427212, 0.028542731, -0.0027891044, 0.0674692467, 0.0896302462,
      -0.0143051632, 0.0219621882, -0.0323148854, -0.0127893481, 0.0527585819, 0.0200583022,
      -0.0584889427, -0.104820624]),
]  # fmt: skip
_MOVED = [
    ([0.3790525198, 0.3645857275, 0.2563616931],
     [-0.0774696171, 0.0128798094, -0.0113041932, -0.0139183104, 0.0036704782, 0.0278455503,
      -0.0475292057, 0.03203528, -0.001566682, -0.014965741, 0.0449061543, 0.0202118345,
      -0.0128798094, -0.0774696171]),
    ([0.3337786496, 0.3351029158, 0.3311183751],
     [-0.0128747877, -0.0110932067, 0.0198484082, 0.0123334946, 0.0598526485, 0.0418376885,
      0.0452363379, -0.0564322472, -0.0364560559, 0.0049480656, 0.0747154504, -0.0278253052,
      0.0326455794, -0.0128747877]),
    ([0.3884654641, 0.3212423921, 0.290292114],
     [-0.0898276567, 0.0183978602, 0.0190947019, -0.0001881868, 0.0511043146, 0.0827476829,
      -0.009506071, 0.0221215077, -0.0195365921, -0.0046408698, 0.0416275077, 0.0195072237,
      -0.0617328063, -0.0898276567]),
]  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, expected",
    [({}, _DEFAULTS), ({"beta": 0.3, "beta_sigma": 0.0, "gamma": 20.0, "rho": 0.2}, _MOVED)],
)
def test_matches_libmtl_over_three_steps(kwargs, expected):
    method, variables = built(weighting.MoCo(**kwargs), 3)
    for step, (expected_lambda, expected_shared) in enumerate(expected):
        shared, heads, weights = run_step(method, variables, 3, step, scale=8.0)
        np.testing.assert_allclose(weights, expected_lambda, rtol=1e-5)
        np.testing.assert_allclose(shared, expected_shared, rtol=1e-4, atol=2e-6)
        for t in range(3):  # heads: the plain task gradient
            np.testing.assert_allclose(heads[t], head_gradient(t), rtol=1e-6)
    assert int(method.step.numpy()) == 3
    np.testing.assert_allclose(method.lambd.numpy(), expected[-1][0], rtol=1e-5)


def test_state_is_committed_by_update_only():
    method, variables = built(weighting.MoCo(), 2)
    y = next(iter(method.estimates.values()))
    run_step(method, variables, 2, 0)
    after_one = y.numpy().copy()
    assert np.any(after_one != 0)
    method._pending = None
    with pytest.raises(RuntimeError, match="same step"):
        method.update([1.0, 1.0])
    np.testing.assert_array_equal(y.numpy(), after_one)


def test_trains_and_logs_end_to_end():
    model, history = fit_and_check("moco")
    assert int(model.loss_weighting.step.numpy()) == 6
    np.testing.assert_allclose(np.array(history["a_weight"]) + history["b_weight"], 1, rtol=1e-6)


def test_subclassed_model_and_steps_per_execution():
    """State made when the step is first traced (subclassed model); several steps per call."""

    class TwoHeads(OptimizedModel):
        def __init__(self):
            super().__init__()
            self.trunk = keras.layers.Dense(4, name="trunk")
            self.a, self.b = keras.layers.Dense(1), keras.layers.Dense(1)

        def call(self, x):
            h = self.trunk(x)
            return {"a": self.a(h), "b": self.b(h)}

    x, y = data()
    model = TwoHeads()
    model.compile(keras.optimizers.SGD(0.05), "mse", loss_weighting="moco")
    history = model.fit(x, y, batch_size=6, epochs=2, verbose=0).history
    assert np.all(np.isfinite(history["a_weight"]))
    model, _ = fit_and_check("moco", steps_per_execution=2)
    assert int(model.loss_weighting.step.numpy()) == 6


def test_save_and_resume_exactly(tmp_path):
    check_save_and_resume(tmp_path, weighting.MoCo(gamma=5.0), ["lambd", "step"])


@pytest.mark.distributed
def test_two_replicas_equal_one():
    _, two = two_replicas_equal_one(lambda: weighting.MoCo(gamma=5.0), two_replica_strategy())
    assert int(two.loss_weighting.step.numpy()) == 6


def test_config_round_trip_and_bad_arguments():
    method = weighting.MoCo(beta=0.25, beta_sigma=0, gamma=1, gamma_sigma=0.1, rho=0.5)
    config = weighting.MoCo.from_config(method.get_config()).get_config()
    assert config == {
        "beta": 0.25,
        "beta_sigma": 0.0,
        "gamma": 1.0,
        "gamma_sigma": 0.1,
        "rho": 0.5,
    }
    for bad in ({"beta": 0}, {"gamma": -1}, {"rho": -0.1}, {"beta_sigma": "x"}):
        with pytest.raises(ValueError, match="Received"):
            weighting.MoCo(**bad)
