# Over 500 lines on purpose: it is one public module (`keras_fastloop.mixed_precision`) whose three
# pieces share `HardwareInfo` and the policy names; each piece is short, and splitting it would
# make users import from three places.
"""Hardware-aware choice of the Keras dtype policy, and float32-output checks.


Three pieces:

- `detect_hardware()` reads the machine into a `HardwareInfo` description (GPUs with their CUDA
  compute capability, CPU flags from `/proc/cpuinfo`, core count, model name).
- `recommended_policy(hardware)` is a pure function of that description, so it can be tested with
  made-up hardware; `set_recommended_policy(...)` applies it and can confirm it by timing a few
  steps of the user's model against float32 (measure, don't assume).
- `check_output_dtypes(model, policy)` lists the model outputs that would reach a loss in a
  16-bit dtype under a mixed policy, and warns naming them; `Float32Output` is the layer that fixes
  them (case C7: float16 overflows at 65504, so logits of ~7e4 or a `-1e9` mask constant become
  `inf` and the softmax / loss becomes NaN).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf

from keras_fastloop import _machine, _timing, _validation
from keras_fastloop._warnings import FastloopWarning

__all__ = [
    "GPUInfo",
    "HardwareInfo",
    "PolicyChoice",
    "Float32Output",
    "detect_hardware",
    "recommended_policy",
    "set_recommended_policy",
    "check_output_dtypes",
]

_CPU_FLAGS_OF_INTEREST = (
    "avx512_bf16",
    "amx_bf16",
    "amx_tile",
    "avx512f",
    "avx2",
    "fma",
)
_MIXED_POLICIES = ("mixed_float16", "mixed_bfloat16")


# --------------------------------------------------------------------------------------------
# Hardware description
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GPUInfo:
    """One physical GPU as TensorFlow sees it.

    Args:
        name: string, the device name reported by TensorFlow (e.g. `"NVIDIA A100-SXM4-40GB"`),
            or the physical device name when no details are available. Defaults to `""`.
        compute_capability: tuple `(major, minor)` of ints, the CUDA compute capability, or
            `None` when TensorFlow does not report one (e.g. ROCm or plugin devices). Defaults
            to `None`.

    Example:

    >>> GPUInfo("A100", (8, 0)).compute_capability
    (8, 0)
    """

    name: str = ""
    compute_capability: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class HardwareInfo:
    """What the policy choice needs to know about the machine.

    Build one by hand to describe other hardware (tests, planning), or read the current machine
    with `detect_hardware()`.

    Args:
        gpus: tuple of `GPUInfo`, the visible GPUs. Defaults to `()` (no GPU).
        cpu_flags: frozenset of strings, the CPU feature flags as spelled in `/proc/cpuinfo`
            (only the ones that matter here are kept by `detect_hardware`: `avx512_bf16`,
            `amx_bf16`, `amx_tile`, `avx512f`, `avx2`, `fma`). Defaults to the empty set.
        cpu_count: int, number of logical CPU cores. Defaults to `1`.
        cpu_model: string, the CPU model name. Defaults to `""`.

    Example:

    >>> hw = HardwareInfo(cpu_flags=frozenset({"avx512_bf16"}))
    >>> hw.cpu_has_bf16
    True
    """

    gpus: tuple[GPUInfo, ...] = ()
    cpu_flags: frozenset[str] = frozenset()
    cpu_count: int = 1
    cpu_model: str = ""

    @property
    def cpu_has_bf16(self) -> bool:
        """Whether the CPU has native bfloat16 matrix math (AVX512_BF16 or AMX)."""
        return bool({"avx512_bf16", "amx_bf16", "amx_tile"} & set(self.cpu_flags))

    @property
    def min_gpu_compute_capability(self) -> tuple[int, int] | None:
        """The lowest compute capability over all GPUs; `None` without GPUs or if one is unknown.

        The weakest GPU decides, since data-parallel training runs the same policy on all of them.
        """
        if not self.gpus:
            return None
        capabilities = [gpu.compute_capability for gpu in self.gpus]
        if any(cc is None for cc in capabilities):
            return None
        return min(capabilities)


def _as_compute_capability(value) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, str):  # some builds report "8.0"
        major, _, minor = value.partition(".")
        value = (major, minor or 0)
    try:
        major, minor = value
        return int(major), int(minor)
    except (TypeError, ValueError):
        return None


def detect_hardware(cpuinfo_path: str = "/proc/cpuinfo") -> HardwareInfo:
    """Reads the GPUs and CPU features of this machine.

    GPUs come from `tf.config.list_physical_devices("GPU")` and
    `tf.config.experimental.get_device_details` (key `compute_capability`). CPU flags and model
    name come from `cpuinfo_path`; when the file cannot be read (macOS, Windows) the flags are
    empty, which makes `recommended_policy` conservative on the CPU side.

    Args:
        cpuinfo_path: string, path of the cpuinfo file. Defaults to `"/proc/cpuinfo"`.

    Returns:
        A `HardwareInfo`.

    Example:

    >>> hw = detect_hardware()
    >>> recommended_policy(hw) in ("float32", "mixed_float16", "mixed_bfloat16")
    True
    """
    gpus = []
    for device in tf.config.list_physical_devices("GPU"):
        try:
            details = tf.config.experimental.get_device_details(device) or {}
        except Exception:  # noqa: BLE001 - details are optional, never fatal
            details = {}
        gpus.append(
            GPUInfo(
                name=str(details.get("device_name", device.name)),
                compute_capability=_as_compute_capability(details.get("compute_capability")),
            )
        )
    cpu = _machine.read_cpuinfo(cpuinfo_path)
    return HardwareInfo(
        gpus=tuple(gpus),
        cpu_flags=cpu.flags & frozenset(_CPU_FLAGS_OF_INTEREST),
        cpu_count=os.cpu_count() or 1,
        cpu_model=cpu.model,
    )


# --------------------------------------------------------------------------------------------
# Policy choice
# --------------------------------------------------------------------------------------------


def recommended_policy(hardware: HardwareInfo | None = None) -> str:
    """The Keras dtype policy name that should be fastest on the given hardware.

    Rules, GPUs first (training runs there when there is one; the weakest GPU decides):

    - GPUs with compute capability >= 8.0 (Ampere and later): `"mixed_bfloat16"` (float32 range,
      no loss scaling needed).
    - GPUs with compute capability 7.x (Volta, Turing): `"mixed_float16"` (Tensor Cores have no
      bfloat16 there).
    - Other or unknown GPUs: `"float32"`.
    - No GPU, CPU with AVX512_BF16 or AMX (`amx_bf16` / `amx_tile`): `"mixed_bfloat16"`.
    - Otherwise `"float32"` (float16 on a CPU without native support is emulated and much slower).

    A pure function of `hardware`; it sets nothing.

    Args:
        hardware: `HardwareInfo` or `None`; `None` reads this machine with `detect_hardware()`.
            Defaults to `None`.

    Returns:
        One of `"float32"`, `"mixed_float16"`, `"mixed_bfloat16"`.

    Example:

    >>> recommended_policy(HardwareInfo(gpus=(GPUInfo("V100", (7, 0)),)))
    'mixed_float16'
    """
    if hardware is None:
        hardware = detect_hardware()
    if hardware.gpus:
        cc = hardware.min_gpu_compute_capability
        if cc is None:
            return "float32"
        if cc >= (8, 0):
            return "mixed_bfloat16"
        if cc[0] == 7:
            return "mixed_float16"
        return "float32"
    if hardware.cpu_has_bf16:
        return "mixed_bfloat16"
    return "float32"


@dataclasses.dataclass(frozen=True)
class PolicyChoice:
    """Result of `set_recommended_policy`.

    Args:
        policy: string, the policy now set globally.
        recommended: string, what `recommended_policy` said before any timing.
        seconds_per_step: dict mapping policy name to measured seconds per training step
            (empty when nothing was timed).
        confirmed: bool, whether the choice was confirmed by timing.
    """

    policy: str
    recommended: str
    seconds_per_step: dict[str, float] = dataclasses.field(default_factory=dict)
    confirmed: bool = False

    @property
    def speedup(self) -> float | None:
        """float32 seconds per step divided by the recommended policy's, when both were timed."""
        t32 = self.seconds_per_step.get("float32")
        tmix = self.seconds_per_step.get(self.recommended)
        if t32 is None or tmix is None or self.recommended == "float32" or tmix <= 0:
            return None
        return t32 / tmix


