"""Benchmark: activation memory and step time with Keras' rematerialization, micro-batching, both.

Two models train on *synthetic* tensors (seeded Gaussian noise, random labels: the data only
has to fill activations): a small Transformer encoder (pre-norm blocks of self-attention and a
feed-forward network, with Dropout) and a small ResNet (basic residual blocks with
BatchNormalization). Rematerialization is Keras' own API, one checkpoint per block:
`keras.RematScope(mode="list_of_layers", layer_names=[the blocks])`. Configurations:

- `none`: plain `OptimizedModel.fit`;
- `remat`: the blocks rematerialized;
- `micro`: `micro_batch_size=B/4`;
- `remat+micro`: both;
- `xla`, `remat+xla` (full run, Transformer only): `jit_compile=True`.

Each configuration runs in its own Python process. After one traced warm-up step, the
allocator's statistics are reset (`tf.config.experimental.reset_memory_stats("CPU:0")`) and a
few steps run: the *activation memory* is the TF allocator's peak above what it held before
(`get_memory_info("CPU:0")`). Under `jit_compile` on CPU, XLA's buffers go through the same
allocator (TF 2.21). The peak resident set size above the RSS before the steps (the kernel's
high-water mark reset through `/proc/self/clear_refs`) is reported beside it; it stays flat
once the allocator's pool has grown in the warm-up step, so it stands in only where the
allocator counted nothing. Step time: median over the steps.

The largest batch fitting a memory budget is estimated from the measured activation memory
per sample (linear in the batch: per-sample bytes = peak / samples per forward pass, where a
forward pass sees the micro-batch under micro-batching, whose peak does not grow with B).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from keras_fastloop_bench import harness

CONFIGS = {
    "none": {},
    "remat": {"remat": True},
    "micro": {"micro": True},
    "remat+micro": {"remat": True, "micro": True},
    "xla": {"jit": True},
    "remat+xla": {"remat": True, "jit": True},
}


def _sizes(quick):
    if quick:
        return {
            "transformer": {"batch": 8, "seq": 64, "width": 64, "blocks": 2, "steps": 2},
            "resnet": {"batch": 16, "size": 32, "filters": 16, "blocks": 2, "steps": 2},
        }
    return {
        "transformer": {"batch": 16, "seq": 128, "width": 128, "blocks": 4, "steps": 3},
        "resnet": {"batch": 32, "size": 32, "filters": 32, "blocks": 4, "steps": 3},
    }


def _transformer(keras, s, names):
    class EncoderBlock(keras.layers.Layer):
        def __init__(self, width, **kwargs):
            super().__init__(**kwargs)
            self.norm1 = keras.layers.LayerNormalization()
            self.attention = keras.layers.MultiHeadAttention(4, width // 4, dropout=0.1)
            self.norm2 = keras.layers.LayerNormalization()
            self.up = keras.layers.Dense(4 * width, activation="gelu")
            self.down = keras.layers.Dense(width)
            self.drop = keras.layers.Dropout(0.1)

        def call(self, x, training=None):
            h = self.norm1(x)
            x = x + self.attention(h, h, training=training)
            return x + self.drop(self.down(self.up(self.norm2(x))), training=training)

    inputs = keras.Input((s["seq"], s["width"]))
    h = inputs
    for name in names:
        h = EncoderBlock(s["width"], name=name)(h)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization()(h))
    return inputs, keras.layers.Dense(10)(h)


def _resnet(keras, s, names):
    class BasicBlock(keras.layers.Layer):
        def __init__(self, filters, **kwargs):
            super().__init__(**kwargs)
            self.conv1 = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)
            self.bn1 = keras.layers.BatchNormalization()
            self.conv2 = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)
            self.bn2 = keras.layers.BatchNormalization()

        def call(self, x, training=None):
            h = keras.ops.relu(self.bn1(self.conv1(x), training=training))
            return keras.ops.relu(x + self.bn2(self.conv2(h), training=training))

    inputs = keras.Input((s["size"], s["size"], 3))
    h = keras.layers.Conv2D(s["filters"], 3, padding="same", activation="relu")(inputs)
    for name in names:
        h = BasicBlock(s["filters"], name=name)(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return inputs, keras.layers.Dense(10)(h)


def _hwm_reset():
    """Reset the kernel's peak-RSS mark (VmHWM); False where Linux does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def _worker(workload, config, quick):
    """Train in this process and return the figures (run in a fresh subprocess)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import gc
    import time

    import keras
    import numpy as np
    import tensorflow as tf

    import keras_fastloop as kf

    s = _sizes(quick)[workload]
    options = CONFIGS[config]
    batch, steps = s["batch"], s["steps"]
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    build = _transformer if workload == "transformer" else _resnet
    shape = (s["seq"], s["width"]) if workload == "transformer" else (s["size"], s["size"], 3)
    x = rng.normal(size=(batch * steps, *shape)).astype("float32")  # synthetic
    y = rng.integers(0, 10, len(x))
    names = [f"block{i}" for i in range(s["blocks"])]
    scope = keras.RematScope(mode="list_of_layers", layer_names=names)
    keras.utils.set_random_seed(0)
    with scope if options.get("remat") else keras.RematScope(mode=None):
        inputs, outputs = build(keras, s, names)
    model = kf.OptimizedModel(inputs, outputs)
    model.compile(
        keras.optimizers.Adam(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        micro_batch_size=batch // 4 if options.get("micro") else None,
        jit_compile=bool(options.get("jit")),
    )
    # One data set for both fits, so its tensors are held before the measured steps.
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True).repeat()
    # warm-up: one step traces (and under XLA compiles) the step
    model.fit(data, steps_per_epoch=1, epochs=1, verbose=0)
    times = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, b, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, b, logs=None):
            times.append(time.perf_counter() - self.t0)

    gc.collect()
    tf.config.experimental.reset_memory_stats("CPU:0")
    allocator_before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    hwm_reset = _hwm_reset()
    rss_before = _status_kb("VmRSS")
    history = model.fit(
        data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[Clock()]
    ).history
    allocator_peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - allocator_before
    rss_peak = _status_kb("VmHWM") if hwm_reset else None
    return {
        "workload": workload,
        "config": config,
        "batch_size": batch,
        "samples_per_forward": batch // 4 if options.get("micro") else batch,
        "allocator_peak_mb": allocator_peak / 2**20,
        "rss_growth_mb": None if rss_peak is None else max(rss_peak - rss_before, 0) / 1024,
        "step_ms": 1000 * float(np.median(times)),
        "final_loss": float(history["loss"][-1]),
        "jit_compile": bool(options.get("jit")),
    }


def _run_setting(workload, config, quick):
    code = (
        "import json; from keras_fastloop_bench.memory import _worker; "
        f"print('RESULT' + json.dumps(_worker({workload!r}, {config!r}, {quick!r})))"
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[len("RESULT") :])
    raise RuntimeError(f"Memory worker failed for {workload}/{config}:\n{proc.stderr[-3000:]}")


def _measure(row):
    """The activation memory (MiB) of a row: the TF allocator's peak (XLA's CPU buffers go
    through it too), else the RSS growth where it counted nothing (it may miss small tensors)."""
    if not row["allocator_peak_mb"]:
        return row["rss_growth_mb"], "RSS"
    return row["allocator_peak_mb"], "alloc"


def _ratio(value, reference):
    return value / reference if value is not None and reference else None


def run(out_dir: pathlib.Path, quick: bool = False, budget_mb: float = 256.0) -> dict:
    """Measure activation memory and step time per configuration, each in its own process.

    Args:
        out_dir: folder (`pathlib.Path`) where `memory.md` and `memory.json` are written;
            created if missing.
        quick: bool, default `False`. `True`: tiny models, four configurations each (about
            two minutes on two shared CPU cores); `False`: the sizes in `_sizes`, plus XLA for
            the Transformer (about four minutes).
        budget_mb: float, default 256. The memory budget (MiB) for the largest-batch estimate.

    Returns:
        A dict with `"rows"` (per workload and configuration: activation memory in MiB, its
        ratio to `none` (same measure), step time in ms and its ratio, the largest batch
        estimated to fit `budget_mb`), `"target_met"` (Transformer `remat` at most 0.5x the
        memory at most 1.4x the step time), the configuration and `"markdown"` (the report).

    Raises:
        RuntimeError: if a worker process fails.

    Example:
        >>> result = run(pathlib.Path("bench_out"), quick=True)  # doctest: +SKIP
        >>> result["rows"][1]["memory_ratio"]  # doctest: +SKIP
    """
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = [
        ("transformer", ["none", "remat", "micro", "remat+micro"]),
        ("resnet", ["none", "remat", "micro", "remat+micro"]),
    ]
    if not quick:
        plan[0][1].extend(["xla", "remat+xla"])
    rows = []
    for workload, configs in plan:
        measured = [_run_setting(workload, c, quick) for c in configs]
        base = {False: measured[0]}
        base[True] = next((r for r in measured if r["config"] == "xla"), None)
        for row in measured:
            ref = base[row["jit_compile"]]
            memory, row["measure"] = _measure(row)
            row["activation_mb"] = memory
            ref_memory = None if ref is None else _measure(ref)[0]
            if ref is not None and row["measure"] != _measure(ref)[1]:
                ref_memory = ref["rss_growth_mb"]  # compare like with like
            row["memory_ratio"] = _ratio(memory, ref_memory)
            row["rss_ratio"] = _ratio(row["rss_growth_mb"], ref and ref["rss_growth_mb"])
            row["time_ratio"] = _ratio(row["step_ms"], ref and ref["step_ms"])
            per_sample = memory / row["samples_per_forward"] if memory else None
            largest = int(budget_mb / per_sample) if per_sample else None
            if row["samples_per_forward"] != row["batch_size"]:
                row["largest_batch_in_budget"] = f"any (micro-batch <= {largest})"
            else:
                row["largest_batch_in_budget"] = largest
            rows.append(row)
    transformer_remat = next(
        r for r in rows if (r["workload"], r["config"]) == ("transformer", "remat")
    )
    target_met = bool(
        transformer_remat["memory_ratio"] is not None
        and transformer_remat["memory_ratio"] <= 0.5
        and transformer_remat["time_ratio"] <= 1.4
    )
    sizes = _sizes(quick)
    result = {
        "suite": "memory",
        "machine": harness.machine_description(),
        "sizes": sizes,
        "budget_mb": budget_mb,
        "measure": (
            "TF allocator peak over a few steps after a traced warm-up step "
            "(get_memory_info('CPU:0')['peak'] after reset_memory_stats, minus the bytes held "
            "before; XLA's buffers included), beside the peak RSS growth (VmHWM after "
            "clear_refs minus VmRSS before: flat once the allocator's pool is grown); median step time; one fresh process per configuration"
        ),
        "rows": rows,
        "target_met": target_met,
    }
    lines = [
        "| model | configuration | batch | activation memory (MiB) | ratio | RSS growth (MiB) "
        f"| ratio | step (ms) | ratio | largest batch in {budget_mb:.0f} MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        measure = r["measure"]

        def fmt(v, spec):
            return "n/a" if v is None else format(v, spec)

        lines.append(
            f"| {r['workload']} | {r['config']} | {r['batch_size']} | "
            f"{fmt(r['activation_mb'], '.1f')} ({measure}) | {fmt(r['memory_ratio'], '.2f')} | "
            f"{fmt(r['rss_growth_mb'], '.1f')} | {fmt(r['rss_ratio'], '.2f')} | "
            f"{r['step_ms']:.0f} | {fmt(r['time_ratio'], '.2f')} | "
            f"{r['largest_batch_in_budget']} |"
        )
    t, n = sizes["transformer"], sizes["resnet"]
    markdown = "\n".join(
        [
            "# Memory: Keras' rematerialization and micro-batching in OptimizedModel.fit",
            "",
            f"Machine: {result['machine']}.",
            f"Transformer encoder: {t['blocks']} pre-norm blocks, sequence {t['seq']}, width "
            f"{t['width']}, 4 heads, Dropout 0.1. ResNet: {n['blocks']} basic blocks of "
            f"{n['filters']} filters on {n['size']}x{n['size']}x3. Synthetic data; Adam. "
            "Remat: `keras.RematScope(mode='list_of_layers')` on the blocks; micro: "
            "`micro_batch_size=B/4`.",
            f"Measure: {result['measure']}. Ratios are to `none` (to `xla` under XLA).",
            "",
            *lines,
            "",
            f"Target (Transformer remat <= 0.5x memory at <= 1.4x step time): "
            f"{'met' if target_met else 'NOT met'}.",
            "",
        ]
    )
    result["markdown"] = markdown
    harness.write_report(
        out_dir, "memory", markdown, {k: v for k, v in result.items() if k != "markdown"}
    )
    return result


if __name__ == "__main__":  # pragma: no cover
    print(
        run(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "bench_out"), quick=True)["markdown"]
    )
