"""Multi-task benchmark: every loss weighting method on two overlapping digits (MultiMNIST-style).

Data: scikit-learn's `load_digits` (1797 real 8x8 handwritten digits, offline), split 80/20
(seed 0) *before* pairing, so no test digit is seen in training. Every image is a pair of
digits on an 11x11 canvas, as Sener & Koltun's MultiMNIST (and PCGrad's, CAGrad's and
Nash-MTL's experiments) build it from MNIST: the left digit in the top-left corner, the right
one shifted 3 pixels right and down, the two combined by a pixel-wise maximum (they overlap on
5x5 of their 8x8 pixels). Task `left`: the left digit (10 classes); task `right`: the right
digit. Both need the shared trunk to tell the strokes of two overlapping digits apart, so the
tasks compete for its features. 2000 training pairs, 1000 test pairs (each a fixed random
pairing; seed 0).

Model: a shared trunk (3x3 conv, 16 channels; 2x2 max-pool; 3x3 conv, 32 channels; dense 64)
and one dense softmax head per task. For each seed the initial weights are drawn once and every
contender starts from them, with the same optimizer (Adam 3e-3), batch size (64), number of
epochs and data order. Methods run with their defaults: by default the 17 of `LOSS_BASED +
GRADIENT_BASED` (within 10 minutes on 2 CPU cores), every registered one with
`methods="all"` (`keras-fastloop bench --suite multitask --methods all`). Single-task baselines (STL) train the
same two-head network with the other task's loss removed.

Reported per method: test accuracy of each task; Delta_m as LibMTL defines it,
`Delta_m = 100/T * sum_i (M_i - M_i^STL) / M_i^STL` (both metrics higher-is-better), per seed
against that seed's STL runs, as mean and standard error over seeds; the paired difference
to `ew` (same seed, same initial weights and data order) with its standard error and a paired
t-test (two-sided, 5 %); and the steady-state step time relative to `ew`, measured side by
side after training: in each of 4 rounds (2 when quick) the last seed's trained model of every
method runs one epoch back to back with `ew`'s (`ew` first in even rounds, second in odd ones),
a batch callback times every step but the first two of each epoch, and the ratio is the median
over rounds of (method's median step / `ew`'s). Targets: loss-based methods <= 1.05x `ew`,
gradient-based <= (T + 0.5)x. Numbers are whatever this machine measures.
"""

from __future__ import annotations

import statistics
import time
import warnings
from pathlib import Path

import numpy as np

from keras_fastloop import _timing

SUITE = "multitask"
LOSS_BASED = ("ew", "loss_ema", "uw", "dwa", "rlw", "famo", "gls", "stch")
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
# The default subset (17 methods, within the 10-minute budget on 2 CPU cores); `methods="all"`
# runs every registered method (`all_methods`).


def all_methods():
    """Every registered weighting id but `static` (`ew` with fixed weights), `ew` first."""
    from keras_fastloop import weighting

    return ("ew", *(m for m in weighting.METHODS if m not in ("ew", "static")))


def is_gradient_based(method):
    """Whether the method decides its weights from per-task gradients (registry's own flag)."""
    from keras_fastloop import weighting

    return weighting.get(method).requires_task_gradients


TASKS = ("left", "right")
CANVAS = 11  # pixels; the right digit starts at (SHIFT, SHIFT)
SHIFT = 3


def _pairs(images, labels, count, rng):
    left = rng.integers(0, len(images), size=count)
    right = rng.integers(0, len(images), size=count)
    canvas = np.zeros((count, CANVAS, CANVAS), "float32")
    canvas[:, :8, :8] = images[left]
    canvas[:, SHIFT : SHIFT + 8, SHIFT : SHIFT + 8] = np.maximum(
        canvas[:, SHIFT : SHIFT + 8, SHIFT : SHIFT + 8], images[right]
    )
    return canvas[..., None], {"left": labels[left], "right": labels[right]}


