"""The code patterns of Keras' official examples, with `OptimizedModel` as the base.

Written here for this project (the patterns, not the examples' code): a GAN with two optimizers,
its own `train_step` and `metrics` property; a VAE tracking three `Mean` metrics; a distiller
overriding `compile` and `compute_loss`; a `train_step` that calls `self.optimizer.apply`;
transfer learning with a frozen base whose BatchNorm runs in inference mode; `add_loss` in a
subclassed layer. Each is built twice from one seed, on `keras.Model` and on `OptimizedModel`,
trained the same way, and must give the same History and weights, then save and load. With
`gradient_clipping` and `nonfinite` on, the models that keep our `train_step` still train.
Tiny models and a few steps: the file runs in well under a minute.
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_fastloop as kf

SEED = 5


def data(n=40, d=6, seed=0):
    """Synthetic inputs, a regression target and 3-class labels (`n` samples)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    y = (x @ rng.normal(size=(d, 1))).astype("float32")
    labels = rng.integers(0, 3, n)
    return x, y, labels


def assert_same_runs(reference, ours):
    """History dicts and weight lists of two runs, equal to the last bit."""
    (h_ref, w_ref), (h, w) = reference, ours
    assert set(h) == set(h_ref)
    for key in h_ref:
        np.testing.assert_array_equal(h[key], h_ref[key], err_msg=key)
    assert len(w) == len(w_ref)
    for a, b in zip(w_ref, w):
        np.testing.assert_array_equal(b, a)


def both(run):
    """`run(base)` for `keras.Model` then `OptimizedModel`, same seed; checks they agree."""
    results = []
    for base in (keras.Model, kf.OptimizedModel):
        keras.utils.set_random_seed(SEED)
        results.append(run(base))
    assert_same_runs(*[r[:2] for r in results])
    return results[1][2]  # our model


# ------------------------------------------------------------------------------------- GAN


