"""The seed's ablation table, measured: `keras-fastloop bench --suite seed-table`.

The seed article, “TensorFlow 2.x custom training loops in practice: deep optimization
strategies that make the loss fall 15% faster” (in Chinese; `harness.SEED_ARTICLE`), claims,
on a V100 with ResNet-50 / CIFAR-10, speed-up and memory saved per strategy: basic custom loop 15% / 5%; mixed precision 45% / 35%; dynamic
batching 23% / 12%; gradient clipping 18% / –; all combined 62% / 42%. This suite measures the
same rows with our own implementation, side by side (contenders alternate, several rounds,
medians), from identical initial weights:

- `baseline`: `keras.Model.fit` on NumPy arrays (Keras' own input pipeline), float32.
- `custom step`: `OptimizedModel.fit` (the hand-written step), everything else the same.
- `+ mixed precision`: the custom step under the policy of
  `keras_fastloop.mixed_precision.set_recommended_policy` (hardware rule, confirmed by timing
  this model once before the rounds; float32 if the mixed policy does not pay).
- `+ dynamic batching`: the custom step fed by the seed's tf.data pipeline (shuffle buffer,
  parallel `map`, `padded_batch`, `prefetch(AUTOTUNE)`). The images here all have one
  size, so `padded_batch` pads nothing: it is padded batching with a prefetching, autotuned
  pipeline, exactly what the seed's "dynamic batching" does on CIFAR-10.
  `keras_fastloop.data.bucket_by_length` (length buckets) only pays on variable-length data
  (the `bucketing` suite measures it there).
- `+ gradient clipping`: the custom step with global-norm clipping at 1.0.
- `all combined`: custom step + mixed precision + dynamic batching + clipping.
- `all combined + steps_per_execution="auto"` (ours, not in the seed's table).

Speed-up is training throughput (samples/s, every epoch but the first, which traces) over the
baseline's, minus one. Memory: on a GPU the peak of `tf.config.experimental.get_memory_info`
after `reset_memory_stats`, per run; on a CPU the growth of the process' peak resident set
size during the run (a coarse measure: TF's allocator caches, graphs and the data pipeline are
all in it). Every figure is also given in FLOP/s against the machine's peak
(`keras_fastloop_bench.flops`).

Profiles: `cpu`: a small ResNet (3 stages of one basic block, 64/128/256 filters, batch norm) on
the real digits images (`load_digits_data`, 16x16). `gpu`: `keras.applications.ResNet50
(weights=None)` on **synthetic** CIFAR-10-shaped tensors (random 32x32x3 images, random
labels: throughput and memory only, accuracy meaningless); with `quick=True` it runs a tiny
stand-in (the small ResNet on 32x32x3 synthetic tensors) so it finishes on a CPU in seconds.
"""

from __future__ import annotations

import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from keras_fastloop import mixed_precision
from keras_fastloop.model import OptimizedModel
from keras_fastloop_bench import flops, harness

LEARNING_RATE = 1e-3

# row -> (claimed speed-up %, claimed memory saved % or None), the seed article's results table.
SEED_CLAIMS = {
    "baseline: keras.Model.fit": (0, 0),
    "custom step (OptimizedModel)": (15, 5),
    "+ mixed precision (auto policy)": (45, 35),
    "+ dynamic batching": (23, 12),
    "+ gradient clipping": (18, None),
    "all combined": (62, 42),
    'all combined + steps_per_execution="auto"': (None, None),
}
BASELINE = "baseline: keras.Model.fit"
ROWS = {
    # name: (model class, mixed precision, seed pipeline, clipping, steps_per_execution)
    BASELINE: (keras.Model, False, False, None, 1),
    "custom step (OptimizedModel)": (OptimizedModel, False, False, None, 1),
    "+ mixed precision (auto policy)": (OptimizedModel, True, False, None, 1),
    "+ dynamic batching": (OptimizedModel, False, True, None, 1),
    "+ gradient clipping": (OptimizedModel, False, False, 1.0, 1),
    "all combined": (OptimizedModel, True, True, 1.0, 1),
    'all combined + steps_per_execution="auto"': (OptimizedModel, True, True, 1.0, "auto"),
}


