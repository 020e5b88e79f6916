"""Benchmark: peak memory of one training step with micro-batching, and equality of the updates.

A small convolutional network (no BatchNorm/Dropout) trains on *synthetic* 64x64x3 tensors
(seeded Gaussian noise with random integer labels — the data only has to fill activations)
with `micro_batch_size` k in {B, B/2, B/4}. Each setting runs in a fresh Python process so the
peak measurement is not polluted by the others:

- TensorFlow's allocator statistics (`tf.config.experimental.get_memory_info("CPU:0")`) are
  tried first; TensorFlow does not support them for CPU devices, and then the peak resident set
  size is used: `resource.getrusage(RUSAGE_SELF).ru_maxrss` at the end minus the RSS
  (`psutil`) right before `fit`, after the model, the data and the optimizer are built.
  That growth includes tracing the step once (the same for every k) and the activations.
- The final weights of every setting are compared with those of the full batch (k = B).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

from keras_fastloop_bench import harness

_SIZE = 64


def _worker(k, batch, steps, weights_path):
    """Train in this process and return the memory figures (run in a fresh subprocess)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import resource

    import keras
    import numpy as np
    import psutil
    import tensorflow as tf

    import keras_fastloop as kf

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, _SIZE, _SIZE, 3)).astype("float32")  # synthetic
    y = rng.integers(0, 10, batch * steps)
    inputs = keras.Input((_SIZE, _SIZE, 3))
    h = inputs
    for filters in (32, 32, 32):
        h = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = kf.OptimizedModel(inputs, keras.layers.Dense(10)(h))
    model.compile(
        keras.optimizers.SGD(0.05, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        micro_batch_size=k,
        jit_compile=False,
    )
    model.optimizer.build(model.trainable_variables)
    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
        allocator_before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    except (ValueError, RuntimeError):
        allocator_before = None
    before = psutil.Process().memory_info().rss
    history = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0).history
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    allocator_peak = None
    if allocator_before is not None:
        allocator_peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - allocator_before
    np.savez(weights_path, *model.get_weights())
    return {
        "micro_batch_size": k,
        "rss_before_fit_mb": before / 2**20,
        "peak_rss_mb": peak / 2**20,
        "peak_growth_mb": max(peak - before, 0) / 2**20,
        "final_loss": float(history["loss"][-1]),
        "allocator_stats_on_cpu": allocator_before is not None,
        "allocator_peak_mb": None if allocator_peak is None else allocator_peak / 2**20,
    }


def _run_setting(k, batch, steps, weights_path):
    code = (
        "import json, sys; from keras_fastloop_bench.micro_batching import _worker; "
        f"print('RESULT' + json.dumps(_worker({k}, {batch}, {steps}, {str(weights_path)!r})))"
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[len("RESULT") :])
    raise RuntimeError(f"Benchmark worker failed for micro_batch_size={k}:\n{proc.stderr[-3000:]}")


def run(out_dir: pathlib.Path, quick: bool = False) -> dict:
    """Measure peak memory per micro-batch size and check the updates are equal.

    Args:
        out_dir: folder (`pathlib.Path`) where `micro_batching.md` and
            `micro_batching.json` are written; created if missing.
        quick: bool, default `False`. `True`: batch 32, one step (about half a minute
            on two CPU cores); `False`: batch 64, three steps.

    Returns:
        A dict with `"settings"` (one entry per k: peak RSS growth in MiB, ratio to the full
        batch, max absolute weight difference to the full batch), `"target_met"` (peak at
        k = B/4 at most 0.5x the full batch's), `"updates_equal"` (all weight differences
        at most 1e-5), the configuration, and `"markdown"` (the report).

    Raises:
        RuntimeError: if a worker process fails.

    Example:
        >>> result = run(pathlib.Path("bench_out"), quick=True)  # doctest: +SKIP
        >>> result["settings"][-1]["ratio_to_full_batch"]  # doctest: +SKIP
    """
    import numpy as np

    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    batch, steps = (32, 1) if quick else (64, 3)
    settings = []
    with tempfile.TemporaryDirectory() as tmp:
        weights = {}
        for k in (batch, batch // 2, batch // 4):
            path = pathlib.Path(tmp) / f"w{k}.npz"
            settings.append(_run_setting(k, batch, steps, path))
            with np.load(path) as data:
                weights[k] = [data[name] for name in sorted(data.files, key=lambda s: int(s[4:]))]
    key = "allocator_peak_mb" if settings[0]["allocator_stats_on_cpu"] else "peak_growth_mb"
    for s in settings:
        s["ratio_to_full_batch"] = s[key] / settings[0][key] if settings[0][key] else float("nan")
        s["rss_ratio_to_full_batch"] = s["peak_growth_mb"] / max(
            settings[0]["peak_growth_mb"], 1e-9
        )
        s["max_abs_weight_diff"] = float(
            max(np.abs(a - b).max() for a, b in zip(weights[s["micro_batch_size"]], weights[batch]))
        )
    result = {
        "data": f"synthetic Gaussian 64x64x3 tensors, 10 random labels, batch {batch}, {steps} step(s)",
        "model": "3x Conv2D(32, 3x3, same, relu) -> GlobalAveragePooling2D -> Dense(10); SGD(0.05, momentum=0.9)",
        "measure": (
            "TF allocator peak during fit (get_memory_info('CPU:0')['peak'] after "
            "reset_memory_stats, minus the bytes held before fit) when TensorFlow supports it, "
            "and peak RSS growth during fit (ru_maxrss - RSS before fit); fresh process per setting"
        ),
        "ratio_based_on": key,
        "batch_size": batch,
        "steps": steps,
        "settings": settings,
        "target_met": bool(settings[-1]["ratio_to_full_batch"] <= 0.5),
        "updates_equal": bool(all(s["max_abs_weight_diff"] <= 1e-5 for s in settings)),
    }
    rows = [
        "| micro_batch_size | TF allocator peak (MiB) | ratio | peak RSS growth (MiB) | ratio "
        "| max abs weight diff |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for s in settings:
        alloc = "n/a" if s["allocator_peak_mb"] is None else f"{s['allocator_peak_mb']:.1f}"
        alloc_ratio = "n/a" if s["allocator_peak_mb"] is None else f"{s['ratio_to_full_batch']:.2f}"
        rows.append(
            f"| {s['micro_batch_size']} | {alloc} | {alloc_ratio} | {s['peak_growth_mb']:.1f} | "
            f"{s['rss_ratio_to_full_batch']:.2f} | {s['max_abs_weight_diff']:.2e} |"
        )
    markdown = "\n".join(
        [
            "# Micro-batching: peak memory",
            "",
            f"Data: {result['data']}. Model: {result['model']}.",
            f"Measure: {result['measure']}. TF allocator statistics on CPU: "
            f"{'available' if settings[0]['allocator_stats_on_cpu'] else 'not supported'}.",
            "",
            *rows,
            "",
            f"Target (peak at k = B/4 <= 0.5x full batch, by {key}): "
            f"{'met' if result['target_met'] else 'NOT met'}. "
            f"Updates equal (<= 1e-5): {'yes' if result['updates_equal'] else 'NO'}.",
            "",
        ]
    )
    result["markdown"] = markdown
    harness.write_report(
        out_dir, "micro_batching", markdown, {k: v for k, v in result.items() if k != "markdown"}
    )
    return result


if __name__ == "__main__":  # pragma: no cover
    print(
        run(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "bench_out"), quick=True)["markdown"]
    )
