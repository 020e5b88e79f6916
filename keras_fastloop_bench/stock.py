"""Stock Keras at its best: the baselines a user would pick, for every suite that times training.

Beside plain `keras.Model.fit` in float32, a user who wants speed sets one line,
`keras.config.set_dtype_policy(...)`, and may raise `steps_per_execution`. This module gives
every suite those contenders and the figure that matters: the framework's gain over *Keras at
its best*, separately from its gain over float32 `fit`:

- `"keras.Model.fit, recommended policy"`: plain `fit` with the dtype policy the recommended
  setup uses (`steps_per_execution=1`);
- `"keras.Model.fit, recommended policy, steps_per_execution=N"` for `N` in
  `SPE_CANDIDATES[1:]` (8 and 32);
- *Keras at its best*: the fastest of those (median throughput, first epoch excluded), chosen
  after the rounds, on the same run (`keras_at_its_best`);
- Keras on the JAX backend (`jax_contender`), in its own process, where `jax` can be imported
  there (`jax_status`); otherwise the report states why the row is missing.

Every contender here is a harness contender `train(run)` (see `keras_fastloop_bench.harness`).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from keras_fastloop_bench import harness, own_process

__all__ = [
    "JAX_PATH_ENV",
    "POLICY_FIT",
    "SPE_CANDIDATES",
    "at_best_section",
    "jax_contender",
    "jax_status",
    "keras_at_its_best",
    "policy_fit_name",
    "policy_fit_names",
    "with_policy",
]

POLICY_FIT = "keras.Model.fit, recommended policy"
JAX = "Keras on JAX (own process), recommended policy"
SPE_CANDIDATES = (1, 8, 32)
# Extra `sys.path` entries (os.pathsep-separated) for the JAX child only: jax is never a
# dependency; install it apart, e.g. `pip install --target /tmp/jaxenv jax jaxlib`.
JAX_PATH_ENV = "KERAS_FASTLOOP_BENCH_JAX_PATH"
_JAX_CHILD = Path(__file__).with_name("_jax_child.py")


def policy_fit_name(steps_per_execution: int) -> str:
    """The row name of plain `fit` at the recommended policy and a fixed `steps_per_execution`."""
    if steps_per_execution == 1:
        return POLICY_FIT
    return f"{POLICY_FIT}, steps_per_execution={steps_per_execution}"


def policy_fit_names(candidates=SPE_CANDIDATES) -> list[str]:
    """The row names of the stock candidates, in `candidates`' order."""
    return [policy_fit_name(n) for n in candidates]


def with_policy(train, policy):
    """Wraps a contender so that its model is built and trained under the global dtype
    `policy` (a string such as `"mixed_bfloat16"`); float32 is restored afterwards."""

    @functools.wraps(train)
    def wrapped(run):
        with harness.dtype_policy(policy):
            train(run)

    return wrapped


def policy_contenders(make_fit, policy, candidates=SPE_CANDIDATES) -> dict:
    """`{row name: contender}` for plain `fit` at `policy` and each fixed `steps_per_execution`.

    Args:
        make_fit: callable `compile_kwargs -> train(run)`, the suite's plain-`fit` contender.
        policy: string, the dtype policy of the recommended setup.
        candidates: ints, the fixed `steps_per_execution` values. Defaults to `(1, 8, 32)`.
    """
    return {
        policy_fit_name(n): with_policy(make_fit({"steps_per_execution": n}), policy)
        for n in candidates
    }


def keras_at_its_best(rows, candidates=SPE_CANDIDATES):
    """The name of the fastest stock row (median throughput) among `policy_fit_names`.

    Args:
        rows: the rows of `harness.summarize`.
        candidates: the fixed `steps_per_execution` values that ran.

    Returns:
        str, the row name, or `None` when none of them ran.
    """
    names = set(policy_fit_names(candidates))
    stock = [
        r
        for r in rows
        if r["contender"] in names
        and r["throughput_samples_per_s"] == r["throughput_samples_per_s"]
    ]
    if not stock:
        return None
    return max(stock, key=lambda r: r["throughput_samples_per_s"])["contender"]


