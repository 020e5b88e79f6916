"""A model's own `train_step` reaches the step's stages: `model.fastloop_step.minimize`.

References are hand-written expert loops on `keras.Model` (tape, `tf.clip_by_global_norm` on
the full gradient, the loss scale seeded by hand) or NumPy; with every option off a custom
step on `OptimizedModel` equals `keras.Model` to the last bit. Synthetic tensors throughout.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_fastloop as kf

pytestmark = pytest.mark.filterwarnings("default::keras_fastloop.FastloopWarning")


def data(n=16, d=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    y = (x @ rng.normal(size=(d, 1)) + 0.5).astype("float32")
    return x, y


def guide_model(base, use_stages, units=1, seed=3):
    """The Keras guide's custom step ('Customizing what happens in fit')."""

    class Guide(base):
        def train_step(self, data):
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            if use_stages:
                self.fastloop_step.minimize(loss, self.trainable_variables, tape)
            else:
                grads = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply(grads, self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
            return {m.name: m.result() for m in self.metrics}

    inputs = keras.Input((3,))
    dense = keras.layers.Dense(units, kernel_initializer=keras.initializers.GlorotUniform(seed))
    return Guide(inputs, dense(inputs))


def weights(model):
    return [w.numpy() for w in model.weights]


def test_guide_step_gets_global_norm_clipping_as_hand_computed():
    x, y = data()
    model = guide_model(kf.OptimizedModel, use_stages=True)
    w0, b0 = (v.numpy().astype("float64") for v in model.weights)
    model.compile(keras.optimizers.SGD(0.1), "mse", gradient_clipping=0.5)
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    # NumPy: the MSE gradient of the one batch, clipped to global norm 0.5, one SGD step.
    residual = x.astype("float64") @ w0 + b0 - y
    grad_w, grad_b = 2 * x.T @ residual / len(x), 2 * residual.mean(axis=0)
    norm = np.sqrt((grad_w**2).sum() + (grad_b**2).sum())
    assert norm > 0.5  # the clip acts
    factor = 0.5 / norm
    np.testing.assert_allclose(model.weights[0].numpy(), w0 - 0.1 * factor * grad_w, rtol=1e-5)
    np.testing.assert_allclose(model.weights[1].numpy(), b0 - 0.1 * factor * grad_b, rtol=1e-5)
    np.testing.assert_allclose(history.history["grad_norm"][0], norm, rtol=1e-5)


def test_guide_step_with_options_off_equals_keras_model():
    x, y = data()
    runs = []
    for base, use_stages in ((keras.Model, False), (kf.OptimizedModel, True)):
        keras.utils.set_random_seed(1)
        model = guide_model(base, use_stages)
        model.compile(keras.optimizers.Adam(0.05), "mse")
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        runs.append((history.history, weights(model)))
    (h_ref, w_ref), (h, w) = runs
    assert h == h_ref
    for a, b in zip(w_ref, w):
        np.testing.assert_array_equal(a, b)


def test_step_that_never_reaches_the_stages_is_told_once():
    x, y = data()
    runs = []
    for base in (keras.Model, kf.OptimizedModel):
        keras.utils.set_random_seed(1)
        model = guide_model(base, use_stages=False)
        options = {"gradient_clipping": 1e-9} if base is kf.OptimizedModel else {}
        model.compile(keras.optimizers.SGD(0.1), "mse", **options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=4, epochs=2, verbose=0)
        runs.append(weights(model))
    told = [w for w in caught if issubclass(w.category, kf.FastloopWarning)]
    assert len(told) == 1
    message = str(told[0].message)
    assert "Guide.train_step" in message and "fastloop_step.minimize" in message
    assert "gradient_clipping=" in message and "Received:" in message
    for a, b in zip(*runs):  # not clipped: said, and the numbers are Keras'
        np.testing.assert_array_equal(a, b)


def test_nonfinite_skip_in_a_custom_step_skips_the_whole_update():
    x, y = data(n=8)
    bad = x.copy()
    bad[0, 0] = np.inf
    model = guide_model(kf.OptimizedModel, use_stages=True)
    model.compile(keras.optimizers.SGD(0.1), "mse", log_metrics=["skipped_steps"])
    reference = guide_model(keras.Model, use_stages=False)
    reference.set_weights(model.get_weights())
    reference.compile(keras.optimizers.SGD(0.1), "mse")
    model.train_on_batch(x, y)
    with pytest.warns(kf.FastloopWarning, match="1 training step skipped"):
        logs = model.train_on_batch(bad, y, return_dict=True)
    assert logs["skipped_steps"] == 1 and int(model.skipped_steps.numpy()) == 1
    model.train_on_batch(x[::-1].copy(), y[::-1].copy())
    reference.train_on_batch(x, y)
    reference.train_on_batch(x[::-1].copy(), y[::-1].copy())
    assert int(model.optimizer.iterations.numpy()) == 2
    for a, b in zip(weights(reference), weights(model)):
        np.testing.assert_allclose(b, a, rtol=1e-6)


def test_mixed_float16_custom_step_is_loss_scaled_like_the_default_step():
    keras.config.set_dtype_policy("mixed_float16")
    x, y = data()
    runs = []
    for use_stages in (None, True):  # None: the library's own step
        keras.utils.set_random_seed(1)
        if use_stages is None:
            inputs = keras.Input((3,))
            dense = keras.layers.Dense(
                1, kernel_initializer=keras.initializers.GlorotUniform(3), dtype="float32"
            )
            model = kf.OptimizedModel(inputs, dense(inputs))
        else:
            model = guide_model(kf.OptimizedModel, use_stages=True)
            model.layers[-1].dtype_policy = keras.DTypePolicy("float32")
        model.compile(keras.optimizers.SGD(0.1), "mse", log_metrics=["loss_scale"])
        history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        runs.append((history.history["loss_scale"], weights(model)))
    (scale_ref, w_ref), (scale, w) = runs
    assert scale == scale_ref == [32768.0]
    for a, b in zip(w_ref, w):
        np.testing.assert_allclose(b, a, rtol=1e-6)


def test_minimize_seeds_the_backward_pass_with_the_loss_scale():
    """Loss scale 1024 through a custom step: w == 0.9 after one step, not 0.99990234."""
    variable_holder = {}

    class Scalar(kf.OptimizedModel):
        def __init__(self):
            super().__init__()
            self.w = self.add_weight(shape=(), initializer="ones", name="w")
            variable_holder["w"] = self.w

        def call(self, x):
            return ops.zeros_like(x) + self.w

        def train_step(self, data):
            with tf.GradientTape() as tape:
                loss = ops.convert_to_tensor(self.w)
            self.fastloop_step.minimize(loss, [self.w], tape)
            return {}

    model = Scalar()
    model(np.zeros((1, 1), "float32"))
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1024)
    model.compile(optimizer)
    model.train_on_batch(np.zeros((1, 1), "float32"), np.zeros((1, 1), "float32"))
    np.testing.assert_allclose(variable_holder["w"].numpy(), 0.9, rtol=1e-7)


