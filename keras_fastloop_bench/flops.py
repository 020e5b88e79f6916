# Over 500 lines on purpose: the counting convention (this docstring) and the per-layer rules that
# follow it must be read together, as must the CPU peak table and the flags it reads.
"""Model FLOPs per sample and the machine's peak FLOP/s, so every bench figure has a ceiling.


**Counting convention.** One multiply-accumulate (MAC) is 2 FLOPs. Per sample, forward pass:

- `Dense`: `2 * d_in * units` per position (all non-batch, non-feature axes), plus
  `units` per position for the bias.
- `Conv1D/2D/3D`: `2 * prod(kernel_size) * c_in / groups * filters` per output position,
  plus `filters` per position for the bias. `DepthwiseConv2D`: `2 * prod(kernel_size) *
  c_in * depth_multiplier` per position (+ bias); `SeparableConv2D`: depthwise + pointwise
  (`2 * c_in * depth_multiplier * filters`) (+ bias). `Conv*Transpose`: `2 *
  prod(kernel_size) * c_in * filters` per *input* position (+ bias per output element).
- A fused activation (`activation=` other than linear): 1 per output element; a standalone
  `Activation`/`ReLU`/`LeakyReLU`/`ELU`: 1 per element; `Softmax` (layer or fused):
  3 per element (exp, sum, divide).
- `MaxPooling`/`AveragePooling`: `prod(pool_size)` per output element;
  `GlobalMax/AveragePooling`: 1 per input element.
- `BatchNormalization`/`LayerNormalization`: 2 per element (scale and shift once the
  statistics are folded; the statistics themselves are ignored).
- `Add`/`Subtract`/`Multiply`/`Average`/`Maximum`/`Minimum`: `n_inputs - 1` per
  output element. `Rescaling`: 2 per element.
- Shape-only layers (`Input`, `Flatten`, `Reshape`, `Dropout`, `ZeroPadding`,
  `Concatenate`, ...): 0. Other layers are listed in `FlopCount.unknown` and count 0.

**Training ≈ 3 × forward**: the backward pass costs about twice the forward (the gradient with
respect to the activations and with respect to the weights are each one product of the forward's
size); Kaplan et al., "Scaling Laws for Neural Language Models" (2020), C ≈ 6N per token = 2N
forward + 4N backward. Optimizer updates (O(parameters)) are not counted.

`profiler_flops` counts the same forward pass with TensorFlow's profiler
(`tf.compat.v1.profiler` with `ProfileOptionBuilder.float_operation()` on the graph of a
concrete function); it counts only ops with registered FLOP statistics (MatMul, Conv2D, BiasAdd,
element-wise math, ...), so it serves as a cross-check.

**Peak FLOP/s.** CPU: `cores × frequency × FLOPs/cycle/core`; fp32 FLOPs per cycle from the
vector width with two FMA units (AVX-512: 2 units × 16 lanes × 2 = 64; AVX2+FMA: 2 × 8 × 2 = 32;
AVX without FMA: 16; SSE: 8). The bf16 peak is given separately: AMX (`amx_bf16`): 1,024
bf16 FLOP/cycle/core (Intel's figure for Sapphire Rapids TMUL); AVX512_BF16 (`vdpbf16ps`,
2 units): 128. `cores` is the CPUs this process may run on (`os.sched_getaffinity`; these are
logical CPUs: with hyper-threading two share one core's FMA units, so the peak is an upper
bound); the frequency is `cpuinfo_max_freq` from `/sys` when present, else `cpu MHz` from
`/proc/cpuinfo` (the current, possibly throttled or turbo clock). GPU: datasheet values by
device name (`GPU_PEAK_TFLOPS`, dense, no sparsity).
"""

from __future__ import annotations

import dataclasses
import math
import os

from keras_fastloop import _machine

__all__ = [
    "FlopCount",
    "CPUDescription",
    "Peak",
    "GPU_PEAK_TFLOPS",
    "TRAINING_FLOPS_FACTOR",
    "count_flops",
    "profiler_flops",
    "training_flops_per_sample",
    "flops_per_cycle",
    "read_cpu_description",
    "cpu_peak",
    "gpu_peak",
    "machine_peak",
    "efficiency_note",
]

