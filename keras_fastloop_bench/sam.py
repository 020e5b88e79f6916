"""`keras-fastloop bench --suite sam`: the cost of sharpness-aware minimization per step.

The ResNet-20 workload of the `resnet` suite (digits upsampled to 32x32, batch 64, Adam,
float32, `steps_per_execution=1`) trained by `OptimizedModel` three ways: the plain step (the
baseline), `compile(sam_rho=0.05)` (SAM, Foret et al. 2021) and `compile(sam_rho=0.5,
sam_adaptive=True)` (ASAM, Kwon et al. 2021). SAM takes two forward and backward passes per
step, so about half the plain step's throughput is expected; the table says what it is here,
with the loss and validation accuracy each reached in the same number of epochs.
"""

from __future__ import annotations

from pathlib import Path

from keras_fastloop import OptimizedModel
from keras_fastloop_bench import harness, resnet, workloads

PLAIN = "OptimizedModel.fit, plain step"
SAM = "OptimizedModel.fit, sam_rho=0.05"
ASAM = "OptimizedModel.fit, sam_rho=0.5, sam_adaptive=True"


def run(
    out_dir: Path,
    quick: bool = False,
    rounds: int | None = None,
    epochs: int | None = None,
    progress=print,
) -> dict:
    """Run the SAM suite; write `sam.md`, `sam.json`, `sam.png` under `out_dir`.

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
    contenders = {
        PLAIN: workloads.fit_contender(w, OptimizedModel),
        SAM: workloads.fit_contender(w, OptimizedModel, {"sam_rho": 0.05}),
        ASAM: workloads.fit_contender(w, OptimizedModel, {"sam_rho": 0.5, "sam_adaptive": True}),
    }
    progress(f"[sam] {w.samples} images, float32, {epochs} epochs x {rounds} rounds")
    runs = harness.run_alternating(
        contenders, lambda: [x.copy() for x in initial], epochs, rounds, progress
    )
    target = max(min(loss for _, loss in rs[0].curve) for rs in runs.values())
    rows = harness.summarize(runs, target, PLAIN)
    machine = harness.machine_description()
    markdown = (
        f"# keras-fastloop bench — sam suite\n\nMachine: {machine}\n\nResNet-20 on digits "
        f"({arrays['x'].shape[1]}x{arrays['x'].shape[2]}, {w.samples} train / "
        f"{len(arrays['x_val'])} validation images), batch {resnet.BATCH_SIZE}, Adam "
        f"{resnet.LEARNING_RATE}, float32, {epochs} epochs x {rounds} alternating rounds "
        f"(medians). SAM's step cost is 1 / its throughput ratio.\n\n"
        + harness.markdown_table(rows, PLAIN, target)
    )
    harness.plot_curves(runs, out_dir / "sam.png", "sam: loss vs wall time", target)
    payload = {
        "suite": "sam",
        "machine": machine,
        "config": {"epochs": epochs, "rounds": rounds, "target_loss": target},
        "rows": rows,
        "curves": {name: [r.curve for r in rs] for name, rs in runs.items()},
        "markdown": markdown,
    }
    harness.write_report(out_dir, "sam", markdown, payload)
    return payload