def _first_batch(data):
    """Returns one `(x, y[, sample_weight])` batch from a tuple of arrays or a dataset."""
    if isinstance(data, tf.data.Dataset):
        data = next(iter(data))
    if not isinstance(data, (tuple, list)) or len(data) not in (2, 3):
        raise ValueError(
            "`data` must be a tuple `(x, y)` or `(x, y, sample_weight)` holding one batch, or a "
            f"`tf.data.Dataset` yielding such tuples. Received: data={type(data).__name__}"
        )
    return tuple(data)


def _warm_model(policy, model_fn, batch, warmup_steps):
    """Builds `model_fn()` under `policy` and runs `warmup_steps` untimed steps (tracing)."""
    keras.config.set_dtype_policy(policy)
    model = model_fn()
    if not getattr(model, "compiled", False):
        raise ValueError(
            "`model_fn` must return a compiled Keras model (call `model.compile(...)` inside it). "
            f"Received: a model with compiled={getattr(model, 'compiled', None)} "
            f"under policy {policy!r}"
        )
    for _ in range(warmup_steps):
        _train_on(model, batch)
    return model


def _train_on(model, batch):
    x, y, *rest = batch
    # train_on_batch returns Python floats, so each step has finished when it returns.
    model.train_on_batch(x, y, sample_weight=rest[0] if rest else None)