def build_small_resnet(
    model_cls=keras.Model, input_shape=(16, 16, 1), num_classes=10, stages=(64, 128, 256)
):
    """A small ResNet: conv stem, stages of one basic block (64, 128, 256 filters), GAP, head.

    Wide enough that convolutions dominate the step (with 16/32/64 filters batch norm and
    element-wise ops dominate, and bf16 measured 1.07x float32 here; with 64/128/256, 1.49x).

    The head is float32 so the loss stays float32 under mixed precision.

    Args:
        model_cls: `keras.Model` or `OptimizedModel`. Defaults to `keras.Model`.
        input_shape: one image's shape. Defaults to `(16, 16, 1)`.
        num_classes: int. Defaults to `10`.
        stages: tuple of ints, filters of each stage (one basic block each; the first keeps
            the resolution, the others halve it). Defaults to `(64, 128, 256)`.

    Returns:
        An uncompiled functional model.
    """
    inputs = keras.Input(input_shape)
    h = keras.layers.Conv2D(stages[0], 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.ReLU()(keras.layers.BatchNormalization(momentum=0.9)(h))
    for i, filters in enumerate(stages):
        stride = 1 if i == 0 else 2
        shortcut = h
        if stride != 1 or h.shape[-1] != filters:
            shortcut = keras.layers.Conv2D(filters, 1, strides=stride, use_bias=False)(h)
            shortcut = keras.layers.BatchNormalization(momentum=0.9)(shortcut)
        y = keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(h)
        y = keras.layers.ReLU()(keras.layers.BatchNormalization(momentum=0.9)(y))
        y = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
        y = keras.layers.BatchNormalization(momentum=0.9)(y)
        h = keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))
    h = keras.layers.GlobalAveragePooling2D()(h)
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32")(h)
    return model_cls(inputs, outputs)


def build_resnet50(model_cls=keras.Model, input_shape=(32, 32, 3), num_classes=10):
    """`keras.applications.ResNet50(weights=None)` without its top, plus a float32 head.

    Args:
        model_cls: `keras.Model` or `OptimizedModel`. Defaults to `keras.Model`.
        input_shape: one image's shape. Defaults to CIFAR-10's `(32, 32, 3)`.
        num_classes: int. Defaults to `10`.

    Returns:
        An uncompiled functional model.
    """
    inputs = keras.Input(input_shape)
    base = keras.applications.ResNet50(
        weights=None, include_top=False, input_shape=input_shape, pooling="avg"
    )
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32")(base(inputs))
    return model_cls(inputs, outputs)


def _tiny_resnet(input_shape):
    def build(model_cls=keras.Model):
        return build_small_resnet(model_cls, input_shape, stages=(8,))

    return build


class _Profile:
    """Data, model builder and sizes of one profile."""

    def __init__(self, profile, quick):
        self.name = profile
        rng = np.random.default_rng(0)
        if profile == "cpu":
            from keras_fastloop.datasets.digits import load_digits_data

            (self.x, self.y), (self.x_val, self.y_val) = load_digits_data(image_size=16)
            self.build = build_small_resnet
            if quick:
                self.x, self.y = self.x[:128], self.y[:128]
                self.x_val, self.y_val = self.x_val[:64], self.y_val[:64]
                self.build = _tiny_resnet((16, 16, 1))
            self.batch_size = 64
            self.epochs, self.rounds = (2, 1) if quick else (4, 2)
            self.model_label = (
                "one-block ResNet (quick run)"
                if quick
                else "small ResNet (3 basic blocks, 64/128/256 filters, batch norm)"
            )
            self.data_label = (
                f"scikit-learn digits, real images 16x16x1: {len(self.x)} train / "
                f"{len(self.x_val)} validation"
            )
        elif profile == "gpu":
            n, n_val = (128, 64) if quick else (12_800, 2_560)
            self.x = rng.normal(size=(n, 32, 32, 3)).astype("float32")
            self.y = rng.integers(0, 10, size=n).astype("int32")
            self.x_val = rng.normal(size=(n_val, 32, 32, 3)).astype("float32")
            self.y_val = rng.integers(0, 10, size=n_val).astype("int32")
            if quick:
                self.build = _tiny_resnet((32, 32, 3))
                self.model_label = "tiny stand-in for ResNet-50 (one-block ResNet, quick run)"
            else:
                self.build = build_resnet50
                self.model_label = "keras.applications.ResNet50(weights=None) + float32 head"
            self.batch_size = 32 if quick else 128
            self.epochs, self.rounds = (2, 1) if quick else (3, 2)
            self.data_label = (
                f"SYNTHETIC CIFAR-10-shaped tensors (random 32x32x3 images, random labels): "
                f"{n} train / {n_val} validation; throughput and memory only"
            )
        else:
            raise ValueError(f'`profile` must be "cpu" or "gpu". Received: profile={profile!r}')

    def seed_pipeline(self):
        """The seed's "dynamic batching": shuffle, parallel map, padded_batch, prefetch."""
        ds = tf.data.Dataset.from_tensor_slices((self.x, self.y))
        ds = ds.shuffle(len(self.x), seed=0, reshuffle_each_iteration=True)
        ds = ds.map(lambda image, label: (image, label), num_parallel_calls=tf.data.AUTOTUNE)
        ds = ds.padded_batch(self.batch_size, padded_shapes=(self.x.shape[1:], ()))
        return ds.prefetch(tf.data.AUTOTUNE)