def load_data(seed=0, train_pairs=2000, test_pairs=1000):
    """Two-digit images as `(x_train, y_train, x_test, y_test)`, `y` dicts `{"left", "right"}`.

    `x` has shape `(n, 11, 11, 1)` in `[0, 1]`; labels are int32 digits. Training pairs are
    drawn from the first 80 % of a seed-0 permutation of the digits, test pairs from the rest.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")
    labels = digits.target.astype("int32")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(images))
    split = int(0.8 * len(images))
    train, test = order[:split], order[split:]
    x, y = _pairs(images[train], labels[train], train_pairs, rng)
    x_test, y_test = _pairs(images[test], labels[test], test_pairs, rng)
    return x, y, x_test, y_test


def build_model():
    import keras

    from keras_fastloop import OptimizedModel

    inputs = keras.Input((CANVAS, CANVAS, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="trunk_1")(inputs)
    h = keras.layers.MaxPooling2D(2)(h)
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="trunk_2")(h)
    h = keras.layers.Dense(64, activation="relu", name="trunk_3")(keras.layers.Flatten()(h))
    outputs = {t: keras.layers.Dense(10, activation="softmax", name=t)(h) for t in TASKS}
    return OptimizedModel(inputs, outputs)


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
    return {f"{t}_accuracy": float(np.mean(np.argmax(pred[t], -1) == y[t])) for t in TASKS}


STL = {f"stl_{t}": t for t in TASKS}


def train_one(method, initial, data, epochs, batch_size=64):
    """Train one contender from `initial` weights; return `(metrics and step times, model)`."""
    import keras

    x, y, x_test, y_test = data
    model = build_model()
    model.set_weights(initial)
    loss = {t: "sparse_categorical_crossentropy" for t in TASKS}
    kwargs = {}
    if method in STL:
        for t in TASKS:
            if t != STL[method]:
                loss[t] = None
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
    steady = [t for i, t in enumerate(timer.times) if i % steps_per_epoch >= 2]
    result = evaluate(model, x_test, y_test)
    result["step_time_ms"] = 1e3 * statistics.median(steady or timer.times)
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
    """LibMTL's Delta_m in percent (every metric higher-is-better): `100/T sum_i (M_i - B_i) / B_i`.

    `metrics` and `baseline` map `"{task}_accuracy"` to accuracies.
    """
    keys = [f"{t}_accuracy" for t in TASKS]
    return 100.0 * sum((metrics[k] - baseline[k]) / baseline[k] for k in keys) / len(keys)


def mean_se(values):
    """Mean and standard error (`std(ddof=1) / sqrt(n)`; NaN for one value)."""
    values = np.asarray(list(values), "float64")
    if len(values) < 2:
        return float(values.mean()), float("nan")
    return float(values.mean()), float(values.std(ddof=1) / np.sqrt(len(values)))


def paired_test(differences, level=0.05):
    """Paired t-test of per-seed differences: `(mean, se, t, p, significant)` (two-sided).

    NaN (and not significant) with fewer than two seeds; a zero standard error with a non-zero
    mean counts as significant.
    """
    from scipy import stats

    mean, se = mean_se(differences)
    n = len(list(differences))
    if n < 2 or not np.isfinite(se):
        return mean, se, float("nan"), float("nan"), False
    if se == 0.0:
        return mean, se, float("inf") if mean else 0.0, 0.0 if mean else 1.0, bool(mean)
    t = mean / se
    p = float(2.0 * stats.t.sf(abs(t), df=n - 1))
    return mean, se, float(t), p, bool(p < level)


def run(
    out_dir: Path,
    quick: bool = False,
    methods: tuple[str, ...] | str | None = None,
    seeds: int | None = None,
    epochs: int | None = None,
) -> dict:
    """Run the suite and write `multitask.md`, `multitask.json`, `multitask.png`.

    Args:
        out_dir: folder for the report (created if missing).
        quick: 2 seeds, 1 epoch on 640 training pairs (for tests and notebooks, well under a
            minute); otherwise 5 seeds, 6 epochs on the 2000 training pairs.
        methods: the weighting method ids to compare (`ew`, the reference of the step times
            and of the paired comparison, is always included), or `"all"`: every registered
            method (`all_methods()`). Default: `LOSS_BASED + GRADIENT_BASED`.
        seeds: number of seeds (overrides the mode's; at least 1).
        epochs: epochs per run (overrides the mode's; at least 1).

    Returns:
        The results dict (also written as JSON) with a `"markdown"` table.

    Raises:
        ValueError: for unknown method ids or a `seeds`/`epochs` below 1.
    """
    import keras

    from keras_fastloop import _validation
    from keras_fastloop_bench.harness import machine_description, write_report

    out_dir = Path(out_dir)
    n_seeds = (
        (2 if quick else 5) if seeds is None else _validation.check_int("seeds", seeds, minimum=1)
    )
    epochs = (
        (1 if quick else 6)
        if epochs is None
        else _validation.check_int("epochs", epochs, minimum=1)
    )
    if methods is None:
        methods = LOSS_BASED + GRADIENT_BASED
    elif methods == "all":
        methods = all_methods()
    known = all_methods()
    unknown = sorted(set(methods) - set(known)) if not isinstance(methods, str) else [methods]
    if unknown:
        raise ValueError(
            f'`methods` must be "all" or ids of {known} (unknown: {unknown}). '
            f"Received: methods={methods!r}"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    seed_list = tuple(range(n_seeds))
    data = load_data()
    if quick:
        data = (data[0][:640], {k: v[:640] for k, v in data[1].items()}, *data[2:])
    methods = ("ew", *(m for m in methods if m != "ew"))
    raw = {m: [] for m in (*STL, *methods)}
    t0 = time.perf_counter()
    trained = {}
    for seed in seed_list:
        keras.utils.set_random_seed(seed)
        initial = build_model().get_weights()
        for method in raw:
            keras.utils.set_random_seed(seed)
            result, trained[method] = train_one(method, initial, data, epochs)
            raw[method].append(result)
            keras.backend.clear_session()
    training_seconds = time.perf_counter() - t0
    # Step times side by side: the last seed's trained models, each paired with `ew`.
    rounds = 2 if quick else 4
    ratios, step_ms = paired_step_time_ratios(
        {m: trained[m] for m in methods}, data[0], data[1], rounds
    )
    del trained
    stl = [
        {f"{t}_accuracy": raw[f"stl_{t}"][s][f"{t}_accuracy"] for t in TASKS}
        for s in range(n_seeds)
    ]
    baseline = {k: float(np.mean([b[k] for b in stl])) for k in stl[0]}
    per_seed = {m: [delta_m(r, b) for r, b in zip(raw[m], stl)] for m in methods}
    rows = {}
    for method in methods:
        runs = raw[method]
        step = statistics.median(step_ms[method])
        per_round = ratios[method]
        family = "gradient" if is_gradient_based(method) else "loss"
        target = 1.05 if family == "loss" else len(TASKS) + 0.5
        row = {"family": family}
        for t in TASKS:
            mean, se = mean_se(r[f"{t}_accuracy"] for r in runs)
            row[f"{t}_accuracy"], row[f"{t}_accuracy_se"] = mean, se
        row["delta_m"], row["delta_m_se"] = mean_se(per_seed[method])
        row["delta_m_per_seed"] = per_seed[method]
        diff = [a - b for a, b in zip(per_seed[method], per_seed["ew"])]
        d, d_se, t_stat, p, significant = paired_test(diff)
        row.update(
            {
                "delta_m_vs_ew": d,
                "delta_m_vs_ew_se": d_se,
                "paired_t": t_stat,
                "paired_p": p,
                "differs_from_ew": significant if method != "ew" else False,
                "step_time_ms": step,
                "relative_step_time": statistics.median(per_round),
                "per_round_relative_step_time": per_round,
                "step_time_during_training_ms": statistics.median(r["step_time_ms"] for r in runs),
                "step_time_target": target,
                "meets_target": bool(statistics.median(per_round) <= target),
                "final_weights": runs[-1]["final_weights"],
            }
        )
        rows[method] = row
    elapsed = time.perf_counter() - t0
    config = {
        "seeds": list(seed_list),
        "epochs": epochs,
        "batch_size": 64,
        "optimizer": "Adam(3e-3)",
        "train_samples": int(len(data[0])),
        "test_samples": int(len(data[2])),
        "canvas": [CANVAS, CANVAS],
        "shift": SHIFT,
        "quick": quick,
        "seconds": elapsed,
        "training_seconds": training_seconds,
        "timing_rounds": rounds,
        "machine": machine_description(),
    }
    markdown = _markdown(rows, baseline, config)
    result = {
        "suite": SUITE,
        "config": config,
        "baselines": {
            **{f"stl_{k}": v for k, v in baseline.items()},
            "stl_step_time_ms": statistics.median(r["step_time_ms"] for r in raw["stl_left"]),
        },
        "methods": rows,
        "markdown": markdown,
    }
    write_report(out_dir, SUITE, markdown, result)  # strict JSON: NaN -> null
    _plot(rows, out_dir / f"{SUITE}.png", config)
    return result


def verdict(rows, n_seeds):
    """One sentence: which methods differ from `ew` beyond the paired test, or that none do."""
    if n_seeds < 2:
        return "One seed: no standard errors, so no method can be told apart from `ew`."
    better = [m for m, r in rows.items() if r["differs_from_ew"] and r["delta_m_vs_ew"] > 0]
    worse = [m for m, r in rows.items() if r["differs_from_ew"] and r["delta_m_vs_ew"] < 0]
    if not better and not worse:
        return (
            f"No method's Δm differs from `ew`'s beyond the noise at this size: every paired "
            f"difference over the {n_seeds} seeds is within its 95 % interval (paired t-test)."
        )
    parts = []
    if better:
        parts.append("better than `ew`: " + ", ".join(f"`{m}`" for m in better))
    if worse:
        parts.append("worse than `ew`: " + ", ".join(f"`{m}`" for m in worse))
    rest = len(rows) - 1 - len(better) - len(worse)
    tests = len(rows) - 1
    strict = [m for m, r in rows.items() if m != "ew" and r["paired_p"] < 0.05 / tests]
    corrected = (
        f"After a Bonferroni correction for the {tests} comparisons (p < {0.05 / tests:.4f}) "
        + (
            "none remains: at this size the differences are not established."
            if not strict
            else "these remain: " + ", ".join(f"`{m}`" for m in strict) + "."
        )
    )
    return (
        f"Beyond the noise (paired t-test over {n_seeds} seeds, p < 0.05, uncorrected), "
        + "; ".join(parts)
        + f". The other {rest} method(s) are within their 95 % interval of `ew`. "
        + corrected
    )


def _fmt(value, spec):
    return "n/a" if value is None or not np.isfinite(value) else format(value, spec)


def _markdown(rows, baseline, config):
    n = len(config["seeds"])
    lines = [
        f"## Multi-task weighting on two overlapping digits (left + right), "
        f"{n} seed(s), {config['epochs']} epochs",
        "",
        f"{config['train_samples']} training and {config['test_samples']} test pairs of digits "
        f"on a {CANVAS}x{CANVAS} canvas (the right one shifted by {SHIFT}, max-combined). STL "
        + ", ".join(f"{t} accuracy {baseline[f'{t}_accuracy']:.4f}" for t in TASKS)
        + ". Δm: mean ± standard error over seeds; vs ew: the mean per-seed difference to `ew` "
        "(same initial weights and data order) ± its standard error, p of a paired t-test. "
        f"× ew: median over {config['timing_rounds']} rounds of one epoch back to back with "
        f"`ew`; target <= 1.05x (loss-based), <= {len(TASKS) + 0.5}x (gradient-based).",
        "",
        "| method | family | left acc. | right acc. | Δm (%) | vs ew (pp) | p | × ew |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method, r in rows.items():
        vs = (
            "—"
            if method == "ew"
            else f"{r['delta_m_vs_ew']:+.2f} ± {_fmt(r['delta_m_vs_ew_se'], '.2f')}"
            + (" *" if r["differs_from_ew"] else "")
        )
        p = "—" if method == "ew" else _fmt(r["paired_p"], ".3f")
        lines.append(
            f"| {method} | {r['family']} | {r['left_accuracy']:.4f} | "
            f"{r['right_accuracy']:.4f} | {r['delta_m']:+.2f} ± {_fmt(r['delta_m_se'], '.2f')} "
            f"| {vs} | {p} | {r['relative_step_time']:.2f} |"
        )
    lines += [
        "",
        "`*`: differs from `ew` beyond the noise (p < 0.05). " + verdict(rows, n),
        "",
        f"Machine: {config['machine']}. Wall time {config['seconds']:.0f} s "
        f"({config['training_seconds']:.0f} s training).",
        "",
    ]
    return "\n".join(lines)


def _plot(rows, path, config):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    colors = ["tab:blue" if rows[m]["family"] == "loss" else "tab:orange" for m in names]
    se = [rows[m]["delta_m_se"] for m in names]
    se = [s if np.isfinite(s) else 0.0 for s in se]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(names, [rows[m]["delta_m"] for m in names], yerr=se, color=colors)
    ax1.axhline(0.0, color="black", linewidth=0.8)
    ax1.set_ylabel("Δm vs single-task (%), ± s.e.")
    ax1.set_title("Left + right digit accuracy, relative to STL")
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