def _seconds_per_step(model, batch, steps, timer):
    """Seconds per step over `steps` timed steps (collector paused); two calls of `timer`."""
    with _timing.collector_paused():
        start = timer()
        for _ in range(steps):
            _train_on(model, batch)
        return (timer() - start) / steps


def set_recommended_policy(
    model_fn: Callable[[], keras.Model] | None = None,
    data: tuple[Any, ...] | tf.data.Dataset | None = None,
    confirm: bool = False,
    steps: int = 5,
    warmup_steps: int = 2,
    min_speedup: float = 1.0,
    hardware: HardwareInfo | None = None,
    timer: Callable[[], float] = time.perf_counter,
    rounds: int = 3,
) -> PolicyChoice:
    """Sets the global Keras dtype policy to the one recommended for this hardware.

    With `confirm=True` the choice is measured, not assumed: the user's model is built by
    `model_fn()` once under float32 and once under the recommended mixed policy, each runs
    `warmup_steps` untimed `train_on_batch` steps (tracing, excluded from the timing), then
    the two are timed in `rounds` alternating rounds of `steps` steps on the same batch
    (float32 first in even rounds, the mixed policy first in odd ones, so a drift of the
    machine's speed hits both alike). Each policy's seconds per step is the median over the
    rounds, and float32 is kept unless the mixed policy is faster by more than `min_speedup`.
    The timer is called exactly twice per candidate per round, in that order, so a fake timer
    can script the outcome.

    Args:
        model_fn: callable with no arguments returning a compiled `keras.Model`; called after the
            candidate policy is set, so its layers pick that policy up. Needed when
            `confirm=True`. Defaults to `None`.
        data: one batch as a tuple `(x, y)` or `(x, y, sample_weight)`, or a `tf.data.Dataset`
            whose first element is used. Needed when `confirm=True`. Defaults to `None`.
        confirm: bool, whether to time the candidates. Defaults to `False`.
        steps: int, number of timed steps per candidate. Defaults to `5`.
        warmup_steps: int, untimed steps per candidate before timing (the first one traces).
            Defaults to `2`.
        min_speedup: float, the mixed policy is kept only if
            `float32_seconds / mixed_seconds > min_speedup`. Defaults to `1.0` (strictly faster).
        hardware: `HardwareInfo` or `None` (read this machine). Defaults to `None`.
        timer: callable returning seconds as a float. Defaults to `time.perf_counter`.
        rounds: int >= 1, alternating timing rounds per candidate. Defaults to `3`.

    Returns:
        A `PolicyChoice` with the policy set, the recommendation, and the measured seconds per
        step by policy name (medians over the rounds).

    Raises:
        ValueError: if `confirm=True` without `model_fn` and `data`, if `steps < 1`,
            `rounds < 1`, `warmup_steps < 0` or `min_speedup <= 0`, or if `model_fn` returns an uncompiled
            model.

    Example:

    >>> def model_fn():
    ...     m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4),
    ...                           keras.layers.Activation("linear", dtype="float32")])
    ...     m.compile("sgd", "mse")
    ...     return m
    >>> import numpy as np
    >>> choice = set_recommended_policy(model_fn, (np.ones((16, 8)), np.ones((16, 4))),
    ...                                 confirm=True)
    >>> choice.policy == keras.config.dtype_policy().name
    True
    """
    steps = _validation.check_int("steps", steps, minimum=1, requirement="an int >= 1")
    warmup_steps = _validation.check_int(
        "warmup_steps", warmup_steps, minimum=0, requirement="an int >= 0"
    )
    rounds = _validation.check_int("rounds", rounds, minimum=1, requirement="an int >= 1")
    _validation.check(
        _validation.is_real(min_speedup) and min_speedup > 0, "min_speedup", "> 0", min_speedup
    )
    if confirm and (model_fn is None or data is None):
        raise ValueError(
            "`confirm=True` times the user's model, so `model_fn` and `data` are required. "
            f"Received: model_fn={model_fn!r}, data={'None' if data is None else 'given'}"
        )

    recommended = recommended_policy(hardware)
    if not confirm or recommended == "float32":
        keras.config.set_dtype_policy(recommended)
        return PolicyChoice(policy=recommended, recommended=recommended)

    batch = _first_batch(data)
    candidates = ("float32", recommended)
    per_round = {policy: [] for policy in candidates}
    try:
        models = {p: _warm_model(p, model_fn, batch, warmup_steps) for p in candidates}
        for r in range(rounds):
            for policy in candidates if r % 2 == 0 else candidates[::-1]:
                per_round[policy].append(_seconds_per_step(models[policy], batch, steps, timer))
    except BaseException:
        keras.config.set_dtype_policy("float32")
        raise
    seconds = {policy: float(statistics.median(values)) for policy, values in per_round.items()}
    mixed_is_faster = seconds[recommended] > 0 and (
        seconds["float32"] / seconds[recommended] > min_speedup
    )
    chosen = recommended if mixed_is_faster else "float32"
    keras.config.set_dtype_policy(chosen)
    return PolicyChoice(
        policy=chosen, recommended=recommended, seconds_per_step=seconds, confirmed=True
    )


