"""CAGrad (Liu et al., NeurIPS 2021): a gradient-based method (`keras_fastloop.weighting._gradient`)."""

from __future__ import annotations

import keras

from keras_fastloop.weighting import _utils
from keras_fastloop.weighting._gradient import GradientWeighting
from keras_fastloop.weighting._solvers import (
    _cagrad_weights_xla,
)
from keras_fastloop.weighting.base import _PACKAGE


@keras.saving.register_keras_serializable(package=_PACKAGE)
class CAGrad(GradientWeighting):
    """Conflict-averse gradient descent.

    Algorithm: with `g0` the average task gradient, find the update `d` that maximises the
    worst task's improvement `min_i <g_i, d>` within `|d - g0| <= c |g0|`. Its dual is
    `min_{w in simplex} <g_w, g0> + c |g0| |g_w|` (`g_w = sum_i w_i g_i`), solved in-graph
    by projected gradient descent (see `cagrad_weights` for the tolerance), then
    `d = (g0 + c |g0| / |g_w| g_w) / (1 + c^2)` (LibMTL's default rescaling).

    Args:
        c: non-negative float, default `0.5`: radius of the ball around `g0` (`0` = `ew`
            on the shared parameters, scaled by `1/T`).
        rescale: int in `{0, 1, 2}`, default `1`: divide `d` by 1, `1 + c^2` or `1 + c`.
        max_iter: positive int, default `100`: solver iterations.

    Example:
        >>> model.compile("adam", losses, loss_weighting=CAGrad(c=0.5))

    Reference:
        Liu, Liu, Jin, Stone & Liu, "Conflict-Averse Gradient Descent for Multi-task Learning",
        NeurIPS 2021.
    """

    name = "cagrad"

    def __init__(self, c: float = 0.5, rescale: int = 1, max_iter: int = 100) -> None:
        super().__init__()
        self.c = _utils.check_positive(c, "c", allow_zero=True)
        if rescale not in (0, 1, 2) or isinstance(rescale, bool):
            raise ValueError(f"`rescale` must be 0, 1 or 2. Received: rescale={rescale!r}")
        self.rescale = rescale
        self.max_iter = _utils.check_positive_int(max_iter, "max_iter")

    def task_weights(self, gram, losses):
        return _cagrad_weights_xla(gram, self.c, self.rescale, self.max_iter)

    def get_config(self):
        return {"c": self.c, "rescale": self.rescale, "max_iter": self.max_iter}