TRAINING_FLOPS_FACTOR = 3.0

# name fragment -> (fp32 TFLOP/s, 16-bit tensor-core TFLOP/s dense), vendor datasheets.
GPU_PEAK_TFLOPS = {
    "H200": (66.9, 989.4),
    "H100 PCIE": (51.2, 756.0),
    "H100": (66.9, 989.4),  # SXM
    "A100": (19.5, 312.0),
    "A10G": (31.2, 70.0),
    "A10": (31.2, 125.0),
    "L40S": (91.6, 362.1),
    "L4": (30.3, 121.0),
    "V100": (15.7, 125.0),  # SXM2
    "T4": (8.1, 65.0),
    "RTX 4090": (82.6, 165.2),
    "RTX 3090": (35.6, 71.0),
    "P100": (9.3, 18.7),
}

_ZERO_FLOP_LAYERS = {
    "InputLayer",
    "Flatten",
    "Reshape",
    "Dropout",
    "SpatialDropout1D",
    "SpatialDropout2D",
    "SpatialDropout3D",
    "GaussianNoise",
    "GaussianDropout",
    "AlphaDropout",
    "ZeroPadding1D",
    "ZeroPadding2D",
    "ZeroPadding3D",
    "Cropping1D",
    "Cropping2D",
    "Cropping3D",
    "Concatenate",
    "Permute",
    "RepeatVector",
    "Identity",
    "Masking",
    "UpSampling1D",
    "UpSampling2D",
    "UpSampling3D",
    "Float32Output",
    "ActivityRegularization",
}
_ELEMENTWISE_ACTIVATIONS = {"Activation", "ReLU", "LeakyReLU", "ELU", "PReLU"}
_MERGE_LAYERS = {"Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum"}


@dataclasses.dataclass
class FlopCount:
    """Forward FLOPs per sample of a model, by layer.

    Args:
        forward: float, forward FLOPs per sample.
        by_layer: dict layer name -> forward FLOPs per sample.
        unknown: list of class names of layers counted as 0 because no rule knows them.
    """

    forward: float = 0.0
    by_layer: dict = dataclasses.field(default_factory=dict)
    unknown: list = dataclasses.field(default_factory=list)

    @property
    def training(self) -> float:
        """Training FLOPs per sample: `TRAINING_FLOPS_FACTOR` (3) × forward."""
        return TRAINING_FLOPS_FACTOR * self.forward


def _prod(values):
    return math.prod(int(v) for v in values)


def _per_sample(shape):
    """Elements per sample of a shape whose first axis is the batch."""
    return _prod(shape[1:])


def _activation_flops(layer, out_elements):
    activation = getattr(layer, "activation", None)
    name = getattr(activation, "__name__", str(activation)) if activation is not None else "linear"
    if name in ("linear", "None"):
        return 0
    return (3 if name == "softmax" else 1) * out_elements


