"""The step is traced once per input signature (`keras_fastloop._step.prebuild`), with Keras' numbers.

Without a strategy `keras.Model` creates the metrics' and the optimizer's variables inside the
first trace, so `tf.function` traces `train_step` a second time; `OptimizedModel` builds them
first, from the data's spec. Every Python call of `train_step` / `test_step` below is a trace.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_fastloop as kf
from keras_fastloop import _keras_internals as internals


def counting(cls):
    """`cls` whose instances count the Python calls (= traces) of `train_step` / `test_step`.

    The count wraps the bound methods on the instance: the class keeps the default steps (a
    class that overrides a step is not pre-built, see `test_an_overridden_step_*`).
    """

    class Counting(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            traces = {"train": 0, "test": 0}
            object.__setattr__(self, "traces", traces)  # untracked
            for kind in traces:
                step = getattr(self, f"{kind}_step")

                def counted(data, step=step, kind=kind):
                    traces[kind] += 1
                    return step(data)

                object.__setattr__(self, f"{kind}_step", counted)

    return Counting


def cnn(cls, dropout=True):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Flatten()(h)
    if dropout:
        h = keras.layers.Dropout(0.3)(h)
    outputs = keras.layers.Dense(3, activation="softmax")(h)
    return counting(cls)(inputs, outputs)


def data(n=70):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8, 8, 1)).astype("float32"), rng.integers(0, 3, n)


def compiled(model, **kwargs):
    model.compile(
        keras.optimizers.Adam(1e-2),
        "sparse_categorical_crossentropy",
        metrics=["accuracy"],
        **kwargs,
    )
    return model


def dataset(x, y, batch=16):
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=1).batch(batch)


def test_keras_model_traces_its_train_step_twice_the_reason_for_prebuilding():
    """The reference behaviour (Keras 3.15): variables created in the first trace force a second.

    If a Keras upgrade builds the state before tracing, this fails, and the prebuild may go.
    """
    x, y = data()
    model = compiled(cnn(keras.Model))
    model.fit(dataset(x, y), epochs=1, verbose=0)
    assert model.traces["train"] == 2


@pytest.mark.parametrize("steps_per_execution", [1, 3, "auto"])
def test_fit_traces_train_and_test_step_once_with_keras_numbers(steps_per_execution):
    x, y = data()
    x_val, y_val = data(20)
    runs = []
    for cls in (keras.Model, kf.OptimizedModel):
        spe = steps_per_execution
        if cls is keras.Model and spe == "auto":
            spe = 1
        model = compiled(cnn(cls), steps_per_execution=spe)
        history = model.fit(
            dataset(x, y), epochs=2, validation_data=(x_val, y_val), verbose=0
        ).history
        runs.append((model, history))
    (reference, expected), (model, history) = runs
    # 70 samples in batches of 16: the partial last batch reuses the same trace (batch dim None).
    assert model.traces == {"train": 1, "test": 1}
    assert set(history) == set(expected)
    for key in expected:
        np.testing.assert_allclose(history[key], expected[key], rtol=1e-6, err_msg=key)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_fit_on_arrays_and_batch_methods_trace_once():
    x, y = data()
    model = compiled(cnn(kf.OptimizedModel))
    model.fit(x, y, batch_size=16, epochs=2, validation_split=0.25, verbose=0)
    assert model.traces == {"train": 1, "test": 1}

    fresh = compiled(cnn(kf.OptimizedModel))
    fresh.train_on_batch(x[:16], y[:16])
    fresh.train_on_batch(x[16:32], y[16:32])
    fresh.test_on_batch(x[:16], y[:16])
    assert fresh.traces == {"train": 1, "test": 1}

    evaluated = compiled(cnn(kf.OptimizedModel))
    evaluated.evaluate(x, y, batch_size=16, verbose=0)
    assert evaluated.traces["test"] == 1


def test_features_compose_with_the_prebuild():
    """Clipping, loss weighting and micro-batching build their own state at compile."""
    x, y = data(64)
    model = compiled(
        cnn(kf.OptimizedModel, dropout=False), gradient_clipping=1.0, micro_batch_size=8
    )
    reference = compiled(cnn(kf.OptimizedModel, dropout=False), gradient_clipping=1.0)
    # Micro-batching with BatchNormalization differs by design; without dropout the rest matches.
    model.fit(dataset(x, y), epochs=1, verbose=0)
    reference.fit(dataset(x, y), epochs=1, verbose=0)
    assert model.traces["train"] == 1
    assert reference.traces["train"] == 1


def test_a_subclassed_model_built_in_its_first_call_keeps_keras_deferred_build():
    class Subclassed(kf.OptimizedModel):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3, activation="softmax")

        def call(self, x):
            return self.dense(keras.ops.reshape(x, (-1, 64)))

    x, y = data()
    keras.utils.set_random_seed(3)
    model = compiled(counting(Subclassed)())
    history = model.fit(dataset(x, y), epochs=2, verbose=0).history
    assert np.all(np.isfinite(history["loss"]))
    assert model.traces["train"] == 2  # as keras.Model: the layers are built in the first trace


def test_an_overridden_step_that_transforms_y_keeps_keras_metrics():
    """The metrics must be built from the `y` the step passes on, not from the data's `y`."""

    def sparse_labels(cls):
        class SparseLabels(cls):
            def train_step(self, data):
                x, y = data
                return super().train_step((x, keras.ops.argmax(y, axis=-1)))

        return SparseLabels

    x, y = data()
    one_hot = np.eye(3, dtype="float32")[y]
    histories = []
    for cls in (keras.Model, kf.OptimizedModel):
        model = compiled(cnn(sparse_labels(cls), dropout=False))
        histories.append(model.fit(x, one_hot, batch_size=16, epochs=2, verbose=0).history)
    for key in histories[0]:
        np.testing.assert_allclose(histories[1][key], histories[0][key], rtol=1e-6, err_msg=key)


