"""SDMGrad (Xiao et al., NeurIPS 2023): three parts of the batch
(`keras_fastloop.weighting._gradient`)."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_fastloop._replicas import state_variable
from keras_fastloop.weighting import _utils
from keras_fastloop.weighting._gradient import GradientWeighting, cross_gram
from keras_fastloop.weighting._solvers import _sdmgrad_weights_xla
from keras_fastloop.weighting.base import _PACKAGE


@keras.saving.register_keras_serializable(package=_PACKAGE)
class SDMGrad(GradientWeighting):
    """SDMGrad: stochastic direction-oriented MGDA (`sdmgrad`).

    Algorithm: LibMTL draws three batches per step; here they are the three consecutive
    parts of the batch (samples `[p n // 3, (p + 1) n // 3)`, sizes differing by at most one
    when 3 does not divide `n`; a batch of fewer than 3 samples is used whole by all three,
    which a `FastloopWarning` reports at the epoch's end).
    With `G_p` the parts' task gradients of the shared variables, `w` (start `1/T`, kept
    across steps) takes `niter` projected SGD steps (step size 5, momentum 0.5, as LibMTL)
    on `w^T C w / 2 + lamda w^T C 1 / T`, `C = G_2 G_3^T` scaled by its mean diagonal
    (`sdmgrad_weights`); then the shared variables get
    `G_1^T (w + lamda / T) / (1 + lamda)`, whose weights are the logged `{task}_weight`.
    That inner loop does not converge in 20 steps and its result depends on rounding
    (LibMTL's float32 and float64 runs differ); ours matches a float64 run of LibMTL's code
    (tests). Heads get the mean of the parts' head gradients (LibMTL sums them: 3 times the
    heads' gradient; see `docs/weighting.md`). `w` lives in step state (`sdmgrad_w`,
    committed after applied steps only). Each step of `steps_per_execution` splits its own
    batch; under `tf.distribute` each replica splits its share and the part gradients are
    summed across replicas. Costs `3 T` backward passes. Keras masks are refused. No random
    numbers: the parts follow the dataset's order (shuffled by `fit` as usual).

    Args:
        lamda: non-negative float, default `0.3` (LibMTL's `SDMGrad_lamda`): the pull
            towards the average gradient.
        niter: positive int, default `20` (`SDMGrad_niter`): inner steps per update.

    Raises:
        ValueError: at construction, for a negative `lamda` or a non-positive `niter`.

    Example:
        >>> model.compile("adam", losses, loss_weighting=SDMGrad(lamda=0.3))

    Reference:
        Xiao, Ban & Ji, "Direction-oriented Multi-objective Learning: Simple and Provable
        Stochastic Algorithms", NeurIPS 2023.
    """

    name = "sdmgrad"
    sub_batches = 3

    def __init__(self, lamda: float = 0.3, niter: int = 20) -> None:
        super().__init__()
        self.lamda = _utils.check_positive(lamda, "lamda", allow_zero=True)
        self.niter = _utils.check_positive_int(niter, "niter")

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        t = (len(task_names),)
        self.w = state_variable(state, "sdmgrad_w", t, 1.0 / len(task_names))
        self.pending_w = state_variable(state, "sdmgrad_pending_w", t)

    def part_weights(self, rows):
        cross = cross_gram(rows[1], rows[2])
        w = _sdmgrad_weights_xla(cross, tf.identity(self.w.value), self.lamda, self.niter)
        self.pending_w.assign(w)
        return (w + self.lamda / self.num_tasks) / (1.0 + self.lamda), 0

    def update(self, losses):
        self.w.assign(self.pending_w)

    def get_config(self):
        return {"lamda": self.lamda, "niter": self.niter}
