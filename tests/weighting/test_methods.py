"""Hand-computed reference values for every loss weighting method (tiny inputs, NumPy)."""

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy.optimize import minimize

from keras_fastloop import OptimizedModel, weighting
from keras_fastloop._step.state import StepState
from keras_fastloop.weighting import _solvers as gb


def _gram(*vectors):
    g = np.array(vectors, dtype="float32")
    return g, tf.constant(g @ g.T)


def _built(method, tasks=("a", "b"), static=None):
    """A method built against a throw-away model and state (no training)."""
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
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


def _exact_min_norm(m):
    """Exact float64 min-norm point of the simplex: every support, KKT system, best feasible."""
    t = len(m)
    best, best_value = None, np.inf
    for mask in itertools.product([False, True], repeat=t):
        support = np.flatnonzero(mask)
        if not len(support):
            continue
        k = len(support)
        kkt = np.zeros((k + 1, k + 1))
        kkt[:k, :k] = 2 * m[np.ix_(support, support)]
        kkt[:k, k] = kkt[k, :k] = 1.0
        rhs = np.zeros(k + 1)
        rhs[k] = 1.0
        solution = np.linalg.lstsq(kkt, rhs, rcond=None)[0]
        if np.any(solution[:k] < -1e-12):
            continue
        alpha = np.zeros(t)
        alpha[support] = np.maximum(solution[:k], 0.0)
        alpha /= alpha.sum()
        value = alpha @ m @ alpha
        if value < best_value - 1e-15:
            best, best_value = alpha, value
    return best


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("tasks", [3, 5, 8])
def test_mgda_default_solver_against_exact_float64_min_norm(seed, tasks):
    rng = np.random.default_rng(seed)
    g = rng.normal(size=(tasks, 8)) * rng.uniform(0.2, 3.0, size=(tasks, 1))
    m = g @ g.T
    exact = _exact_min_norm(m)
    kkt = m @ exact  # optimality: (M alpha)_i is minimal (= alpha^T M alpha) on the support
    assert np.all(kkt >= exact @ m @ exact - 1e-9)
    method, _ = _built(weighting.MGDA(), tasks=[f"t{i}" for i in range(tasks)])
    alpha = method.task_weights(tf.constant(m, tf.float32), tf.ones((tasks,))).numpy()
    np.testing.assert_allclose(alpha, exact, atol=1e-5)
    np.testing.assert_allclose(gb.min_norm_weights(tf.constant(m, tf.float32)), exact, atol=1e-5)
    # Sener & Koltun's Frank-Wolfe (LibMTL's solver) stops early: only the norm is close
    fw = gb._mgda_weights_xla(tf.constant(m, tf.float32), 250, 1e-5).numpy()
    assert fw @ m @ fw - exact @ m @ exact <= 5e-3 * np.trace(m) / tasks


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


def test_uw_objective_is_kendalls_eq7_by_default():
    method, model = _built(weighting.get("uw"))
    assert any(v is method.log_variances for v in model.trainable_variables)
    method.log_variances.assign([0.0, np.log(2.0)])
    objective, weights = method.combine([tf.constant(2.0), tf.constant(3.0)])
    # L / (2 sigma^2) + log sigma with sigma^2 = e^s: 2/2 + 0 + 3/4 + log(2)/2
    np.testing.assert_allclose(float(objective), 1.0 + 0.75 + 0.5 * np.log(2.0), rtol=1e-6)
    np.testing.assert_allclose(weights.numpy(), [0.5, 0.25], rtol=1e-6)
    np.testing.assert_allclose(method.weights.numpy(), [0.5, 0.25], rtol=1e-6)


def test_uw_unhalved_objective():
    method, _ = _built(weighting.UncertaintyWeighting(halved=False))
    method.log_variances.assign([0.0, np.log(2.0)])
    objective, weights = method.combine([tf.constant(2.0), tf.constant(3.0)])
    np.testing.assert_allclose(float(objective), 2.0 + 3.0 / 2.0 + np.log(2.0), rtol=1e-6)
    np.testing.assert_allclose(weights.numpy(), [1.0, 0.5], rtol=1e-6)


def test_uw_libmtl_start():
    method, _ = _built(weighting.UncertaintyWeighting(initial_log_variance=-0.5))
    np.testing.assert_allclose(method.weights.numpy(), [np.exp(0.5) / 2] * 2, rtol=1e-6)


