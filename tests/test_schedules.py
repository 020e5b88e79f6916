"""Tests for keras_fastloop.schedules.WarmupCosineDecayRestarts and LearningRateLogger."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_fastloop.callbacks.lr_logger import LearningRateLogger
from keras_fastloop.schedules import WarmupCosineDecayRestarts

CosineDecay = keras.optimizers.schedules.CosineDecay
CosineDecayRestarts = keras.optimizers.schedules.CosineDecayRestarts


def values(schedule, steps):
    return np.array([float(schedule(step)) for step in steps])


def sgdr_reference(step, peak, first_decay_steps, t_mul, m_mul, alpha):
    """SGDR written out period by period in float64 (Loshchilov & Hutter 2017).

    As in Keras, `m_mul` scales the cosine part only: period i decays from
    `peak * ((1 - alpha) * m_mul**i + alpha)` to the fixed floor `peak * alpha`.
    """
    start, length, level = 0.0, float(first_decay_steps), 1.0
    while step >= start + length:
        start, length, level = start + length, length * t_mul, level * m_mul
    fraction = (step - start) / length
    return peak * ((1 - alpha) * level * 0.5 * (1 + math.cos(math.pi * fraction)) + alpha)


def reference(step, initial, target, warmup_steps, first_decay_steps, t_mul, m_mul, alpha):
    if step < warmup_steps:
        return initial + (target - initial) * step / warmup_steps
    return sgdr_reference(step - warmup_steps, target, first_decay_steps, t_mul, m_mul, alpha)


# --- Keras' own CosineDecay / CosineDecayRestarts values ----------------------------------------------------


def test_c14_keras_cosine_decay_with_warmup_values():
    schedule = CosineDecay(0.0, decay_steps=1000, warmup_target=0.1, warmup_steps=1000, alpha=0.1)
    got = values(schedule, [500, 1000, 1500, 2000, 5000])
    np.testing.assert_allclose(got, [0.05, 0.1, 0.055, 0.01, 0.01], rtol=1e-6)


def test_c14_keras_cosine_decay_restarts_values():
    schedule = CosineDecayRestarts(1.0, first_decay_steps=10, t_mul=2.0, m_mul=0.5)
    np.testing.assert_allclose(values(schedule, [5, 10, 30]), [0.5, 0.5, 0.25], rtol=1e-6)


# --- our schedule agrees with Keras' where they overlap ------------------------------------------


def test_c14_agrees_with_cosine_decay_with_warmup_before_first_restart():
    ours = WarmupCosineDecayRestarts(
        0.0, warmup_target=0.1, warmup_steps=1000, first_decay_steps=1000, alpha=0.1
    )
    keras_schedule = CosineDecay(
        0.0, decay_steps=1000, warmup_target=0.1, warmup_steps=1000, alpha=0.1
    )
    warmup_steps = np.arange(0, 1000, 7)
    # Same formula as Keras' warmup: bit-identical.
    np.testing.assert_array_equal(values(ours, warmup_steps), values(keras_schedule, warmup_steps))
    decay_steps = np.arange(1000, 2000, 7)
    np.testing.assert_allclose(
        values(ours, decay_steps), values(keras_schedule, decay_steps), rtol=1e-5, atol=1e-8
    )
    np.testing.assert_allclose(values(ours, [500, 1000, 1500]), [0.05, 0.1, 0.055], rtol=1e-6)
    # Where they stop overlapping: Keras stays at the floor, SGDR restarts at step 2000.
    np.testing.assert_allclose(float(keras_schedule(2000)), 0.01, rtol=1e-6)
    np.testing.assert_allclose(float(ours(2000)), 0.1, rtol=1e-6)


def test_c14_agrees_with_cosine_decay_restarts_after_warmup():
    warmup = 7
    ours = WarmupCosineDecayRestarts(
        0.0, warmup_target=1.0, warmup_steps=warmup, first_decay_steps=10, t_mul=2.0, m_mul=0.5
    )
    np.testing.assert_allclose(
        values(ours, [warmup + 5, warmup + 10, warmup + 30]), [0.5, 0.5, 0.25], rtol=1e-6
    )
    keras_schedule = CosineDecayRestarts(1.0, first_decay_steps=10, t_mul=2.0, m_mul=0.5)
    steps = np.arange(warmup, warmup + 200)
    # Delegated to Keras' CosineDecayRestarts: bit-identical after the shift.
    np.testing.assert_array_equal(values(ours, steps), values(keras_schedule, steps - warmup))


@pytest.mark.parametrize(
    "initial, target, warmup_steps, first_decay_steps, t_mul, m_mul, alpha",
    [
        (0.0, 0.1, 50, 100, 2.0, 1.0, 0.0),
        (0.01, 0.5, 13, 20, 1.0, 0.7, 0.1),
        (1e-4, 3e-3, 1, 7, 1.5, 0.9, 0.05),
    ],
)
def test_matches_numpy_reference(
    initial, target, warmup_steps, first_decay_steps, t_mul, m_mul, alpha
):
    schedule = WarmupCosineDecayRestarts(
        initial,
        first_decay_steps,
        warmup_target=target,
        warmup_steps=warmup_steps,
        t_mul=t_mul,
        m_mul=m_mul,
        alpha=alpha,
    )
    steps = np.arange(0, 600, 3)
    expected = [
        reference(s, initial, target, warmup_steps, first_decay_steps, t_mul, m_mul, alpha)
        for s in steps
    ]
    np.testing.assert_allclose(values(schedule, steps), expected, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(first_decay_steps=10),
        dict(first_decay_steps=10, t_mul=2.0, m_mul=0.5),
        dict(first_decay_steps=7, t_mul=1.0, m_mul=0.8, alpha=0.1),
        dict(first_decay_steps=100, t_mul=1.5, m_mul=1.0, alpha=0.3),
    ],
)
def test_no_warmup_equals_keras_cosine_decay_restarts_exactly(kwargs):
    ours = WarmupCosineDecayRestarts(0.3, **kwargs)  # Keras' signature and defaults
    keras_schedule = CosineDecayRestarts(0.3, **kwargs)
    steps = np.arange(0, 3000)
    ours_fn = tf.function(lambda s: ours(s))
    keras_fn = tf.function(lambda s: keras_schedule(s))
    got = np.array([float(ours_fn(tf.constant(s, tf.int64))) for s in steps[::37]])
    want = np.array([float(keras_fn(tf.constant(s, tf.int64))) for s in steps[::37]])
    np.testing.assert_array_equal(got, want)
    # Vectorised over many steps (the schedules are elementwise).
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(ours(steps)), keras.ops.convert_to_numpy(keras_schedule(steps))
    )


def test_called_by_an_optimizer_with_its_iterations_variable():
    schedule = WarmupCosineDecayRestarts(0.0, 10, warmup_target=0.2, warmup_steps=4)
    optimizer = keras.optimizers.SGD(learning_rate=schedule)
    variable = keras.Variable(np.zeros(2, "float32"))
    optimizer.build([variable])
    for _ in range(6):
        optimizer.apply([keras.ops.ones(2)], [variable])
    assert int(optimizer.iterations) == 6
    np.testing.assert_allclose(float(optimizer.learning_rate), float(schedule(6)), rtol=0)


# --- continuity and warmup direction --------------------------------------------------------


def test_continuous_at_end_of_warmup():
    schedule = WarmupCosineDecayRestarts(
        0.001, 50, warmup_target=0.1, warmup_steps=100, t_mul=2.0, m_mul=0.5, alpha=0.1
    )
    assert float(schedule(100)) == pytest.approx(0.1, rel=1e-7)
    left = float(schedule(100.0 - 1e-3))
    right = float(schedule(100.0 + 1e-3))
    assert abs(left - 0.1) < 1e-5
    assert abs(right - 0.1) < 1e-5
    # Integer steps around the joint move by about one warmup increment, no jump.
    increment = (0.1 - 0.001) / 100
    assert float(schedule(100)) - float(schedule(99)) == pytest.approx(increment, rel=1e-3)


def test_decreasing_warmup_rejected_unless_allowed():
    with pytest.raises(
        ValueError, match="allow_decreasing_warmup.*Received: initial_learning_rate"
    ):
        WarmupCosineDecayRestarts(0.1, 10, warmup_target=0.01, warmup_steps=10)
    schedule = WarmupCosineDecayRestarts(
        0.1, 10, warmup_target=0.01, warmup_steps=10, allow_decreasing_warmup=True
    )
    np.testing.assert_allclose(values(schedule, [0, 5, 10]), [0.1, 0.055, 0.01], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(initial_learning_rate=-0.1), "initial_learning_rate"),
        (dict(initial_learning_rate=float("nan")), "initial_learning_rate"),
        (dict(initial_learning_rate="0.1"), "initial_learning_rate"),
        (dict(warmup_target=float("inf")), "warmup_target"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(warmup_steps=2.5), "warmup_steps"),
        (dict(warmup_steps=True), "warmup_steps"),
        (dict(first_decay_steps=0), "first_decay_steps"),
        (dict(first_decay_steps=10.0), "first_decay_steps"),
        (dict(t_mul=0.5), "t_mul"),
        (dict(m_mul=-1.0), "m_mul"),
        (dict(alpha=1.5), "alpha"),
        (dict(alpha=-0.1), "alpha"),
        (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
        (dict(allow_decreasing_warmup=1), "allow_decreasing_warmup"),
        (dict(name=3), "name"),
    ],
)
def test_bad_arguments(kwargs, name):
    args = dict(initial_learning_rate=0.0, warmup_target=0.1, warmup_steps=5, first_decay_steps=10)
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"`{name}` must be .* Received: {name}="):
        WarmupCosineDecayRestarts(**args)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(first_decay_steps=10),
        dict(first_decay_steps=10, t_mul=2.0, m_mul=0.5, alpha=0.05),
        dict(first_decay_steps=3, t_mul=1.0, m_mul=0.9),
    ],
)
def test_no_warmup_is_keras_bit_for_bit_on_float32_steps_across_restarts(kwargs):
    """`CosineDecayRestarts(1e-3, ...)` -> ours with the same arguments, no warmup."""
    ours = WarmupCosineDecayRestarts(1e-3, **kwargs)
    keras_schedule = CosineDecayRestarts(1e-3, **kwargs)
    steps = tf.range(0, 2000, dtype=tf.float32)  # many restarts for every case
    got, want = ours(steps), keras_schedule(steps)
    assert got.dtype == want.dtype == tf.float32
    assert bool(tf.reduce_all(got == want))
    for step in (0, 9, 10, 11, 29, 30, 31, 1999):  # scalar float32 steps around restarts
        s = tf.constant(step, tf.float32)
        assert bool(ours(s) == keras_schedule(s))


def test_signature_is_keras_plus_keyword_only_warmup():
    import inspect

    keras_params = list(inspect.signature(CosineDecayRestarts).parameters)
    ours = inspect.signature(WarmupCosineDecayRestarts).parameters
    positional = [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == keras_params
    for name in keras_params[2:]:
        if name != "name":
            assert (
                ours[name].default
                == inspect.signature(CosineDecayRestarts).parameters[name].default
            )
    assert ours["warmup_target"].kind is inspect.Parameter.KEYWORD_ONLY
    assert ours["warmup_target"].default is None and ours["warmup_steps"].default == 0


def test_warmup_steps_without_target_is_refused():
    with pytest.raises(ValueError, match="needs a `warmup_target`.*Received: warmup_target=None"):
        WarmupCosineDecayRestarts(1e-3, 100, warmup_steps=10)


def test_the_old_positional_order_fails_loudly():
    # (initial, warmup_target, warmup_steps, first_decay_steps) of earlier versions
    with pytest.raises((ValueError, TypeError)):
        WarmupCosineDecayRestarts(0.0, 1e-3, 10, 100)
    with pytest.raises(ValueError, match="`first_decay_steps` must be .* Received"):
        WarmupCosineDecayRestarts(0.0, 1e-3)


def test_no_warmup_config_round_trip():
    schedule = WarmupCosineDecayRestarts(1e-3, 20, m_mul=0.5)
    config = schedule.get_config()
    assert config["warmup_target"] is None and config["warmup_steps"] == 0
    clone = WarmupCosineDecayRestarts.from_config(config)
    assert clone.get_config() == config
    steps = tf.range(0, 200, dtype=tf.float32)
    assert bool(tf.reduce_all(clone(steps) == schedule(steps)))


# --- serialization --------------------------------------------------------------------------


def test_config_round_trip():
    schedule = WarmupCosineDecayRestarts(
        0.001,
        30,
        warmup_target=0.1,
        warmup_steps=20,
        t_mul=1.5,
        m_mul=0.7,
        alpha=0.05,
        gradient_accumulation_steps=2,
    )
    config = schedule.get_config()
    clone = WarmupCosineDecayRestarts.from_config(config)
    assert clone.get_config() == config
    serialized = keras.saving.serialize_keras_object(schedule)
    assert serialized["registered_name"] == "keras_fastloop>WarmupCosineDecayRestarts"
    restored = keras.saving.deserialize_keras_object(serialized)
    assert isinstance(restored, WarmupCosineDecayRestarts)
    steps = np.arange(0, 300, 11)
    np.testing.assert_array_equal(values(restored, steps), values(schedule, steps))


def test_saved_model_keeps_schedule(tmp_path):
    schedule = WarmupCosineDecayRestarts(0.0, 10, warmup_target=0.05, warmup_steps=3, m_mul=0.5)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=schedule), loss="mse")
    model.fit(np.ones((8, 2), "float32"), np.ones((8, 1), "float32"), batch_size=4, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    restored = keras.saving.deserialize_keras_object(loaded.optimizer.get_config()["learning_rate"])
    assert isinstance(restored, WarmupCosineDecayRestarts)
    assert restored.get_config() == schedule.get_config()
    assert int(loaded.optimizer.iterations) == 2
    assert float(loaded.optimizer.learning_rate) == float(schedule(2))


# --- counting optimizer updates under Keras gradient accumulation --------------------------


def test_gradient_accumulation_steps_counts_updates():
    base = WarmupCosineDecayRestarts(0.0, 10, warmup_target=1.0, warmup_steps=3, m_mul=0.5)
    accumulated = WarmupCosineDecayRestarts(
        0.0, 10, warmup_target=1.0, warmup_steps=3, m_mul=0.5, gradient_accumulation_steps=4
    )
    micro_steps = np.arange(0, 200)
    np.testing.assert_array_equal(values(accumulated, micro_steps), values(base, micro_steps // 4))


# --- LearningRateLogger ---------------------------------------------------------------------


def test_learning_rate_logger_reports_schedule_value():
    schedule = WarmupCosineDecayRestarts(0.0, 5, warmup_target=0.1, warmup_steps=4)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=schedule), loss="mse")
    batch_rates = []
    recorder = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch_rates.append(logs["learning_rate"])
    )
    history = model.fit(
        np.ones((12, 2), "float32"),
        np.zeros((12, 1), "float32"),
        batch_size=2,
        epochs=2,
        verbose=0,
        callbacks=[LearningRateLogger(), recorder],
    )
    # After update u the optimizer's next rate is schedule(u).
    np.testing.assert_allclose(batch_rates, values(schedule, range(1, 13)), rtol=1e-7)
    assert all(isinstance(rate, float) for rate in history.history["learning_rate"])
    np.testing.assert_allclose(
        history.history["learning_rate"], values(schedule, [6, 12]), rtol=1e-7
    )
