"""Multi-task benchmark: every loss weighting method on real digits, classify + segment.

Data: scikit-learn's `load_digits` (1797 real 8x8 handwritten digits, offline). Task `cls`:
the digit (10 classes). Task `seg`: the ink mask of the *clean* image (pixel > 4 of 16). The
network sees a corrupted image: Gaussian noise (sigma 0.35 on the [0, 1] scale) and one random
3x3 patch blanked out, so segmentation needs the shape, not a threshold, and competes with
classification for the shared trunk. Fixed 80/20 split (seed 0).

Model: a shared conv trunk (two 3x3 conv layers, 16 channels) with a classification head
(flatten + dense softmax) and a segmentation head (1x1 conv, sigmoid). For each seed the initial
weights are drawn once and every contender starts from them, with the same optimizer (Adam
3e-3), batch size (64), number of epochs and data order. Methods run with their defaults
(`dwa`'s averaging window is one epoch, its default since the window became epoch-based;
the bench used to pass `DWA(window=steps_per_epoch)` explicitly). Single-task baselines (STL)
train the same two-head network with the other task's loss removed.

Reported per method: test accuracy, test IoU of the ink mask, Delta_m as LibMTL defines it,
`Delta_m = 100/T * sum_i (-1)^{l_i} (M_i - M_i^STL) / M_i^STL` (`l_i = 1` when lower is
better; both metrics here are higher-is-better), and the steady-state step time relative to
`ew`, measured side by side after training: in each of 6 rounds (2 when quick) the last
seed's trained model of every method runs one epoch back to back with `ew`'s (`ew` first in
even rounds, second in odd ones), a batch callback times every step but the first two of each
epoch, and the ratio is the median over rounds of (method's median step / `ew`'s). Targets: loss-based methods <= 1.05x `ew`, gradient-based <= (T + 0.5)x.
Numbers are whatever this machine measures.
"""

from __future__ import annotations

import statistics
import time
import warnings
from pathlib import Path

import numpy as np

from keras_fastloop import _timing

SUITE = "multitask"
LOSS_BASED = ("ew", "loss_ema", "uw", "dwa", "rlw", "famo")
GRADIENT_BASED = (
    "gradnorm",
    "pcgrad",
    "cagrad",
    "mgda",
    "imtl",
    "imtl_g",
    "nash_mtl",
    "aligned_mtl",
    "upgrad",
)
TASKS = ("cls", "seg")


def load_data(seed=0):
    """Digits as `(x_train, y_train, x_test, y_test)` with `y` dicts `{"cls", "seg"}`."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    clean = (digits.images / 16.0).astype("float32")
    rng = np.random.default_rng(seed)
    noisy = clean + rng.normal(0.0, 0.35, clean.shape).astype("float32")
    for image in noisy:
        r, c = rng.integers(0, 6, size=2)
        image[r : r + 3, c : c + 3] = 0.0
    mask = (digits.images > 4).astype("float32")[..., None]
    order = rng.permutation(len(clean))
    split = int(0.8 * len(clean))
    train, test = order[:split], order[split:]
    x = noisy[..., None]
    y = {"cls": digits.target.astype("int32"), "seg": mask}
    return (
        x[train],
        {k: v[train] for k, v in y.items()},
        x[test],
        {k: v[test] for k, v in y.items()},
    )


def build_model():
    import keras

    from keras_fastloop import OptimizedModel

    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="trunk_1")(inputs)
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="trunk_2")(h)
    cls = keras.layers.Dense(10, activation="softmax", name="cls")(keras.layers.Flatten()(h))
    seg = keras.layers.Conv2D(1, 1, activation="sigmoid", name="seg")(h)
    return OptimizedModel(inputs, {"cls": cls, "seg": seg})


class StepTimer:
    """Keras callback recording the wall time of every training step."""

    def __new__(cls):
        import keras

        class _Timer(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.times = []

            def on_train_batch_begin(self, batch, logs=None):
                self._t = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                self.times.append(time.perf_counter() - self._t)

        return _Timer()


def evaluate(model, x, y):
    pred = {k: np.asarray(v) for k, v in model(x, training=False).items()}
    accuracy = float(np.mean(np.argmax(pred["cls"], -1) == y["cls"]))
    p, t = pred["seg"] > 0.5, y["seg"] > 0.5
    iou = float(np.logical_and(p, t).sum() / max(np.logical_or(p, t).sum(), 1))
    pixel = float(np.mean(p == t))
    return {"accuracy": accuracy, "iou": iou, "pixel_accuracy": pixel}


def train_one(method, initial, data, epochs, batch_size=64):
    """Train one contender from `initial` weights; return `(metrics and step times, model)`."""
    import keras

    x, y, x_test, y_test = data
    model = build_model()
    model.set_weights(initial)
    loss = {"cls": "sparse_categorical_crossentropy", "seg": "binary_crossentropy"}
    kwargs = {}
    if method in ("stl_cls", "stl_seg"):
        loss[{"stl_cls": "seg", "stl_seg": "cls"}[method]] = None
    else:
        kwargs["loss_weighting"] = method
    model.compile(keras.optimizers.Adam(3e-3), loss, **kwargs)
    timer = StepTimer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # STL: the unused head gets no gradient
        history = model.fit(
            x,
            y,
            batch_size=batch_size,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=[timer],
        ).history
    steps_per_epoch = -(-len(x) // batch_size)
    steady = [t for i, t in enumerate(timer.times) if i % steps_per_epoch >= 2 or i >= 2]
    result = evaluate(model, x_test, y_test)
    result["step_time_ms"] = 1e3 * statistics.median(steady[1:] if len(steady) > 1 else steady)
    result["final_weights"] = [
        float(history[f"{t}_weight"][-1]) for t in TASKS if f"{t}_weight" in history
    ]
    return result, model


def _epoch_step_ms(model, x, y, batch_size):
    """Median step time (ms) of one training epoch, the first two steps left out."""
    timer = StepTimer()
    with warnings.catch_warnings(), _timing.collector_paused():
        warnings.simplefilter("ignore")
        model.fit(
            x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[timer]
        )
    return 1e3 * statistics.median(timer.times[2:] or timer.times)


def paired_step_time_ratios(models, x, y, rounds, batch_size=64, reference="ew"):
    """Each method's steady-state step time relative to `reference`, timed in adjacent pairs.

    Per round and method, one epoch of the method and one of the reference run back to back
    (reference first in even rounds, the method first in odd ones), so the two see the same
    state of the machine. Returns `{method: [ratio per round]}` (the reference: all ones) and
    `{method: [median step ms per round]}`.
    """
    ratios = {reference: [1.0] * rounds}
    step_ms = {name: [] for name in models}
    for r in range(rounds):
        for name in models:
            if name == reference:
                continue
            pair = (reference, name) if r % 2 == 0 else (name, reference)
            times = {n: _epoch_step_ms(models[n], x, y, batch_size) for n in pair}
            ratios.setdefault(name, []).append(times[name] / times[reference])
            step_ms[name].append(times[name])
            step_ms[reference].append(times[reference])
    return ratios, step_ms


def delta_m(metrics, baseline):
    """LibMTL's Delta_m in percent (both metrics higher-is-better)."""
    terms = [(metrics[k] - baseline[k]) / baseline[k] for k in ("accuracy", "iou")]
    return 100.0 * sum(terms) / len(terms)


