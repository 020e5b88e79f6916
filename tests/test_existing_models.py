"""Models users already have get the step: `kf.optimized(model)`, and KerasHub tasks in
either base order. With every option off each trains exactly as the original would (History
and weights to the last bit); with clipping on the option acts. Models of KerasHub are built
from a small config with random weights and a hand-made vocabulary (nothing downloaded);
data are synthetic."""

import keras
import numpy as np
import pytest
from _helpers import LABELS, TEXTS, bert_classifier

import keras_fastloop as kf


def data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, (x.sum(axis=1, keepdims=True) > 0).astype("float32")


def functional():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def sequential():
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )


def history_and_weights(model, x, y, **kwargs):
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, **kwargs)
    return history.history, [w.numpy() for w in model.weights]


def assert_same(run_a, run_b):
    assert run_a[0] == run_b[0]
    for a, b in zip(run_a[1], run_b[1]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("build", [functional, sequential])
def test_stock_saved_model_continues_through_optimized(build, tmp_path):
    x, y = data()
    model = build()
    model.compile(keras.optimizers.Adam(0.01), "mse", metrics=["mae"])
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = tmp_path / "stock.keras"
    model.save(path)
    reference = keras.saving.load_model(path)
    ours = kf.optimized(keras.saving.load_model(path))
    assert isinstance(ours, kf.OptimizedTrainer) and isinstance(ours, type(reference))
    assert int(ours.optimizer.iterations.numpy()) == 4  # the optimizer state came along
    assert_same(history_and_weights(reference, x, y), history_and_weights(ours, x, y))
    # saves and loads with the step: as OptimizedModel / OptimizedSequential
    ours.save(tmp_path / "again.keras")
    again = keras.saving.load_model(tmp_path / "again.keras")
    assert type(again) is type(ours) and isinstance(again, type(reference))


def test_optimized_model_shares_weights_and_takes_options():
    x, y = data()
    model = functional()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    kernel = model.weights[0]
    same = kf.optimized(model, gradient_clipping=1e-4, log_metrics=["grad_norm"])
    assert same is model and model.weights[0] is kernel
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert history.history["grad_norm"][0] > 1e-4  # clipped to 1e-4: the update is tiny
    assert model.gradient_clipping.clipnorm == 1e-4


def test_optimized_keeps_a_subclass_own_step_and_methods():
    class Custom(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

        def describe(self):
            return "custom"

    model = kf.optimized(Custom())
    assert model.describe() == "custom" and type(model).__name__ == "Custom"
    x, y = data()
    model.compile("sgd", "mse")
    model.fit(x, y, verbose=0)


def test_optimized_model_of_an_existing_model_names_the_call():
    with pytest.raises(TypeError, match=r"keras_fastloop.optimized\(model\)"):
        kf.OptimizedModel(functional())


def test_options_for_an_uncompiled_model_are_refused():
    with pytest.raises(ValueError, match="not compiled.*Received: \\['gradient_clipping'\\]"):
        kf.optimized(functional(), gradient_clipping=1.0)


# ---------------------------------------------------------------------------- KerasHub


@pytest.mark.slow  # four small BERT tasks: the slow job
def test_kerashub_task_in_either_base_order_and_optimized_equals_the_stock_task():
    keras_hub = pytest.importorskip("keras_hub")
    stock = keras_hub.models.BertTextClassifier

    class First(kf.OptimizedModel, stock):
        pass

    class Second(stock, kf.OptimizedModel):
        pass

    runs = []
    for make in (
        lambda: bert_classifier(stock),
        lambda: bert_classifier(First),
        lambda: bert_classifier(Second),
        lambda: kf.optimized(bert_classifier(stock)),
    ):
        model = make()
        model.compile()  # the task's own "auto" optimizer, loss and metrics
        assert isinstance(model.optimizer, keras.optimizers.Adam)
        runs.append(history_and_weights(model, TEXTS, LABELS))  # raw strings: preprocessor
    for run in runs[1:]:
        assert_same(runs[0], run)


@pytest.mark.slow
def test_kerashub_task_trains_with_clipping_on():
    keras_hub = pytest.importorskip("keras_hub")

    class Task(kf.OptimizedModel, keras_hub.models.BertTextClassifier):
        pass

    model = bert_classifier(Task)
    model.compile(gradient_clipping=1e-3)
    history = model.fit(TEXTS, LABELS, batch_size=8, epochs=1, verbose=0)
    assert history.history["grad_norm"][0] > 1e-3
    assert model.predict(["the cat"], verbose=0).shape == (1, 2)  # preprocessor kept
