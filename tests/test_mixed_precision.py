"""Tests for keras_fastloop.mixed_precision: hardware description, policy choice, float32 outputs under float16."""

import gc
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_fastloop import mixed_precision as mp
from keras_fastloop.mixed_precision import (
    Float32Output,
    GPUInfo,
    HardwareInfo,
    check_output_dtypes,
    detect_hardware,
    recommended_policy,
    set_recommended_policy,
)

# ---------------------------------------------------------------------------------------------
# Hardware description
# ---------------------------------------------------------------------------------------------

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_fp16

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_fp16
"""


def test_detect_hardware_parses_cpuinfo(tmp_path, monkeypatch):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: [])
    hw = detect_hardware(str(path))
    assert hw.cpu_flags == frozenset(
        {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    )
    assert hw.cpu_model == "Intel(R) Xeon(R) Platinum 8480+"
    assert hw.cpu_count >= 1
    assert hw.gpus == ()
    assert recommended_policy(hw) == "mixed_bfloat16"


def test_detect_hardware_missing_cpuinfo_is_conservative(tmp_path, monkeypatch):
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: [])
    hw = detect_hardware(str(tmp_path / "does_not_exist"))
    assert hw.cpu_flags == frozenset()
    assert recommended_policy(hw) == "float32"


def test_detect_hardware_reads_gpu_compute_capability(tmp_path, monkeypatch):
    fake = [
        tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU"),
        tf.config.PhysicalDevice("/physical_device:GPU:1", "GPU"),
    ]
    details = {
        fake[0].name: {"device_name": "NVIDIA A100", "compute_capability": (8, 0)},
        fake[1].name: {"device_name": "Tesla V100", "compute_capability": (7, 0)},
    }
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: list(fake))
    monkeypatch.setattr(tf.config.experimental, "get_device_details", lambda d: details[d.name])
    (tmp_path / "cpuinfo").write_text("")
    hw = detect_hardware(str(tmp_path / "cpuinfo"))
    assert hw.gpus == (GPUInfo("NVIDIA A100", (8, 0)), GPUInfo("Tesla V100", (7, 0)))
    # The weakest GPU decides: a V100 in the mix rules out bfloat16.
    assert hw.min_gpu_compute_capability == (7, 0)
    assert recommended_policy(hw) == "mixed_float16"


def test_detect_hardware_on_this_machine_is_consistent():
    hw = detect_hardware()
    assert isinstance(hw, HardwareInfo)
    assert hw.cpu_flags <= frozenset(mp._CPU_FLAGS_OF_INTEREST)
    assert recommended_policy(hw) in ("float32", "mixed_float16", "mixed_bfloat16")


# ---------------------------------------------------------------------------------------------
# Policy choice for made-up hardware
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hardware, expected",
    [
        (HardwareInfo(gpus=(GPUInfo("A100", (8, 0)),)), "mixed_bfloat16"),
        (HardwareInfo(gpus=(GPUInfo("H100", (9, 0)),)), "mixed_bfloat16"),
        (HardwareInfo(gpus=(GPUInfo("RTX 3090", (8, 6)),)), "mixed_bfloat16"),
        (HardwareInfo(gpus=(GPUInfo("V100", (7, 0)),)), "mixed_float16"),
        (HardwareInfo(gpus=(GPUInfo("T4", (7, 5)),)), "mixed_float16"),
        (HardwareInfo(gpus=(GPUInfo("P100", (6, 0)),)), "float32"),
        (HardwareInfo(gpus=(GPUInfo("unknown", None),)), "float32"),
        # A GPU decides even when the CPU could do bfloat16.
        (
            HardwareInfo(gpus=(GPUInfo("P100", (6, 0)),), cpu_flags=frozenset({"amx_bf16"})),
            "float32",
        ),
        (HardwareInfo(cpu_flags=frozenset({"avx512f", "avx512_bf16"})), "mixed_bfloat16"),
        (HardwareInfo(cpu_flags=frozenset({"amx_bf16", "amx_tile"})), "mixed_bfloat16"),
        (HardwareInfo(cpu_flags=frozenset({"amx_tile"})), "mixed_bfloat16"),
        (HardwareInfo(cpu_flags=frozenset({"avx2", "fma", "avx512f"})), "float32"),
        (HardwareInfo(), "float32"),
    ],
)
def test_recommended_policy(hardware, expected):
    assert recommended_policy(hardware) == expected


def test_set_recommended_policy_without_confirm_sets_global_policy():
    choice = set_recommended_policy(hardware=HardwareInfo(gpus=(GPUInfo("V100", (7, 0)),)))
    assert choice.policy == "mixed_float16"
    assert keras.config.dtype_policy().name == "mixed_float16"
    assert choice.seconds_per_step == {} and not choice.confirmed


# ---------------------------------------------------------------------------------------------
# Confirm by timing (fake timer; the real model runs but its real speed is never asserted)
# ---------------------------------------------------------------------------------------------


class ScriptedTimer:
    """Returns the scripted timestamps in order; fails loudly if called more often.

    `collector_on` records, per call, whether Python's garbage collector was enabled.
    """

    def __init__(self, values):
        self.values = list(values)
        self.calls = 0
        self.collector_on = []

    def __call__(self):
        self.collector_on.append(gc.isenabled())
        value = self.values[self.calls]
        self.calls += 1
        return value


def _tiny_model_fn(built_policies):
    def model_fn():
        built_policies.append(keras.config.dtype_policy().name)
        inputs = keras.Input((6,))
        h = keras.layers.Dense(8, activation="relu")(inputs)
        outputs = keras.layers.Dense(2, dtype="float32")(h)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer="sgd", loss="mse")
        return model

    return model_fn


BF16_CPU = HardwareInfo(cpu_flags=frozenset({"avx512_bf16"}))
DATA = (np.ones((8, 6), "float32"), np.zeros((8, 2), "float32"))


def test_confirm_keeps_mixed_when_faster():
    built = []
    # float32: 0 -> 10 s for 5 steps (2 s/step); mixed: 20 -> 25 s (1 s/step).
    timer = ScriptedTimer([0.0, 10.0, 20.0, 25.0])
    choice = set_recommended_policy(
        _tiny_model_fn(built),
        DATA,
        confirm=True,
        steps=5,
        rounds=1,
        hardware=BF16_CPU,
        timer=timer,
    )
    assert built == ["float32", "mixed_bfloat16"]
    assert timer.calls == 4
    assert timer.collector_on == [False] * 4 and gc.isenabled()  # no collection inside a timing
    assert choice.confirmed and choice.recommended == "mixed_bfloat16"
    assert choice.policy == "mixed_bfloat16"
    assert choice.seconds_per_step == {"float32": 2.0, "mixed_bfloat16": 1.0}
    assert choice.speedup == pytest.approx(2.0)
    assert keras.config.dtype_policy().name == "mixed_bfloat16"


def test_confirm_falls_back_to_float32_when_mixed_is_slower():
    built = []
    # float32 1 s/step, mixed 6.5 s/step (like float16 emulated on a CPU).
    timer = ScriptedTimer([0.0, 2.0, 10.0, 23.0])
    choice = set_recommended_policy(
        _tiny_model_fn(built),
        DATA,
        confirm=True,
        steps=2,
        rounds=1,
        hardware=BF16_CPU,
        timer=timer,
    )
    assert choice.policy == "float32"
    assert choice.recommended == "mixed_bfloat16"
    assert choice.seconds_per_step == {"float32": 1.0, "mixed_bfloat16": 6.5}
    assert keras.config.dtype_policy().name == "float32"


def test_confirm_equal_speed_falls_back_and_min_speedup_is_respected():
    timer = ScriptedTimer([0.0, 1.0, 0.0, 1.0])
    choice = set_recommended_policy(
        _tiny_model_fn([]),
        DATA,
        confirm=True,
        steps=1,
        rounds=1,
        hardware=BF16_CPU,
        timer=timer,
    )
    assert choice.policy == "float32"  # "not faster" -> float32
    timer = ScriptedTimer([0.0, 1.2, 0.0, 1.0])  # 1.2x faster, but 1.5x required
    choice = set_recommended_policy(
        _tiny_model_fn([]),
        tf.data.Dataset.from_tensor_slices(DATA).batch(4),
        confirm=True,
        steps=1,
        rounds=1,
        min_speedup=1.5,
        hardware=BF16_CPU,
        timer=timer,
    )
    assert choice.policy == "float32"


def test_confirm_alternates_rounds_and_takes_medians():
    """Three rounds, float32 first in rounds 0 and 2, mixed first in round 1; medians decide.

    Round 1 is disturbed (the machine slowed down while float32 ran): with one round per
    policy that round alone would pick the mixed policy; the medians keep float32.
    """
    built = []
    durations = [  # seconds per step (steps=1): (policy, seconds) in timing order
        ("float32", 1.0),
        ("mixed", 1.1),  # round 0
        ("mixed", 1.1),
        ("float32", 5.0),  # round 1: float32 hit by a slowdown
        ("float32", 1.0),
        ("mixed", 1.2),  # round 2
    ]
    ticks, now = [], 0.0
    for _, seconds in durations:
        ticks += [now, now + seconds]
        now += seconds
    timer = ScriptedTimer(ticks)
    choice = set_recommended_policy(
        _tiny_model_fn(built),
        DATA,
        confirm=True,
        steps=1,
        rounds=3,
        warmup_steps=1,
        hardware=BF16_CPU,
        timer=timer,
    )
    assert built == ["float32", "mixed_bfloat16"]  # both built (and warmed) before timing
    assert timer.calls == 12
    assert choice.seconds_per_step == pytest.approx({"float32": 1.0, "mixed_bfloat16": 1.1})
    assert choice.policy == "float32"
    with pytest.raises(ValueError, match="Received: rounds=0"):
        set_recommended_policy(_tiny_model_fn([]), DATA, confirm=True, rounds=0, hardware=BF16_CPU)


def test_confirm_skips_timing_when_recommendation_is_float32():
    timer = ScriptedTimer([])
    choice = set_recommended_policy(
        _tiny_model_fn([]), DATA, confirm=True, hardware=HardwareInfo(), timer=timer
    )
    assert choice.policy == "float32" and timer.calls == 0


def test_set_recommended_policy_argument_errors():
    with pytest.raises(ValueError, match="`model_fn` and `data` are required"):
        set_recommended_policy(confirm=True, hardware=BF16_CPU)
    with pytest.raises(ValueError, match="Received: steps=0"):
        set_recommended_policy(steps=0, hardware=BF16_CPU)
    with pytest.raises(ValueError, match="Received: min_speedup=0"):
        set_recommended_policy(min_speedup=0, hardware=BF16_CPU)

    def uncompiled():
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])

    with pytest.raises(ValueError, match="compiled"):
        set_recommended_policy(uncompiled, DATA, confirm=True, hardware=BF16_CPU)
    assert keras.config.dtype_policy().name == "float32"  # restored after the failure


# ---------------------------------------------------------------------------------------------
# float32 outputs under mixed_float16 (logits ~7e4 overflow float16)
# ---------------------------------------------------------------------------------------------


@keras.saving.register_keras_serializable(package="keras_fastloop_tests")
class AddMask(keras.layers.Layer):
    """logits + (1 - mask) * -1e9, computed in the layer's compute dtype (the usual recipe)."""

    def call(self, logits, mask):
        big = keras.ops.cast(-1e9, self.compute_dtype)
        return logits + (1.0 - keras.ops.cast(mask, self.compute_dtype)) * big