def _mean_std(values):
    values = list(values)
    return float(np.mean(values)), float(np.std(values))


def run(out_dir: Path, quick: bool = False, methods: tuple[str, ...] | None = None) -> dict:
    """Run the suite and write `multitask.md`, `multitask.json`, `multitask.png`.

    Args:
        out_dir: folder for the report (created if missing).
        quick: 1 seed, 2 epochs on 640 training images (for tests and notebooks, well under a
            minute); otherwise 3 seeds, 8 epochs on the full training split.
        methods: the weighting method ids to compare (`ew`, the reference of the step times,
            is always included). Default: every method of `LOSS_BASED + GRADIENT_BASED`.

    Returns:
        The results dict (also written as JSON) with a `"markdown"` table.
    """
    import keras

    from keras_fastloop.bench.harness import machine_description, write_report

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seeds = (0,) if quick else (0, 1, 2)
    epochs = 2 if quick else 8
    data = load_data()
    if quick:
        data = (data[0][:640], {k: v[:640] for k, v in data[1].items()}, *data[2:])
    if methods is None:
        methods = LOSS_BASED + GRADIENT_BASED
    unknown = sorted(set(methods) - set(LOSS_BASED + GRADIENT_BASED))
    if unknown:
        raise ValueError(
            f"`methods` must be ids of {LOSS_BASED + GRADIENT_BASED} (unknown: {unknown}). "
            f"Received: methods={methods!r}"
        )
    methods = ("ew", *(m for m in methods if m != "ew"))
    raw = {m: [] for m in ("stl_cls", "stl_seg", *methods)}
    t0 = time.perf_counter()
    trained = {}
    for seed in seeds:
        keras.utils.set_random_seed(seed)
        initial = build_model().get_weights()
        for method in raw:
            keras.utils.set_random_seed(seed)
            result, trained[method] = train_one(method, initial, data, epochs)
            raw[method].append(result)
            keras.backend.clear_session()
    # Step times side by side: the last seed's trained models, each paired with `ew`.
    rounds = 2 if quick else 6
    ratios, step_ms = paired_step_time_ratios(
        {m: trained[m] for m in methods}, data[0], data[1], rounds
    )
    del trained
    baseline = {
        "accuracy": float(np.mean([r["accuracy"] for r in raw["stl_cls"]])),
        "iou": float(np.mean([r["iou"] for r in raw["stl_seg"]])),
    }
    rows = {}
    for method in methods:
        runs = raw[method]
        per_seed_dm = [
            delta_m(r, {"accuracy": c["accuracy"], "iou": s["iou"]})
            for r, c, s in zip(runs, raw["stl_cls"], raw["stl_seg"])
        ]
        step = statistics.median(step_ms[method])
        per_round = ratios[method]
        family = "loss" if method in LOSS_BASED else "gradient"
        target = 1.05 if family == "loss" else len(TASKS) + 0.5
        acc, acc_sd = _mean_std(r["accuracy"] for r in runs)
        iou, iou_sd = _mean_std(r["iou"] for r in runs)
        dm, dm_sd = _mean_std(per_seed_dm)
        rows[method] = {
            "family": family,
            "accuracy": acc,
            "accuracy_std": acc_sd,
            "iou": iou,
            "iou_std": iou_sd,
            "pixel_accuracy": float(np.mean([r["pixel_accuracy"] for r in runs])),
            "delta_m": dm,
            "delta_m_std": dm_sd,
            "step_time_ms": step,
            "relative_step_time": statistics.median(per_round),
            "per_round_relative_step_time": per_round,
            "step_time_during_training_ms": statistics.median(r["step_time_ms"] for r in runs),
            "step_time_target": target,
            "meets_target": bool(statistics.median(per_round) <= target),
            "final_weights": runs[-1]["final_weights"],
        }
    elapsed = time.perf_counter() - t0
    config = {
        "seeds": list(seeds),
        "epochs": epochs,
        "batch_size": 64,
        "optimizer": "Adam(3e-3)",
        "train_samples": int(len(data[0])),
        "test_samples": int(len(data[2])),
        "quick": quick,
        "seconds": elapsed,
        "timing_rounds": rounds,
        "machine": machine_description(),
    }
    markdown = _markdown(rows, baseline, raw, config)
    result = {
        "suite": SUITE,
        "config": config,
        "baselines": {
            "stl_accuracy": baseline["accuracy"],
            "stl_iou": baseline["iou"],
            "stl_cls_step_time_ms": statistics.median(r["step_time_ms"] for r in raw["stl_cls"]),
        },
        "methods": rows,
        "markdown": markdown,
    }
    write_report(out_dir, SUITE, markdown, result)  # strict JSON: NaN -> null
    _plot(rows, out_dir / f"{SUITE}.png", config)
    return result


