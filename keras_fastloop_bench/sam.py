"""`keras-fastloop bench --suite sam`: SAM and EMA cost per step.

The ResNet-20 workload of the `resnet` suite (digits upsampled to 32x32, batch 64, Adam,
float32, `steps_per_execution=1`) trained by `OptimizedModel` six ways, the plain step being the
baseline:

- `compile(sam_rho=0.05)` (SAM, Foret et al. 2021) and `compile(sam_rho=0.5,
  sam_adaptive=True)` (ASAM, Kwon et al. 2021): two forward and backward passes per step, so
  about half the plain step's throughput is expected;
- `Adam(use_ema=True)` (Keras' default `ema_momentum=0.99`): the moving average (Polyak &
  Juditsky 1992) updated after every step;
- `Adam(use_ema=True)` with `kf.callbacks.PeriodicValidation({"periodic": val},
  every_n_steps=N)` validating the raw weights about four times an epoch (a named set, beside
  `fit`'s per-epoch validation that every row runs), and the same with `ema=True`, validating the
  averages (`kf.callbacks.ema_weights`: copy, assign, assign back). The two differ only in the
  swap, so their throughput ratio is its cost; the mid-epoch validations count as training time.

The table gives the loss and validation accuracy each reached in the same number of epochs.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from keras_fastloop import OptimizedModel
from keras_fastloop.callbacks import PeriodicValidation
from keras_fastloop_bench import harness, resnet, workloads

PLAIN = "OptimizedModel.fit, plain step"
SAM = "OptimizedModel.fit, sam_rho=0.05"
ASAM = "OptimizedModel.fit, sam_rho=0.5, sam_adaptive=True"
EMA = "OptimizedModel.fit, Adam(use_ema=True)"
VALIDATION = "OptimizedModel.fit, Adam(use_ema=True), PeriodicValidation(every_n_steps=N)"
EMA_VALIDATION = (
    "OptimizedModel.fit, Adam(use_ema=True), PeriodicValidation(every_n_steps=N, ema=True)"
)

VALIDATIONS_PER_EPOCH = 4
_USE_EMA = {"use_ema": True}


def _validating_contender(w, every_n_steps, ema):
    """`OptimizedModel` with `Adam(use_ema=True)` and a `PeriodicValidation` on `w.val()`
    every `every_n_steps` updates (on the averages if `ema`); records the number of
    validations in `run.extra["validations"]`."""
    made = []

    def make_callback():
        # Named, so its `val_periodic_*` keys sit beside fit's per-epoch `val_*` ones.
        sets = {"periodic": w.val()}
        made.append(PeriodicValidation(sets, every_n_steps=every_n_steps, ema=ema))
        return made[-1]

    train = workloads.fit_contender(
        w, OptimizedModel, optimizer_kwargs=_USE_EMA, callbacks=[make_callback]
    )

    def run_it(run):
        train(run)
        run.extra["validations"] = len(made[-1].history)

    return run_it


def _swap_line(runs):
    """Markdown: the EMA swap's cost, `EMA_VALIDATION`'s throughput against `VALIDATION`'s."""
    pairs = [
        a.throughput() / b.throughput() for a, b in zip(runs[EMA_VALIDATION], runs[VALIDATION])
    ]
    spread = f" (per round {min(pairs):.3f}-{max(pairs):.3f})" if len(pairs) > 1 else ""
    return (
        f"EMA swap: validating the averages runs at {statistics.median(pairs):.3f}× the "
        f"throughput of validating the raw weights{spread}, median of the rounds' paired "
        "ratios.\n"
    )