def _c7_model(out_dtype):
    """Logits of magnitude ~7e4 and a -1e9 mask, then softmax; the last layers use out_dtype."""
    x = keras.Input((2,), name="x")
    mask = keras.Input((3,), name="mask")
    kernel = np.array([[7e4, -7e4, 1.0], [1.0, 2.0, 3.0]], "float32")
    logits = keras.layers.Dense(
        3,
        name="logits",
        dtype=out_dtype,
        kernel_initializer=keras.initializers.Constant(kernel),
        bias_initializer="zeros",
    )(x)
    masked = AddMask(name="masked", dtype=out_dtype)(logits, mask)
    probs = keras.layers.Softmax(name="probs", dtype=out_dtype)(masked)
    return keras.Model({"x": x, "mask": mask}, probs)


C7_X = {
    "x": np.array([[1.0, 0.0], [0.5, 0.0], [0.0, 1.0]], "float32"),
    "mask": np.array([[1, 1, 0], [1, 1, 1], [0, 1, 1]], "float32"),
}
C7_Y = np.array([0, 0, 2])


def test_c7_float32_output_stays_finite_under_mixed_float16():
    keras.config.set_dtype_policy("mixed_float16")
    model = _c7_model("float32")
    assert model.get_layer("logits").compute_dtype == "float32"
    assert model.output.dtype == "float32"
    assert check_output_dtypes(model, warn=False) == []

    probs = keras.ops.convert_to_numpy(model(C7_X))
    assert probs.dtype == np.float32
    assert np.all(np.isfinite(probs))
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, atol=1e-3)
    assert probs[0, 2] == 0.0 and probs[2, 0] == 0.0  # masked positions get no mass
    loss = keras.losses.sparse_categorical_crossentropy(C7_Y, probs)
    assert np.all(np.isfinite(keras.ops.convert_to_numpy(loss)))

    # A real training step under mixed_float16 (LossScaleOptimizer) stays finite too.
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    logs = model.train_on_batch(C7_X, C7_Y, return_dict=True)
    assert np.isfinite(logs["loss"])


