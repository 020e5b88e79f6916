"""The one-line recommended setup: precision for the hardware, `"auto"` steps, a tf.data pipeline.

Reference: TensorFlow guide "Better performance with the tf.data API" (2019-) for the pipeline.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import keras
import tensorflow as tf

from keras_fastloop.tuning._glue import AUTO

if TYPE_CHECKING:
    from keras_fastloop.mixed_precision import HardwareInfo, PolicyChoice

__all__ = ["RecommendedSetup", "onednn_off_on_x86", "optimize_pipeline", "recommended_setup"]


def optimize_pipeline(
    dataset: tf.data.Dataset, cache: bool = False, autotune: bool = False
) -> tf.data.Dataset:
    """A tf.data pipeline that overlaps input work with training.

    Turns on tf.data's `map_parallelization` and `parallel_batch` optimizations, sets its
    autotuning as asked (off by default), optionally caches the (already batched) elements in
    memory, and ends with `prefetch(tf.data.AUTOTUNE)`. The element order is unchanged
    (`deterministic` stays on).

    Autotuning is off by default because its model thread stalled the end of every other
    epoch on a busy 2-core CPU: deleting the epoch's iterator waited about 0.55 s for it, in
    4 to 8 of 11 epochs of the bench CNN, and turning it off made `fit` 1.15x faster
    (`docs/performance.md`). Without it `AUTOTUNE` parallelism and buffer sizes take tf.data's
    fixed defaults.

    Args:
        dataset: a `tf.data.Dataset` of batches.
        cache: bool, cache the elements in memory after the first pass (only for data sets that
            fit in memory and whose elements do not change between epochs; shuffling before
            batching would be frozen). Defaults to `False`.
        autotune: bool, `tf.data.Options().autotune.enabled` for the whole pipeline (it
            overrides the dataset's own setting). Turn it on for pipelines with parallel maps
            on machines with cores to spare. Defaults to `False`.

    Returns:
        The `tf.data.Dataset` to pass to `fit`.

    Raises:
        TypeError: if `dataset` is not a `tf.data.Dataset`, or `cache` or `autotune` is not
            a bool.

    Example:
        >>> ds = tf.data.Dataset.range(8).batch(4)
        >>> [b.numpy().tolist() for b in optimize_pipeline(ds)]
        [[0, 1, 2, 3], [4, 5, 6, 7]]

    Reference: TensorFlow guide "Better performance with the tf.data API".
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"`dataset` must be a tf.data.Dataset. Received: dataset={type(dataset).__name__}"
        )
    for name, value in (("cache", cache), ("autotune", autotune)):
        if not isinstance(value, bool):
            raise TypeError(f"`{name}` must be a bool. Received: {name}={value!r}")
    options = tf.data.Options()
    options.autotune.enabled = autotune
    options.experimental_optimization.map_parallelization = True
    options.experimental_optimization.parallel_batch = True
    dataset = dataset.with_options(options)
    if cache:
        dataset = dataset.cache()
    return dataset.prefetch(tf.data.AUTOTUNE)