def test_uw_gradient_of_log_variance():
    method, _ = _built(weighting.get("uw"))
    with tf.GradientTape() as tape:
        objective, _ = method.combine([tf.constant(2.0), tf.constant(0.5)])
    grad = tape.gradient(objective, method.log_variances.value).numpy()
    # d/ds (exp(-s) L + s) / 2 = (1 - L) / 2 at s = 0
    np.testing.assert_allclose(grad, [-0.5, 0.25], rtol=1e-6)


def test_dwa_weights_with_temperature_two():
    method, _ = _built(weighting.DWA(temperature=2.0, window=2))
    for losses in ([1.0, 1.0], [1.0, 1.0], [0.5, 0.8], [0.5, 0.8]):
        np.testing.assert_allclose(method.weights.numpy(), [1.0, 1.0])  # first two windows
        method.update([tf.constant(v) for v in losses])
    r = np.array([0.5, 0.8]) / np.array([1.0, 1.0])
    expected = 2 * np.exp(r / 2) / np.exp(r / 2).sum()
    np.testing.assert_allclose(method.weights.numpy(), expected, rtol=1e-6)
    assert abs(expected[1] - 1.0749) < 1e-3  # hand value: 2 e^0.4 / (e^0.25 + e^0.4)


def test_dwa_default_window_is_one_epoch_closed_by_end_window():
    method, _ = _built(weighting.DWA())
    assert method.window is None and len(method.callbacks()) == 1
    epochs = ([[1.0, 2.0], [3.0, 2.0]], [[1.0, 1.0]], [[0.5, 1.5], [1.5, 0.5], [1.0, 1.0]])
    for epoch in epochs:
        for losses in epoch:
            method.update([tf.constant(v) for v in losses])
            np.testing.assert_allclose(method.weights.numpy(), [1.0, 1.0])  # fixed within
        method.end_window()
    # epoch means: [2, 2], [1, 1], [1, 1]; weights after the third: ratios [1, 1] -> [1, 1]
    np.testing.assert_allclose(method.weights.numpy(), [1.0, 1.0], rtol=1e-6)
    method.end_window()  # an empty window is left open
    assert int(method.windows.numpy()) == 3
    for losses in ([0.25, 0.9], [0.75, 0.7]):
        method.update([tf.constant(v) for v in losses])
    method.end_window()  # means [0.5, 0.8] after [1, 1]
    r = np.array([0.5, 0.8])
    expected = 2 * np.exp(r / 2) / np.exp(r / 2).sum()
    np.testing.assert_allclose(method.weights.numpy(), expected, rtol=1e-6)
    # after two windows with ratio 1: the same as after [2, 2] -> [1, 1]: ratio 1/2 each
    np.testing.assert_allclose(method.previous.numpy(), [[1.0, 1.0], [0.5, 0.8]])


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
    for xla, plain in (
        (gb._nash_mtl_weights_xla(gram, 20), gb.nash_mtl_weights(gram, 20)),
        (gb._upgrad_weights_xla(gram, 1e-4, 1e-4), gb.upgrad_weights(gram)),
        (gb._min_norm_weights_xla(gram), gb.min_norm_weights(gram)),
    ):
        np.testing.assert_allclose(xla.numpy(), plain.numpy(), rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------ IMTL (hybrid), IMTL-G


def test_imtl_hybrid_scales_the_gradients_before_imtl_g():
    method, model = _built(weighting.get("imtl"))
    assert type(weighting.get("imtl_g")) is weighting.IMTLG
    assert any(v is method.loss_scales for v in model.trainable_variables)
    s = np.array([0.0, np.log(2.0)])
    method.loss_scales.assign(s)
    g = np.array([[1.0, 0.0], [1.0, 1.0]])
    # scaled gradients e^s g: h1 = (1, 0), h2 = (2, 2); IMTL-G on them by hand:
    # u1 = (1, 0), u2 = (1, 1)/sqrt2; alpha_2 = h1.(u1 - u2) / ((h1 - h2).(u1 - u2))
    u = np.array([[1.0, 0.0], [1.0, 1.0]]) / np.array([[1.0], [np.sqrt(2.0)]])
    h = np.exp(s)[:, None] * g
    a2 = h[0] @ (u[0] - u[1]) / ((h[0] - h[1]) @ (u[0] - u[1]))
    alpha = np.array([1 - a2, a2])
    agg = alpha @ h
    np.testing.assert_allclose(u @ agg, (u @ agg)[0])  # equal projections (hand check)
    beta = method.task_weights(tf.constant(g @ g.T, tf.float32), tf.ones((2,))).numpy()
    np.testing.assert_allclose(beta, alpha * np.exp(s), rtol=1e-5)
    np.testing.assert_allclose(method.head_weights().numpy(), [1.0, 2.0], rtol=1e-6)


def test_imtl_hybrid_loss_scale_gradient_is_e_s_l_minus_one():
    method, _ = _built(weighting.get("imtl"))
    method.loss_scales.assign([0.0, np.log(0.5)])
    losses = [tf.constant(3.0), tf.constant(1.0)]
    with tf.GradientTape() as tape:
        tape.watch(losses)
        objective, _ = method.combine(losses)
    grad_s, *grad_losses = tape.gradient(objective, [method.loss_scales.value, *losses])
    np.testing.assert_allclose(grad_s.numpy(), [3.0 - 1.0, 0.5 - 1.0], rtol=1e-6)
    assert all(g is None for g in grad_losses)  # the network's gradients come from the task passes
    np.testing.assert_allclose(float(objective), 3.0 + 0.5 - np.log(0.5), rtol=1e-6)


# -------------------------------------------------------------------------------- Nash-MTL


def _nash_reference(m):
    """float64 root of the raw equation M alpha = 1 / alpha, solved in log-space by SciPy."""
    from scipy.optimize import root

    sol = root(
        lambda x: m @ np.exp(x) - np.exp(-x),
        -0.5 * np.log(np.diag(m)),
        jac=lambda x: m * np.exp(x)[None, :] + np.diag(np.exp(-x)),
        tol=1e-14,
    )
    alpha = np.exp(sol.x)
    np.testing.assert_allclose((m @ alpha) * alpha, 1.0, rtol=1e-10)  # solved in float64
    return alpha


def test_nash_mtl_orthogonal_gradients_by_hand():
    _, gram = _gram([3.0, 0.0], [0.0, 4.0])  # M = diag(9, 16): alpha_i^2 M_ii = 1
    alpha = gb.nash_mtl_weights(gram).numpy()
    np.testing.assert_allclose(alpha, [1 / 3, 1 / 4], rtol=1e-6)


def test_nash_mtl_rescaling_solves_the_raw_equation():
    # the root a of (M / n) a = 1 / a, divided by sqrt(n), is the root of M alpha = 1 / alpha
    g = np.array([[1.0, 0.5, 0.0], [-0.2, 2.0, 1.0], [0.3, -1.0, 4.0]])
    m = g @ g.T
    n = np.linalg.norm(m)
    normalised = _nash_reference(m / n)
    np.testing.assert_allclose(normalised / np.sqrt(n), _nash_reference(m), rtol=1e-10)
    alpha = gb.nash_mtl_weights(tf.constant(m, tf.float32)).numpy()
    np.testing.assert_allclose(alpha, normalised / np.sqrt(n), rtol=1e-5)


def test_nash_mtl_two_tasks_closed_form():
    # a x^2 + b x y = 1 = b x y + c y^2  =>  y = x sqrt(a / c), x = 1 / sqrt(a + b sqrt(a / c))
    g, gram = _gram([1.0, 0.0], [-0.5, 2.0])
    m = (g @ g.T).astype("float64")
    a, b, c = m[0, 0], m[0, 1], m[1, 1]
    x = 1.0 / np.sqrt(a + b * np.sqrt(a / c))
    expected = np.array([x, x * np.sqrt(a / c)])
    np.testing.assert_allclose(gb.nash_mtl_weights(gram).numpy(), expected, rtol=1e-5)
    np.testing.assert_allclose(expected, _nash_reference(m), rtol=1e-10)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("tasks", [3, 6])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_nash_mtl_matches_float64_solve(seed, tasks, scale):
    rng = np.random.default_rng(seed)
    g = scale * rng.normal(size=(tasks, 10)) * rng.uniform(0.1, 5.0, size=(tasks, 1))
    m = g @ g.T
    alpha = gb._nash_mtl_weights_xla(tf.constant(m, tf.float32), 20).numpy()
    np.testing.assert_allclose(alpha, _nash_reference(m), rtol=1e-4)
    np.testing.assert_allclose((m @ alpha) * alpha, np.ones(tasks), rtol=1e-4)
    # the update's norm: |G alpha|^2 = alpha^T M alpha = T, whatever the gradients' scale
    np.testing.assert_allclose(alpha @ m @ alpha, tasks, rtol=1e-4)


def test_nash_mtl_clip_factor():
    g, gram = _gram([3.0, 0.0], [0.0, 4.0])
    beta = tf.constant([1.0, 1.0])  # |d| = 5
    assert float(gb.clip_factor(beta, gram, 1.0)) == pytest.approx(0.2, rel=1e-6)
    assert float(gb.clip_factor(beta, gram, 10.0)) == 1.0
    assert float(gb.clip_factor(beta, gram, 0.0)) == 1.0


def _nash_model(tasks=3):
    inputs = keras.Input((4,))
    h = keras.layers.Dense(3, use_bias=False, name="trunk")(inputs)
    outputs = {k: keras.layers.Dense(1, use_bias=False, name=k)(h) for k in "abc"[:tasks]}
    return OptimizedModel(inputs, outputs)


def _nash_step(method, seed=0):
    """One SGD(1) step; returns (G, trunk change, per-task head gradients, logged weights)."""
    rng = np.random.default_rng(seed)
    keras.utils.set_random_seed(seed)
    model = _nash_model()
    x = rng.normal(size=(6, 4)).astype("float32")
    y = {k: rng.normal(size=(6, 1)).astype("float32") * 3 for k in "abc"}
    y["c"] = -y["a"]  # conflicts with task a
    before = [v.numpy().copy() for v in model.trainable_variables]
    grads = []
    for k in "abc":
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y[k], model(x)[k])
        grads.append(
            [g.numpy() for g in tape.gradient(loss, model.trainable_variables) if g is not None]
        )
    trunk_index = [v.path for v in model.trainable_variables].index("trunk/kernel")
    g = np.stack([gr[0].reshape(-1) for gr in grads]).astype("float64")
    model.compile(keras.optimizers.SGD(1.0), "mse", loss_weighting=method)
    logs = model.train_on_batch(x, y, return_dict=True)
    change = before[trunk_index] - model.trainable_variables[trunk_index].numpy()
    return g, change.reshape(-1), np.array([logs[f"{k}_weight"] for k in "abc"]), model