# --------------------------------------------------------------------------------------------
# Float32 outputs under mixed precision (case C7)
# --------------------------------------------------------------------------------------------


@keras.saving.register_keras_serializable(package="keras_fastloop")
class Float32Output(keras.layers.Layer):
    """Casts its input to float32; put it last on every output that feeds a loss.

    Under a mixed policy layers compute in float16 / bfloat16. float16 overflows above 65504, so
    large logits or a `-1e9` mask constant become `inf` and softmax / cross-entropy become NaN;
    bfloat16 keeps the range but only ~3 significant digits. Casting the output to float32 before
    the loss (and doing the final softmax / masking in float32 layers) keeps the loss finite.
    Equivalent to `keras.layers.Activation("linear", dtype="float32")`.

    Note: the cast cannot rescue a value that already overflowed; give the *last computing*
    layer (e.g. the logits `Dense`) `dtype="float32"` when its values can exceed 65504.

    Args:
        **kwargs: base `Layer` arguments (`name`, ...). `dtype` is always float32.

    Input shape: any. Output shape: same as input, dtype float32.

    Example:

    >>> keras.config.set_dtype_policy("mixed_float16")
    >>> x = keras.Input((4,))
    >>> y = Float32Output()(keras.layers.Dense(3)(x))
    >>> y.dtype
    'float32'
    >>> keras.config.set_dtype_policy("float32")
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs["dtype"] = "float32"
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, inputs: Any) -> Any:
        return keras.tree.map_structure(lambda t: keras.ops.cast(t, "float32"), inputs)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.pop("dtype", None)
        return config


def _policy_name(policy) -> str:
    if policy is None:
        return keras.config.dtype_policy().name
    if isinstance(policy, str):
        return policy
    name = getattr(policy, "name", None)
    if isinstance(name, str):
        return name
    raise ValueError(
        "`policy` must be a policy name, a `keras.DTypePolicy` or None. "
        f"Received: policy={policy!r}"
    )


def _named_outputs(model, outputs) -> list[tuple[str, object]]:
    """Flattens `outputs` (or the model's symbolic outputs) into (name, tensor) pairs."""
    if outputs is None:
        try:
            outputs = model.output
        except (AttributeError, ValueError):
            return []  # subclassed model not called yet: nothing symbolic to look at
    layer_names = list(getattr(model, "output_names", None) or [])
    if isinstance(outputs, Mapping):
        return [(str(k), v) for k, v in outputs.items()]
    if isinstance(outputs, Sequence) and not isinstance(outputs, str):
        flat = keras.tree.flatten(outputs)
        names = layer_names if len(layer_names) == len(flat) else []
        return [(names[i] if names else f"output_{i}", tensor) for i, tensor in enumerate(flat)]
    name = layer_names[0] if len(layer_names) == 1 else "output_0"
    return [(name, outputs)]


def check_output_dtypes(
    model: keras.Model,
    policy: str | keras.DTypePolicy | None = None,
    outputs: Any = None,
    warn: bool = True,
) -> list[str]:
    """Names of the model outputs that would reach a loss in 16-bit precision.

    Under a mixed policy (compute dtype float16 or bfloat16) every output that feeds a loss
    should be float32; otherwise large logits or `-1e9` mask constants overflow float16 (case
    C7) and softmax sums lose precision. Call it from `compile()` of a model; it looks at the
    symbolic outputs of functional models (dict outputs are named by their keys, others by
    `model.output_names`). For subclassed models, which have no symbolic outputs before they are
    called, pass `outputs=` (e.g. `y_pred` at the first trace of the train step).

    Args:
        model: `keras.Model`, the model to check.
        policy: policy name, `keras.DTypePolicy`, or `None` for the global policy. Defaults to
            `None`.
        outputs: optional structure (dict / list / single) of tensors or `KerasTensor`s to check
            instead of `model.output`. Defaults to `None`.
        warn: bool, whether to emit a `UserWarning` naming the offending outputs. Defaults to
            `True`.

    Returns:
        List of output names (possibly empty) whose floating dtype is not float32 / float64.
        Always empty when the policy is not mixed.

    Raises:
        ValueError: if `policy` is not a name, a policy object or None.

    Example:

    >>> keras.config.set_dtype_policy("mixed_float16")
    >>> x = keras.Input((4,))
    >>> m = keras.Model(x, keras.layers.Dense(3, name="logits")(x))
    >>> check_output_dtypes(m, warn=False)
    ['logits']
    >>> keras.config.set_dtype_policy("float32")
    """
    name = _policy_name(policy)
    if name not in _MIXED_POLICIES:
        return []
    offending = []
    for out_name, tensor in _named_outputs(model, outputs):
        dtype = getattr(tensor, "dtype", None)
        if dtype is None:
            continue
        dtype = keras.backend.standardize_dtype(dtype)
        if dtype in ("float16", "bfloat16"):
            offending.append(out_name)
    if offending and warn:
        risk = (
            "float16 overflows above 65504 (large logits or a -1e9 mask constant become inf and "
            "the loss NaN)"
            if name == "mixed_float16"
            else "bfloat16 keeps 8 bits of mantissa (softmax rows and small probabilities lose "
            "~3 significant digits before the loss sees them)"
        )
        warnings.warn(
            f"Under the {name!r} dtype policy these model outputs are not float32 and would "
            f"reach the loss in 16-bit precision: {offending}. {risk}. Make the last "
            'layer of each float32 (e.g. `Dense(..., dtype="float32")`) or append '
            "`keras_fastloop.mixed_precision.Float32Output()` / "
            '`keras.layers.Activation("linear", dtype="float32")`.',
            FastloopWarning,
            stacklevel=2,
        )
    return offending
