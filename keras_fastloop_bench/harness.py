"""What every benchmark suite shares: timing, memory sampling, alternation and the report.

A *contender* is a function `train(run) -> None` that trains one model from the given initial
weights for `run.epochs` epochs and calls `run.epoch_done(train_loss, train_seconds,
samples)` after each epoch (`train_seconds`: time spent in training steps only, so
throughput excludes validation) and `run.finish(val_accuracy)` at the end. The harness runs
all contenders `rounds` times in alternation, the order rotated by one each round (A B C,
B C A, C A B, ...), so slow drifts of the machine, and a drift within a round, hit every
contender alike; it reports medians and ratios against the first contender. As `timeit` does,
each run starts after a full garbage collection and runs with Python's cyclic collector off: a
collection triggered by garbage of earlier runs (TensorFlow's object graph makes one take 0.5-3 s)
would otherwise land in whichever contender happens to be running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import keras

from keras_fastloop import _machine, _timing

# The article whose claims the bench measures ("the seed"), cited by its title.
SEED_ARTICLE = (
    "“TensorFlow 2.x 自定义训练循环实战："
    "Loss下降速度提升15%的深度优化策略” "
    "(“TensorFlow 2.x custom training loops in practice: deep optimization strategies that "
    "make the loss fall 15% faster”)"
)


def machine_description() -> str:
    """CPU model (family, model number, bf16 units), core count, accelerators and oneDNN's
    switch, for the report header."""
    import tensorflow as tf

    from keras_fastloop import _keras_internals

    cpu = _machine.read_cpuinfo().identity() or platform.processor() or platform.machine()
    onednn = {True: "on", False: "off", None: "n/a"}[_keras_internals.onednn_enabled()]
    gpus = [
        tf.config.experimental.get_device_details(g).get("device_name", g.name)
        for g in tf.config.list_physical_devices("GPU")
    ]
    accel = ", ".join(gpus) if gpus else "no GPU"
    return (
        f"{cpu}, {os.cpu_count()} cores, {accel}, oneDNN {onednn}; TensorFlow {tf.__version__}, "
        f"Keras {__import__('keras').__version__}, Python {platform.python_version()}"
    )


class PeakRSS:
    """Samples the process' resident set size in a thread; `peak_mb` is max RSS - RSS at start.

    CPU-only measure (the process' whole memory, including TF's allocator and graph caches); a
    GPU's memory is measured with `tf.config.experimental.get_memory_info` instead.
    """

    def __init__(self, interval=0.005):
        self.interval = interval
        self._stop = threading.Event()
        self.start_mb = self.peak_mb_abs = 0.0

    @staticmethod
    def rss_mb():
        try:
            import psutil

            return psutil.Process().memory_info().rss / 2**20
        except ImportError:  # pragma: no cover - psutil is in the bench extra
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def _loop(self):
        while not self._stop.is_set():
            self.peak_mb_abs = max(self.peak_mb_abs, self.rss_mb())
            time.sleep(self.interval)

    def __enter__(self):
        self.start_mb = self.peak_mb_abs = self.rss_mb()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_mb_abs = max(self.peak_mb_abs, self.rss_mb())

    @property
    def peak_mb(self):
        return self.peak_mb_abs - self.start_mb


class EpochTimer(keras.callbacks.Callback):
    """Reports each epoch's training loss and training-only time to a harness `Run`."""

    def __init__(self, run, samples_per_epoch):
        super().__init__()
        self.run = run
        self.samples = samples_per_epoch

    def on_epoch_begin(self, epoch, logs=None):
        self.t0 = self.t_last = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.t_last = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.run.epoch_done(logs["loss"], self.t_last - self.t0, self.samples)