# ----------------------------------------------------------------------- two optimizers


def make_gan(base, use_stages):
    """A least-squares GAN on 3 features; latent codes come with the data (no RNG)."""

    class GAN(base):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            init = keras.initializers.GlorotUniform
            self.discriminator = keras.Sequential(
                [keras.Input((3,)), keras.layers.Dense(1, kernel_initializer=init(1))]
            )
            self.generator = keras.Sequential(
                [keras.Input((2,)), keras.layers.Dense(3, kernel_initializer=init(2))]
            )

        def compile(self, d_optimizer, g_optimizer, **kwargs):
            super().compile(**kwargs)
            self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

        def call(self, z):
            return self.generator(z)

        def _apply(self, loss, variables, tape, optimizer, clipnorm):
            if use_stages:
                self.fastloop_step.minimize(loss, variables, tape, optimizer)
            else:  # the expert's hand-written loop
                grads = tape.gradient(loss, variables)
                if clipnorm is not None:
                    grads, _ = tf.clip_by_global_norm(grads, clipnorm)
                optimizer.apply(grads, variables)

        def train_step(self, data):
            real, z = data
            d_vars = self.discriminator.trainable_variables
            g_vars = self.generator.trainable_variables
            with tf.GradientTape() as tape:
                fake = self.generator(z)
                d_loss = ops.mean((self.discriminator(real) - 1) ** 2) + ops.mean(
                    self.discriminator(fake) ** 2
                )
            self._apply(d_loss, d_vars, tape, self.d_optimizer, self.clipnorm)
            with tf.GradientTape() as tape:
                g_loss = ops.mean((self.discriminator(self.generator(z)) - 1) ** 2)
            self._apply(g_loss, g_vars, tape, self.g_optimizer, self.clipnorm)
            return {"d_loss": d_loss, "g_loss": g_loss}

    return GAN()


