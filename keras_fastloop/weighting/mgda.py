"""MGDA (Sener & Koltun, NeurIPS 2018): a gradient-based method (`keras_fastloop.weighting._gradient`)."""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop.weighting import _utils
from keras_fastloop.weighting._gradient import GradientWeighting
from keras_fastloop.weighting._solvers import (
    _mgda_weights_xla,
    _min_norm_weights_xla,
    mgda_weights,
)
from keras_fastloop.weighting.base import _PACKAGE

_MGDA_NORMALIZATIONS = ("none", "l2", "loss", "loss+")
_MGDA_SOLVERS = ("active_set", "frank_wolfe")


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MGDA(GradientWeighting):
    """Multiple-gradient descent: the min-norm convex combination of the task gradients.

    Algorithm: `alpha = argmin_{alpha in simplex} |sum_i alpha_i g_i / n_i|^2` with the
    normaliser `n_i` of `gradient_normalization`; closed form for two tasks, otherwise the
    exact active-set solver (`min_norm_weights`, default) or Sener & Koltun's
    Frank-Wolfe iteration (their Algorithm 2, exact line search, as LibMTL; it stops when
    `sum |delta alpha| < tolerance`, which can leave `alpha` a few 1e-2 from the optimum).
    The shared variables get `sum_i (alpha_i / n_i) g_i`; the logged weights are
    `alpha_i / n_i` (= `alpha` with the default `"none"`).

    Args:
        gradient_normalization: one of `"none"` (default, LibMTL), `"l2"` (`|g_i|`),
            `"loss"` (`L_i`), `"loss+"` (`L_i |g_i|`).
        solver: `"active_set"` (default, exact) or `"frank_wolfe"` (`T > 2`).
        max_iter: positive int, default `250`: Frank-Wolfe iterations.
        tolerance: positive float, default `1e-5`: Frank-Wolfe's stopping threshold.

    Example:
        >>> model.compile("adam", losses, loss_weighting="mgda")

    Reference:
        Sener & Koltun, "Multi-Task Learning as Multi-Objective Optimization", NeurIPS 2018.
    """

    name = "mgda"

    def __init__(
        self,
        gradient_normalization: str = "none",
        solver: str = "active_set",
        max_iter: int = 250,
        tolerance: float = 1e-5,
    ) -> None:
        super().__init__()
        if gradient_normalization not in _MGDA_NORMALIZATIONS:
            raise ValueError(
                f"`gradient_normalization` must be one of {_MGDA_NORMALIZATIONS}. "
                f"Received: gradient_normalization={gradient_normalization!r}"
            )
        if solver not in _MGDA_SOLVERS:
            raise ValueError(
                f"`solver` must be one of {_MGDA_SOLVERS}. Received: solver={solver!r}"
            )
        self.gradient_normalization = gradient_normalization
        self.solver = solver
        self.max_iter = _utils.check_positive_int(max_iter, "max_iter")
        self.tolerance = _utils.check_positive(tolerance, "tolerance")

    def task_weights(self, gram, losses):
        norms = ops.sqrt(ops.maximum(tf.linalg.diag_part(gram), 1e-30))
        n = {
            "none": ops.ones_like(norms),
            "l2": norms,
            "loss": losses,
            "loss+": losses * norms,
        }[self.gradient_normalization]
        n = ops.maximum(n, 1e-12)
        gram = gram / (n[:, None] * n[None, :])
        if self.num_tasks == 2:
            alpha = mgda_weights(gram)
        elif self.solver == "active_set":
            alpha = _min_norm_weights_xla(gram)
        else:
            alpha = _mgda_weights_xla(gram, self.max_iter, self.tolerance)
        return alpha / n

    def get_config(self):
        return {
            "gradient_normalization": self.gradient_normalization,
            "solver": self.solver,
            "max_iter": self.max_iter,
            "tolerance": self.tolerance,
        }
