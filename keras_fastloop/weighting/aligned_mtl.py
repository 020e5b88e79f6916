"""Aligned-MTL (Senushkin et al., CVPR 2023): a gradient-based method (`keras_fastloop.weighting._gradient`)."""

from __future__ import annotations

import keras

from keras_fastloop.weighting._gradient import GradientWeighting
from keras_fastloop.weighting._solvers import (
    _ALIGNED_SCALE_MODES,
    aligned_mtl_weights,
)
from keras_fastloop.weighting.base import _PACKAGE


@keras.saving.register_keras_serializable(package=_PACKAGE)
class AlignedMTL(GradientWeighting):
    """Aligned-MTL: align the principal components of the task gradients (`aligned_mtl`).

    Algorithm: with the task-gradient matrix `G = U S V^T`, replace it by the aligned
    `sigma_min U V^T` (every singular value set to the smallest non-negligible one, which
    makes the linear system's condition number 1) and update with its column sum (equal task
    weights `w = 1`), i.e. `beta = sigma_min V S^{-1} V^T 1` from the eigen-decomposition
    of the Gram matrix (`aligned_mtl_weights`). Orthogonal gradients of norms `n_i` get
    `beta_i = min(n) / n_i`. Heads get weight 1.

    Args:
        scale_mode: `"min"` (default), `"median"` or `"rmse"`: the common singular value,
            as the authors' `scale_mode`: the smallest kept one, the square root of the
            (lower) median or of the mean of the kept eigenvalues of `G^T G`.

    Raises:
        ValueError: at construction, for another `scale_mode`.

    Example:
        >>> model.compile("adam", losses, loss_weighting=AlignedMTL(scale_mode="min"))

    Reference:
        Senushkin, Patakin, Kuznetsov & Konushin, "Independent Component Alignment for
        Multi-Task Learning", CVPR 2023.
    """

    name = "aligned_mtl"

    def __init__(self, scale_mode: str = "min") -> None:
        super().__init__()
        if scale_mode not in _ALIGNED_SCALE_MODES:
            raise ValueError(
                f"`scale_mode` must be one of {_ALIGNED_SCALE_MODES}. "
                f"Received: scale_mode={scale_mode!r}"
            )
        self.scale_mode = scale_mode

    def task_weights(self, gram, losses):
        return aligned_mtl_weights(gram, self.scale_mode)

    def get_config(self):
        return {"scale_mode": self.scale_mode}