def _gpu_name():
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    details = tf.config.experimental.get_device_details(gpus[0]) or {}
    return str(details.get("device_name", gpus[0].name))


def _contender(profile, config, mixed_policy):
    model_cls, mixed, seed_pipeline, clipping, steps_per_execution = config
    on_gpu = _gpu_name() is not None

    def train(run):
        policy = mixed_policy if mixed else "float32"
        try:
            keras.config.set_dtype_policy(policy)
            model = profile.build(model_cls)
            model.set_weights(run.initial_weights)
            kwargs = {"steps_per_execution": steps_per_execution}
            if model_cls is OptimizedModel:
                kwargs["gradient_clipping"] = clipping
            model.compile(
                keras.optimizers.Adam(LEARNING_RATE),
                "sparse_categorical_crossentropy",
                metrics=["accuracy"],
                **kwargs,
            )
            if on_gpu:
                tf.config.experimental.reset_memory_stats("GPU:0")
            fit_kwargs = dict(
                epochs=run.epochs,
                validation_data=(profile.x_val, profile.y_val),
                callbacks=[harness.EpochTimer(run, len(profile.x))],
                verbose=0,
            )
            if seed_pipeline:
                model.fit(profile.seed_pipeline(), **fit_kwargs)
            else:
                model.fit(
                    profile.x, profile.y, batch_size=profile.batch_size, shuffle=True, **fit_kwargs
                )
            if on_gpu:
                run.gpu_peak_mb = tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
            run.finish(
                model.evaluate(profile.x_val, profile.y_val, verbose=0, return_dict=True)[
                    "accuracy"
                ]
            )
        finally:
            keras.config.set_dtype_policy("float32")

    return train


def _confirm_policy(profile, quick):
    def model_fn():
        model = profile.build()
        model.compile(keras.optimizers.Adam(LEARNING_RATE), "sparse_categorical_crossentropy")
        return model

    batch = (profile.x[: profile.batch_size], profile.y[: profile.batch_size])
    t0 = time.perf_counter()
    try:
        choice = mixed_precision.set_recommended_policy(
            model_fn,
            batch,
            confirm=True,
            steps=2 if quick else 5,
            warmup_steps=1 if quick else 2,
            min_speedup=1.05,
        )
    finally:
        keras.config.set_dtype_policy("float32")
    return choice, time.perf_counter() - t0


def _fmt(value, pattern, missing="–"):
    return missing if value is None or value != value else pattern.format(value)


