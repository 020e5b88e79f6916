"""What the workload suites (`resnet`, `text`) share: contenders and the report.

A `Workload` names a model builder, the stock training and validation pipelines and the
optimizer's learning rate. The contenders are plain `keras.Model.fit` (float32, or the
recommended policy with a fixed `steps_per_execution`: `bench.stock`) and `OptimizedModel` with
the recommended setup (the policy, `steps_per_execution="auto"`, `optimize_pipeline`); all run
in alternating rounds (`harness.run_alternating`) from the same initial weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import keras

from keras_fastloop import mixed_precision, tuning
from keras_fastloop.model import OptimizedModel
from keras_fastloop_bench import harness, stock

BASELINE = "keras.Model.fit, float32"
RECOMMENDED = "OptimizedModel, recommended setup"


@dataclasses.dataclass
class Workload:
    """One model and its data for the workload suites.

    Args:
        build: callable `model_cls -> keras.Model` (uncompiled; `model_cls` is `keras.Model` or
            `OptimizedModel`).
        train: callable `() -> tf.data.Dataset` of batches, the stock training pipeline (the
            same order every call sequence).
        val: callable `() -> tf.data.Dataset` of validation batches.
        samples: int, training samples per epoch.
        learning_rate: float, Adam's learning rate.
    """

    build: Callable
    train: Callable
    val: Callable
    samples: int
    learning_rate: float


def fit_contender(
    w,
    model_cls=keras.Model,
    compile_kwargs=None,
    train=None,
    val=None,
    optimizer_kwargs=None,
    callbacks=(),
):
    """Trains `w.build(model_cls)` with `fit` on `train()` (default `w.train`), validating on
    `val()` (default `w.val`) after every epoch, under the current global dtype policy.

    `optimizer_kwargs` (dict, default none) go to `keras.optimizers.Adam` beside the workload's
    learning rate. `callbacks` (zero-argument callables, each returning a callback; default none)
    are called once per run, as `default.fit_contender`'s; their callbacks run before the epoch
    timer, so their `on_train_batch_end` time (a mid-epoch validation) counts as training time."""
    train = train or w.train
    val = val or w.val

    def run_it(run):
        model = w.build(model_cls)
        model.set_weights(run.initial_weights)
        model.compile(
            keras.optimizers.Adam(w.learning_rate, **(optimizer_kwargs or {})),
            "sparse_categorical_crossentropy",
            metrics=["accuracy"],
            **(compile_kwargs or {}),
        )
        model.fit(
            train(),
            epochs=run.epochs,
            validation_data=val(),
            callbacks=[
                *(make() for make in callbacks),
                harness.EpochTimer(run, w.samples),
            ],
            verbose=0,
            shuffle=False,  # tf.data pipelines: they order their own batches
        )
        if isinstance(model, OptimizedModel) and compile_kwargs:
            if compile_kwargs.get("steps_per_execution") == tuning.AUTO:
                tuner = tuning.steps_per_execution_tuner(model)
                run.extra["steps_per_execution"] = f"{tuner.steps} ({tuner.phase})"
        run.finish(model.evaluate(val(), verbose=0, return_dict=True)["accuracy"])

    return run_it


def recommended_contender(w, policy, train=None):
    """`OptimizedModel` with the recommended setup: `policy`, `steps_per_execution="auto"`,
    `optimize_pipeline` on the training (default `w.train`) and validation pipelines."""
    setup = tuning.RecommendedSetup(policy=policy, policy_choice=None)
    train = train or w.train
    return stock.with_policy(
        fit_contender(
            w,
            OptimizedModel,
            setup.compile_kwargs,
            train=lambda: setup.pipeline(train()),
            val=lambda: setup.pipeline(w.val()),
        ),
        policy,
    )


def base_contenders(w, policy, stock_train=None):
    """Float32 `fit` (the baseline), `fit` at `policy` with `steps_per_execution` 1, 8, 32 on
    `stock_train` (default `w.train`), and the recommended setup."""
    suite = {BASELINE: fit_contender(w)}
    suite.update(
        stock.policy_contenders(
            lambda kw: fit_contender(w, compile_kwargs=kw, train=stock_train), policy
        )
    )
    suite[RECOMMENDED] = recommended_contender(w, policy)
    return suite


def default_policy():
    """The recommended policy by the hardware rule (`mixed_precision.recommended_policy`)."""
    return mixed_precision.recommended_policy()


def run_suite(
    suite,
    w,
    contenders,
    ours,
    initial,
    epochs,
    rounds,
    out_dir,
    header,
    notes=(),
    progress=print,
):
    """Alternating rounds, medians, the table against float32 `fit`, the section against Keras
    at its best, the curves; writes `{suite}.md/.json/.png` under `out_dir`.

    The target loss is the highest of the contenders' lowest first-round losses, so every
    contender reaches it (`time to target` is then defined for all).

    Returns:
        The JSON-able payload (`rows`, `markdown`, ...).
    """
    out_dir = Path(out_dir)
    runs = harness.run_alternating(
        contenders, lambda: [x.copy() for x in initial], epochs, rounds, progress
    )
    target = max(min(loss for _, loss in rs[0].curve) for rs in runs.values())
    rows = harness.summarize(runs, target, BASELINE)
    table = harness.markdown_table(rows, BASELINE, target)
    at_best = stock.at_best_section(runs, rows, ours, BASELINE, target)
    machine = harness.machine_description()
    auto = "; ".join(
        f"{name}: " + ", ".join(r.extra.get("steps_per_execution", "?") for r in runs[name])
        for name in ours
        if name in runs
    )
    markdown = (
        f"# keras-fastloop bench — {suite} suite\n\nMachine: {machine}\n\n{header} "
        f"{epochs} epochs x {rounds} alternating rounds (medians).\n\n{table}\n{at_best}\n"
        + "".join(f"{note}\n\n" for note in notes)
        + f'`"auto"` at the end of each run (rounds in order): {auto}.\n'
    )
    harness.plot_curves(
        runs, out_dir / f"{suite}.png", f"{suite}: loss vs wall time", target, highlight=ours
    )
    payload = {
        "suite": suite,
        "machine": machine,
        "config": {"epochs": epochs, "rounds": rounds, "target_loss": target},
        "rows": rows,
        "curves": {name: [r.curve for r in rs] for name, rs in runs.items()},
        "extra": {name: [r.extra for r in rs] for name, rs in runs.items()},
        "markdown": markdown,
    }
    harness.write_report(out_dir, suite, markdown, payload)
    return payload