@pytest.mark.parametrize("seed", [0, 1])
def test_nash_mtl_step_equals_the_raw_equation_before_the_clip(seed):
    g, change, weights, _ = _nash_step(weighting.NashMTL(max_norm=None), seed)
    alpha = _nash_reference(g @ g.T)
    np.testing.assert_allclose(weights, alpha, rtol=2e-4)
    np.testing.assert_allclose(change, alpha @ g, rtol=2e-4, atol=1e-5)
    assert np.linalg.norm(change) == pytest.approx(np.sqrt(3.0), rel=2e-4)


def test_nash_mtl_step_clips_the_shared_update_to_max_norm():
    g, change, weights, _ = _nash_step(weighting.NashMTL(max_norm=0.5))
    alpha = _nash_reference(g @ g.T)
    expected = alpha @ g * 0.5 / np.sqrt(3.0)  # |G alpha| = sqrt(3) > 0.5
    np.testing.assert_allclose(change, expected, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(weights, alpha * 0.5 / np.sqrt(3.0), rtol=2e-4)
    assert np.linalg.norm(change) == pytest.approx(0.5, rel=1e-5)


def test_nash_mtl_holds_alpha_between_updates(tmp_path):
    method = weighting.NashMTL(max_norm=None, update_weights_every=3)
    _, _, first, model = _nash_step(method)
    np.testing.assert_allclose(method.alpha.numpy(), first, rtol=1e-6)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(6, 4)).astype("float32")
    y = {k: rng.normal(size=(6, 1)).astype("float32") for k in "abc"}
    for _ in (1, 2):
        logs = model.train_on_batch(x, y, return_dict=True)
        np.testing.assert_allclose([logs[f"{k}_weight"] for k in "abc"], first, rtol=1e-6)
    logs = model.train_on_batch(x, y, return_dict=True)  # step 3: recomputed
    assert not np.allclose([logs[f"{k}_weight"] for k in "abc"], first, rtol=1e-3)
    assert int(method.step.numpy()) == 4
    path = tmp_path / "nash.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True).loss_weighting
    assert loaded.get_config() == method.get_config()
    np.testing.assert_allclose(loaded.alpha.numpy(), method.alpha.numpy())
    assert int(loaded.step.numpy()) == 4


