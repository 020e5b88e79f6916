"""GradVac: reference values from LibMTL's code, state, logs and training."""

import numpy as np
import pytest
import tensorflow as tf
from _helpers import two_replica_strategy
from _linear_tasks import (
    built,
    check_save_and_resume,
    fit_and_check,
    head_gradient,
    run_step,
    two_replicas_equal_one,
)

from keras_fastloop import weighting

# LibMTL (github median-research-group/LibMTL, LibMTL/weighting/GradVac.py at the current main)
# run on the linear losses of `_linear_tasks` (3 tasks, GradVac_beta=0.5, float32), three steps,
# with `random.shuffle` replaced by the orders our generator draws for seed 0 at steps 0, 1, 2:
# the shared gradient after each `backward`, and `rho_T` after the third.
_ORDERS = [[[0, 1, 2], [1, 0, 2], [1, 0, 2]], [[0, 2, 1], [0, 1, 2], [2, 0, 1]],
           [[0, 1, 2], [2, 1, 0], [1, 0, 2]]]  # fmt: skip
_LIBMTL = {
    "model": (  # GradVac_group_type=0
        [
            [-5.7800812721, 0.7322870493, -0.8962122202, -1.3199415207, -0.0340231955,
             2.1171796322, -3.5329999924, 2.3769836426, -0.3587781191, -1.3848924637,
             3.6319739819, 1.1869441271, -0.7322870493, -5.7800812721],
            [2.1536655426, -0.9967464209, 1.767275095, 1.3430938721, 2.5000128746, 0.4264335632,
             4.2672877312, -4.2672877312, -2.0335359573, 1.3030506372, 1.8874044418,
             -1.2370052338, 2.0735793114, 2.1536655426],
            [-4.86059618, 1.7130918503, -0.1368884444, -0.8540946841, 0.2926099896,
             3.7481131554, -2.396075964, 3.6112251282, 0.4637205601, -0.8198726177,
             0.2053326368, 1.4735369682, -4.7921519279, -4.86059618],
        ],
        [[[0.0], [0.2375766933], [0.0365742892]], [[0.2375766933], [0.0], [-0.0791983455]],
         [[0.0451357812], [-0.079198353], [0.0]]],
    ),
    "layer": (  # GradVac_group_type=1 (one group per nn.Linear)
        [
            [-5.2613630295, 0.6684427261, -0.9578773379, -1.3417071104, -0.242236793,
             2.0337486267, -3.1804168224, 2.1281442642, -0.305311799, -1.3594870567,
             3.7508563995, 1.5035803318, -0.8432030678, -6.2142720222],
            [2.3985683918, -1.0101959705, 2.0114746094, 1.3027455807, 2.6911177635,
             0.4816375971, 4.7025923729, -4.7025923729, -2.425110817, 2.0002999306,
             1.7936146259, -1.4580885172, 2.4697535038, 2.5590381622],
            [-4.8416399956, 1.5198025703, 0.0370303392, -0.8639870882, 0.3649380207,
             3.6034572124, -2.4300775528, 3.6404876709, 0.617079258, -0.6720299125,
             0.3545318842, 1.4334790707, -4.5655498505, -4.6837272644],
        ],
        [[[0.0, 0.0], [0.3601526618, 0.0810445696], [0.1193458661, -0.0913926959]],
         [[0.3601526618, 0.0794269145], [0.0, 0.0], [-0.1326867491, 0.0039870068]],
         [[0.1230041012, -0.0816667527], [-0.132686764, 0.0045193993], [0.0, 0.0]]],
    ),
    "variable": (  # GradVac_group_type=2 (one group per parameter)
        [
            [-6.0340909958, 0.61742413044, -0.81287872791, -1.4022729397, 0.0015151202679,
             2.1181817055, -3.0, 2.0, 1.1569871902, -0.79171681404, 4.3306512833, 2.1497612,
             -0.66939902306, -5.303278923],
            [2.9314074516, -1.1809704304, 2.7874088287, 1.1826024055, 2.9330391884,
             0.2863650322, 4.0, -4.0, -2.2282907963, 1.9879869223, 1.6121053696,
             -1.5190333128, 2.0, 2.0],
            [-4.9285206795, 1.3921943903, 0.1408064365, -0.9312593937, 0.3712738752,
             3.5907855034, -2.0, 3.0, 0.3622852564, -1.5423201323, 0.653260231, 1.395876646,
             -4.0, -4.0],
        ],
        [[[0.0, 0.0, 0.0, 0.0], [0.2388768792, 0.8701736927, -0.2381408811, 0.8327803016],
          [-0.009338811, 0.8649187088, -0.4162626863, 0.56513834]],
         [[0.2388768494, 0.8701736927, -0.3335683942, 0.8327803016], [0.0, 0.0, 0.0, 0.0],
          [-0.3742637038, 0.874037683, -0.2506551147, 0.6557500362]],
         [[0.0039476678, 0.8649187088, -0.4500386417, 0.5762419701],
          [-0.3811185956, 0.874037683, -0.294732213, 0.6557500362], [0.0, 0.0, 0.0, 0.0]]],
    ),
}  # fmt: skip


@pytest.mark.parametrize("granularity", ["model", "layer", "variable"])
def test_matches_libmtl_over_three_steps(granularity):
    method, variables = built(weighting.GradVac(beta=0.5, granularity=granularity, seed=0), 3)
    expected_grads, expected_targets = _LIBMTL[granularity]
    for step in range(3):
        keys = tf.random.stateless_uniform((3, 3), seed=[0, step])
        assert tf.argsort(keys, axis=1).numpy().tolist() == _ORDERS[step]
        shared, heads, _ = run_step(method, variables, 3, step, scale=2.0)
        np.testing.assert_allclose(shared, expected_grads[step], rtol=1e-5, atol=1e-5)
        for t in range(3):  # heads: the plain task gradient
            np.testing.assert_allclose(heads[t], head_gradient(t), rtol=1e-6)
    np.testing.assert_allclose(method.targets.numpy(), expected_targets, atol=1e-5)
    assert int(method.step.numpy()) == 3


def test_trains_and_logs_end_to_end():
    model, history = fit_and_check("gradvac")
    assert int(model.loss_weighting.step.numpy()) == 6
    assert model.loss_weighting.shared_variable_paths == [
        "trunk/kernel", "trunk/bias", "trunk2/kernel", "trunk2/bias"
    ]  # fmt: skip
    fit_and_check(weighting.GradVac(granularity="layer"))


def test_save_and_resume_exactly(tmp_path):
    check_save_and_resume(tmp_path, weighting.GradVac(granularity="variable"), ["targets", "step"])


@pytest.mark.slow
@pytest.mark.distributed
def test_two_replicas_equal_one():
    _, two = two_replicas_equal_one(
        lambda: weighting.GradVac(granularity="layer", seed=3), two_replica_strategy()
    )
    assert int(two.loss_weighting.step.numpy()) == 6


def test_config_round_trip_and_bad_arguments():
    method = weighting.GradVac(beta=0.25, granularity="variable", seed=7)
    again = weighting.GradVac.from_config(method.get_config())
    assert again.get_config() == {"beta": 0.25, "granularity": "variable", "seed": 7}
    for bad in ({"beta": 1.5}, {"beta": -0.1}, {"granularity": 1}, {"seed": "x"}):
        with pytest.raises(ValueError, match="Received"):
            weighting.GradVac(**bad)
