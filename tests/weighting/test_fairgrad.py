"""FairGrad: reference values from LibMTL's code, the alpha-fair equation, logs and training."""

import numpy as np
import pytest
import tensorflow as tf
from _helpers import two_replica_strategy
from _linear_tasks import built, fit_and_check, head_gradient, run_step, two_replicas_equal_one

from keras_fastloop import weighting
from keras_fastloop.weighting import _solvers

# LibMTL (github median-research-group/LibMTL, LibMTL/weighting/FairGrad.py at the current main)
# run on the linear losses of `_linear_tasks` (3 tasks, steps 0 and 1, float32; SciPy's
# least_squares from 1/T): the weights it returned and the shared gradient after `backward`.
_LIBMTL = {
    (1.0, 0): ([0.1684946483, 0.2188819171, 0.187514223],
               [-0.9581513405, 0.1582694054, -0.1662708223, -0.1996316761, 0.004678309,
                0.3642409444, -0.5812306404, 0.3896003962, -0.0270209685, -0.205971539,
                0.5828921795, 0.2026484013, -0.1582694054, -0.9581513405]),
    (1.0, 1): ([0.1750274924, 0.2410879839, 0.2505569637],
               [0.4444483221, -0.1718711555, 0.3483040035, 0.2428389788, 0.5154161453,
                0.121320799, 0.863720119, -0.863720119, -0.3689187765, 0.2176624686,
                0.4238334894, -0.3229300976, 0.3940953016, 0.4444483221]),
    (2.0, 0): ([0.0905089438, 0.1331554672, 0.1091347705],
               [-0.5546653271, 0.0941651687, -0.0860986263, -0.1028665081, 0.0204837695,
                0.2032403052, -0.3390077949, 0.2280747443, -0.0105592627, -0.1090751141,
                0.3247326314, 0.1376254261, -0.0941651687, -0.5546653271]),
    (0.5, 1): ([0.3188009865, 0.3832858501, 0.3934677581],
               [0.7303697467, -0.3154070377, 0.5856379271, 0.4352498949, 0.850212574,
                0.1696206629, 1.4358506203, -1.4358506203, -0.6557029486, 0.4103609324,
                0.6603047252, -0.4647405744, 0.6805919409, 0.7303697467]),
}  # fmt: skip


@pytest.mark.parametrize("alpha, step", sorted(_LIBMTL))
def test_matches_libmtl(alpha, step):
    method, variables = built(weighting.FairGrad(alpha=alpha), 3)
    shared, heads, weights = run_step(method, variables, 3, step, scale=4.0)
    expected_weights, expected_shared = _LIBMTL[(alpha, step)]
    np.testing.assert_allclose(weights, expected_weights, rtol=2e-5)
    np.testing.assert_allclose(shared, expected_shared, rtol=2e-5, atol=1e-6)
    for t in range(3):  # heads get weight 1 (LibMTL: x_t)
        np.testing.assert_allclose(heads[t], head_gradient(t), rtol=1e-6)


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0, 5.0])
def test_solves_the_alpha_fair_equation(alpha):
    """`M x = x^(-1/alpha)` in float64 for gradients over six decades of scale."""
    rng = np.random.default_rng(int(alpha * 10))
    for _ in range(10):
        t = int(rng.integers(2, 6))
        g = rng.normal(size=(t, 8)) * rng.uniform(0.1, 10, (t, 1)) * 10.0 ** rng.uniform(-3, 3)
        m = g @ g.T
        x = _solvers.fairgrad_weights(tf.constant(m, tf.float64), alpha).numpy()
        assert np.all(x > 0)
        np.testing.assert_allclose(m @ x, x ** (-1.0 / alpha), rtol=1e-8)
        x32 = _solvers._fairgrad_weights_xla(tf.constant(m, tf.float32), alpha).numpy()
        np.testing.assert_allclose(x32, x, rtol=2e-3)


def test_alpha_one_is_nash_mtl_and_orthogonal_gradients_by_hand():
    m = tf.constant([[4.0, 0.0], [0.0, 0.25]])
    # orthogonal: x_i = M_ii^(-alpha / (1 + alpha))
    for alpha in (1.0, 3.0):
        expected = np.array([4.0, 0.25]) ** (-alpha / (1 + alpha))
        np.testing.assert_allclose(_solvers.fairgrad_weights(m, alpha), expected, rtol=1e-5)
    m = tf.constant([[2.0, -0.5], [-0.5, 1.0]])
    np.testing.assert_allclose(
        _solvers.fairgrad_weights(m, 1.0), _solvers.nash_mtl_weights(m), rtol=1e-5
    )


def test_trains_and_logs_end_to_end():
    fit_and_check("fairgrad")
    fit_and_check(weighting.FairGrad(alpha=2.0))


@pytest.mark.slow
@pytest.mark.distributed
def test_two_replicas_equal_one():
    two_replicas_equal_one(weighting.FairGrad, two_replica_strategy())


def test_config_round_trip_and_bad_arguments():
    method = weighting.FairGrad(alpha=np.float32(2.0), max_iter=30)
    assert weighting.FairGrad.from_config(method.get_config()).get_config() == {
        "alpha": 2.0,
        "max_iter": 30,
    }
    for bad in ({"alpha": 0}, {"alpha": "1"}, {"max_iter": 0}):
        with pytest.raises(ValueError, match="Received"):
            weighting.FairGrad(**bad)
