"""Hand-computed reference values for every loss weighting method (tiny inputs, NumPy)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy.optimize import minimize

from keras_fastloop import weighting
from keras_fastloop.state import StepState
from keras_fastloop.weighting import gradient_based as gb


def _gram(*vectors):
    g = np.array(vectors, dtype="float32")
    return g, tf.constant(g @ g.T)


def _built(method, tasks=("a", "b"), static=None):
    """A method built against a throw-away model and state (no training)."""
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model._shared_variables = None
    static = static or [1.0] * len(tasks)
    method.build(model, StepState(), list(tasks), static)
    return method, model


# --------------------------------------------------------------------------- gradient-based


def test_pcgrad_projects_two_conflicting_gradients():
    g, gram = _gram([1.0, 0.0], [-1.0, 1.0])  # <g1, g2> = -1 < 0
    beta = gb.pcgrad_weights(gram, tf.constant([[0, 1], [1, 0]], tf.int32)).numpy()
    g1_pc = g[0] - (-1.0 / 2.0) * g[1]  # [0.5, 0.5]
    g2_pc = g[1] - (-1.0 / 1.0) * g[0]  # [0, 1]
    np.testing.assert_allclose(beta @ g, g1_pc + g2_pc, atol=1e-6)
    np.testing.assert_allclose(beta, [2.0, 1.5], atol=1e-6)


def test_pcgrad_leaves_agreeing_gradients_alone():
    _, gram = _gram([1.0, 0.0], [1.0, 1.0])
    beta = gb.pcgrad_weights(gram, tf.constant([[1, 0], [0, 1]], tf.int32)).numpy()
    np.testing.assert_allclose(beta, [1.0, 1.0])


def test_pcgrad_three_tasks_follows_the_given_order():
    g, gram = _gram([1.0, 0.0, 0.0], [-1.0, 1.0, 0.0], [-1.0, -1.0, 1.0])
    order = np.array([[2, 0, 1], [0, 1, 2], [1, 2, 0]])
    expected = np.zeros(3)
    for i in range(3):
        gi = g[i].astype("float64").copy()
        for j in order[i]:
            if j != i and gi @ g[j] < 0:
                gi -= gi @ g[j] / (g[j] @ g[j]) * g[j]
        expected += gi
    beta = gb.pcgrad_weights(gram, tf.constant(order, tf.int32)).numpy()
    np.testing.assert_allclose(beta @ g, expected, atol=1e-5)


def test_mgda_two_task_closed_form():
    g, gram = _gram([1.0, 0.0], [0.0, 2.0])
    alpha = gb.mgda_weights(gram).numpy()
    # alpha_1 = (M22 - M12) / (M11 + M22 - 2 M12) = 4 / 5
    np.testing.assert_allclose(alpha, [0.8, 0.2], atol=1e-6)
    np.testing.assert_allclose(alpha @ g, [0.8, 0.4], atol=1e-6)


def test_mgda_two_task_clips_to_the_shorter_gradient():
    _, gram = _gram([1.0, 0.0], [3.0, 0.0])  # min-norm point is g1
    np.testing.assert_allclose(gb.mgda_weights(gram).numpy(), [1.0, 0.0], atol=1e-6)


def _min_norm_reference(m):
    t = len(m)
    res = minimize(
        lambda a: a @ m @ a,
        np.ones(t) / t,
        bounds=[(0, 1)] * t,
        constraints=({"type": "eq", "fun": lambda a: 1 - a.sum()},),
        tol=1e-12,
    )
    return res.x


def test_mgda_frank_wolfe_matches_min_norm_solution():
    rng = np.random.default_rng(0)
    g = rng.normal(size=(4, 6)).astype("float32")
    m = (g @ g.T).astype("float64")
    alpha = gb.mgda_weights(tf.constant(m, tf.float32), max_iter=2000, tolerance=1e-9).numpy()
    ref = _min_norm_reference(m)
    np.testing.assert_allclose(alpha.sum(), 1.0, atol=1e-5)
    assert alpha @ m @ alpha <= ref @ m @ ref + 1e-4 * np.trace(m)


def _cagrad_reference(g, c):
    m = g @ g.T
    t = len(g)
    b = np.ones(t) / t
    cc = c * np.sqrt(m.mean() + 1e-8)
    res = minimize(
        lambda x: x @ m @ b + cc * np.sqrt(x @ m @ x + 1e-8),
        b,
        bounds=[(0, 1)] * t,
        constraints=({"type": "eq", "fun": lambda x: 1 - x.sum()},),
    )
    w = res.x
    gw = w @ g
    d = g.mean(0) + cc / (np.linalg.norm(gw) + 1e-8) * gw
    return d / (1 + c**2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cagrad_matches_scipy_solution(seed):
    rng = np.random.default_rng(seed)
    g = rng.normal(size=(3, 5)) * np.array([[1.0], [0.3], [2.0]])
    beta = gb.cagrad_weights(tf.constant(g @ g.T, tf.float32), c=0.5).numpy()
    expected = _cagrad_reference(g, 0.5)
    scale = np.sqrt(np.mean(np.sum(g**2, 1)))
    np.testing.assert_allclose(beta @ g, expected, atol=1e-3 * scale)


def test_cagrad_with_c_zero_is_the_mean_gradient():
    _, gram = _gram([1.0, 0.0], [-1.0, 2.0])
    np.testing.assert_allclose(gb.cagrad_weights(gram, c=0.0).numpy(), [0.5, 0.5], atol=1e-6)


def test_imtl_matches_numpy_and_equalises_projections():
    g = np.array([[1.0, 0.0, 0.0], [0.5, 2.0, 0.0], [-0.3, 0.4, 1.5]], "float32")
    u = g / np.linalg.norm(g, axis=1, keepdims=True)
    d = g[0:1] - g[1:]
    uu = u[0:1] - u[1:]
    a = g[0] @ uu.T @ np.linalg.inv(d @ uu.T)
    expected = np.concatenate([[1 - a.sum()], a])
    alpha = gb.imtl_weights(tf.constant(g @ g.T)).numpy()
    np.testing.assert_allclose(alpha, expected, rtol=1e-4, atol=1e-5)
    agg = alpha @ g
    proj = u @ agg
    np.testing.assert_allclose(proj, proj[0], rtol=1e-4)


def test_gradnorm_weight_update_by_hand():
    w = np.array([1.0, 1.0], "float32")
    norms = np.array([2.0, 1.0], "float32")
    losses = np.array([0.5, 0.9], "float32")
    initial = np.array([1.0, 1.0], "float32")
    new = gb.gradnorm_update(
        tf.constant(w), tf.constant(norms), tf.constant(losses), tf.constant(initial), 1.5, 0.1
    ).numpy()
    # G = [2, 1], mean 1.5; ratios [0.5, 0.9] / 0.7; targets 1.5 r^1.5 = [0.8113, 1.9533]
    r = np.array([0.5, 0.9]) / 0.7
    target = 1.5 * r**1.5
    step = w - 0.1 * np.sign(w * norms - target) * norms  # [0.8, 1.1]
    np.testing.assert_allclose(step, [0.8, 1.1], atol=1e-6)
    np.testing.assert_allclose(new, 2 * step / step.sum(), atol=1e-6)


def test_simplex_projection():
    np.testing.assert_allclose(
        gb.project_to_simplex(tf.constant([0.5, 0.5, 0.5])).numpy(), [1 / 3] * 3, atol=1e-6
    )
    np.testing.assert_allclose(
        gb.project_to_simplex(tf.constant([2.0, 0.0, -1.0])).numpy(), [1, 0, 0], atol=1e-6
    )


# ------------------------------------------------------------------------------ loss-based


def test_uw_objective():
    method, model = _built(weighting.get("uw"))
    assert any(v is method.log_variances for v in model.trainable_variables)
    method.log_variances.assign([0.0, np.log(2.0)])
    objective, weights = method.combine([tf.constant(2.0), tf.constant(3.0)])
    np.testing.assert_allclose(float(objective), 2.0 + 3.0 / 2.0 + np.log(2.0), rtol=1e-6)
    np.testing.assert_allclose(weights.numpy(), [1.0, 0.5], rtol=1e-6)


def test_uw_gradient_of_log_variance():
    method, _ = _built(weighting.get("uw"))
    with tf.GradientTape() as tape:
        objective, _ = method.combine([tf.constant(2.0), tf.constant(0.5)])
    grad = tape.gradient(objective, method.log_variances.value).numpy()
    # d/ds (exp(-s) L + s) = 1 - L at s = 0
    np.testing.assert_allclose(grad, [-1.0, 0.5], rtol=1e-6)


def test_dwa_weights_with_temperature_two():
    method, _ = _built(weighting.DWA(temperature=2.0, window=2))
    for losses in ([1.0, 1.0], [1.0, 1.0], [0.5, 0.8], [0.5, 0.8]):
        np.testing.assert_allclose(method.weights.numpy(), [1.0, 1.0])  # first two windows
        method.update([tf.constant(v) for v in losses])
    r = np.array([0.5, 0.8]) / np.array([1.0, 1.0])
    expected = 2 * np.exp(r / 2) / np.exp(r / 2).sum()
    np.testing.assert_allclose(method.weights.numpy(), expected, rtol=1e-6)
    assert abs(expected[1] - 1.0749) < 1e-3  # hand value: 2 e^0.4 / (e^0.25 + e^0.4)


def test_loss_ema_weights():
    method, _ = _built(weighting.LossEMA(decay=0.5))
    method.update([tf.constant(1.0), tf.constant(3.0)])  # ema = [1, 3]
    np.testing.assert_allclose(method.weights.numpy(), [0.5, 1.5], rtol=1e-6)
    method.update([tf.constant(3.0), tf.constant(3.0)])  # ema = [2, 3]
    np.testing.assert_allclose(method.weights.numpy(), [0.8, 1.2], rtol=1e-6)
    objective, weights = method.combine([tf.constant(1.0), tf.constant(2.0)])
    np.testing.assert_allclose(float(objective), 0.8 + 2.4, rtol=1e-6)


def test_rlw_weights_are_a_reproducible_softmax_of_normals():
    method, _ = _built(weighting.RLW(seed=7), tasks=("a", "b", "c"))
    _, w0 = method.combine([tf.constant(1.0)] * 3)
    _, again = method.combine([tf.constant(1.0)] * 3)
    np.testing.assert_allclose(w0.numpy(), again.numpy())  # evaluate does not advance it
    z = tf.random.stateless_normal((3,), seed=tf.constant([7, 0], tf.int64)).numpy()
    np.testing.assert_allclose(w0.numpy(), np.exp(z) / np.exp(z).sum(), rtol=1e-6)
    method.update(None)
    _, w1 = method.combine([tf.constant(1.0)] * 3)
    assert not np.allclose(w0.numpy(), w1.numpy())
    np.testing.assert_allclose(w1.numpy().sum(), 1.0, rtol=1e-6)


def test_famo_objective_and_update():
    method, _ = _built(weighting.FAMO(w_lr=0.1, gamma=0.0))
    losses = [tf.constant(2.0), tf.constant(0.5)]
    with tf.GradientTape() as tape:
        tape.watch(losses)
        objective, weights = method.combine(losses)
    grads = [g.numpy() for g in tape.gradient(objective, losses)]
    # z = [0.5, 0.5], c = 0.5/2 + 0.5/0.5 = 1.25: weights z / (c L) = [0.2, 0.8]
    np.testing.assert_allclose(weights.numpy(), [0.2, 0.8], rtol=1e-5)
    np.testing.assert_allclose(grads, [0.2, 0.8], rtol=1e-5)
    np.testing.assert_allclose(float(objective), (0.5 * np.log(2) + 0.5 * np.log(0.5)) / 1.25)

    method.update(losses)  # first update: only records the losses
    np.testing.assert_allclose(method.logits.numpy(), [0.0, 0.0])
    method.update([tf.constant(1.0), tf.constant(0.45)])
    delta = np.log([2.0, 0.5]) - np.log([1.0, 0.45])
    z = np.array([0.5, 0.5])
    g = z * (delta - z @ delta)
    m, v = 0.1 * g, 0.001 * g**2
    step = 0.1 * (m / 0.1) / (np.sqrt(v / 0.001) + 1e-8)  # first Adam step = lr * sign(g)
    np.testing.assert_allclose(method.logits.numpy(), -step, rtol=1e-5)
    assert method.logits.numpy()[1] > method.logits.numpy()[0]  # task b improved less


@pytest.mark.parametrize("method_id", weighting.METHODS)
def test_every_method_round_trips_its_config(method_id):
    method = weighting.get(method_id)
    config = keras.saving.serialize_keras_object(method)
    restored = keras.saving.deserialize_keras_object(config)
    assert type(restored) is type(method)
    assert restored.get_config() == method.get_config()
    assert method.name == method_id
    assert method.__doc__ and "Reference" in (method.__doc__ + type(method).__doc__)


def test_xla_solvers_match_the_plain_ones():
    rng = np.random.default_rng(3)
    g = rng.normal(size=(3, 4))
    gram = tf.constant(g @ g.T, tf.float32)
    np.testing.assert_allclose(
        gb._cagrad_weights_xla(gram, 0.5, 1, 100).numpy(),
        gb.cagrad_weights(gram, 0.5, 1, 100).numpy(),
        rtol=1e-3,  # float32 rounding differs between XLA and the op-by-op loop
        atol=1e-5,
    )
    np.testing.assert_allclose(
        gb._mgda_weights_xla(gram, 250, 1e-5).numpy(),
        gb.mgda_weights(gram, 250, 1e-5).numpy(),
        rtol=1e-4,
        atol=1e-5,
    )
