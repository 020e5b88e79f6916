"""One way to validate arguments: `keras_fastloop._validation`, and NumPy scalars everywhere."""

import numpy as np
import pytest
from _helpers import fresh_user_mlp

import keras_fastloop as kf
from keras_fastloop import _validation, mixed_precision
from keras_fastloop.tuning import StepsPerExecutionTuner, validate_steps_per_execution
from keras_fastloop.weighting import _utils


def test_one_message_shape():
    with pytest.raises(ValueError, match=r"^`x` must be a positive integer\. Received: x=0$"):
        _validation.check_int("x", 0, minimum=1)
    with pytest.raises(ValueError, match=r"^`x` must be None or a positive integer\. "):
        _validation.check_int("x", 0, minimum=1, allow_none=True)
    with pytest.raises(ValueError, match=r"^`r` must be a finite number >= 0 and <= 1\. "):
        _validation.check_real("r", 1.5, minimum=0, maximum=1)
    with pytest.raises(ValueError, match=r"^`f` must be callable\. Received: f=3$"):
        _validation.check_callable("f", 3)


@pytest.mark.parametrize("value", [np.int64(3), np.int32(3), np.uint8(3), 3])
def test_numpy_integers_are_integers_and_come_back_as_int(value):
    out = _validation.check_int("n", value, minimum=1)
    assert out == 3 and type(out) is int


@pytest.mark.parametrize("value", [True, False, 2.0, "2", None, np.float32(2)])
def test_non_integers_are_refused(value):
    with pytest.raises(ValueError, match="`n` must be"):
        _validation.check_int("n", value, minimum=0)


def test_reals_accept_numpy_and_refuse_bool_and_non_finite():
    assert _validation.check_real("r", np.float32(0.5), minimum=0, maximum=1) == 0.5
    assert type(_validation.check_real("r", np.int64(1), minimum=0)) is float
    for bad in (True, float("nan"), float("inf"), "0.5"):
        with pytest.raises(ValueError, match="`r` must be"):
            _validation.check_real("r", bad, minimum=0)
    with pytest.raises(ValueError, match="a positive number"):
        _validation.check_real("r", 0.0, minimum=0, exclusive_minimum=True)


def test_numpy_scalars_accepted_by_the_public_constructors(tmp_path):
    monitor = kf.callbacks.ThroughputMonitor(batch_size=np.int64(32), log_every_n_steps=np.int32(5))
    assert monitor.batch_size == 32 and type(monitor.batch_size) is int
    window = kf.callbacks.ProfilerWindow(np.int64(2), np.int64(4), logdir=str(tmp_path))
    assert (window.start_step, window.stop_step) == (2, 4)
    x = np.zeros((4, 1), "float32")
    validation = kf.callbacks.PeriodicValidation((x, x), every_n_steps=np.int64(2), verbose=0)
    assert validation.every_n_steps == 2 and type(validation.every_n_steps) is int
    schedule = kf.schedules.WarmupCosineDecayRestarts(
        np.float32(0.0),
        np.int64(100),
        warmup_target=np.float64(0.1),
        warmup_steps=np.int64(10),
        alpha=np.float32(0.0),
    )
    assert float(schedule(10)) == pytest.approx(0.1)
    assert validate_steps_per_execution(np.int64(4)) == 4
    tuner = StepsPerExecutionTuner(initial=np.int64(2), max_steps=np.int64(64))
    assert (tuner.initial, tuner.max_steps) == (2, 64)
    assert kf.data.geometric_boundaries(np.int64(64), first=np.int64(16)) == (
        kf.data.geometric_boundaries(64, first=16)
    )
    assert _utils.check_positive_int(np.int64(3), "window") == 3
    assert _utils.check_positive(np.float32(2.0), "temperature") == 2.0
    assert _utils.resolve_seed(np.int64(7)) == 7


def test_bool_is_not_a_number_anywhere():
    with pytest.raises(ValueError, match="`batch_size` must be"):
        kf.callbacks.ThroughputMonitor(batch_size=True)
    with pytest.raises(ValueError, match="`steps_per_execution` must be"):
        validate_steps_per_execution(True)
    with pytest.raises(ValueError, match="`steps` must be an int >= 1"):
        mixed_precision.set_recommended_policy(steps=True)


def test_numpy_scalars_accepted_by_compile():
    model = fresh_user_mlp()
    model.compile(
        "sgd",
        "sparse_categorical_crossentropy",
        gradient_clipping=np.float32(1.0),
        micro_batch_size=np.int64(4),
    )
    assert model.gradient_clipping.clipnorm == 1.0 and model.fastloop_step.micro_batch_size == 4
    assert kf.clipping.ClipByNorm(np.float64(0.5)).clipnorm == 0.5


def test_numpy_scalars_are_accepted_wherever_numbers_are():
    """Every numeric check goes through `_validation`: NumPy scalars pass as Keras takes them."""
    import keras

    assert kf.clipping.AutoClip(np.float32(10)).percentile == 10
    kf.weighting.UncertaintyWeighting(initial_log_variance=np.float32(0.0))
    kf.weighting.LossEMA(decay=np.float32(0.5))
    x = np.ones((4, 2), "float32")
    y = {"a": np.zeros((4, 1), "float32"), "b": np.ones((4, 1), "float32")}
    logs = []
    for weights in ({"a": 0.5, "b": 2.0}, {"a": np.float32(0.5), "b": np.float64(2.0)}):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((2,))
        outputs = {
            "a": keras.layers.Dense(1, name="a")(inputs),
            "b": keras.layers.Dense(1, name="b")(inputs),
        }
        model = kf.OptimizedModel(inputs, outputs)
        model.compile("sgd", {"a": "mse", "b": "mse"}, loss_weights=weights)
        logs.append(model.fit(x, y, epochs=1, verbose=0).history)
    assert logs[0] == logs[1]
