"""FairGrad (Ban & Ji, ICML 2024): a gradient-based method (`keras_fastloop.weighting._gradient`)."""

from __future__ import annotations

import keras

from keras_fastloop.weighting import _utils
from keras_fastloop.weighting._gradient import GradientWeighting
from keras_fastloop.weighting._solvers import _fairgrad_weights_xla
from keras_fastloop.weighting.base import _PACKAGE


@keras.saving.register_keras_serializable(package=_PACKAGE)
class FairGrad(GradientWeighting):
    """FairGrad: alpha-fair allocation of the update between tasks (`fairgrad`).

    Algorithm: the shared variables get `d = sum_i x_i g_i` with `x > 0` solving
    `M x = x^(-1/alpha)` on the raw Gram matrix `M`, i.e. every task's improvement
    `<g_i, d>` is `x_i^(-1/alpha)`: the alpha-fair utility's optimum (`alpha = 1`:
    proportional fairness, Nash-MTL's equation; large `alpha` approaches max-min fairness).
    Solved in-graph by damped Newton steps (`fairgrad_weights`); LibMTL calls SciPy's
    `least_squares` from `x = 1/T`, which agrees where it converges and sometimes stops
    short (tests). The logged `{task}_weight` is `x`. As LibMTL, `x` is used as is: the
    authors' code multiplies it by `T` and clips the update's norm, LibMTL does neither.
    Heads get weight 1 (LibMTL back-propagates `sum_i x_i L_i`, so its heads get `x_i`;
    see `docs/weighting.md`). No state.

    Args:
        alpha: positive float, default `1.0` (LibMTL's `FairGrad_alpha`): the fairness
            exponent.
        max_iter: positive int, default `50`: Newton steps at most (not in LibMTL).

    Raises:
        ValueError: at construction, for a non-positive `alpha` or `max_iter`.

    Example:
        >>> model.compile("adam", losses, loss_weighting=FairGrad(alpha=2.0))

    Reference:
        Ban & Ji, "Fair Resource Allocation in Multi-Task Learning", ICML 2024.
    """

    name = "fairgrad"

    def __init__(self, alpha: float = 1.0, max_iter: int = 50) -> None:
        super().__init__()
        self.alpha = _utils.check_positive(alpha, "alpha")
        self.max_iter = _utils.check_positive_int(max_iter, "max_iter")

    def task_weights(self, gram, losses):
        return _fairgrad_weights_xla(gram, self.alpha, self.max_iter)

    def get_config(self):
        return {"alpha": self.alpha, "max_iter": self.max_iter}