def test_c7_float16_output_overflows_and_is_flagged():
    keras.config.set_dtype_policy("mixed_float16")
    model = _c7_model(None)  # layers follow the global mixed_float16 policy
    assert model.output.dtype == "float16"
    probs = keras.ops.convert_to_numpy(model(C7_X)).astype("float32")
    assert not np.all(np.isfinite(probs))  # the overflow a float16 output suffers

    with pytest.warns(UserWarning, match=r"\['probs'\]"):
        assert check_output_dtypes(model) == ["probs"]


def test_c7_float32output_layer_fixes_casting_but_not_earlier_overflow():
    keras.config.set_dtype_policy("mixed_float16")
    x = keras.Input((2,))
    logits = keras.layers.Dense(3, name="logits")(x)
    out = Float32Output(name="cast")(logits)
    model = keras.Model(x, out)
    assert out.dtype == "float32"
    assert check_output_dtypes(model, warn=False) == []
    # Moderate logits are fine; the cast is exact for float16 values.
    y = keras.ops.convert_to_numpy(model(np.ones((2, 2), "float32")))
    assert y.dtype == np.float32 and np.all(np.isfinite(y))


def test_float32output_serialization_round_trip(tmp_path):
    keras.config.set_dtype_policy("mixed_bfloat16")
    x = keras.Input((2,))
    model = keras.Model(x, Float32Output(name="cast")(keras.layers.Dense(3)(x)))
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.get_layer("cast").dtype_policy.name == "float32"
    assert loaded.output.dtype == "float32"
    data = np.ones((2, 2), "float32")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(model(data)), keras.ops.convert_to_numpy(loaded(data))
    )


