"""Internals of `OptimizedTrainer.train_step` (private: not part of the public API).

- `losses`: per-task losses from Keras' `CompileLoss` (`TaskLoss`).
- `loss_shares`: the denominator rule that keeps micro-batches and replicas exact.
- `micro_batching`: the in-step accumulation loop.
- `scaling`: loss scaling for float16 (Keras' `LossScaleOptimizer`).
- `guards`: the non-finite policy (`NonFiniteError`, skip without touching the scale).
- `distributed`: replica context helpers (all-reduces, replica counts).
- `state`: the step's own variables (`StepState`).
- `prebuild`: metrics, loss and optimizer state built before the first trace (one trace).
- `results`: `StepResult`, the one contract between the paths of the step and the trainer.

See `docs/design.md` for the order of the step.
"""
