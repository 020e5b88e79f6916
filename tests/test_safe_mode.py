"""`.keras` files: OptimizedModel loads with `safe_mode=True` and no `custom_objects`; files
with a Python lambda or an unknown object are refused without running any of their code.

The refusals are checked in a fresh subprocess (only `keras_fastloop` imported, nothing else
registered), with a side effect (a marker file) that the refused code would cause; the same load
with `safe_mode=False` does cause it, so the test can tell the difference.
"""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import keras_fastloop as kf

pytestmark = pytest.mark.slow  # integration: the slow job


def _multitask_model():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = kf.OptimizedModel(
        inputs,
        {
            "a": keras.layers.Dense(1, name="a")(hidden),
            "b": keras.layers.Dense(1, name="b")(hidden),
        },
    )
    schedule = kf.schedules.WarmupCosineDecayRestarts(
        initial_learning_rate=0.0, warmup_target=1e-2, warmup_steps=2, first_decay_steps=5
    )
    model.compile(
        keras.optimizers.AdamW(schedule),
        {"a": "mse", "b": "mse"},
        gradient_clipping=kf.clipping.AutoClip(50.0, history_size=8),
        loss_weighting="uw",
    )
    return model


def test_optimized_model_loads_in_safe_mode_without_custom_objects(tmp_path):
    model = _multitask_model()
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    model.fit(x, {"a": x[:, :1], "b": x[:, 1:2]}, batch_size=4, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)

    loaded = keras.saving.load_model(path, safe_mode=True)
    assert isinstance(loaded, kf.OptimizedModel)
    assert isinstance(loaded.gradient_clipping, kf.clipping.AutoClip)
    assert isinstance(loaded.loss_weighting, kf.weighting.UncertaintyWeighting)
    learning_rate = loaded.optimizer.learning_rate
    assert isinstance(
        getattr(loaded.optimizer, "_learning_rate", learning_rate),
        kf.schedules.WarmupCosineDecayRestarts,
    )
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(model.fastloop_step.state.weights, loaded.fastloop_step.state.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_allclose(
        model.predict(x, verbose=0)["a"], loaded.predict(x, verbose=0)["a"], atol=1e-6
    )


LOADER = textwrap.dedent(
    """
    import os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import keras
    import keras_fastloop  # registers keras_fastloop's objects, nothing else
    path, safe = sys.argv[1], sys.argv[2] == "safe"
    try:
        keras.saving.load_model(path, safe_mode=safe)
    except Exception as error:
        print("REFUSED", type(error).__name__, str(error).replace("\\n", " ")[:20000])
    else:
        print("LOADED")
    """
)


def _load_in_subprocess(path, safe, marker):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    env["SAFE_MODE_MARKER"] = str(marker)
    process = subprocess.run(
        [sys.executable, "-c", LOADER, path, "safe" if safe else "unsafe"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == 0, process.stderr[-2000:]
    return process.stdout.strip().splitlines()[-1]


def test_lambda_is_refused_and_not_executed(tmp_path, monkeypatch):
    marker = tmp_path / "lambda_ran"
    monkeypatch.setenv("SAFE_MODE_MARKER", str(marker))
    inputs = keras.Input((4,))
    # The marker's path comes from the environment: Keras 3.15 cannot load a lambda with
    # default arguments (it stores them as a list), and globals do not travel with the code.
    outputs = keras.layers.Lambda(
        lambda t: (open(__import__("os").environ["SAFE_MODE_MARKER"], "w").close(), t)[1]
    )(inputs)
    model = kf.OptimizedModel(inputs, keras.layers.Dense(1)(outputs))
    model.compile("sgd", "mse")
    path = str(tmp_path / "lambda.keras")
    model.save(path)
    os.remove(marker)  # building the model above ran the lambda once

    result = _load_in_subprocess(path, True, marker)
    assert result.startswith("REFUSED ValueError"), result
    assert "safe_mode" in result
    assert not marker.exists()

    # Control: the unsafe load does run the file's code.
    assert _load_in_subprocess(path, False, marker) == "LOADED"
    assert marker.exists()


class _Evil(keras.layers.Layer):
    """Registered only in this process; its constructor leaves a marker when it runs."""

    def __init__(self, marker=None, **kwargs):
        super().__init__(**kwargs)
        self.marker = marker
        if marker:
            open(marker, "w").close()

    def call(self, inputs):
        return inputs

    def get_config(self):
        return {**super().get_config(), "marker": self.marker}


@pytest.mark.parametrize("safe", [True, False])
def test_unknown_object_is_refused_and_not_executed(tmp_path, safe):
    marker = tmp_path / "evil_ran"
    evil = keras.saving.register_keras_serializable(package="not_installed")(_Evil)
    try:
        inputs = keras.Input((4,))
        model = kf.OptimizedModel(inputs, keras.layers.Dense(1)(evil(str(marker))(inputs)))
        model.compile("sgd", "mse")
        path = str(tmp_path / "evil.keras")
        model.save(path)
    finally:
        keras.saving.get_custom_objects().pop("not_installed>_Evil", None)
    os.remove(marker)

    result = _load_in_subprocess(path, safe, marker)
    assert result.startswith("REFUSED"), result
    assert "_Evil" in result
    assert not marker.exists()