def make_gan(base, latent_dim=3, features=6):
    class GAN(base):
        def __init__(self, discriminator, generator, latent_dim, **kwargs):
            super().__init__(**kwargs)
            self.discriminator, self.generator = discriminator, generator
            self.latent_dim = latent_dim
            self.noise = keras.random.SeedGenerator(17)
            self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
            self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

        def compile(self, d_optimizer, g_optimizer, loss_fn, **kwargs):
            super().compile(**kwargs)
            self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

        @property
        def metrics(self):
            return [self.d_loss_tracker, self.g_loss_tracker]

        def call(self, z):
            return self.generator(z)

        def train_step(self, real):
            import tensorflow as tf

            n = ops.shape(real)[0]
            z = keras.random.normal((n, self.latent_dim), seed=self.noise)
            fake = self.generator(z)
            both_ = ops.concatenate([fake, real], axis=0)
            labels = ops.concatenate([ops.ones((n, 1)), ops.zeros((n, 1))], axis=0)
            with tf.GradientTape() as tape:
                d_loss = self.loss_fn(labels, self.discriminator(both_))
            grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
            z = keras.random.normal((n, self.latent_dim), seed=self.noise)
            with tf.GradientTape() as tape:
                g_loss = self.loss_fn(ops.zeros((n, 1)), self.discriminator(self.generator(z)))
            grads = tape.gradient(g_loss, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
            self.d_loss_tracker.update_state(d_loss)
            self.g_loss_tracker.update_state(g_loss)
            return {m.name: m.result() for m in self.metrics}

    discriminator = keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    generator = keras.Sequential(
        [
            keras.Input((latent_dim,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(features),
        ]
    )
    gan = GAN(discriminator, generator, latent_dim)
    gan.compile(
        keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3), keras.losses.BinaryCrossentropy()
    )
    return gan


def test_gan_with_two_optimizers_and_own_metrics_property(tmp_path):
    x, _, _ = data()

    def run(base):
        gan = make_gan(base)
        history = gan.fit(x, batch_size=8, epochs=2, verbose=0, shuffle=False).history
        return history, gan.get_weights(), gan

    gan = both(run)
    assert {"d_loss", "g_loss"} == set(gan.history.history)
    path = str(tmp_path / "gan.weights.h5")
    z = np.zeros((1, 3), "float32")
    gan(z)  # built by its first call, as any subclassed model
    gan.save_weights(path)
    keras.utils.set_random_seed(SEED + 1)
    fresh = make_gan(kf.OptimizedModel)
    fresh(z)
    fresh.load_weights(path)
    for a, b in zip(gan.get_weights(), fresh.get_weights()):
        np.testing.assert_array_equal(b, a)


# ------------------------------------------------------------------------------------- VAE


@keras.saving.register_keras_serializable(package="kf_test_client")
class Sampling(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(3)

    def call(self, inputs):
        mean, log_var = inputs
        eps = keras.random.normal(ops.shape(mean), seed=self.seed_generator)
        return mean + ops.exp(0.5 * log_var) * eps


def _vae_parts(features=6, latent=2):
    i = keras.Input((features,))
    h = keras.layers.Dense(8, activation="relu")(i)
    mean, log_var = keras.layers.Dense(latent)(h), keras.layers.Dense(latent)(h)
    encoder = keras.Model(i, [mean, log_var, Sampling()([mean, log_var])], name="encoder")
    j = keras.Input((latent,))
    decoder = keras.Model(
        j, keras.layers.Dense(features)(keras.layers.Dense(8, activation="relu")(j)), name="decoder"
    )
    return encoder, decoder


def make_vae_class(base):
    class VAE(base):
        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder, self.decoder = encoder, decoder
            self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
            self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
            self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

        @property
        def metrics(self):
            return [self.total_loss_tracker, self.reconstruction_loss_tracker, self.kl_loss_tracker]

        def call(self, x):
            return self.decoder(self.encoder(x)[2])

        def train_step(self, x):
            import tensorflow as tf

            with tf.GradientTape() as tape:
                mean, log_var, z = self.encoder(x)
                reconstruction = self.decoder(z)
                rec = ops.mean(ops.sum(ops.square(x - reconstruction), axis=1))
                kl = -0.5 * (1 + log_var - ops.square(mean) - ops.exp(log_var))
                kl = ops.mean(ops.sum(kl, axis=1))
                total = rec + kl
            grads = tape.gradient(total, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.total_loss_tracker.update_state(total)
            self.reconstruction_loss_tracker.update_state(rec)
            self.kl_loss_tracker.update_state(kl)
            return {m.name: m.result() for m in self.metrics}

        def get_config(self):
            return {
                **super().get_config(),
                "encoder": keras.saving.serialize_keras_object(self.encoder),
                "decoder": keras.saving.serialize_keras_object(self.decoder),
            }

        @classmethod
        def from_config(cls, config):
            encoder = keras.saving.deserialize_keras_object(config.pop("encoder"))
            decoder = keras.saving.deserialize_keras_object(config.pop("decoder"))
            return cls(encoder, decoder, **config)

    return VAE


def test_vae_with_two_positional_models_and_three_mean_metrics(tmp_path):
    x, _, _ = data()

    def run(base):
        vae = make_vae_class(base)(*_vae_parts())
        vae.compile(keras.optimizers.Adam(1e-2))
        history = vae.fit(x, batch_size=8, epochs=2, verbose=0, shuffle=False).history
        return history, vae.get_weights(), vae

    vae = both(run)
    assert set(vae.history.history) == {"total_loss", "reconstruction_loss", "kl_loss"}
    path = str(tmp_path / "vae.keras")
    vae.save(path)
    VAE = type(vae)
    loaded = keras.saving.load_model(path, custom_objects={"VAE": VAE})
    assert type(loaded) is VAE
    for a, b in zip(vae.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(b, a)


# ------------------------------------------------------------------------------- distiller


def _classifier(name, width):
    i = keras.Input((6,))
    return keras.Model(
        i, keras.layers.Dense(3)(keras.layers.Dense(width, activation="relu")(i)), name=name
    )


def make_distiller_class(base):
    class Distiller(base):
        def __init__(self, student, teacher, **kwargs):
            super().__init__(**kwargs)
            self.student, self.teacher = student, teacher

        def compile(
            self,
            optimizer,
            metrics,
            student_loss_fn,
            distillation_loss_fn,
            alpha=0.1,
            temperature=3,
            **kwargs,
        ):
            super().compile(optimizer=optimizer, metrics=metrics, **kwargs)
            self.student_loss_fn = student_loss_fn
            self.distillation_loss_fn = distillation_loss_fn
            self.alpha, self.temperature = alpha, temperature

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
            teacher_pred = self.teacher(x, training=False)
            student_loss = self.student_loss_fn(y, y_pred)
            t = self.temperature
            distillation_loss = self.distillation_loss_fn(
                ops.softmax(teacher_pred / t, axis=1), ops.softmax(y_pred / t, axis=1)
            ) * (t**2)
            return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

        def call(self, x):
            return self.student(x)

    return Distiller


def _distill(base, **features):
    x, _, labels = data()
    teacher = _classifier("teacher", 12)
    teacher.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    teacher.fit(x, labels, epochs=1, batch_size=8, verbose=0, shuffle=False)
    distiller = make_distiller_class(base)(_classifier("student", 4), teacher)
    distiller.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
        student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        distillation_loss_fn=keras.losses.KLDivergence(),
        **features,
    )
    history = distiller.fit(x, labels, batch_size=8, epochs=3, verbose=0, shuffle=False).history
    return history, distiller.student.get_weights(), distiller


def test_distiller_overriding_compile_and_compute_loss(tmp_path):
    distiller = both(_distill)
    assert set(distiller.history.history) == {"loss", "sparse_categorical_accuracy"}
    path = str(tmp_path / "student.keras")
    distiller.student.save(path)
    loaded = keras.saving.load_model(path)
    x, _, _ = data()
    np.testing.assert_array_equal(
        loaded.predict(x, verbose=0), distiller.student.predict(x, verbose=0)
    )


# ------------------------------------------------------------- train_step with optimizer.apply


def make_apply_model(base):
    class ApplyItself(base):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(8, activation="relu")
            self.out = keras.layers.Dense(1)

        def call(self, x):
            return self.out(self.hidden(x))

        def train_step(self, data):
            import tensorflow as tf

            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    return ApplyItself()


def test_train_step_calling_optimizer_apply(tmp_path):
    x, y, _ = data()

    def run(base):
        model = make_apply_model(base)
        model.compile(keras.optimizers.SGD(0.01), "mse", metrics=["mae"])
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False).history
        return history, model.get_weights(), model

    model = both(run)
    assert {"loss", "mae"} <= set(model.history.history)
    path = str(tmp_path / "apply.weights.h5")
    model.save_weights(path)
    fresh = make_apply_model(kf.OptimizedModel)
    fresh(x[:1])
    fresh.load_weights(path)
    np.testing.assert_array_equal(fresh.predict(x, verbose=0), model.predict(x, verbose=0))


# -------------------------------------------------- transfer learning, BatchNorm in inference


def _frozen_base():
    i = keras.Input((6,))
    h = keras.layers.BatchNormalization()(keras.layers.Dense(8)(i))
    return keras.Model(i, keras.layers.Activation("relu")(h), name="base")


def _transfer(base_cls, **features):
    x, _, labels = data(seed=1)
    pretrained = _frozen_base()
    pretrained.compile("adam", "mse")
    pretrained.fit(x, np.ones((40, 8), "float32"), epochs=1, batch_size=8, verbose=0, shuffle=False)
    pretrained.trainable = False
    i = keras.Input((6,))
    h = pretrained(i, training=False)  # BatchNorm stays in inference mode, also when unfrozen
    model = base_cls(i, keras.layers.Dense(3, activation="softmax")(keras.layers.Dropout(0.2)(h)))
    model.compile(
        keras.optimizers.Adam(1e-2),
        "sparse_categorical_crossentropy",
        metrics=["accuracy"],
        **features,
    )
    first = model.fit(x, labels, batch_size=8, epochs=2, verbose=0, shuffle=False).history
    pretrained.trainable = True  # fine-tuning: recompile with a low learning rate
    model.compile(
        keras.optimizers.Adam(1e-4),
        "sparse_categorical_crossentropy",
        metrics=["accuracy"],
        **features,
    )
    second = model.fit(x, labels, batch_size=8, epochs=2, verbose=0, shuffle=False).history
    history = {f"{k}_frozen": v for k, v in first.items()} | second
    return history, model.get_weights(), model


def test_transfer_learning_with_a_frozen_base_and_batchnorm_in_inference(tmp_path):
    model = both(_transfer)
    bn = model.get_layer("base").layers[2]
    assert isinstance(bn, keras.layers.BatchNormalization)
    path = str(tmp_path / "transfer.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, kf.OptimizedModel)
    x, _, _ = data(seed=1)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


# ----------------------------------------------------------------- add_loss in a custom layer


@keras.saving.register_keras_serializable(package="kf_test_client")
class ActivityPenalty(keras.layers.Layer):
    def __init__(self, rate=1e-2, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate

    def call(self, x):
        self.add_loss(self.rate * ops.mean(ops.square(x)))
        return x

    def get_config(self):
        return {**super().get_config(), "rate": self.rate}


def make_add_loss_class(base):
    class Penalised(base):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(8, activation="relu")
            self.penalty = ActivityPenalty()
            self.out = keras.layers.Dense(1)

        def call(self, x):
            return self.out(self.penalty(self.hidden(x)))

    return Penalised


def _add_loss_run(base, **features):
    x, y, _ = data()
    model = make_add_loss_class(base)()
    model.compile(keras.optimizers.SGD(0.01), "mse", **features)
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False).history
    return history, model.get_weights(), model


def test_add_loss_in_a_subclassed_layer(tmp_path):
    model = both(_add_loss_run)
    x, y, _ = data()
    path = str(tmp_path / "penalised.keras")
    model.save(path)
    cls = type(model)
    loaded = keras.saving.load_model(path, custom_objects={cls.__name__: cls})
    assert type(loaded) is cls
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(b, a)
    # training goes on identically from the loaded copy
    h1 = model.fit(x, y, batch_size=8, verbose=0, shuffle=False).history
    h2 = loaded.fit(x, y, batch_size=8, verbose=0, shuffle=False).history
    assert h1 == h2


# --------------------------------------- features on: the models that keep our train_step


@pytest.mark.parametrize(
    "run", [_distill, _transfer, _add_loss_run], ids=["distiller", "transfer", "add_loss"]
)
def test_models_keeping_our_train_step_train_with_clipping_and_nonfinite(run):
    keras.utils.set_random_seed(SEED)
    history, _, model = run(kf.OptimizedModel, gradient_clipping=1.0, nonfinite="raise")
    assert model.gradient_clipping is not None
    loss = history.get("loss_frozen", history["loss"])  # transfer: the head's training
    assert np.all(np.isfinite(loss)) and loss[-1] < loss[0], loss
    assert history["skipped_steps"][-1] == 0