@dataclasses.dataclass
class Run:
    """One training run of one contender; filled in by the contender through its callbacks."""

    name: str
    epochs: int
    initial_weights: list
    start: float = dataclasses.field(default_factory=time.perf_counter)
    curve: list = dataclasses.field(default_factory=list)  # (wall seconds, epoch train loss)
    train_seconds: list = dataclasses.field(default_factory=list)
    samples: list = dataclasses.field(default_factory=list)
    val_accuracy: float = float("nan")
    peak_memory_mb: float = float("nan")
    total_seconds: float = float("nan")
    extra: dict = dataclasses.field(default_factory=dict)  # contender-specific facts

    def epoch_done(self, train_loss, train_seconds, samples):
        self.curve.append((time.perf_counter() - self.start, float(train_loss)))
        self.train_seconds.append(float(train_seconds))
        self.samples.append(int(samples))

    def finish(self, val_accuracy):
        self.val_accuracy = float(val_accuracy)
        self.total_seconds = time.perf_counter() - self.start

    def throughput(self):
        """Training samples per second over all epochs but the first (which traces the step)."""
        seconds = sum(self.train_seconds[1:])
        return sum(self.samples[1:]) / seconds if seconds > 0 else float("nan")

    def first_epoch_seconds(self):
        """Training time of the first epoch, which includes tracing the step (seconds)."""
        return self.train_seconds[0] if self.train_seconds else float("nan")

    def time_to_target_parts(self, target):
        """Where the wall time to `target` went: a dict of seconds, or `None` if never reached.

        Keys: `epochs` (epochs trained until the loss was <= target), `setup` (before the first
        epoch: building, compiling, the data), `first_epoch` (its training, tracing included),
        `later_epochs` (the training of the other epochs until the target), `validation` (the
        validation passes and epoch ends until the target). Training times are measured
        (`EpochTimer`); an epoch's non-training time is its wall time minus its training; the
        first epoch's is split into setup and validation by taking the median non-training
        time of the later epochs as its validation (all of it with a single epoch).
        """
        reached = [i for i, (_, loss) in enumerate(self.curve) if loss <= target]
        if not reached or len(self.train_seconds) < len(self.curve):
            return None
        k = reached[0]
        walls = [0.0] + [seconds for seconds, _ in self.curve]
        rest = [walls[i + 1] - walls[i] - self.train_seconds[i] for i in range(len(self.curve))]
        later_rest = rest[1:]
        first_validation = statistics.median(later_rest) if later_rest else rest[0]
        first_validation = min(first_validation, rest[0])
        return {
            "epochs": k + 1,
            "setup": rest[0] - first_validation,
            "first_epoch": self.train_seconds[0],
            "later_epochs": sum(self.train_seconds[1 : k + 1]),
            "validation": first_validation + sum(rest[1 : k + 1]),
        }

    def time_to_loss(self, target):
        """Wall seconds (training + validation) until the epoch training loss is <= target."""
        for seconds, loss in self.curve:
            if loss <= target:
                return seconds
        return float("nan")


@contextlib.contextmanager
def dtype_policy(policy):
    """Sets Keras' global dtype policy for the block (`None`: leaves it as it is) and restores
    the previous one afterwards, also when the block raises."""
    previous = keras.config.dtype_policy()
    try:
        if policy is not None:
            keras.config.set_dtype_policy(policy)
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def timed_run(train, run):
    """Runs `train(run)` as every timed run: after a full garbage collection, with the cyclic
    collector off, `run.start` set right before. Returns the peak RSS growth in MB."""
    with _timing.collector_paused(collect_first=True), PeakRSS() as mem:
        run.start = time.perf_counter()
        train(run)
    return mem.peak_mb


def run_alternating(contenders, make_initial_weights, epochs, rounds, progress=print):
    """Run every contender `rounds` times, alternating; returns `{name: [Run, ...]}`.

    Round `r` starts with contender `r % len(contenders)` (the order rotates), so no contender
    always runs at the same point of a round. Each run starts after `gc.collect()` and runs with
    the cyclic garbage collector disabled (re-enabled afterwards, also on an error).
    """
    runs = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            train = contenders[name]
            run = Run(name=name, epochs=epochs, initial_weights=make_initial_weights())
            peak_mb = timed_run(train, run)
            if math.isnan(run.peak_memory_mb):  # a child-process contender measures its own
                run.peak_memory_mb = peak_mb
            runs[name].append(run)
            progress(
                f"  round {r + 1}/{rounds}  {name:<44s} {run.throughput():9.0f} samples/s  "
                f"final loss {run.curve[-1][1]:.4f}  val acc {run.val_accuracy:.4f}  "
                f"{run.total_seconds:6.1f} s"
            )
    return runs


def _median(values):
    values = [v for v in values if v == v]  # drop NaN
    return statistics.median(values) if values else float("nan")


def summarize(runs, target_loss, baseline):
    """Median figures per contender and ratios against `baseline`; JSON-able rows."""
    rows = []
    base_tp = _median([r.throughput() for r in runs[baseline]])
    base_ttl = _median([r.time_to_loss(target_loss) for r in runs[baseline]])
    base_first = _median([r.first_epoch_seconds() for r in runs[baseline]])
    for name, rs in runs.items():
        tp = _median([r.throughput() for r in rs])
        ttl = _median([r.time_to_loss(target_loss) for r in rs])
        first = _median([r.first_epoch_seconds() for r in rs])
        rows.append(
            {
                "contender": name,
                "throughput_samples_per_s": tp,
                "throughput_ratio": tp / base_tp,
                "per_round_throughput_ratio": [
                    r.throughput() / b.throughput() for r, b in zip(rs, runs[baseline])
                ],
                "first_epoch_s": first,
                "first_epoch_ratio": first / base_first,
                "time_to_target_s": ttl,
                "speedup_to_target": base_ttl / ttl if ttl == ttl else float("nan"),
                "final_train_loss": _median([r.curve[-1][1] for r in rs]),
                "val_accuracy": _median([r.val_accuracy for r in rs]),
                "peak_rss_growth_mb": _median([r.peak_memory_mb for r in rs]),
                "total_seconds": _median([r.total_seconds for r in rs]),
                "time_to_target_parts": _median_parts(rs, target_loss),
            }
        )
    return rows


