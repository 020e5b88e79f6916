"""IMTL and IMTL-G (Liu et al., ICLR 2021): a gradient-based method (`keras_fastloop.weighting._gradient`)."""

from __future__ import annotations

import keras
from keras import ops

from keras_fastloop import _keras_internals as internals
from keras_fastloop.weighting._gradient import GradientWeighting
from keras_fastloop.weighting._solvers import (
    imtl_weights,
)
from keras_fastloop.weighting.base import _PACKAGE


@keras.saving.register_keras_serializable(package=_PACKAGE)
class IMTLG(GradientWeighting):
    """Impartial multi-task learning, gradient part only (IMTL-G, `imtl_g`).

    Algorithm: find `alpha` (summing to 1) such that the aggregate `g = sum_i alpha_i g_i`
    has the same projection on every task's unit gradient `u_i = g_i / |g_i|`; closed form
    `alpha_{2..T} = g_1 U^T (D U^T)^{-1}`, `alpha_1 = 1 - sum alpha_{2..T}` with
    `D = [g_1 - g_i]`, `U = [u_1 - u_i]` (see `imtl_weights`; a pseudo-inverse, so
    aligned tasks give a finite answer). The logged weights are `alpha`; heads get weight 1.
    The full method of the paper, with IMTL-L's learned loss scales, is `imtl`
    (`IMTL`).

    Example:
        >>> model.compile("adam", losses, loss_weighting="imtl_g")

    Reference:
        Liu, Li, Kuang, Xue, Chen, Yang, Liao & Zhang, "Towards Impartial Multi-task Learning",
        ICLR 2021 (Section 3.2, IMTL-G).
    """

    name = "imtl_g"

    def task_weights(self, gram, losses):
        return imtl_weights(gram)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class IMTL(GradientWeighting):
    """Impartial multi-task learning, the hybrid of the paper (IMTL-L + IMTL-G, `imtl`).

    Algorithm, with one trainable loss scale `s_i` per task (start 0):

    - IMTL-L: every task's loss becomes `e^{s_i} L_i - s_i`. The `s_i` are trained by the
      model's optimizer on the gradient of that scaled loss, `e^{s_i} L_i - 1` (its minimum
      over `s_i` is at `e^{s_i} = 1 / L_i`: every scaled loss is pushed towards 1).
    - IMTL-G on the scaled losses' gradients `e^{s_i} g_i`: `alpha` summing to 1 with
      equal projections of `sum_i alpha_i e^{s_i} g_i` on every unit gradient
      (`imtl_weights` on `diag(e^s) M diag(e^s)`).

    The shared variables get `sum_i alpha_i e^{s_i} g_i` (logged `{task}_weight` =
    `alpha_i e^{s_i}`, the weight of the raw gradient `g_i`); task-specific variables get
    the scaled loss' gradient `e^{s_i} g_i`. The `s_i` are created with
    `model.add_weight` (name `imtl_loss_scales`), saved with the model and trained with
    its learning rate; the `- s_i` term is divided by the number of replicas like any
    regularization loss. The paper applies IMTL-G to the gradients with respect to the shared
    *representation*; here (as LibMTL's default) to the shared *parameters*.

    Example:
        >>> model.compile("adam", losses, loss_weighting="imtl")

    Reference:
        Liu, Li, Kuang, Xue, Chen, Yang, Liao & Zhang, "Towards Impartial Multi-task Learning",
        ICLR 2021 (Algorithm 1, IMTL); LibMTL's `IMTL`.
    """

    name = "imtl"

    def __init__(self) -> None:
        super().__init__()
        self.loss_scales = None

    def build(self, model, state, task_names, static_weights):
        from keras_fastloop.weighting.uw import _model_variable

        super().build(model, state, task_names, static_weights)
        self.loss_scales = _model_variable(model, "imtl_loss_scales", (len(task_names),), 0.0)

    def _scales(self):
        return ops.exp(ops.cast(ops.convert_to_tensor(self.loss_scales), "float32"))

    def head_weights(self):
        return ops.stop_gradient(self._scales())

    def combine(self, losses):
        s = ops.cast(ops.convert_to_tensor(self.loss_scales), "float32")
        scaled = ops.exp(s) * ops.stop_gradient(ops.stack(losses))
        # Gradient for s only (the network's gradients come from the per-task passes).
        objective = ops.sum(scaled) - internals.scale_loss_for_distribution(ops.sum(s))
        return objective, self.read_weights()

    def task_weights(self, gram, losses):
        scales = self._scales()
        alpha = imtl_weights(gram * scales[:, None] * scales[None, :])
        return alpha * scales
