"""Loss weighting inside OptimizedModel's step: equivalence, logs, mid-fit changes, saving."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import EXPECT_SKIP_WARNINGS, two_replica_strategy

from keras_fastloop import OptimizedModel, weighting
from keras_fastloop.weighting import _solvers as gb

pytestmark = EXPECT_SKIP_WARNINGS


def _data(n=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = {"a": rng.normal(size=(n, 1)).astype("float32"), "b": rng.normal(size=(n, 1)) * 3}
    return x, y


def _layers(kernel_seed=0):
    init = keras.initializers.GlorotUniform(seed=kernel_seed)
    trunk = keras.layers.Dense(4, use_bias=False, kernel_initializer=init, name="trunk")
    a = keras.layers.Dense(1, use_bias=False, kernel_initializer=init, name="a")
    b = keras.layers.Dense(1, use_bias=False, kernel_initializer=init, name="b")
    return trunk, a, b


def _model(cls=OptimizedModel, counter=None):
    inputs = keras.Input((3,))
    trunk, a, b = _layers()
    h = trunk(inputs)
    return cls(inputs, {"a": a(h), "b": b(h)})


def _counting_mse(counter):
    def loss(y_true, y_pred):
        counter.append(1)  # runs once per trace, never per step
        return keras.losses.mean_squared_error(y_true, y_pred)

    return loss


# ------------------------------------------------------------------------------ equivalence


def test_static_equals_keras_loss_weights():
    x, y = _data(32)
    reference = _model(keras.Model)
    model = _model()
    model.set_weights(reference.get_weights())
    loss_weights = {"a": 0.3, "b": 2.0}
    losses = {"a": "mse", "b": "mse"}
    reference.compile(keras.optimizers.SGD(0.05), losses, loss_weights=loss_weights)
    model.compile(
        keras.optimizers.SGD(0.05), losses, loss_weights=loss_weights, loss_weighting="static"
    )
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    for w_ref, w in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(w, w_ref, atol=1e-6)
    assert history["a_weight"][-1] == pytest.approx(0.3)
    assert history["b_weight"][-1] == pytest.approx(2.0)


def _task_grads(model, x, y):
    """Per-task gradients of the shared trunk and the heads, independent of the step."""
    variables = model.trainable_variables
    with tf.GradientTape(persistent=True) as tape:
        pred = model(x)
        losses = [keras.losses.MeanSquaredError()(y[k], pred[k]) for k in ("a", "b")]
    grads = [tape.gradient(loss, variables) for loss in losses]
    return {
        v.path: [None if g[k] is None else g[k].numpy() for g in grads]
        for k, v in enumerate(variables)
    }


@pytest.mark.parametrize("loss_scale", [False, True])
@pytest.mark.parametrize("method_id", ["mgda", "pcgrad"])
def test_gradient_based_step_matches_numpy(method_id, loss_scale):
    x, y = _data(8)
    model = _model()
    grads = _task_grads(model, x, y)
    before = {v.path: v.numpy() for v in model.trainable_variables}
    optimizer = keras.optimizers.SGD(0.1)
    if loss_scale:  # mixed-precision glue: results must not depend on the loss scale
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=2.0**10)
    model.compile(optimizer, "mse", loss_weighting=method_id)
    logs = model.fit(x, y, batch_size=8, epochs=1, verbose=0).history

    trunk = "trunk/kernel"
    g = np.stack([grads[trunk][0].ravel(), grads[trunk][1].ravel()])
    m = g @ g.T
    if method_id == "mgda":
        a1 = np.clip((m[1, 1] - m[0, 1]) / (m[0, 0] + m[1, 1] - 2 * m[0, 1]), 0, 1)
        beta = np.array([a1, 1 - a1])
    else:
        beta = np.ones(2)
        if m[0, 1] < 0:
            beta = np.array([1 - m[0, 1] / m[0, 0], 1 - m[0, 1] / m[1, 1]])
    expected_trunk = before[trunk] - 0.1 * (beta @ g).reshape(before[trunk].shape)
    after = {v.path: v.numpy() for v in model.trainable_variables}
    np.testing.assert_allclose(after[trunk], expected_trunk, rtol=1e-5, atol=1e-6)
    # heads: plain task gradient (weight 1)
    np.testing.assert_allclose(
        after["a/kernel"], before["a/kernel"] - 0.1 * grads["a/kernel"][0], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        after["b/kernel"], before["b/kernel"] - 0.1 * grads["b/kernel"][1], rtol=1e-5, atol=1e-6
    )
    # the logged weights are this step's effective weights
    np.testing.assert_allclose([logs["a_weight"][0], logs["b_weight"][0]], beta, rtol=1e-5)
    assert model.loss_weighting.shared_variable_paths == [trunk]


def test_gradnorm_uses_and_updates_its_weights():
    x, y = _data(8)
    model = _model()
    grads = _task_grads(model, x, y)
    model.compile(keras.optimizers.SGD(0.0), "mse", loss_weighting=weighting.GradNorm(1.5, 0.1))
    model.loss_weighting.weights.assign([0.5, 1.5])
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0).history
    assert [history["a_weight"][0], history["b_weight"][0]] == pytest.approx([0.5, 1.5])
    norms = np.array([np.linalg.norm(grads["trunk/kernel"][i]) for i in range(2)])
    expected = gb.gradnorm_update(
        tf.constant([0.5, 1.5]),
        tf.constant(norms, tf.float32),
        tf.constant([1.0, 1.0]),
        tf.constant([1.0, 1.0]),
        1.5,
        0.1,
    )
    np.testing.assert_allclose(model.loss_weighting.weights.numpy(), expected.numpy(), rtol=1e-5)


_SOLVERS = {
    # the default max_norm=1.0 clips the shared update (|G alpha| = sqrt(2) before the clip)
    "nash_mtl": lambda m: gb.nash_mtl_weights(m) * gb.clip_factor(gb.nash_mtl_weights(m), m, 1.0),
    "aligned_mtl": gb.aligned_mtl_weights,
    "upgrad": gb.upgrad_weights,
    "imtl_g": gb.imtl_weights,
}


@pytest.mark.parametrize("method_id", sorted(_SOLVERS))
def test_new_gradient_methods_step_applies_their_weights(method_id):
    x, y = _data(8)
    model = _model()
    grads = _task_grads(model, x, y)
    before = {v.path: v.numpy() for v in model.trainable_variables}
    model.compile(keras.optimizers.SGD(0.1), "mse", loss_weighting=method_id)
    logs = model.fit(x, y, batch_size=8, epochs=1, verbose=0).history
    trunk = "trunk/kernel"
    g = np.stack([grads[trunk][0].ravel(), grads[trunk][1].ravel()])
    beta = _SOLVERS[method_id](tf.constant(g @ g.T, tf.float32)).numpy()
    after = {v.path: v.numpy() for v in model.trainable_variables}
    expected = before[trunk] - 0.1 * (beta @ g).reshape(before[trunk].shape)
    np.testing.assert_allclose(after[trunk], expected, rtol=1e-5, atol=1e-6)
    for head, i in (("a/kernel", 0), ("b/kernel", 1)):  # heads: weight 1
        np.testing.assert_allclose(
            after[head], before[head] - 0.1 * grads[head][i], rtol=1e-5, atol=1e-6
        )
    np.testing.assert_allclose([logs["a_weight"][0], logs["b_weight"][0]], beta, rtol=1e-5)


def test_imtl_hybrid_step_by_hand():
    x, y = _data(8)
    model = _model()
    grads = _task_grads(model, x, y)
    before = {v.path: v.numpy() for v in model.trainable_variables}
    model.compile(keras.optimizers.SGD(0.1), "mse", loss_weighting="imtl")
    scales = model.loss_weighting.loss_scales
    scales.assign([0.5, -0.25])
    e = np.exp([0.5, -0.25])
    pred = model(x)  # the task losses at the start
    losses = np.array([keras.losses.MeanSquaredError()(y[k], pred[k]) for k in "ab"])
    logs = model.fit(x, y, batch_size=8, epochs=1, verbose=0).history
    trunk = "trunk/kernel"
    g = np.stack([grads[trunk][0].ravel(), grads[trunk][1].ravel()])
    h = e[:, None] * g  # gradients of the scaled losses e^s L
    u = h / np.linalg.norm(h, axis=1, keepdims=True)
    a2 = h[0] @ (u[0] - u[1]) / ((h[0] - h[1]) @ (u[0] - u[1]))
    beta = np.array([1 - a2, a2]) * e
    after = {v.path: v.numpy() for v in model.trainable_variables}
    expected = before[trunk] - 0.1 * (beta @ g).reshape(before[trunk].shape)
    np.testing.assert_allclose(after[trunk], expected, rtol=1e-5, atol=1e-6)
    for head, i in (("a/kernel", 0), ("b/kernel", 1)):  # heads: gradient of e^s L
        np.testing.assert_allclose(
            after[head], before[head] - 0.1 * e[i] * grads[head][i], rtol=1e-5, atol=1e-6
        )
    # s: one SGD step on e^s L - 1
    np.testing.assert_allclose(
        scales.numpy(), np.log(e) - 0.1 * (e * losses - 1.0), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose([logs["a_weight"][0], logs["b_weight"][0]], beta, rtol=1e-5)


def test_shared_variables_can_be_given():
    x, y = _data(8)
    model = _model()
    trunk = model.get_layer("trunk")
    model.compile("sgd", "mse", loss_weighting="mgda", shared_variables=[trunk])
    model.fit(x, y, verbose=0)
    assert model.loss_weighting.shared_variable_paths == ["trunk/kernel"]


def _two_trunks():
    inputs = keras.Input((3,))
    init = keras.initializers.GlorotUniform(seed=1)
    h = keras.layers.Dense(4, use_bias=False, kernel_initializer=init, name="t1")(inputs)
    h = keras.layers.Dense(4, use_bias=False, kernel_initializer=init, name="t2")(h)
    _, a, b = _layers()
    return OptimizedModel(inputs, {"a": a(h), "b": b(h)})


@pytest.mark.parametrize("method", ["mgda", "pcgrad"])
def test_given_shared_variables_act_and_all_of_them_equal_the_inferred_ones(method):
    x, y = _data(8)
    runs = {}
    for given in (None, ["t1"], ["t1", "t2"]):
        model = _two_trunks()
        shared = None if given is None else [model.get_layer(name) for name in given]
        model.compile("sgd", "mse", loss_weighting=method, shared_variables=shared)
        history = model.fit(x, y, epochs=2, verbose=0).history
        paths = model.loss_weighting.shared_variable_paths
        runs[str(given)] = (paths, history["loss"], [w.numpy() for w in model.weights])
    assert runs["None"][0] == ["t1/kernel", "t2/kernel"]
    assert runs["['t1']"][0] == ["t1/kernel"]  # t2 is then a task-specific (summed) variable
    assert runs["['t1', 't2']"][0] == runs["None"][0]
    np.testing.assert_array_equal(runs["['t1', 't2']"][1], runs["None"][1])
    for given_all, inferred in zip(runs["['t1', 't2']"][2], runs["None"][2]):
        np.testing.assert_array_equal(given_all, inferred)
    if method == "mgda":  # t2 then gets the plain sum of the tasks' gradients, not MGDA's mix
        assert not np.array_equal(runs["['t1']"][2][1], runs["None"][2][1])


def test_uw_log_variances_are_trained_by_the_model_optimizer():
    x, y = _data(16)
    model = _model()
    model.compile(keras.optimizers.SGD(0.1), "mse", loss_weighting="uw")
    assert "uw_log_variances" in [v.name for v in model.trainable_variables]
    model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    s = model.loss_weighting.log_variances.numpy()
    assert np.all(s != 0.0)
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0).history
    # the logged weights are exp(-s) / 2 of the step, i.e. before that step's update of s
    np.testing.assert_allclose(
        [history["a_weight"][0], history["b_weight"][0]], np.exp(-s) / 2, rtol=1e-6
    )


# ------------------------------------------------------------------------ mid-fit changes


class _AssignAt(keras.callbacks.Callback):
    def __init__(self, epoch, values):
        super().__init__()
        self.epoch, self.values = epoch, values

    def on_train_batch_end(self, batch, logs=None):
        if self._epoch == self.epoch:
            self.model.loss_weighting.weights.assign(self.values)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch


def test_weights_assigned_mid_fit_take_effect_next_step_without_retrace():
    x, y = _data(8)
    traces = []
    model = _model()
    model.compile(keras.optimizers.SGD(0.01), _counting_mse(traces), loss_weighting="static")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # one step per epoch
    traced = len(traces)
    iterations = int(model.optimizer.iterations)
    history = model.fit(
        x, y, batch_size=8, epochs=4, verbose=0, callbacks=[_AssignAt(1, [0.0, 2.0])]
    ).history
    assert len(traces) == traced  # no new trace
    assert int(model.optimizer.iterations) == iterations + 4  # optimizer not reset
    loss, a, b = (np.array(history[k]) for k in ("loss", "a_loss", "b_loss"))
    np.testing.assert_allclose(loss[:2], (a + b)[:2], rtol=1e-6)  # epochs 0-1: old weights
    np.testing.assert_allclose(loss[2:], 2.0 * b[2:], rtol=1e-6)  # from the next step on
    assert history["a_weight"][2:] == [0.0, 0.0]


def test_uw_state_assigned_mid_fit_takes_effect_next_step():
    x, y = _data(8)
    model = _model()
    model.compile(keras.optimizers.SGD(0.0), "mse", loss_weighting="uw")

    class SetLogVariances(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.loss_weighting.log_variances.assign([np.log(2.0), 0.0])

    history = model.fit(x, y, epochs=2, verbose=0, callbacks=[SetLogVariances()]).history
    assert history["a_weight"] == pytest.approx([0.5, 0.25])


# -------------------------------------------------------------------------- serialization


@pytest.mark.parametrize("method", ["loss_ema", "uw", "famo", "pcgrad"])
def test_save_and_load_restores_the_weighting(tmp_path, method):
    x, y = _data(16)
    model = _model()
    model.compile(keras.optimizers.Adam(0.01), "mse", loss_weighting=method)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert type(loaded.loss_weighting) is type(model.loss_weighting)
    assert loaded.loss_weighting.get_config() == model.loss_weighting.get_config()
    np.testing.assert_allclose(
        loaded.loss_weighting.weights.numpy(), model.loss_weighting.weights.numpy()
    )
    if method == "uw":
        np.testing.assert_allclose(
            loaded.loss_weighting.log_variances.numpy(),
            model.loss_weighting.log_variances.numpy(),
        )
    if method == "famo":
        np.testing.assert_allclose(
            loaded.loss_weighting.logits.numpy(), model.loss_weighting.logits.numpy()
        )
    # training continues from the restored state
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)


# ----------------------------------------------------------------------------- bad inputs


def test_unknown_method_id():
    with pytest.raises(ValueError, match="Unknown `loss_weighting`"):
        _model().compile("sgd", "mse", loss_weighting="nashmtl")


def test_multi_task_method_on_single_task_model_fails_at_compile():
    inputs = keras.Input((3,))
    model = OptimizedModel(inputs, keras.layers.Dense(1)(inputs))
    for method in ("mgda", "uw", "dwa"):
        with pytest.raises(ValueError, match="at least two outputs"):
            model.compile("sgd", "mse", loss_weighting=method)


@pytest.mark.parametrize(
    "make",
    [
        lambda: weighting.DWA(temperature=0),
        lambda: weighting.DWA(window=0),
        lambda: weighting.LossEMA(decay=1.0),
        lambda: weighting.CAGrad(rescale=3),
        lambda: weighting.MGDA(gradient_normalization="l1"),
        lambda: weighting.GradNorm(alpha=-1),
        lambda: weighting.RLW(seed="x"),
        lambda: weighting.FAMO(w_lr=0),
        lambda: weighting.MGDA(solver="qp"),
        lambda: weighting.NashMTL(max_iter=0),
        lambda: weighting.NashMTL(max_norm=-1.0),
        lambda: weighting.NashMTL(max_norm="1"),
        lambda: weighting.NashMTL(update_weights_every=0),
        lambda: weighting.NashMTL(update_weights_every=1.5),
        lambda: weighting.AlignedMTL(scale_mode="max"),
        lambda: weighting.UPGrad(pref_vector="uniform"),
        lambda: weighting.UPGrad(pref_vector=[1.0, float("nan")]),
        lambda: weighting.UPGrad(pref_vector=[[0.5, 0.5]]),
        lambda: weighting.UPGrad(pref_vector=[]),
        lambda: weighting.UPGrad(reg_eps=-1.0),
        lambda: weighting.UPGrad(norm_eps="x"),
        lambda: weighting.UncertaintyWeighting(halved=1),
    ],
)
def test_bad_arguments_fail_at_construction(make):
    with pytest.raises(ValueError, match="Received"):
        make()


def test_upgrad_pref_vector_of_the_wrong_length_fails_at_compile():
    with pytest.raises(ValueError, match=r"one entry per task .*Received: pref_vector"):
        _model().compile("sgd", "mse", loss_weighting=weighting.UPGrad(pref_vector=[1.0] * 3))


# one loss per output: Keras itself refuses one loss with two weights (`"mse"` + a weights dict)
_MSE = {"a": "mse", "b": "mse"}


@pytest.mark.parametrize("method_id", ["uw", "dwa", "famo", "pcgrad", "ew", "nash_mtl"])
def test_loss_weights_that_a_method_would_ignore_are_refused(method_id):
    with pytest.raises(ValueError, match=r"`loss_weights` would be ignored .*Received: loss_w"):
        _model().compile("sgd", _MSE, loss_weights={"a": 1.0, "b": 0.5}, loss_weighting=method_id)
    with pytest.raises(ValueError, match="would be ignored"):
        weighting.check_loss_weights(weighting.get(method_id), [2.0, 1.0])
    # all ones change nothing and are accepted; so are static weights and no weights
    _model().compile("sgd", _MSE, loss_weights={"a": 1, "b": 1.0}, loss_weighting=method_id)
    _model().compile("sgd", "mse", loss_weighting=method_id)
    weighting.check_loss_weights(weighting.get(method_id), None)


def test_loss_weights_are_used_by_static():
    for method in (None, "static", weighting.Static()):
        weighting.check_loss_weights(weighting.get(method), {"a": 0.3, "b": 2.0})


def test_dwa_windows_are_fit_epochs():
    x, y = _data(16)
    model = _model()
    model.compile(keras.optimizers.SGD(0.05), "mse", loss_weighting="dwa")
    history = model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0).history
    a, b = np.array(history["a_loss"]), np.array(history["b_loss"])  # epoch means, 2 steps each
    assert history["a_weight"][:2] == [1.0, 1.0]
    for epoch in (2, 3):  # weights from the two previous epochs' mean losses
        r = np.array([a[epoch - 1] / a[epoch - 2], b[epoch - 1] / b[epoch - 2]])
        expected = 2 * np.exp(r / 2) / np.exp(r / 2).sum()
        got = [history["a_weight"][epoch], history["b_weight"][epoch]]
        np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert int(model.loss_weighting.windows.numpy()) == 4


def test_foreign_shared_variable_fails_at_compile():
    foreign = keras.Variable(np.zeros(3), name="foreign")
    model = _model()
    with pytest.raises(ValueError, match="shared_variables"):
        model.compile("sgd", "mse", loss_weighting="pcgrad", shared_variables=[foreign])
    assert len(model.trainable_variables) == 3  # the given list is not adopted by the model


def test_no_shared_variable_is_a_clear_error():
    inputs = keras.Input((3,))
    a, b = keras.layers.Dense(1, name="a")(inputs), keras.layers.Dense(1, name="b")(inputs)
    model = OptimizedModel(inputs, {"a": a, "b": b})
    model.compile("sgd", "mse", loss_weighting="mgda")
    x, y = _data(8)
    with pytest.raises(ValueError, match="no trainable variable is reached by more than one"):
        model.fit(x, y, verbose=0)


def test_micro_batching_rejects_gradient_based_methods():
    with pytest.raises(ValueError, match="micro_batch_size"):
        _model().compile("sgd", "mse", loss_weighting="cagrad", micro_batch_size=2)


# ------------------------------------------------------------------------ every method runs


@pytest.mark.parametrize("method_id", weighting.METHODS)
def test_every_method_trains_and_logs(method_id):
    x, y = _data(16)
    model = _model()
    model.compile(keras.optimizers.SGD(0.05), "mse", loss_weighting=method_id)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0).history
    for key in ("loss", "a_loss", "b_loss", "a_weight", "b_weight"):
        assert np.all(np.isfinite(history[key])), key
    model.evaluate(x, y, verbose=0)


@pytest.mark.parametrize(
    "method_id", ["mgda", "cagrad", "pcgrad", "imtl", "imtl_g", "nash_mtl", "aligned_mtl", "upgrad"]
)
def test_three_tasks(method_id):
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, name="trunk")(inputs)
    model = OptimizedModel(inputs, {k: keras.layers.Dense(1, name=k)(h) for k in "abc"})
    model.compile(keras.optimizers.SGD(0.05), "mse", loss_weighting=method_id)
    x, y = _data(16)
    y["c"] = -y["a"]  # conflicts with task a on the shared trunk
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0).history
    weights = [history[f"{k}_weight"][-1] for k in "abc"]
    assert np.all(np.isfinite(weights))
    if method_id == "mgda":
        assert sum(weights) == pytest.approx(1.0, abs=1e-5)
    assert model.loss_weighting.shared_variable_paths == ["trunk/kernel", "trunk/bias"]


# ------------------------------------------------------------ mixed precision, distribution


@pytest.mark.parametrize("method_id", ["mgda", "uw", "famo"])
def test_mixed_float16(method_id):
    keras.config.set_dtype_policy("mixed_float16")
    model = _model()
    model.compile(keras.optimizers.SGD(0.05), "mse", loss_weighting=method_id)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    x, y = _data(16)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0).history
    # dynamic loss scaling may skip the first overflowing steps (2**15 start), as with `ew`
    assert history["skipped_steps"][-1] < 4
    # an epoch of overflows only logs a NaN loss (no update applied); the weights are state
    assert np.all(np.isfinite(history["a_weight"] + history["b_weight"]))
    assert np.isfinite(history["loss"][-1])


def _two_replica_run(method_id, strategy):
    x, y = _data(16)
    keras.utils.set_random_seed(1)
    scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
    with scope:
        model = _model()
        model.compile(keras.optimizers.SGD(0.05), "mse", loss_weighting=method_id)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    return model, history


def _mirrored():
    return two_replica_strategy()  # one strategy per process (collective instances)


@pytest.mark.distributed
@pytest.mark.parametrize("method_id", ["pcgrad", "mgda", "uw", "rlw", "ew", "nash_mtl"])
def test_two_replicas_equal_one(method_id):
    """Gradient-based weights come from the all-reduced task gradients: exact across replicas."""
    strategy = _mirrored()
    one, h1 = _two_replica_run(method_id, None)
    two, h2 = _two_replica_run(method_id, strategy)
    for v1, v2 in zip(one.trainable_variables, two.trainable_variables):
        np.testing.assert_allclose(v2.numpy(), v1.numpy(), rtol=1e-5, atol=1e-6)
    assert h2["a_weight"][-1] == pytest.approx(h1["a_weight"][-1], rel=1e-5)


@pytest.mark.distributed
def test_two_replicas_equal_one_nash_mtl_holding_alpha_and_clipping():
    """The held alpha (step state) and the clip of the shared update are replica-independent."""
    strategy = _mirrored()
    x, y = _data(16)
    runs = []
    for s in (None, strategy):
        keras.utils.set_random_seed(1)
        with s.scope() if s else tf.distribute.get_strategy().scope():
            model = _model()
            method = weighting.NashMTL(max_norm=0.05, update_weights_every=3)
            model.compile(keras.optimizers.SGD(0.05), "mse", loss_weighting=method)
        history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0).history
        runs.append((model, history))
    (one, h1), (two, h2) = runs
    for v1, v2 in zip(one.trainable_variables, two.trainable_variables):
        np.testing.assert_allclose(v2.numpy(), v1.numpy(), rtol=1e-5, atol=1e-6)
    assert h2["a_weight"] == pytest.approx(h1["a_weight"], rel=1e-5)
    assert int(two.loss_weighting.step.numpy()) == 6


@pytest.mark.distributed
@pytest.mark.parametrize("method_id", ["loss_ema", "famo"])
def test_two_replicas_keep_identical_state(method_id):
    """Loss-based state follows the first replica's losses and is the same on every replica."""
    strategy = _mirrored()
    model, history = _two_replica_run(method_id, strategy)
    local = strategy.experimental_local_results(model.loss_weighting.weights.value)
    values = [np.asarray(v) for v in local]
    assert len(values) == 2
    np.testing.assert_array_equal(values[0], values[1])
    assert np.all(np.isfinite(values[0])) and not np.allclose(values[0], 1.0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: weighting.STCH(mu=float("inf")),
        lambda: weighting.FairGrad(alpha=float("inf")),
        lambda: weighting.MoCo(beta=float("inf")),
        lambda: weighting.DWA(temperature=float("inf")),
    ],
)
def test_an_infinite_hyperparameter_is_refused_at_construction(make):
    with pytest.raises(ValueError, match=r"must be a finite .*Received: \w+=inf"):
        make()