PARTS = ("setup", "first_epoch", "later_epochs", "validation")


def _median_parts(runs_of_one, target_loss):
    """`Run.time_to_target_parts` of the median round by time to target (`None`: not reached).

    One round's parts, not per-part medians, so they add up to that round's time to target.
    """
    return runs_of_one[median_round(runs_of_one, target_loss)].time_to_target_parts(target_loss)


def parts_section(rows, names, target_loss):
    """Markdown: where the time to the target loss went, for the contenders `names`.

    One row per contender (its median round by time to target) and a last row, "limit": each
    part's smallest value among the rows, i.e. what a contender would take if it matched the
    best measured one on every part. `""` when no row reached the target.
    """
    by_name = {r["contender"]: r for r in rows}
    picked = [(n, by_name[n]["time_to_target_parts"]) for n in names if n in by_name]
    picked = [(n, p) for n, p in picked if p is not None]
    if not picked:
        return ""
    lines = [
        f"Where the time to train loss ≤ {target_loss:g} went (seconds, the median round by time "
        "to target; validation = wall time minus measured training time, the first epoch's "
        "split off from setup by the later epochs' median):\n",
        "| contender | epochs to target | setup | first epoch (training) "
        "| later epochs (training) | validation, epoch ends | total |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, p in picked:
        total = sum(p[k] for k in PARTS)
        lines.append(
            f"| {name} | {p['epochs']} | "
            + " | ".join(f"{p[k]:.2f}" for k in PARTS)
            + f" | {total:.2f} |"
        )
    limit = {k: min(p[k] for _, p in picked) for k in PARTS}
    lines.append(
        f"| limit (smallest of each part) | {min(p['epochs'] for _, p in picked)} | "
        + " | ".join(f"{limit[k]:.2f}" for k in PARTS)
        + f" | {sum(limit.values()):.2f} |"
    )
    return "\n".join(lines) + "\n"


def _per_round(ratios):
    """`'median (min-max)'` of the paired per-round ratios, or `'–'` with fewer than two."""
    ratios = [r for r in ratios if r == r]
    if len(ratios) < 2:
        return "–"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def markdown_table(rows, baseline, target_loss):
    """The suite's table. Throughput: the ratio of the medians over the rounds, then the ratio
    of each round's run to the baseline's run of the same round (median and range): a drift of
    the machine between rounds moves both runs of a pair, so the range says how far one
    round can be trusted."""
    head = (
        f"| contender | samples/s | throughput vs `{baseline}` | per round: median (range) "
        f"| first epoch, with tracing (s) "
        f"| vs `{baseline}` | time to train loss ≤ {target_loss:g} (s) | speed-up to target "
        "| final val acc | peak RSS growth (MB) |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r['contender']} | {r['throughput_samples_per_s']:.0f} | {r['throughput_ratio']:.3f}× | "
        f"{_per_round(r['per_round_throughput_ratio'])} | "
        f"{r['first_epoch_s']:.2f} | {r['first_epoch_ratio']:.2f}× | "
        f"{r['time_to_target_s']:.2f} | {r['speedup_to_target']:.2f}× | {r['val_accuracy']:.4f} | "
        f"{r['peak_rss_growth_mb']:.0f} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


def median_round(runs_of_one, target_loss=None):
    """Index of the representative round: the (lower) median by time to target, else by time.

    Args:
        runs_of_one: list of `Run` of one contender (its rounds).
        target_loss: float or None. With a target that every round reached, rounds are ranked
            by `time_to_loss(target_loss)`; otherwise by `total_seconds`.

    Returns:
        int, the index in `runs_of_one` of the round at rank `(len - 1) // 2`.
    """
    keys = [r.time_to_loss(target_loss) for r in runs_of_one] if target_loss is not None else []
    if not keys or any(k != k for k in keys):  # a NaN: some round never reached the target
        keys = [r.total_seconds for r in runs_of_one]
    order = sorted(range(len(runs_of_one)), key=lambda i: (keys[i], i))
    return order[(len(order) - 1) // 2]


# Row names are long and alike ("keras.Model.fit, recommended policy, steps_per_execution=8"):
# the plot's labels abbreviate them the same way everywhere.
_ABBREVIATIONS = (
    ("keras.Model.fit", "fit"),
    ("recommended policy", "rec. policy"),
    ("recommended setup", "rec. setup"),
    ("steps_per_execution=", "spe="),
    ("own process", "own proc."),
)


def plot_labels(names, width=40):
    """Short, distinct labels of `names` for the plot (abbreviated, then cut at `width`).

    Args:
        names: the contenders' row names.
        width: int, the longest label in characters. Default 40.

    Returns:
        list of str, one per name; labels that would coincide after cutting get the full
        abbreviated name instead.
    """
    abbreviated = []
    for name in names:
        for long, short in _ABBREVIATIONS:
            name = name.replace(long, short)
        abbreviated.append(name)
    cut = [a if len(a) <= width else a[: width - 1] + "…" for a in abbreviated]
    return [a if cut.count(c) > 1 else c for a, c in zip(abbreviated, cut)]


def plot_curves(runs, path, title, target_loss=None, highlight=()):
    """Loss against wall time (left) and median throughput (right), saved to `path`.

    Left: every round of every contender as a faint line, its median round (`median_round`)
    bold, and the target loss as a dashed horizontal line. Right: a horizontal bar per
    contender with its median throughput (samples/s, first epoch excluded), the same figure
    as the report's table.

    Args:
        runs: `{name: [Run, ...]}` from `run_alternating`.
        path: file name of the PNG.
        title: str, title of the curves.
        target_loss: float or None (default). Drawn when given.
        highlight: names drawn on top with a thick line and a bold, edged bar (the
            recommended setup among a dozen alike rows). Default none.

    Returns:
        The (closed) `matplotlib.figure.Figure`, for inspection.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(runs)
    labels = plot_labels(names)
    highlight = set(highlight)
    fig, (ax, bars) = plt.subplots(
        1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]}, layout="constrained"
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    rounds = max(len(rs) for rs in runs.values())
    for k, name in enumerate(names):
        rs = runs[name]
        color = colors[k % len(colors)]
        chosen = median_round(rs, target_loss)
        for i, run in enumerate(rs):
            seconds, losses = zip(*run.curve)
            if i == chosen:
                strong = name in highlight
                ax.plot(
                    seconds,
                    losses,
                    color=color,
                    marker="o",
                    markersize=3,
                    linewidth=3.0 if strong else 1.5,
                    zorder=3 if strong else 2,
                    label=labels[k],
                )
            else:
                ax.plot(seconds, losses, color=color, alpha=0.25, linewidth=1)
    if target_loss is not None:
        ax.axhline(target_loss, color="black", linestyle="--", linewidth=1)
        ax.annotate(
            f"target {target_loss:g}",
            (0.99, target_loss),
            xycoords=("axes fraction", "data"),
            ha="right",
            va="bottom",
            fontsize=8,
        )
    ax.set_xlabel("wall time (s, training + validation)")
    ax.set_ylabel("epoch training loss")
    ax.set_yscale("log")
    ax.set_title(f"{title}\n(bold: median round of {rounds}; faint: the others)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)

    throughput = [_median([r.throughput() for r in runs[name]]) for name in names]
    positions = list(range(len(names)))[::-1]  # first contender on top
    drawn = bars.barh(
        positions, throughput, color=[colors[k % len(colors)] for k in range(len(names))]
    )
    bars.set_yticks(positions, labels)
    bars.tick_params(axis="y", labelsize=7)
    for name, patch, tick in zip(names, drawn, bars.get_yticklabels()):
        if name in highlight:
            patch.set_edgecolor("black")
            patch.set_linewidth(1.5)
            tick.set_fontweight("bold")
    bars.set_xlabel("samples/s (median over rounds, first epoch excluded)")
    bars.set_title("throughput", fontsize=10)
    bars.grid(axis="x", alpha=0.3)
    for y, value in zip(positions, throughput):
        bars.annotate(f" {value:.0f}", (value, y), va="center", fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def _strict_json(value):
    """NaN/inf (e.g. a target loss never reached) become `null`: the file stays strict JSON.

    NumPy scalars and arrays become Python numbers and lists first, so a `np.float32` NaN is
    caught too.
    """
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # NumPy scalar / array
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_report(out_dir: Path, suite: str, markdown: str, payload: dict):
    """Write `{suite}.md` and `{suite}.json` under `out_dir`; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path = out_dir / f"{suite}.md"
    json_path = out_dir / f"{suite}.json"
    md_path.write_text(markdown)
    json_path.write_text(
        json.dumps(_strict_json(payload), indent=2, allow_nan=False, default=float)
    )
    return md_path, json_path
