"""Linear task losses with known gradients, for reference tests of gradient-based methods.

Task `t`'s loss at step `s` (part `p` of the batch) is `c(s, t) + <G(s, t, p), theta>` over the
shared variables `theta` of a small `Dense(2) -> Dense(2)` model (`l1/kernel`, `l1/bias`,
`l2/kernel`, `l2/bias`: 14 numbers) plus `<h_t, head_t>` over one head variable per task, so
every gradient is a constant given here. The reference values in the tests were computed by
running LibMTL's own code on the same losses (a PyTorch `Linear(3, 2) -> Linear(2, 2)`
encoder whose flattened parameters line up with these variables, initialised at 0).
"""

import keras
import numpy as np
import tensorflow as tf

from keras_fastloop._step.state import StepState

SIZES = [6, 2, 4, 2]
HEAD_SIZE = 3


def shared_gradient(step, task, part=0, n=14, spread=None):
    """The flat gradient of task `task` at step `step` (batch part `part`).

    With `spread`: a gradient common to all tasks plus `spread` times the task's own
    (nearly aligned tasks).
    """
    i = np.arange(n)
    if spread is not None:
        return shared_gradient(step, 5, part, n) + spread * shared_gradient(step, task, part, n)
    return ((i * i * 5 + i * (3 + 2 * task) + 7 * step + 11 * part + 1) % 13 - 6) / 3.0


def loss_value(step, task):
    return 0.5 + 0.3 * task + 0.1 * step


def head_gradient(task, part=0):
    return np.arange(HEAD_SIZE) + 1.0 + task - 0.5 * part


def built(method, num_tasks):
    """`method` built on the model's variables (shared) and `num_tasks` head variables."""
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(2, name="l1")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="l2")(hidden))
    for variable in model.trainable_variables:  # the losses' values are then c(s, t)
        variable.assign(np.zeros(variable.shape, "float32"))
    method.build(model, StepState(), [f"t{i}" for i in range(num_tasks)], [1.0] * num_tasks)
    heads = [
        keras.Variable(np.zeros(HEAD_SIZE, "float32"), name=f"head{i}") for i in range(num_tasks)
    ]
    return method, list(model.trainable_variables) + heads


def _task_losses(variables, num_tasks, step, part, spread=None):
    shared, heads = variables[:4], variables[4:]
    losses = []
    for t in range(num_tasks):
        g = shared_gradient(step, t, part, spread=spread)
        total = tf.constant(loss_value(step, t), "float32")
        start = 0
        for v, size in zip(shared, SIZES):
            coefficient = tf.constant(g[start : start + size].reshape(v.shape), "float32")
            total += tf.reduce_sum(coefficient * v)
            start += size
        total += tf.reduce_sum(tf.constant(head_gradient(t, part), "float32") * heads[t])
        losses.append(total)
    return losses


def run_step(method, variables, num_tasks, step, parts=1, scale=1.0, spread=None):
    """One `gradients` + `update` call on the step's linear losses.

    Returns:
        `(shared, heads, weights)`: the flat shared gradient (14 numbers, divided by `scale`),
        the heads' gradients and the weights the method logged.
    """
    with tf.GradientTape(persistent=True) as tape:
        losses = _task_losses(variables, num_tasks, step, 0, spread)
        part_losses = [_task_losses(variables, num_tasks, step, p, spread) for p in range(parts)]
        objective = tf.constant(0.0)
    extra = {"part_losses": part_losses} if parts > 1 else {}
    grads = method.gradients(tape, losses, objective, variables, lambda x: x * scale, **extra)
    weights = method.read_weights().numpy()
    method.update(losses)
    shared = np.concatenate([np.reshape(g.numpy(), -1) for g in grads[:4]]) / scale
    heads = [g.numpy() / scale for g in grads[4:]]
    return shared, heads, weights


# ---------------------------------------------------------------- end-to-end, save and resume


def data(n=18, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = {
        "a": rng.normal(size=(n, 1)).astype("float32"),
        "b": (rng.normal(size=(n, 1)) * 3).astype("float32"),
    }
    return x, y


def two_task_model():
    from keras_fastloop import OptimizedModel

    init = keras.initializers.GlorotUniform(seed=0)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, kernel_initializer=init, name="trunk")(inputs)
    h = keras.layers.Dense(4, kernel_initializer=init, activation="tanh", name="trunk2")(h)
    a = keras.layers.Dense(1, kernel_initializer=init, name="a")(h)
    b = keras.layers.Dense(1, kernel_initializer=init, name="b")(h)
    return OptimizedModel(inputs, {"a": a, "b": b})


def fit_and_check(loss_weighting, batch_size=6, epochs=2, **compile_kwargs):
    """Compile with `loss_weighting`, fit a few steps; finite losses, logged weights."""
    x, y = data()
    model = two_task_model()
    model.compile(
        keras.optimizers.SGD(0.05), "mse", loss_weighting=loss_weighting, **compile_kwargs
    )
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0)
    for key in ("loss", "a_loss", "b_loss", "a_weight", "b_weight"):
        assert np.all(np.isfinite(history.history[key])), key
    return model, history.history


def check_save_and_resume(tmp_path, loss_weighting, state_names):
    """Saved and loaded mid-training, the model continues exactly as the original does."""
    x, y = data()
    model = two_task_model()
    model.compile(keras.optimizers.SGD(0.05), "mse", loss_weighting=loss_weighting)
    model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert type(loaded.loss_weighting) is type(model.loss_weighting)
    assert loaded.loss_weighting.get_config() == model.loss_weighting.get_config()
    for name in state_names:
        np.testing.assert_array_equal(
            getattr(loaded.loss_weighting, name).numpy(),
            getattr(model.loss_weighting, name).numpy(),
        )
    h1 = model.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0).history
    h2 = loaded.fit(x, y, batch_size=6, epochs=1, shuffle=False, verbose=0).history
    for w1, w2 in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_allclose(w2, w1, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(h2["a_weight"], h1["a_weight"], rtol=1e-6)


def two_replicas_equal_one(make_weighting, strategy, batch_size=6, atol=1e-6):
    """Training under a two-replica strategy gives one replica's weights and logs."""
    import tensorflow as tf

    x, y = data()
    runs = []
    for s in (None, strategy):
        keras.utils.set_random_seed(1)
        with s.scope() if s else tf.distribute.get_strategy().scope():
            model = two_task_model()
            model.compile(keras.optimizers.SGD(0.05), "mse", loss_weighting=make_weighting())
        history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
        runs.append((model, history.history))
    (one, h1), (two, h2) = runs
    for v1, v2 in zip(one.trainable_variables, two.trainable_variables):
        np.testing.assert_allclose(v2.numpy(), v1.numpy(), rtol=1e-5, atol=atol)
    np.testing.assert_allclose(h2["a_weight"], h1["a_weight"], rtol=1e-4, atol=atol)
    return one, two
