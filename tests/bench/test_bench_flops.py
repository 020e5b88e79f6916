"""FLOP counting against hand-computed numbers, and the peak FLOP/s formula on mocked hardware."""

import keras
import pytest

from keras_fastloop_bench import flops

pytestmark = pytest.mark.slow  # integration: the slow job


def test_dense_model_hand_computed():
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)]
    )
    count = flops.count_flops(model)
    # Dense(4): 2*5*4 MAC-FLOPs + 4 bias + 4 relu = 48; Dense(2): 2*4*2 + 2 bias = 18
    assert count.forward == 48 + 18
    assert count.training == 3 * 66
    assert count.unknown == []


def test_conv_model_hand_computed():
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(3, 3, name="conv")(inputs)  # valid: 4x4x3
    h = keras.layers.MaxPooling2D(2, name="pool")(h)  # 2x2x3
    h = keras.layers.Flatten()(h)
    outputs = keras.layers.Dense(5, activation="softmax", name="head")(h)
    count = flops.count_flops(keras.Model(inputs, outputs))
    assert count.by_layer["conv"] == 2 * 3 * 3 * 2 * 3 * 16 + 48  # MACs x 2 + bias
    assert count.by_layer["pool"] == 4 * 12  # 2x2 window per output element
    assert count.by_layer["head"] == 2 * 12 * 5 + 5 + 3 * 5  # matmul + bias + softmax
    assert count.forward == 1776 + 48 + 140


def test_residual_add_batchnorm_and_nested_model():
    inner_in = keras.Input((4,))
    inner = keras.Model(inner_in, keras.layers.Dense(4, use_bias=False, name="d")(inner_in))
    inputs = keras.Input((4,))
    h = keras.layers.BatchNormalization(name="bn")(inputs)
    out = keras.layers.Add(name="add")([inner(h), h])
    count = flops.count_flops(keras.Model(inputs, out))
    assert count.by_layer["bn"] == 2 * 4
    assert count.by_layer["add"] == 4
    assert count.forward == 8 + 2 * 4 * 4 + 4


def test_unknown_layers_are_reported():
    inputs = keras.Input((3, 4))
    out = keras.layers.LSTM(2)(inputs)
    count = flops.count_flops(keras.Model(inputs, out))
    assert "LSTM" in count.unknown


def test_profiler_agrees_on_a_matmul():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, use_bias=False)])
    assert flops.count_flops(model).forward == 40
    assert flops.profiler_flops(model, (5,)) == pytest.approx(40)


def test_subclassed_model_needs_profiler():
    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    with pytest.raises(ValueError, match="Received"):
        flops.count_flops(Sub())
    with pytest.raises(ValueError, match="input_shape"):
        flops.training_flops_per_sample(Sub())


@pytest.mark.parametrize(
    "flags, fp32, bf16",
    [
        ({"avx512f", "avx2", "fma"}, 64, None),
        ({"avx512f", "avx512_bf16"}, 64, 128),
        ({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, 64, 1024),
        ({"avx2", "fma"}, 32, None),
        ({"avx"}, 16, None),
        (set(), 8, None),
    ],
)
def test_flops_per_cycle(flags, fp32, bf16):
    got_fp32, got_bf16, _ = flops.flops_per_cycle(flags)
    assert (got_fp32, got_bf16) == (fp32, bf16)


def test_cpu_peak_formula():
    description = flops.CPUDescription(
        cores=4, mhz=3000.0, flags=frozenset({"avx2", "fma", "avx512f", "amx_bf16"})
    )
    peak = flops.cpu_peak(description)
    assert peak.fp32 == 4 * 3.0e9 * 64
    assert peak.low_precision == 4 * 3.0e9 * 1024
    assert peak.for_policy("float32") == peak.fp32
    assert peak.for_policy("mixed_bfloat16") == peak.low_precision


def test_read_cpu_description_from_files(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Test CPU\ncpu MHz\t\t: 2600.000\nflags\t\t: fpu avx2 fma\n"
    )
    described = flops.read_cpu_description(str(cpuinfo), str(tmp_path / "missing"))
    assert described.model == "Test CPU"
    assert described.mhz == 2600.0
    assert {"avx2", "fma"} <= described.flags
    freq = tmp_path / "max_freq"
    freq.write_text("3500000\n")
    assert flops.read_cpu_description(str(cpuinfo), str(freq)).mhz == 3500.0


def test_gpu_peak_table():
    assert flops.gpu_peak("NVIDIA H200").fp32 == pytest.approx(66.9e12)
    assert flops.gpu_peak("NVIDIA H100 PCIe").fp32 == pytest.approx(51.2e12)
    assert flops.gpu_peak("Tesla V100-SXM2-16GB").low_precision == pytest.approx(125e12)
    assert flops.gpu_peak("NVIDIA L40S").fp32 == pytest.approx(91.6e12)
    assert flops.gpu_peak("Some Future GPU") is None


def test_efficiency_note():
    peak = flops.Peak("x", 1e10, 1e11, "")
    assert flops.efficiency_note(1e9, peak) == "1.00 GFLOP/s = 10.0% of fp32 peak"
    assert flops.efficiency_note(1e9, peak, "mixed_bfloat16").endswith("1.0% of bf16/fp16 peak")


def test_one_cpuinfo_parser_for_policy_flops_and_reports(tmp_path):
    from keras_fastloop import _machine, mixed_precision

    path = tmp_path / "cpuinfo"
    path.write_text(
        "processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: Test CPU\n"
        "cpu MHz\t\t: 2600.000\nflags\t\t: fpu avx2 fma avx512_bf16\n"
        "processor\t: 1\ncpu family\t: 6\nmodel\t\t: 143\nflags\t\t: fpu\n"
    )
    cpu = _machine.read_cpuinfo(str(path))
    assert cpu == _machine.CPUInfo(
        flags=frozenset({"fpu", "avx2", "fma", "avx512_bf16"}),
        model="Test CPU",
        mhz=2600.0,
        family=25,
        model_number=17,
    )
    assert flops.read_cpu_description(str(path), str(tmp_path / "no")).flags == cpu.flags
    hw = mixed_precision.detect_hardware(str(path))
    assert (
        hw.cpu_model == "Test CPU" and "avx512_bf16" in hw.cpu_flags and "fpu" not in hw.cpu_flags
    )
    arm = _machine.parse_cpuinfo("Features\t: fp asimd\n")
    assert arm == _machine.CPUInfo(flags=frozenset({"fp", "asimd"}))
    assert _machine.read_cpuinfo(str(tmp_path / "missing")) == _machine.CPUInfo()


def test_cpu_identity_names_family_model_and_bf16_units():
    """Report headers tell two CPUs that share a model name apart (the AMD EPYC VMs of this
    project were Zen 4, family 25, and Zen 5, family 26, both "AMD EPYC")."""
    from keras_fastloop import _machine

    zen4 = _machine.parse_cpuinfo(
        "cpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\nflags\t: avx512f avx512_bf16\n"
    )
    assert zen4.identity() == "AMD EPYC (family 25, model 17; bf16: AVX512_BF16)"
    xeon = _machine.parse_cpuinfo(
        "cpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
        "flags\t: avx512_bf16 amx_bf16 amx_tile\n"
    )
    assert xeon.identity() == (
        "Intel(R) Xeon(R) Platinum 8480+ (family 6, model 143; bf16: AMX-BF16, AVX512_BF16)"
    )
    assert _machine.parse_cpuinfo("model name\t: X\nflags\t: avx2\n").identity() == "X"
    assert _machine.parse_cpuinfo("model\t: junk\n").identity() == ""
