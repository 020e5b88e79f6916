"""UPGrad (Quinton & Rey, 2024, torchjd): a gradient-based method (`keras_fastloop.weighting._gradient`)."""

from __future__ import annotations

import keras
import numpy as np

from keras_fastloop import _validation
from keras_fastloop.weighting import _utils
from keras_fastloop.weighting._gradient import GradientWeighting
from keras_fastloop.weighting._solvers import (
    _upgrad_weights_xla,
)
from keras_fastloop.weighting.base import _PACKAGE


@keras.saving.register_keras_serializable(package=_PACKAGE)
class UPGrad(GradientWeighting):
    """UPGrad: unconflicting projection of gradients (`upgrad`, the `torchjd` aggregator).

    Algorithm: project every task gradient `g_i` onto the dual cone of all of them,
    `{x : <g_j, x> >= 0 for all j}` (so the projection conflicts with no task), and update
    with their combination by the preference vector `p` (default `1/T` each: their mean).
    Each projection is a small quadratic program on the Gram matrix, solved exactly in-graph
    (`upgrad_weights`); without conflicts the update is `sum_i p_i g_i` (`beta = p`).
    Heads get weight 1.

    Args:
        pref_vector: `None` (default: `1/T` each) or a list of `T` finite floats (`torchjd`'s
            `pref_vector`), checked against the number of tasks at `compile()`.
        norm_eps: non-negative float, default `1e-4`: a Gram matrix whose trace is below is
            treated as zero (`torchjd`'s default).
        reg_eps: non-negative float, default `1e-4`: `reg_eps * I` is added to the
            trace-normalised Gram matrix (`torchjd`'s default; `0` = the exact projection).

    Raises:
        ValueError: at construction, for a `pref_vector` that is not a list of finite
            numbers or negative `norm_eps` / `reg_eps`; at `compile()`, for a `pref_vector`
            whose length is not the number of tasks.

    Example:
        >>> model.compile("adam", losses, loss_weighting=UPGrad(pref_vector=[0.5, 0.5]))

    Reference:
        Quinton & Rey, "Jacobian Descent for Multi-Objective Optimization", arXiv:2406.16232,
        2024 (UPGrad; the `torchjd` library's aggregator).
    """

    name = "upgrad"

    def __init__(
        self,
        pref_vector: list[float] | None = None,
        norm_eps: float = 1e-4,
        reg_eps: float = 1e-4,
    ) -> None:
        super().__init__()
        if pref_vector is not None:
            values = list(pref_vector) if isinstance(pref_vector, (list, tuple, np.ndarray)) else []
            ok = bool(values) and all(
                _validation.is_real(v) and np.isfinite(float(v)) for v in values
            )
            if not ok or np.ndim(pref_vector) != 1:
                raise ValueError(
                    "`pref_vector` must be None or a list of finite numbers, one per task. "
                    f"Received: pref_vector={pref_vector!r}"
                )
            pref_vector = [float(v) for v in values]
        self.pref_vector = pref_vector
        self.norm_eps = _utils.check_positive(norm_eps, "norm_eps", allow_zero=True)
        self.reg_eps = _utils.check_positive(reg_eps, "reg_eps", allow_zero=True)

    def check_tasks(self, task_names):
        super().check_tasks(task_names)
        if self.pref_vector is not None and len(self.pref_vector) != len(task_names):
            raise ValueError(
                f"`pref_vector` must have one entry per task ({len(task_names)} tasks: "
                f"{list(task_names)}). Received: pref_vector={self.pref_vector!r}"
            )

    def task_weights(self, gram, losses):
        pref = None if self.pref_vector is None else tuple(self.pref_vector)
        return _upgrad_weights_xla(gram, self.norm_eps, self.reg_eps, pref)

    def get_config(self):
        return {"pref_vector": self.pref_vector, "norm_eps": self.norm_eps, "reg_eps": self.reg_eps}