@dataclasses.dataclass
class RecommendedSetup:
    """What `recommended_setup` chose; spread `compile_kwargs` into `compile`.

    Args:
        policy: string, the global dtype policy now set.
        policy_choice: the `keras_fastloop.mixed_precision.PolicyChoice` behind it.
        steps_per_execution: `"auto"` (the compile argument). Defaults to `"auto"`.
        onednn_off_on_x86: bool, the model trains on a CPU where TensorFlow left oneDNN's
            kernels off by default (`onednn_off_on_x86()`, and no GPU); `summary` then says
            how to try them. Defaults to `False`.
    """

    policy: str
    policy_choice: PolicyChoice
    steps_per_execution: int | str = AUTO
    onednn_off_on_x86: bool = False

    @property
    def compile_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `OptimizedModel.compile`: `{"steps_per_execution": ...}`."""
        return {"steps_per_execution": self.steps_per_execution}

    def pipeline(
        self, dataset: tf.data.Dataset, cache: bool = False, autotune: bool = False
    ) -> tf.data.Dataset:
        """The dataset through `optimize_pipeline` (same arguments and errors)."""
        return optimize_pipeline(dataset, cache=cache, autotune=autotune)

    def summary(self) -> str:
        """One line: what was chosen, why, and how to undo it."""
        choice = self.policy_choice
        if choice.confirmed and choice.speedup is not None:
            why = f"timed on your model: {choice.recommended} {choice.speedup:.2f}x float32's speed"
            if self.policy != choice.recommended:
                why += " (too little gain: kept float32)"
        else:
            why = f"hardware rule: {choice.recommended}"
        line = (
            f"keras_fastloop.recommended_setup: dtype policy {self.policy!r} ({why}); "
            f"compile(**setup.compile_kwargs) adds steps_per_execution="
            f"{self.steps_per_execution!r}. Undo: keras.config.set_dtype_policy('float32')."
        )
        if self.onednn_off_on_x86:
            line += (
                " TensorFlow left oneDNN's CPU kernels off on this CPU: set "
                "TF_ENABLE_ONEDNN_OPTS=1 before Python imports TensorFlow to try them "
                "(`keras-fastloop bench` times both)."
            )
        return line


def onednn_off_on_x86() -> bool:
    """True where TensorFlow left oneDNN's CPU kernels off by its own default, on x86-64.

    TensorFlow reads `TF_ENABLE_ONEDNN_OPTS` once, at import. Unset, on Linux it turns oneDNN
    on only for CPUs with AVX512_VNNI, AVX512_BF16, AVX_VNNI or AMX. On an AMD EPYC with AVX2
    only, turning it on made the bench's recommended setup 1.40x faster (docs/performance.md).
    False when the variable is set (the user chose), off x86-64, or where TensorFlow reports
    no oneDNN switch. A TensorFlow built without oneDNN also reports
    it off; the official x86-64 wheels include it.
    """
    import os

    from keras_fastloop import _keras_internals

    if os.environ.get("TF_ENABLE_ONEDNN_OPTS") is not None:
        return False
    machine = platform.machine().lower()
    return _keras_internals.onednn_enabled() is False and machine in ("x86_64", "amd64")


def recommended_setup(
    model_fn: Callable[[], keras.Model] | None = None,
    data: tuple[Any, ...] | tf.data.Dataset | None = None,
    *,
    min_speedup: float = 1.05,
    steps: int = 5,
    rounds: int = 3,
    hardware: HardwareInfo | None = None,
    timer: Callable[[], float] = time.perf_counter,
    verbose: bool = True,
) -> RecommendedSetup:
    """Turns on the recommended fast setup for the next models: one line, before building them.

    1. Precision: sets the global dtype policy chosen for the hardware by
       `keras_fastloop.mixed_precision` (`mixed_bfloat16` on GPUs of compute capability
       >= 8.0 and CPUs with AVX512_BF16/AMX, `mixed_float16` on 7.x GPUs, else float32). With
       `model_fn` and `data` the choice is timed against float32 on the user's model and the
       mixed policy is kept only if it is faster by more than `min_speedup`; otherwise float32
       stays (never slower than plain precision, by measurement). Without them the hardware
       rule alone decides.
    2. `steps_per_execution="auto"` for `compile` (see `docs/fit_loop.md`): it starts
       at 1 (Keras' default) and grows unless a larger count measures slower, so it falls back
       to 1 when larger counts are slower.
    3. `RecommendedSetup.pipeline`: prefetch and map optimizations for a tf.data input,
       tf.data's autotuning off (`optimize_pipeline`).

    Call it before building the model (layers take the policy when they are created). The
    model's output layers that feed losses should be float32 (`dtype="float32"` or
    `keras_fastloop.mixed_precision.Float32Output`); `check_output_dtypes` names offenders.

    Args:
        model_fn: callable with no arguments returning a compiled model, or `None`. Defaults
            to `None`.
        data: one batch `(x, y)` or a dataset, used with `model_fn`. Defaults to `None`.
        min_speedup: float > 0, required speed-up of the mixed policy. Defaults to `1.05`.
        steps: int >= 1, timed steps per candidate policy and round. Defaults to `5`.
        rounds: int >= 1, alternating timing rounds (medians decide). Defaults to `3`.
        hardware: `mixed_precision.HardwareInfo` or `None` (this machine). Defaults to
            `None`.
        timer: callable returning seconds. Defaults to `time.perf_counter`.
        verbose: bool, print `RecommendedSetup.summary` (what was chosen, why, how to
            undo it). Defaults to `True`.

    Returns:
        A `RecommendedSetup`.

    Raises:
        ValueError: `model_fn` given without `data` (or the reverse), or as
            `mixed_precision.set_recommended_policy`; a non-bool `verbose`.

    Example:
        >>> setup = recommended_setup()  # before building the model; prints   # doctest: +SKIP
        >>> model = OptimizedModel(inputs, outputs)             # doctest: +SKIP
        >>> model.compile("adam", "mse", **setup.compile_kwargs)  # doctest: +SKIP
        >>> model.fit(setup.pipeline(train_ds), epochs=3)        # doctest: +SKIP
    """
    from keras_fastloop import mixed_precision

    if not isinstance(verbose, bool):
        raise ValueError(f"`verbose` must be a bool. Received: verbose={verbose!r}")
    if (model_fn is None) != (data is None):
        raise ValueError(
            "`model_fn` and `data` go together (the policy is timed on the model with one "
            f"batch). Received: model_fn={model_fn!r}, data={'None' if data is None else 'given'}"
        )
    if hardware is None:
        hardware = mixed_precision.detect_hardware()
    choice = mixed_precision.set_recommended_policy(
        model_fn,
        data,
        confirm=model_fn is not None,
        steps=steps,
        rounds=rounds,
        min_speedup=min_speedup,
        hardware=hardware,
        timer=timer,
    )
    setup = RecommendedSetup(
        policy=choice.policy,
        policy_choice=choice,
        onednn_off_on_x86=not hardware.gpus and onednn_off_on_x86(),
    )
    if verbose:
        print(setup.summary())
    return setup