@pytest.mark.parametrize("clipnorm", [None, 0.05])
def test_gan_with_two_optimizers_gets_the_policies_for_each(clipnorm):
    rng = np.random.default_rng(0)
    real = rng.normal(size=(16, 3)).astype("float32")
    z = rng.normal(size=(16, 2)).astype("float32")
    runs = []
    for base, use_stages in ((keras.Model, False), (kf.OptimizedModel, True)):
        keras.utils.set_random_seed(1)
        gan = make_gan(base, use_stages)
        gan.clipnorm = clipnorm
        options = {}
        if base is kf.OptimizedModel and clipnorm is not None:
            options = {"gradient_clipping": clipnorm, "log_metrics": ["grad_norm"]}
        gan.compile(keras.optimizers.SGD(0.1), keras.optimizers.Adam(0.01), **options)
        history = gan.fit(real, z, batch_size=8, epochs=2, shuffle=False, verbose=0)
        runs.append((history.history, weights(gan)))
    (h_ref, w_ref), (h, w) = runs
    for key in ("d_loss", "g_loss"):
        np.testing.assert_allclose(h[key], h_ref[key], rtol=1e-6)
    for a, b in zip(w_ref, w):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    if clipnorm is not None:
        assert "grad_norm" in h and min(h["grad_norm"]) > clipnorm  # it did clip


# ------------------------------------------------------------------------- replicas


def test_custom_step_clips_the_gradient_summed_across_two_replicas(mirrored_strategy):
    """Clipping the cross-replica sum in a custom step: 2 replicas == 1 replica with the same global batch."""
    x, y = data(n=16)
    runs = []
    for strategy in (tf.distribute.get_strategy(), mirrored_strategy):
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = guide_model(kf.OptimizedModel, use_stages=True)
            model.compile(keras.optimizers.SGD(0.1), "mse", gradient_clipping=0.3)
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        runs.append((history.history["grad_norm"], weights(model)))
    (norm_ref, w_ref), (norm, w) = runs
    np.testing.assert_allclose(norm, norm_ref, rtol=1e-5)
    for a, b in zip(w_ref, w):
        np.testing.assert_allclose(b, a, rtol=1e-5)


# ------------------------------------------------------------------- refused at compile


def test_micro_batching_with_an_own_train_step_is_refused_at_compile():
    model = guide_model(kf.OptimizedModel, use_stages=True)
    with pytest.raises(ValueError, match="micro_batch_size.*Guide.*Received: micro_batch_size=4"):
        model.compile("sgd", "mse", micro_batch_size=4)
    assert not model.compiled


def test_mixin_after_keras_model_is_refused_at_class_creation():
    with pytest.raises(TypeError, match="must come before keras.Model"):

        class Wrong(keras.Model, kf.OptimizedTrainer):
            pass


def test_misspelled_option_names_the_closest():
    model = guide_model(kf.OptimizedModel, use_stages=True)
    with pytest.raises(
        TypeError, match="did you mean `gradient_clipping`.*Received: gradient_cliping=1.0"
    ):
        model.compile("sgd", "mse", gradient_cliping=1.0)