def _markdown(rows, baseline, raw, config):
    lines = [
        f"## Multi-task weighting on digits (classify + segment ink), "
        f"{len(config['seeds'])} seed(s), {config['epochs']} epochs",
        "",
        f"STL baselines: accuracy {baseline['accuracy']:.4f}, IoU {baseline['iou']:.4f}. "
        f"Step time: median steady-state step; × ew: median over {config['timing_rounds']} "
        "rounds of one epoch back to back with `ew` (order alternating); target <= 1.05x "
        "(loss-based), "
        f"<= {len(TASKS) + 0.5}x (gradient-based, T={len(TASKS)}).",
        "",
        "| method | family | accuracy | IoU | Δm (%) | step (ms) | × ew | target met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method, r in rows.items():
        lines.append(
            f"| {method} | {r['family']} | {r['accuracy']:.4f} ± {r['accuracy_std']:.4f} | "
            f"{r['iou']:.4f} ± {r['iou_std']:.4f} | {r['delta_m']:+.2f} ± {r['delta_m_std']:.2f} "
            f"| {r['step_time_ms']:.2f} | {r['relative_step_time']:.2f} | "
            f"{'yes' if r['meets_target'] else 'no'} |"
        )
    lines += ["", f"Machine: {config['machine']}. Wall time {config['seconds']:.0f} s.", ""]
    return "\n".join(lines)


def _plot(rows, path, config):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    colors = ["tab:blue" if rows[m]["family"] == "loss" else "tab:orange" for m in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(
        names,
        [rows[m]["delta_m"] for m in names],
        yerr=[rows[m]["delta_m_std"] for m in names],
        color=colors,
    )
    ax1.axhline(0.0, color="black", linewidth=0.8)
    ax1.set_ylabel("Δm vs single-task (%)")
    ax1.set_title("Accuracy + IoU, relative to STL")
    ax1.tick_params(axis="x", rotation=45)
    for m, c in zip(names, colors):
        ax2.scatter(rows[m]["relative_step_time"], rows[m]["delta_m"], color=c)
        ax2.annotate(m, (rows[m]["relative_step_time"], rows[m]["delta_m"]), fontsize=8)
    ax2.axvline(1.05, color="tab:blue", linestyle=":", linewidth=0.8)
    ax2.axvline(len(TASKS) + 0.5, color="tab:orange", linestyle=":", linewidth=0.8)
    ax2.set_xlabel("step time / ew")
    ax2.set_ylabel("Δm (%)")
    ax2.set_title(f"{len(config['seeds'])} seed(s), {config['epochs']} epochs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
