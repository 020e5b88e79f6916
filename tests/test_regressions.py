"""Faults found by a fresh user trying the package (each failed before its fix)."""

import json

import keras
import numpy as np
import pytest

import keras_fastloop as kf
from keras_fastloop.bench import harness


def mlp():
    keras.utils.set_random_seed(0)
    i = keras.Input((8,))
    return kf.OptimizedModel(
        i, keras.layers.Dense(3, activation="softmax")(keras.layers.Dense(16, activation="relu")(i))
    )


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 3, 64)


def test_autoclip_zero_gradient_batches_do_not_write_nan():
    x, y = data()
    sw = np.ones(64, "float32")
    sw[:16] = 0.0  # the first batch has a zero gradient: AutoClip's first threshold is 0
    model = mlp()
    model.compile(
        "sgd",
        "sparse_categorical_crossentropy",
        gradient_clipping=kf.clipping.AutoClip(),
        log_metrics=["grad_norm", "skipped_steps"],
    )
    history = model.fit(x, y, sample_weight=sw, batch_size=16, shuffle=False, epochs=2, verbose=0)
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["skipped_steps"][-1] == 0


def test_terminate_stops_one_fit_only_and_says_so(capsys):
    x, y = data()
    bad = x.copy()
    bad[20, 3] = np.nan
    model = mlp()
    model.compile("sgd", "sparse_categorical_crossentropy", nonfinite="terminate")
    model.fit(bad, y, batch_size=16, shuffle=False, verbose=0)
    assert "terminating training" in capsys.readouterr().out
    assert int(model.optimizer.iterations.numpy()) == 1
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)  # clean data trains again
    assert int(model.optimizer.iterations.numpy()) == 1 + 8


def test_skip_warning_on_small_epochs():
    x, y = data()
    model = mlp()
    model.compile("sgd", lambda yt, yp: keras.ops.mean(yp, axis=-1) * np.nan)
    with pytest.warns(UserWarning, match="were skipped"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def test_missing_target_key_is_a_clear_error():
    keras.utils.set_random_seed(0)
    i = keras.Input((8,))
    h = keras.layers.Dense(4)(i)
    model = kf.OptimizedModel(
        i,
        {"cls": keras.layers.Dense(3, name="cls")(h), "reg": keras.layers.Dense(1, name="reg")(h)},
    )
    model.compile("sgd", {"cls": "sparse_categorical_crossentropy", "reg": "mse"})
    x, y = data()
    with pytest.raises(
        ValueError, match=r"no entry for output 'reg'.*Received: keys=\['cls', 'regg'\]"
    ):
        model.fit(x, {"cls": y, "regg": np.zeros((64, 1))}, verbose=0)


def test_numpy_scalars_are_accepted():
    model = mlp()
    model.compile(
        "sgd",
        "sparse_categorical_crossentropy",
        gradient_clipping=np.float32(1.0),
        micro_batch_size=np.int64(4),
    )
    assert model._gradient_clipping.clipnorm == 1.0 and model._micro_batch_size == 4
    assert kf.clipping.ClipByNorm(np.float64(0.5)).clipnorm == 0.5


def test_periodic_validation_takes_a_single_callback():
    x, y = data()
    stop = keras.callbacks.EarlyStopping(patience=1)
    pv = kf.callbacks.PeriodicValidation((x, y), every_n_steps=2, callbacks=stop)
    assert pv.callbacks == [stop]


def test_reports_are_strict_json(tmp_path):
    harness.write_report(tmp_path, "s", "md", {"a": float("nan"), "b": [1.0, float("inf")]})
    text = (tmp_path / "s.json").read_text()
    assert json.loads(text, parse_constant=lambda c: pytest.fail(c)) == {
        "a": None,
        "b": [1.0, None],
    }