def test_check_output_dtypes_names_dict_and_list_outputs():
    keras.config.set_dtype_policy("mixed_bfloat16")
    x = keras.Input((4,))
    cls = keras.layers.Dense(3, name="cls_head")(x)
    seg = keras.layers.Dense(2, name="seg_head", dtype="float32")(x)
    dict_model = keras.Model(x, {"cls": cls, "seg": seg})
    list_model = keras.Model(x, [cls, seg])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warn=False must not warn
        assert check_output_dtypes(dict_model, warn=False) == ["cls"]
    assert check_output_dtypes(list_model, warn=False) == ["cls_head"]
    # Not a mixed policy: nothing to flag.
    assert check_output_dtypes(dict_model, policy="float32", warn=False) == []
    assert check_output_dtypes(dict_model, policy=keras.DTypePolicy("float32")) == []
    # Explicit outputs (e.g. y_pred of a subclassed model at trace time).
    y_pred = {"a": tf.zeros((1,), "float16"), "b": tf.zeros((1,), "float32")}
    assert check_output_dtypes(dict_model, outputs=y_pred, warn=False) == ["a"]
    with pytest.raises(ValueError, match="Received: policy=3"):
        check_output_dtypes(dict_model, policy=3)


def test_check_output_dtypes_subclassed_model_without_outputs_is_empty():
    keras.config.set_dtype_policy("mixed_float16")

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    assert check_output_dtypes(Sub(), warn=False) == []
