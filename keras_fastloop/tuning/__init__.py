"""Automatic `steps_per_execution` and the one-line recommended setup.

`OptimizedModel.compile(steps_per_execution="auto")` tunes how many training steps run inside
one compiled execution while `fit` runs (Keras 2 had this; Keras 3 dropped it). The parts:

- `.tuner`: `StepsPerExecutionTuner`, a pure state machine fed with
  `(steps, seconds)` measurements (`._cost_model`: the alpha-beta model it fits);
- `._glue`: the `compile` argument, the per-model state `AutoSteps` (driven through its
  methods by the running `fit`, `keras_fastloop._fit_run.FitRun`, which groups batches into
  executions) and the variable-count train function;
- the step events every execution ends at: the protocol of `keras_fastloop.callbacks.events`;
- `.recommended`: `recommended_setup`, `optimize_pipeline` and `onednn_off_on_x86`.

The design (what Keras 3.15 allows, the grouping rule, what is not tuned) is in
`docs/fit_loop.md`.
"""

from keras_fastloop.callbacks.events import (  # noqa: F401
    batches_until_next_event,
    event_periods,
    steps_until_next_event,
)
from keras_fastloop.tuning._glue import (  # noqa: F401 - used as kf.tuning.<name>
    AUTO,
    make_train_function,
    resolve_steps_per_execution,
    steps_per_execution_tuner,
    validate_steps_per_execution,
)
from keras_fastloop.tuning.recommended import (
    RecommendedSetup,
    onednn_off_on_x86,
    optimize_pipeline,
    recommended_setup,
)
from keras_fastloop.tuning.tuner import StepsPerExecutionTuner

__all__ = [
    "StepsPerExecutionTuner",
    "steps_per_execution_tuner",
    "RecommendedSetup",
    "recommended_setup",
    "onednn_off_on_x86",
    "optimize_pipeline",
    "validate_steps_per_execution",
    "steps_until_next_event",
]