def run(
    out_dir: Path,
    quick: bool = False,
    rounds: int | None = None,
    epochs: int | None = None,
    progress=print,
) -> dict:
    """Run the SAM and EMA suite; write `sam.md`, `sam.json`, `sam.png` under `out_dir`.

    Args:
        out_dir: folder for the report (created if missing).
        quick: 128 images at 16x16, 2 epochs, 1 round (tests).
        rounds: alternating rounds. Default 2 (1 when `quick`).
        epochs: epochs per run. Default 4 (2 when `quick`).
        progress: callable receiving progress lines. Default `print`.

    Returns:
        JSON-able dict with `rows` (throughput and its ratio to the plain step per contender)
        and `markdown`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rounds = rounds or (1 if quick else 2)
    epochs = epochs or (2 if quick else 4)
    w, arrays = resnet.workload(quick)
    initial = w.build().get_weights()
    steps_per_epoch = -(-w.samples // resnet.BATCH_SIZE)
    every_n_steps = max(1, steps_per_epoch // VALIDATIONS_PER_EPOCH)
    contenders = {
        PLAIN: workloads.fit_contender(w, OptimizedModel),
        SAM: workloads.fit_contender(w, OptimizedModel, {"sam_rho": 0.05}),
        ASAM: workloads.fit_contender(w, OptimizedModel, {"sam_rho": 0.5, "sam_adaptive": True}),
        EMA: workloads.fit_contender(w, OptimizedModel, optimizer_kwargs=_USE_EMA),
        VALIDATION: _validating_contender(w, every_n_steps, ema=False),
        EMA_VALIDATION: _validating_contender(w, every_n_steps, ema=True),
    }
    progress(
        f"[sam] {w.samples} images, float32, {epochs} epochs x {rounds} rounds; validation "
        f"every {every_n_steps} of {steps_per_epoch} steps an epoch"
    )
    runs = harness.run_alternating(
        contenders, lambda: [x.copy() for x in initial], epochs, rounds, progress
    )
    target = max(min(loss for _, loss in rs[0].curve) for rs in runs.values())
    rows = harness.summarize(runs, target, PLAIN)
    machine = harness.machine_description()
    validations = {
        name: runs[name][0].extra["validations"] for name in (VALIDATION, EMA_VALIDATION)
    }
    updates = epochs * steps_per_epoch
    markdown = (
        f"# keras-fastloop bench — sam suite: SAM and EMA cost\n\nMachine: {machine}\n\n"
        f"ResNet-20 on digits ({arrays['x'].shape[1]}x{arrays['x'].shape[2]}, {w.samples} "
        f"train / {len(arrays['x_val'])} validation images), batch {resnet.BATCH_SIZE}, Adam "
        f"{resnet.LEARNING_RATE}, float32, {epochs} epochs x {rounds} alternating rounds "
        f"(medians). A step's cost is 1 / its throughput ratio. The `PeriodicValidation` rows "
        f"validate every N = {every_n_steps} of the {steps_per_epoch} steps of an epoch "
        f"({validations[VALIDATION]} validations in a run) on the {len(arrays['x_val'])} "
        "validation images, counted in their training time; one validates the raw weights, "
        "the other the EMA weights, so their ratio is the swap's cost.\n\n"
        + harness.markdown_table(rows, PLAIN, target)
        + "\n"
        + _swap_line(runs)
        + "\nThe `use_ema` rows' final validation accuracy is the averages' (Keras assigns "
        f"them to the model when `fit` ends); after {updates} updates at `ema_momentum=0.99` "
        f"they still weigh the initial weights by 0.99^{updates} = {0.99**updates:.2f}.\n"
    )
    harness.plot_curves(runs, out_dir / "sam.png", "sam: loss vs wall time", target)
    payload = {
        "suite": "sam",
        "machine": machine,
        "config": {
            "epochs": epochs,
            "rounds": rounds,
            "target_loss": target,
            "every_n_steps": every_n_steps,
            "validations": validations,
        },
        "rows": rows,
        "curves": {name: [r.curve for r in rs] for name, rs in runs.items()},
        "markdown": markdown,
    }
    harness.write_report(out_dir, "sam", markdown, payload)
    return payload