def _paired(runs, name, against, figure):
    """Per-round ratios `figure(run of name) / figure(run of against)`, paired by round."""
    return [figure(a) / figure(b) for a, b in zip(runs[name], runs[against])]


def _spread(ratios):
    ratios = [r for r in ratios if r == r]
    if not ratios:
        return "–"
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def at_best_section(runs, rows, ours, baseline, target_loss, candidates=SPE_CANDIDATES):
    """Markdown: each of `ours` against float32 `fit` (`baseline`) and against Keras at its best.

    Adds to each row of `ours`: `vs_keras_at_best` (throughput ratio of the medians),
    `first_epoch_vs_policy_fit` (first-epoch seconds ratio: lower is better),
    `speedup_to_target_vs_policy_fit` and `keras_at_best` (the chosen row's name).

    Args:
        runs: `{name: [Run, ...]}` from `harness.run_alternating`.
        rows: the rows of `harness.summarize` (modified in place).
        ours: row names of the framework's contenders.
        baseline: row name of float32 `fit`.
        target_loss: float, the training loss of "time to target".
        candidates: the fixed `steps_per_execution` values that ran.

    Returns:
        str, a markdown paragraph and table, then `harness.parts_section` for `fit` at the
        same policy, Keras at its best and `ours` (`""` when no stock row ran).
    """
    best = keras_at_its_best(rows, candidates)
    if best is None:
        return ""
    by_name = {r["contender"]: r for r in rows}
    stock = by_name[best]
    same_policy = by_name.get(POLICY_FIT, stock)
    lines = [
        f"Keras at its best: `{best}` (the fastest of `steps_per_execution` "
        f"{', '.join(map(str, candidates))} at the recommended policy, chosen on this run). "
        "Ratios > 1 are the framework's gain; the first-epoch ratio is a time (< 1: faster). "
        "Per round: median (range) of the ratios of runs of the same round.\n",
        f"| contender | throughput vs float32 `fit` | vs Keras at its best | per round "
        f"| first epoch vs `{POLICY_FIT}` | time to target vs `{POLICY_FIT}` "
        f"| time to target vs Keras at its best |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ours:
        if name not in by_name:
            continue
        row = by_name[name]
        row["keras_at_best"] = best
        row["vs_keras_at_best"] = (
            row["throughput_samples_per_s"] / stock["throughput_samples_per_s"]
        )
        row["first_epoch_vs_policy_fit"] = row["first_epoch_s"] / same_policy["first_epoch_s"]
        row["speedup_to_target_vs_policy_fit"] = (
            same_policy["time_to_target_s"] / row["time_to_target_s"]
        )
        row["speedup_to_target_vs_keras_at_best"] = (
            stock["time_to_target_s"] / row["time_to_target_s"]
        )
        per_round = _spread(_paired(runs, name, best, harness.Run.throughput))
        lines.append(
            f"| {name} | {row['throughput_ratio']:.2f}× | **{row['vs_keras_at_best']:.2f}×** | "
            f"{per_round} | {row['first_epoch_vs_policy_fit']:.2f}× | "
            f"{row['speedup_to_target_vs_policy_fit']:.2f}× | "
            f"{row['speedup_to_target_vs_keras_at_best']:.2f}× |"
        )
    del baseline  # named in the table head through the rows' own ratios
    same_policy_name = POLICY_FIT if POLICY_FIT in by_name else best
    names = list(dict.fromkeys([same_policy_name, best, *ours]))
    parts = harness.parts_section(rows, names, target_loss)
    return "\n".join(lines) + "\n" + ("\n" + parts if parts else "")


# -- Keras on JAX, in its own process ------------------------------------------------------


@functools.cache
def jax_status() -> tuple[bool, str]:
    """Whether a child process with `KERAS_BACKEND=jax` can import jax and Keras.

    The child's `sys.path` gets the entries of `$KERAS_FASTLOOP_BENCH_JAX_PATH` first (jax is
    never a dependency of this project). Cached for the process.

    Returns:
        `(True, "jax X.Y.Z")` or `(False, reason)`.
    """
    try:
        child = subprocess.run(
            [sys.executable, "-c", "import jax, keras; print(jax.__version__)"],
            env=_jax_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        return False, "importing jax in a child process took over 300 s"
    if child.returncode != 0:
        last = (child.stderr.strip().splitlines() or ["?"])[-1]
        return False, (
            f"jax cannot be imported ({last}); install it apart (e.g. `pip install --target "
            f"/tmp/jaxenv jax jaxlib`) and set {JAX_PATH_ENV}=/tmp/jaxenv"
        )
    return True, f"jax {child.stdout.strip()}"


def _jax_env():
    env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "2"}
    extra = os.environ.get(JAX_PATH_ENV, "")
    if extra:
        env["PYTHONPATH"] = os.pathsep.join([extra, env.get("PYTHONPATH", "")]).strip(os.pathsep)
    return env


def jax_contender(
    build,
    arrays,
    policy,
    batch_size,
    learning_rate,
    loss="sparse_categorical_crossentropy",
    timeout=1800.0,
):
    """Keras on the JAX backend, the same model, in a child process (`KERAS_BACKEND=jax`).

    The parent builds the model under `policy` with the run's initial weights and saves it as a
    `.keras` file (backend-neutral); the child (`_jax_child.py`, which imports neither
    TensorFlow nor this package) loads it, compiles Adam(`learning_rate`) and `loss`, and trains
    on the NumPy arrays with `fit(shuffle=True)` (so its batch order differs from tf.data's).
    Import and load are not timed: the clock starts when training starts, as in-process.

    Args:
        build: callable `() -> keras.Model`, the suite's model.
        arrays: dict of NumPy arrays `x`, `y`, `x_val`, `y_val`.
        policy: string, the dtype policy.
        batch_size: int.
        learning_rate: float.
        loss: the Keras loss name. Defaults to sparse categorical cross-entropy.
        timeout: float, seconds before the child is killed. Defaults to 1800.

    Returns:
        A contender `train(run)`.

    Raises:
        RuntimeError: from `train(run)`, when the child fails (with its standard error's tail).
    """

    def train(run):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            with harness.dtype_policy(policy):
                model = build()
            model.set_weights(run.initial_weights)
            model.save(tmp / "model.keras")
            np.savez(tmp / "data.npz", **arrays)
            spec = {
                "model": str(tmp / "model.keras"),
                "data": str(tmp / "data.npz"),
                "policy": policy,
                "epochs": run.epochs,
                "batch_size": batch_size,
                "learning_rate": learning_rate,
                "loss": loss,
                "out": str(tmp / "run.json"),
            }
            (tmp / "spec.json").write_text(json.dumps(spec))
            result = own_process.run_child(
                [sys.executable, str(_JAX_CHILD), str(tmp / "spec.json")],
                tmp / "run.json",
                _jax_env(),
                timeout,
                "The JAX contender",
            )
        own_process.record_result(run, result)
        run.extra["backend"] = result["backend"]

    return train


def jax_contenders(build, arrays, policy, batch_size, learning_rate, notes):
    """`{JAX: contender}` where `jax_status()` allows, else `{}` and the reason in `notes`."""
    ok, why = jax_status()
    if not ok:
        notes.append(f"`{JAX}` skipped: {why}.")
        return {}
    notes.append(f"`{JAX}`: {why}; batches from `fit(shuffle=True)` on NumPy arrays.")
    return {JAX: jax_contender(build, arrays, policy, batch_size, learning_rate)}