def run(out_dir: Path, quick: bool = False, profile: str = "cpu", progress=print) -> dict:
    """Run the seed-table suite; write `seed_table.md` and `seed_table.json`.

    Args:
        out_dir: `pathlib.Path` or string, folder for the reports (created if missing).
        quick: bool, tiny sizes (1 round, 2 epochs; the gpu profile uses a tiny stand-in
            model) for tests: under a minute on 2 CPU cores. Defaults to `False`.
        profile: `"cpu"` (small ResNet, real digits images) or `"gpu"` (ResNet-50,
            synthetic CIFAR-10-shaped tensors). Defaults to `"cpu"`.
        progress: callable receiving progress lines. Defaults to `print`.

    Returns:
        A JSON-able dict: `suite`, `profile`, `machine`, `peak`, `policy`, `config`,
        `rows` (one per row: measured speed-up %, memory change %, claims, ...), and
        `markdown`.

    Raises:
        ValueError: an unknown `profile`.

    Example:
        >>> result = run(Path("bench_results"), quick=True)   # doctest: +SKIP
        >>> print(result["markdown"])                         # doctest: +SKIP
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = _Profile(profile, quick)
    choice, confirm_seconds = _confirm_policy(data, quick)
    progress(
        f"[seed-table/{profile}] policy {choice.policy} (recommended {choice.recommended}, "
        f"timed {choice.seconds_per_step}); {data.epochs} epochs x {data.rounds} rounds"
    )
    keras.utils.set_random_seed(0)
    initial = data.build().get_weights()
    contenders = {name: _contender(data, config, choice.policy) for name, config in ROWS.items()}
    runs = harness.run_alternating(
        contenders, lambda: [w.copy() for w in initial], data.epochs, data.rounds, progress
    )
    summary = {r["contender"]: r for r in harness.summarize(runs, float("-inf"), BASELINE)}
    gpu = _gpu_name()
    peak = flops.machine_peak()
    train_flops = flops.count_flops(data.build()).training

    def memory(name):
        values = [getattr(r, "gpu_peak_mb", None) if gpu else r.peak_memory_mb for r in runs[name]]
        values = [v for v in values if v is not None and v == v]
        return float(np.median(values)) if values else float("nan")

    base_memory = memory(BASELINE)
    rows = []
    for name, config in ROWS.items():
        s = summary[name]
        policy = choice.policy if config[1] else "float32"
        mem = memory(name)
        claim_speed, claim_memory = SEED_CLAIMS[name]
        achieved = s["throughput_samples_per_s"] * train_flops
        rows.append(
            {
                "row": name,
                "policy": policy,
                "samples_per_s": s["throughput_samples_per_s"],
                "speedup_percent": 100 * (s["throughput_ratio"] - 1),
                "per_round_throughput_ratio": s["per_round_throughput_ratio"],
                "peak_memory_mb": mem,
                "memory_change_percent": (
                    100 * (mem - base_memory) / base_memory if base_memory > 0 else float("nan")
                ),
                "claimed_speedup_percent": claim_speed,
                "claimed_memory_saved_percent": claim_memory,
                "val_accuracy": s["val_accuracy"],
                "achieved_gflops": achieved / 1e9,
                "percent_of_peak": 100 * achieved / peak.for_policy(policy),
            }
        )
    by_name = {r["row"]: r for r in rows}
    mp_vs_fp32 = (
        by_name["+ mixed precision (auto policy)"]["samples_per_s"]
        / by_name["custom step (OptimizedModel)"]["samples_per_s"]
    )
    memory_label = "GPU peak (MB)" if gpu else "peak RSS growth (MB)"
    lines = [
        f"| row | policy | samples/s | speed-up | seed claims | {memory_label} | memory change "
        "| seed claims saved | val acc | GFLOP/s | % of peak |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['row']} | {r['policy']} | {r['samples_per_s']:.0f} | "
            f"{r['speedup_percent']:+.0f}% | {_fmt(r['claimed_speedup_percent'], '{}%')} | "
            f"{r['peak_memory_mb']:.0f} | {r['memory_change_percent']:+.0f}% | "
            f"{_fmt(r['claimed_memory_saved_percent'], '{}%')} | {r['val_accuracy']:.4f} | "
            f"{r['achieved_gflops']:.1f} | {r['percent_of_peak']:.2f} |"
        )
    machine = harness.machine_description()
    timed = ", ".join(f"{k} {1e3 * v:.1f} ms/step" for k, v in choice.seconds_per_step.items())
    markdown = (
        f"# keras-fastloop bench — the seed's table, measured ({profile} profile"
        f"{', quick' if quick else ''})\n\n"
        f"Machine: {machine}\n\nPeak: {peak.device}: fp32 {peak.fp32 / 1e9:.0f} GFLOP/s"
        + (f", bf16/fp16 {peak.low_precision / 1e9:.0f} GFLOP/s" if peak.low_precision else "")
        + f" ({peak.formula}).\n\n"
        f"Model: {data.model_label}; {train_flops / 1e6:.1f} MFLOP per training sample "
        f"(analytic, 3 x forward). Data: {data.data_label}. Batch {data.batch_size}, Adam "
        f"{LEARNING_RATE}, {data.epochs} epochs, validation every epoch, {data.rounds} "
        f"alternating rounds (medians). Speed-up: training samples/s (epochs after the first) "
        f"vs the baseline. Memory change: vs the baseline's "
        f"{'GPU peak' if gpu else 'peak RSS growth (coarse on CPU)'}.\n\n"
        + "\n".join(lines)
        + f"\n\nAuto precision: `{choice.policy}` (hardware rule `{choice.recommended}`, timed "
        f"once in {confirm_seconds:.1f} s: {timed or 'not timed'}); mixed precision row vs "
        f"custom step: **{mp_vs_fp32:.2f}x** throughput.\n\n"
        f"Seed claims: ResNet-50 / CIFAR-10 on a V100 ({harness.SEED_ARTICLE}). Dynamic batching on "
        "fixed-size images is padded batching with a prefetching, autotuned tf.data pipeline "
        "(nothing to pad); length bucketing only pays on variable-length data.\n"
    )
    payload = {
        "suite": "seed-table",
        "profile": profile,
        "quick": quick,
        "machine": machine,
        "gpu": gpu,
        "peak": {
            "device": peak.device,
            "fp32_flops": peak.fp32,
            "low_precision_flops": peak.low_precision,
            "formula": peak.formula,
        },
        "policy": {
            "policy": choice.policy,
            "recommended": choice.recommended,
            "seconds_per_step": choice.seconds_per_step,
            "confirm_seconds": confirm_seconds,
        },
        "mixed_precision_vs_float32": mp_vs_fp32,
        "config": {
            "model": data.model_label,
            "data": data.data_label,
            "batch_size": data.batch_size,
            "epochs": data.epochs,
            "rounds": data.rounds,
            "train_images": len(data.x),
            "training_flops_per_sample": train_flops,
        },
        "rows": rows,
        "markdown": markdown,
    }
    harness.write_report(out_dir, "seed_table", markdown, payload)
    return payload