def test_nash_mtl_zero_gradients_give_ones():
    alpha = gb.nash_mtl_weights(tf.zeros((3, 3))).numpy()
    np.testing.assert_array_equal(alpha, [1.0, 1.0, 1.0])


# ----------------------------------------------------------------------------- Aligned-MTL


def test_aligned_mtl_orthogonal_gradients_by_hand():
    # singular values 2 and 1: both aligned gradients get norm sigma_min = 1
    _, gram = _gram([2.0, 0.0], [0.0, 1.0])
    np.testing.assert_allclose(gb.aligned_mtl_weights(gram).numpy(), [0.5, 1.0], atol=1e-6)


def test_aligned_mtl_rank_deficient_by_hand():
    # g2 = 2 g1: rank 1, V = (1, 2)/sqrt5 only, beta = V V^T 1 = (3/5, 6/5); update 3 g1 = G 1
    _, gram = _gram([1.0, 0.0], [2.0, 0.0])
    np.testing.assert_allclose(gb.aligned_mtl_weights(gram).numpy(), [0.6, 1.2], atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aligned_mtl_matches_numpy_svd(seed):
    rng = np.random.default_rng(seed)
    g = rng.normal(size=(4, 9)) * rng.uniform(0.2, 3.0, size=(4, 1))
    u, sv, vt = np.linalg.svd(g.T, full_matrices=False)  # columns of G are the gradients
    aligned = sv.min() * u @ vt  # the paper's aligned matrix
    expected_update = aligned.sum(axis=1)
    beta = gb.aligned_mtl_weights(tf.constant(g @ g.T, tf.float32)).numpy()
    scale = np.linalg.norm(expected_update)
    np.testing.assert_allclose(beta @ g, expected_update, atol=1e-5 * scale)


@pytest.mark.parametrize("scale_mode", ["min", "median", "rmse"])
@pytest.mark.parametrize("tasks", [3, 4])
def test_aligned_mtl_scale_modes_match_numpy_svd(scale_mode, tasks):
    rng = np.random.default_rng(tasks)
    g = rng.normal(size=(tasks, 9)) * rng.uniform(0.2, 3.0, size=(tasks, 1))
    u, sv, vt = np.linalg.svd(g.T, full_matrices=False)
    eig = np.sort(sv**2)  # eigenvalues of G^T G, ascending
    scale = {
        "min": sv.min(),
        "median": np.sqrt(eig[(tasks - 1) // 2]),  # torch.median: the lower median
        "rmse": np.sqrt(eig.mean()),
    }[scale_mode]
    expected_update = (scale * u @ vt).sum(axis=1)
    beta = gb.aligned_mtl_weights(tf.constant(g @ g.T, tf.float32), scale_mode).numpy()
    np.testing.assert_allclose(
        beta @ g, expected_update, atol=1e-5 * np.linalg.norm(expected_update)
    )
    method = weighting.AlignedMTL(scale_mode=scale_mode)
    np.testing.assert_allclose(method.task_weights(tf.constant(g @ g.T, tf.float32), None), beta)


def test_aligned_mtl_orthogonal_scale_modes_by_hand():
    # singular values 3, 2, 1: beta_i = s / n_i with s = 1 (min), 2 (median), sqrt(14/3) (rmse)
    _, gram = _gram([3.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 1.0])
    n = np.array([3.0, 2.0, 1.0])
    for mode, s in (("min", 1.0), ("median", 2.0), ("rmse", np.sqrt(14 / 3))):
        np.testing.assert_allclose(gb.aligned_mtl_weights(gram, mode).numpy(), s / n, rtol=1e-5)


# ---------------------------------------------------------------------------------- UPGrad


def _box_qp_reference(m, u):
    """float64 argmin_{v >= u} v^T M v by enumerating which constraints are active (KKT)."""
    t = len(m)
    for free in itertools.product([False, True], repeat=t):
        free = np.array(free)
        v = u.astype("float64").copy()
        if free.any():
            rhs = -m[np.ix_(free, ~free)] @ u[~free]
            v[free] = np.linalg.solve(m[np.ix_(free, free)], rhs)
        gradient = m @ v
        if np.all(v[free] >= u[free] - 1e-12) and np.all(gradient[~free] >= -1e-12):
            return v
    raise AssertionError("no KKT point")


def _upgrad_reference(g, norm_eps=1e-4, reg_eps=1e-4):
    m = g @ g.T
    trace = np.trace(m)
    m = (np.zeros_like(m) if trace < norm_eps else m / trace) + reg_eps * np.eye(len(m))
    t = len(m)
    return sum(_box_qp_reference(m, np.eye(t)[i]) for i in range(t)) / t


def test_upgrad_two_conflicting_gradients_by_hand():
    # g1 = (1, 0), g2 = (-1, 1): pi(g1) = g1 + g2/2 = (.5, .5), pi(g2) = g2 + g1 = (0, 1)
    g, gram = _gram([1.0, 0.0], [-1.0, 1.0])
    beta = gb.upgrad_weights(gram, reg_eps=0.0).numpy()
    np.testing.assert_allclose(beta, [1.0, 0.75], atol=1e-6)
    np.testing.assert_allclose(beta @ g, [0.25, 0.75], atol=1e-6)
    assert np.all(g @ (beta @ g) >= 0)  # conflicts with no task


def test_upgrad_without_conflict_is_the_mean_gradient():
    _, gram = _gram([1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.5, 2.0])
    np.testing.assert_allclose(gb.upgrad_weights(gram, reg_eps=0.0).numpy(), [1 / 3] * 3, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("tasks", [3, 5])
def test_upgrad_matches_float64_enumerated_qp(seed, tasks):
    rng = np.random.default_rng(seed)
    g = rng.normal(size=(tasks, 6)) * rng.uniform(0.2, 3.0, size=(tasks, 1))
    beta = gb._upgrad_weights_xla(tf.constant(g @ g.T, tf.float32), 1e-4, 1e-4).numpy()
    np.testing.assert_allclose(beta, _upgrad_reference(g), atol=2e-5)
    assert np.all(g @ (beta @ g) >= -1e-5 * np.sum(g**2))  # inside the dual cone


@pytest.mark.parametrize("pref", [[0.2, 0.5, 0.3], [1.0, 0.0, 2.0], [0.6, -0.1, 0.5]])
def test_upgrad_pref_vector_matches_float64_enumerated_qp(pref):
    rng = np.random.default_rng(11)
    g = rng.normal(size=(3, 6)) * rng.uniform(0.2, 3.0, size=(3, 1))
    m = g @ g.T
    m = m / np.trace(m) + 1e-4 * np.eye(3)
    expected = sum(_box_qp_reference(m, p * np.eye(3)[i]) for i, p in enumerate(pref))
    beta = gb._upgrad_weights_xla(tf.constant(g @ g.T, tf.float32), 1e-4, 1e-4, tuple(pref))
    np.testing.assert_allclose(beta.numpy(), expected, atol=2e-5)
    method = weighting.UPGrad(pref_vector=pref)
    np.testing.assert_allclose(
        method.task_weights(tf.constant(g @ g.T, tf.float32), None).numpy(), expected, atol=2e-5
    )


def test_upgrad_default_pref_vector_is_uniform():
    g = np.random.default_rng(3).normal(size=(3, 5))
    gram = tf.constant(g @ g.T, tf.float32)
    np.testing.assert_allclose(
        gb.upgrad_weights(gram).numpy(), gb.upgrad_weights(gram, pref_vector=[1 / 3] * 3).numpy()
    )
    # without conflict the update is sum_i p_i g_i
    _, gram = _gram([1.0, 0.0], [1.0, 1.0])
    np.testing.assert_allclose(
        gb.upgrad_weights(gram, reg_eps=0.0, pref_vector=[0.25, 2.0]).numpy(),
        [0.25, 2.0],
        atol=1e-6,
    )


def test_nonnegative_quadratic_matches_enumeration():
    rng = np.random.default_rng(7)
    a = rng.normal(size=(5, 5))
    m, c = a @ a.T + 0.1 * np.eye(5), rng.normal(size=5)
    z = gb.nonnegative_quadratic(tf.constant(m, tf.float32), tf.constant(c, tf.float32)).numpy()
    # with M w = c: z^T M z / 2 + c^T z = (z + w)^T M (z + w) / 2 + const, and z >= 0 <=> v >= w
    w = np.linalg.solve(m, c)
    expected = _box_qp_reference(m, w) - w
    np.testing.assert_allclose(z, expected, atol=1e-5)
    assert np.all(z >= 0) and np.any(z > 0) and np.any(z == 0)  # both kinds of coordinates