def _frozen_first_layer(cls):
    model = cnn(cls, dropout=False)
    model.layers[1].trainable = False  # the Conv2D
    return compiled(model)


class Unfreeze(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.model.layers[1].trainable = True


def test_the_optimizer_is_built_with_the_variables_trainable_at_the_first_step():
    """Keras builds the optimizer in the first trace: after `on_train_begin`, after `evaluate`."""
    x, y = data()
    runs = []
    for cls in (keras.Model, kf.OptimizedModel):
        evaluated = _frozen_first_layer(cls)
        evaluated.evaluate(x, y, verbose=0)
        evaluated.layers[1].trainable = True
        first = evaluated.fit(x, y, batch_size=16, epochs=1, verbose=0).history
        by_callback = _frozen_first_layer(cls)
        second = by_callback.fit(
            x, y, batch_size=16, epochs=1, callbacks=[Unfreeze()], verbose=0
        ).history
        runs.append((evaluated, first, by_callback, second))
    (ref_a, ref_first, ref_b, ref_second), (model_a, first, model_b, second) = runs
    assert model_a.traces["train"] == 1 and model_b.traces["train"] == 1
    assert len(model_a.optimizer.variables) == len(ref_a.optimizer.variables)
    for expected, got in ((ref_first, first), (ref_second, second)):
        for key in expected:
            np.testing.assert_allclose(got[key], expected[key], rtol=1e-6, err_msg=key)
    for reference, model in ((ref_a, model_a), (ref_b, model_b)):
        for a, b in zip(reference.get_weights(), model.get_weights()):
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_evaluate_alone_leaves_the_optimizer_unbuilt_as_keras(tmp_path):
    x, y = data()
    model = compiled(cnn(kf.OptimizedModel))
    model.evaluate(x, y, verbose=0)
    assert model.traces["test"] == 1
    assert not model.optimizer.built


def test_a_failing_symbolic_build_leaves_the_state_to_the_trace(monkeypatch):
    calls = []

    def failing(model, data_batch):
        calls.append(data_batch)
        raise RuntimeError("cannot build symbolically")

    monkeypatch.setattr(internals, "build_compiled_metrics_and_loss", failing)
    x, y = data()
    model = compiled(cnn(kf.OptimizedModel))
    history = model.fit(dataset(x, y), epochs=1, verbose=0).history
    assert calls and np.isfinite(history["loss"][0])
    assert model.traces["train"] == 2  # Keras' deferred build
