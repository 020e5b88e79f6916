"""Benchmark: OptimizedModel vs `keras.Model.fit` under a 2-replica MirroredStrategy.

Two measurements, in a fresh Python process that configures two logical CPU devices before
TensorFlow initialises its devices (`tf.config.set_logical_device_configuration` must run
first; in an already-initialised process it fails, hence the subprocess):

1. **Step time.** The same model and data, `keras.Model` (plain `fit`) and
   `OptimizedModel` with `gradient_clipping` on, under one `MirroredStrategy` over the two
   devices. Rounds alternate between the two contenders; the first round (tracing) is
   discarded; the time of a step is the gap between consecutive `on_train_batch_end` calls,
   the first batch of every round excluded. Reported: median step time of each and their ratio
   (target: OptimizedModel at most 1.15x plain `fit`).
2. **Clip norm of the applied update (case C10).** SGD with learning rate 1, clip threshold 1.0,
   one step on a batch whose gradient norm is far above the threshold: the norm of the weight
   change is the norm of the gradient that was applied. Keras' `global_clipnorm` clips each
   replica's share before the sum (the update exceeds 1.0); OptimizedModel clips the sum.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from keras_fastloop_bench import harness

CLIP = 1.0


def _child(quick: bool) -> dict:  # pragma: no cover - runs in the subprocess
    """The measurements; must run before TensorFlow initialises its devices."""
    import time

    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )

    import keras
    import numpy as np

    import keras_fastloop as kf

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    width, batch = (128, 128) if quick else (256, 256)
    steps, rounds = (10, 4) if quick else (30, 8)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, 64)).astype("float32")
    y = rng.integers(0, 10, size=(batch * steps,)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).cache()

    def build(cls):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((64,))
        h = keras.layers.Dense(width, activation="relu")(inputs)
        h = keras.layers.Dense(width, activation="relu")(h)
        return cls(inputs, keras.layers.Dense(10)(h))

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with strategy.scope():
        plain = build(keras.Model)
        plain.compile(keras.optimizers.SGD(0.01, global_clipnorm=CLIP), loss)
        ours = build(kf.OptimizedModel)
        ours.set_weights(plain.get_weights())
        ours.compile(keras.optimizers.SGD(0.01), loss, gradient_clipping=CLIP)

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    times = {"keras": [], "ours": []}
    for r in range(rounds):
        order = (
            [("keras", plain), ("ours", ours)] if r % 2 == 0 else [("ours", ours), ("keras", plain)]
        )
        for name, model in order:
            timer = Timer()
            model.fit(dataset, epochs=1, verbose=0, callbacks=[timer])
            if r > 0:  # round 0 traces the step
                times[name].extend(np.diff(timer.ends).tolist())
    med = {k: float(np.median(v)) for k, v in times.items()}

    # C10: the norm of the update that is actually applied (SGD, learning rate 1).
    xb = rng.normal(size=(8, 64)).astype("float32") * 10.0
    yb = rng.integers(0, 10, size=(8,)).astype("int32")
    one_batch = tf.data.Dataset.from_tensor_slices((xb, yb)).batch(8)

    def applied_norm(model_cls, in_strategy, **kwargs):
        with in_strategy.scope():
            model = build(model_cls)
            model.set_weights(plain.get_weights())
            opt = keras.optimizers.SGD(1.0, **kwargs.pop("opt", {}))
            model.compile(opt, loss, **kwargs)
        before = [w.numpy() for w in model.trainable_weights]
        model.fit(one_batch, verbose=0)
        after = [w.numpy() for w in model.trainable_weights]
        return float(np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(after, before))))

    default = tf.distribute.get_strategy()
    clip = {
        "keras_global_clipnorm_1_replica": applied_norm(
            keras.Model, default, opt={"global_clipnorm": CLIP}
        ),
        "keras_global_clipnorm_2_replicas": applied_norm(
            keras.Model, strategy, opt={"global_clipnorm": CLIP}
        ),
        "ours_gradient_clipping_2_replicas": applied_norm(
            kf.OptimizedModel, strategy, gradient_clipping=CLIP
        ),
    }
    return {
        "model": f"MLP 64 -> {width} -> {width} -> 10 (relu), SGD, clip {CLIP}",
        "global_batch": batch,
        "steps_per_round": steps,
        "rounds": rounds,
        "replicas": strategy.num_replicas_in_sync,
        "devices": "2 logical CPU devices (MirroredStrategy)",
        "step_time_s": med,
        "samples": {k: len(v) for k, v in times.items()},
        "ratio": med["ours"] / med["keras"],
        "clip_threshold": CLIP,
        "applied_update_norm": clip,
    }


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """Measure step time and the clip norm of the applied update under 2-replica MirroredStrategy.

    The measurements run in a subprocess that configures two logical CPU devices first (this
    cannot be done in a process whose TensorFlow devices are already initialised).

    Args:
        out_dir: folder (`pathlib.Path`) where `distributed.md` and `distributed.json`
            are written; created if missing.
        quick: bool, default `False`. `True`: small model, 4 rounds of 10 steps (well under
            40 s on two CPU cores); `False`: 8 rounds of 30 steps with a wider model.

    Returns:
        A dict with `"step_time_s"` (median seconds per step, `"keras"` and `"ours"`),
        `"ratio"` (ours / keras), `"target_met"` (ratio at most 1.15),
        `"applied_update_norm"` (norm of the applied update for Keras' `global_clipnorm` on
        1 and 2 replicas and for OptimizedModel's `gradient_clipping` on 2 replicas),
        `"clip_obeyed"` (per contender: norm at most threshold + 1e-4), the configuration,
        and `"markdown"` (the report).

    Raises:
        RuntimeError: if the measuring subprocess fails.

    Example:
        >>> result = run(pathlib.Path("bench_out"), quick=True)  # doctest: +SKIP
        >>> result["applied_update_norm"]["ours_gradient_clipping_2_replicas"]  # doctest: +SKIP
        1.0
    """
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    code = (
        "import json, sys\n"
        "from keras_fastloop_bench.distributed import _child\n"
        f"print('RESULT' + json.dumps(_child({bool(quick)})))\n"
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT"):
            result = json.loads(line[len("RESULT") :])
    if result is None:
        raise RuntimeError(
            f"The distributed benchmark subprocess failed (exit code {proc.returncode}). "
            f"Received: stderr={proc.stderr[-3000:]!r}"
        )
    result["target_met"] = bool(result["ratio"] <= 1.15)
    norms = result["applied_update_norm"]
    result["clip_obeyed"] = {k: bool(v <= CLIP + 1e-4) for k, v in norms.items()}
    t = result["step_time_s"]
    markdown = "\n".join(
        [
            "# Distributed: OptimizedModel vs keras.Model.fit, 2-replica MirroredStrategy",
            "",
            f"Model: {result['model']}; global batch {result['global_batch']}; "
            f"{result['devices']}. Rounds alternate between the contenders; round 0 (tracing) "
            f"and the first step of every round are excluded; median of {result['samples']['ours']} "
            "steps each.",
            "",
            "| contender | median step time (ms) |",
            "|---|---:|",
            f"| keras.Model.fit (global_clipnorm) | {t['keras'] * 1e3:.2f} |",
            f"| OptimizedModel (gradient_clipping) | {t['ours'] * 1e3:.2f} |",
            "",
            f"Ratio OptimizedModel / fit: **{result['ratio']:.3f}x** (target <= 1.15x: "
            f"{'met' if result['target_met'] else 'NOT met'}).",
            "",
            f"## Clip norm of the applied update (threshold {CLIP}, SGD lr 1, one step)",
            "",
            "| contender | norm of the applied update | obeys the clip |",
            "|---|---:|---|",
            *[
                f"| {name} | {value:.4f} | {'yes' if result['clip_obeyed'][name] else 'NO'} |"
                for name, value in norms.items()
            ],
            "",
            "Keras clips each replica's gradient before the cross-replica sum, so on 2 replicas "
            "the applied update can exceed the threshold (up to 2x); OptimizedModel clips the sum.",
            "",
        ]
    )
    result["markdown"] = markdown
    harness.write_report(
        out_dir, "distributed", markdown, {k: v for k, v in result.items() if k != "markdown"}
    )
    return result


if __name__ == "__main__":  # pragma: no cover
    print(
        run(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "bench_out"), quick=True)["markdown"]
    )