def _layer_flops(layer, in_shapes, out_shape):
    """Forward FLOPs per sample of one call of `layer`; `None` for an unknown layer."""
    kind = type(layer).__name__
    out_elements = _per_sample(out_shape)
    in_shape = in_shapes[0]
    bias = getattr(layer, "use_bias", False)
    if kind in _ZERO_FLOP_LAYERS:
        return 0
    if kind == "Dense":
        d_in = int(in_shape[-1])
        positions = out_elements // int(layer.units)
        flops = 2 * d_in * layer.units * positions + (layer.units * positions if bias else 0)
        return flops + _activation_flops(layer, out_elements)
    if kind in ("Conv1D", "Conv2D", "Conv3D"):
        channels_last = getattr(layer, "data_format", "channels_last") == "channels_last"
        c_in = int(in_shape[-1] if channels_last else in_shape[1])
        groups = int(getattr(layer, "groups", 1) or 1)
        positions = out_elements // int(layer.filters)
        per_position = 2 * _prod(layer.kernel_size) * (c_in // groups) * layer.filters
        flops = per_position * positions + (out_elements if bias else 0)
        return flops + _activation_flops(layer, out_elements)
    if kind in ("Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose"):
        channels_last = getattr(layer, "data_format", "channels_last") == "channels_last"
        c_in = int(in_shape[-1] if channels_last else in_shape[1])
        in_positions = _per_sample(in_shape) // c_in
        flops = 2 * _prod(layer.kernel_size) * c_in * layer.filters * in_positions
        return flops + (out_elements if bias else 0) + _activation_flops(layer, out_elements)
    if kind in ("DepthwiseConv1D", "DepthwiseConv2D"):
        flops = 2 * _prod(layer.kernel_size) * out_elements
        return flops + (out_elements if bias else 0) + _activation_flops(layer, out_elements)
    if kind in ("SeparableConv1D", "SeparableConv2D"):
        channels_last = getattr(layer, "data_format", "channels_last") == "channels_last"
        c_in = int(in_shape[-1] if channels_last else in_shape[1])
        positions = out_elements // int(layer.filters)
        mid = c_in * layer.depth_multiplier
        flops = 2 * _prod(layer.kernel_size) * mid * positions + 2 * mid * layer.filters * positions
        return flops + (out_elements if bias else 0) + _activation_flops(layer, out_elements)
    if kind in (
        "MaxPooling1D",
        "MaxPooling2D",
        "MaxPooling3D",
        "AveragePooling1D",
        "AveragePooling2D",
        "AveragePooling3D",
    ):
        return _prod(layer.pool_size) * out_elements
    if kind.startswith("Global") and "Pooling" in kind:
        return _per_sample(in_shape)
    if kind in (
        "BatchNormalization",
        "LayerNormalization",
        "GroupNormalization",
        "UnitNormalization",
    ):
        return 2 * out_elements
    if kind == "Softmax":
        return 3 * out_elements
    if kind in _ELEMENTWISE_ACTIVATIONS:
        return _activation_flops(layer, out_elements) if kind == "Activation" else out_elements
    if kind in _MERGE_LAYERS:
        return (len(in_shapes) - 1) * out_elements
    if kind == "Rescaling":
        return 2 * out_elements
    return None


def _functional(model):
    inner = getattr(model, "_functional", None)  # Sequential keeps a Functional inside
    if inner is not None:
        return inner
    if hasattr(model, "_nodes_by_depth"):
        return model
    return None


def count_flops(model, prefix="") -> FlopCount:
    """Forward FLOPs per sample of a functional or Sequential Keras model, counted analytically.

    Nested functional models are counted layer by layer. Shapes come from the model's graph,
    so the model must be built with known input shapes (batch axis excluded).

    Args:
        model: a built functional or `Sequential` `keras.Model`.
        prefix: string prepended to layer names in `by_layer` (used for nested models).
            Defaults to `""`.

    Returns:
        A `FlopCount`.

    Raises:
        ValueError: if the model has no graph (subclassed models: use `profiler_flops`).

    Example:
        >>> import keras
        >>> m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        >>> count_flops(m).forward   # 2*4*3 + 3 (bias)
        27.0
    """
    graph = _functional(model)
    if graph is None:
        raise ValueError(
            "`count_flops` needs a functional or Sequential model with a graph; for a "
            "subclassed model use `profiler_flops(model, input_shape)`. "
            f"Received: model of type {type(model).__name__}"
        )
    result = FlopCount()
    for depth in sorted(graph._nodes_by_depth, reverse=True):
        for node in graph._nodes_by_depth[depth]:
            layer = node.operation
            name = prefix + layer.name
            in_shapes = [tuple(t.shape) for t in node.input_tensors]
            out_tensors = node.output_tensors
            if not out_tensors:
                continue
            if _functional(layer) is not None:
                inner = count_flops(layer, prefix=name + "/")
                result.forward += inner.forward
                result.by_layer.update(inner.by_layer)
                result.unknown.extend(inner.unknown)
                continue
            if not in_shapes:
                continue
            flops = _layer_flops(layer, in_shapes, tuple(out_tensors[0].shape))
            if flops is None:
                result.unknown.append(type(layer).__name__)
                flops = 0
            result.by_layer[name] = result.by_layer.get(name, 0.0) + float(flops)
            result.forward += float(flops)
    return result


def profiler_flops(model, input_shape) -> float:
    """Forward FLOPs per sample counted by TensorFlow's profiler on the forward graph.

    Traces `model(x, training=False)` for one sample of shape `input_shape` into a concrete
    function and runs `tf.compat.v1.profiler.profile` with
    `ProfileOptionBuilder.float_operation()` on its graph.

    Args:
        model: a `keras.Model` (any kind).
        input_shape: tuple of ints, one sample's shape (no batch axis).

    Returns:
        Float, FLOPs per sample (only ops with registered FLOP statistics are counted).

    Example:
        >>> import keras
        >>> m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        >>> profiler_flops(m, (4,)) >= 24
        True
    """
    import tensorflow as tf

    spec = tf.TensorSpec((1, *input_shape), tf.float32)
    concrete = tf.function(lambda x: model(x, training=False)).get_concrete_function(spec)
    options = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
    options["output"] = "none"
    info = tf.compat.v1.profiler.profile(
        graph=concrete.graph, run_meta=tf.compat.v1.RunMetadata(), cmd="op", options=options
    )
    return float(info.total_float_ops)


def training_flops_per_sample(model, input_shape=None) -> float:
    """Training FLOPs per sample (3 × forward), analytic when possible, else the profiler's.

    Args:
        model: a `keras.Model`.
        input_shape: one sample's shape, needed only for models without a graph. Defaults to
            `None`.

    Returns:
        Float, FLOPs per training sample.

    Raises:
        ValueError: a model without a graph and no `input_shape`.
    """
    if _functional(model) is not None:
        return count_flops(model).training
    if input_shape is None:
        raise ValueError(
            "A model without a graph needs `input_shape` for the profiler. Received: "
            "input_shape=None"
        )
    return TRAINING_FLOPS_FACTOR * profiler_flops(model, input_shape)


# --------------------------------------------------------------------------------------------
# Peak FLOP/s
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CPUDescription:
    """What the CPU peak needs: cores, clock and feature flags.

    Args:
        cores: int, CPUs this process may use.
        mhz: float, clock in MHz.
        flags: frozenset of strings, `/proc/cpuinfo` flags.
        model: string, the model name. Defaults to `""`.
        mhz_source: string, where the clock came from. Defaults to `""`.
    """

    cores: int
    mhz: float
    flags: frozenset
    model: str = ""
    mhz_source: str = ""


@dataclasses.dataclass(frozen=True)
class Peak:
    """A device's peak FLOP/s.

    Args:
        device: string, what was measured ("CPU: ..." or the GPU name).
        fp32: float, peak fp32 FLOP/s.
        low_precision: float or None, peak bf16/fp16 FLOP/s (AMX, AVX512_BF16, tensor cores).
        formula: string, how the figures were obtained.
    """

    device: str
    fp32: float
    low_precision: float | None
    formula: str

    def for_policy(self, policy: str) -> float:
        """The peak that applies to a dtype policy (mixed policies: the low-precision one)."""
        if policy.startswith("mixed") and self.low_precision:
            return self.low_precision
        return self.fp32


def flops_per_cycle(flags) -> tuple[int, int | None, str]:
    """Per-core fp32 and bf16 FLOPs per cycle from CPU flags (two FMA units assumed).

    Args:
        flags: iterable of `/proc/cpuinfo` flag strings.

    Returns:
        `(fp32_per_cycle, bf16_per_cycle or None, description)`.

    Example:
        >>> flops_per_cycle({"avx512f", "fma", "avx2"})[0]
        64
    """
    flags = set(flags)
    if "avx512f" in flags:
        fp32, what = 2 * 16 * 2, "AVX-512, 2 FMA units: 2x16x2"
    elif "avx2" in flags and "fma" in flags:
        fp32, what = 2 * 8 * 2, "AVX2 FMA, 2 units: 2x8x2"
    elif "avx" in flags:
        fp32, what = 16, "AVX without FMA: 8 mul + 8 add"
    else:
        fp32, what = 8, "SSE: 4 mul + 4 add"
    if "amx_bf16" in flags:
        bf16, what = 1024, what + "; bf16 AMX TMUL: 1024"
    elif "avx512_bf16" in flags:
        bf16, what = 128, what + "; bf16 AVX512_BF16: 2x32x2"
    else:
        bf16 = None
    return fp32, bf16, what


def read_cpu_description(
    cpuinfo_path="/proc/cpuinfo",
    sys_freq_path="/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq",
):
    """Reads this machine's CPU description.

    Args:
        cpuinfo_path: string. Defaults to `"/proc/cpuinfo"`.
        sys_freq_path: string, the kHz maximum clock. Defaults to cpu0's `cpuinfo_max_freq`.

    Returns:
        A `CPUDescription` (clock 0 when nothing can be read).
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    cpu = _machine.read_cpuinfo(cpuinfo_path)
    flags, model, mhz, source = cpu.flags, cpu.model, 0.0, ""
    if cpu.mhz is not None:
        mhz, source = cpu.mhz, "/proc/cpuinfo cpu MHz"
    try:
        with open(sys_freq_path) as f:
            mhz, source = int(f.read().strip()) / 1000.0, "cpuinfo_max_freq"
    except (OSError, ValueError):
        pass
    return CPUDescription(cores=cores, mhz=mhz, flags=flags, model=model, mhz_source=source)


def cpu_peak(description: CPUDescription) -> Peak:
    """Peak FLOP/s of a CPU: cores × clock × FLOPs/cycle/core.

    Args:
        description: a `CPUDescription`.

    Returns:
        A `Peak`.

    Example:
        >>> d = CPUDescription(cores=2, mhz=2600.0, flags=frozenset({"avx512f"}))
        >>> cpu_peak(d).fp32 / 1e9     # 2 x 2.6 GHz x 64
        332.8
    """
    fp32_cycle, bf16_cycle, what = flops_per_cycle(description.flags)
    hz = description.mhz * 1e6
    fp32 = description.cores * hz * fp32_cycle
    bf16 = description.cores * hz * bf16_cycle if bf16_cycle else None
    formula = (
        f"{description.cores} cores x {description.mhz / 1000:.2f} GHz "
        f"({description.mhz_source or 'given'}) x {fp32_cycle} fp32 FLOP/cycle ({what})"
    )
    return Peak(f"CPU: {description.model or 'unknown'}", fp32, bf16, formula)


def gpu_peak(name: str) -> Peak | None:
    """Datasheet peak of a GPU by name (longest matching table key), or `None` if unknown.

    Example:
        >>> gpu_peak("NVIDIA H200").fp32 / 1e12
        66.9
    """
    upper = name.upper()
    for key in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):
        if key in upper:
            fp32, low = GPU_PEAK_TFLOPS[key]
            return Peak(name, fp32 * 1e12, low * 1e12, f"datasheet ({key}): {fp32} / {low} TFLOP/s")
    return None


def machine_peak() -> Peak:
    """The peak of the device training runs on: the first GPU if any (and known), else the CPU.

    Returns:
        A `Peak`.
    """
    import tensorflow as tf

    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu) or {}
        peak = gpu_peak(str(details.get("device_name", gpu.name)))
        if peak is not None:
            return peak
    return cpu_peak(read_cpu_description())


def efficiency_note(achieved_flops: float, peak: Peak, policy: str = "float32") -> str:
    """`"12.3 GFLOP/s = 3.7% of peak"` for a figure against the policy's peak.

    Args:
        achieved_flops: float, FLOP/s achieved.
        peak: a `Peak`.
        policy: dtype policy name the figure was measured under. Defaults to `"float32"`.

    Returns:
        A short string.

    Example:
        >>> efficiency_note(1e9, Peak("x", 1e10, None, ""))
        '1.00 GFLOP/s = 10.0% of fp32 peak'
    """
    ceiling = peak.for_policy(policy)
    kind = "bf16/fp16" if ceiling is not peak.fp32 and ceiling != peak.fp32 else "fp32"
    return (
        f"{achieved_flops / 1e9:.2f} GFLOP/s = {100 * achieved_flops / ceiling:.1f}% of {kind} peak"
    )
