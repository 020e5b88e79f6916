"""The small two-task problem on which the reference values of the LibMTL-derived methods were
computed: the same data, initial weights and SGD schedule were run through LibMTL's own
weighting classes (PyTorch, float32) by a script outside this repository, which printed the
weights after training (see each test's comment)."""

import contextlib

import keras
import numpy as np

from keras_fastloop import OptimizedModel

EPOCHS, BATCH_SIZE, LEARNING_RATE = 3, 4, 0.05


def data():
    """`(x, y, initial kernels)`: 8 samples, 3 features, tasks `a` (N(0,1)) and `b` (N(0,9))."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 3)).astype("float32")
    y = {
        "a": rng.normal(size=(8, 1)).astype("float32"),
        "b": (rng.normal(size=(8, 1)) * 3).astype("float32"),
    }
    kernels = [
        (rng.normal(size=shape) * 0.5).astype("float32") for shape in ((3, 4), (4, 1), (4, 1))
    ]
    return x, y, kernels


def model():
    """Linear trunk `x W` (3 -> 4, no bias) and one linear head per task (4 -> 1, no bias)."""
    x, _, kernels = data()
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, use_bias=False, name="trunk")(inputs)
    outputs = {k: keras.layers.Dense(1, use_bias=False, name=k)(h) for k in "ab"}
    m = OptimizedModel(inputs, outputs)
    m.set_weights(kernels)
    return m


def train(method, epochs=EPOCHS, strategy=None):
    """`(model, history)` after `epochs` epochs of SGD on batches of 4, in order (built and
    compiled under `strategy`'s scope when given)."""
    x, y, _ = data()
    with strategy.scope() if strategy else contextlib.nullcontext():
        m = model()
        m.compile(keras.optimizers.SGD(LEARNING_RATE), "mse", loss_weighting=method)
    history = m.fit(x, y, batch_size=BATCH_SIZE, epochs=epochs, shuffle=False, verbose=0).history
    return m, history


def resume(method, tmp_path, first_epochs=2):
    """Train `first_epochs`, save, load and train the remaining epochs: `(loaded, history)`."""
    m, _ = train(method, epochs=first_epochs)
    path = tmp_path / "m.keras"
    m.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    assert loaded.loss_weighting.get_config() == m.loss_weighting.get_config()
    x, y, _ = data()
    history = loaded.fit(
        x, y, batch_size=BATCH_SIZE, epochs=EPOCHS - first_epochs, shuffle=False, verbose=0
    ).history
    return loaded, history


def check_weights(m, trunk, a, b, rtol=1e-5, atol=1e-6):
    """The trained kernels equal LibMTL's (trunk `(3, 4)`, heads `(4,)`)."""
    got = {v.path: v.numpy() for v in m.trainable_variables}
    np.testing.assert_allclose(got["trunk/kernel"], trunk, rtol=rtol, atol=atol)
    np.testing.assert_allclose(got["a/kernel"].ravel(), a, rtol=rtol, atol=atol)
    np.testing.assert_allclose(got["b/kernel"].ravel(), b, rtol=rtol, atol=atol)
