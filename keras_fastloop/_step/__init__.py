"""The stages of the training step (private: not part of the public API).

Each stage takes the model's `keras_fastloop.TrainingStep` (its configuration and state)
explicitly; none reads step settings from the model.

- `gradients`: forward, loss and the loss-scaled gradient (full batch or micro-batched).
- `objective`: the default `compute_loss` (task losses combined by the weighting).
- `losses`: per-task losses from Keras' `CompileLoss` (`TaskLoss`).
- `loss_shares`: the denominator rule that keeps micro-batches and replicas exact.
- `micro_batching`: the in-step accumulation loop.
- `sam`: sharpness-aware minimization's second gradient (`compile(sam_rho=...)`).
- `scaling`: loss scaling for float16 (Keras' `LossScaleOptimizer`).
- `guards`: the non-finite policy (`NonFiniteError`, skip without touching the scale).
- `update`: apply or skip the update; record the metrics.
- `distributed`: replica context helpers (all-reduces, replica counts).
- `state`: the step's own variables (`StepState`).
- `prebuild`: metrics, loss and optimizer state built before the first trace (one trace).
- `results`: `StepResult`, the contract between the gradient paths and the step.
- `user_metrics`: a user's `compute_metrics` override, undone on a skipped step.

See `docs/design.md` for the order of the step.
"""
