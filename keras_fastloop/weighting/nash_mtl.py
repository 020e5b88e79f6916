"""Nash-MTL (Navon et al., ICML 2022): a gradient-based method (`keras_fastloop.weighting._gradient`)."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_fastloop._replicas import state_variable
from keras_fastloop.weighting import _utils
from keras_fastloop.weighting._gradient import GradientWeighting
from keras_fastloop.weighting._solvers import (
    _nash_mtl_weights_xla,
    clip_factor,
)
from keras_fastloop.weighting.base import _PACKAGE


@keras.saving.register_keras_serializable(package=_PACKAGE)
class NashMTL(GradientWeighting):
    """Nash-MTL: the Nash bargaining solution between tasks (`nash_mtl`).

    Algorithm: the update of the shared variables is `d = sum_i alpha_i g_i` with `alpha > 0`
    solving `(G^T G) alpha = 1 / alpha` (element-wise) on the raw Gram matrix, i.e. every
    task's directional improvement `<g_i, d>` equals `1 / alpha_i` (proportional fairness),
    and `|d| = sqrt(T)` whatever the gradients' scale, as in the authors' and LibMTL's code.
    Solved exactly in-graph by damped Newton iterations (on `G^T G / |G^T G|_F` for
    conditioning, then rescaled; see `nash_mtl_weights`); the paper approximates it by a
    sequence of convex programs with a CVXPY solver, at most 20 of them by default. Then, as
    the reference does, the *shared* update is clipped to norm `max_norm` (the heads'
    gradients are not). The logged weights are `alpha` times that clip factor (the weight each
    task's shared gradient gets this step). Heads get weight 1 (the reference code gives them
    `alpha_i`, unclipped); regularization gradients are added after the clip.

    With `update_weights_every=k`, `alpha` is recomputed on applied steps `0, k, 2k, ...` and
    held in between (a state variable `nash_mtl_alpha`, saved and restored with the model;
    the clip is applied every step to that step's gradients). The task gradients are still
    computed every step (the Gram matrix feeds the clip), so `k > 1` saves only the solve.

    Args:
        max_iter: positive int, default `20`: Newton steps at most.
        max_norm: non-negative float or `None`, default `1.0`: clip the shared update to
            this norm (LibMTL's `max_norm`); `0` or `None` disables the clip.
        update_weights_every: positive int, default `1`: recompute `alpha` every this many
            applied steps (LibMTL's `update_weights_every`).

    Raises:
        ValueError: at construction, for a `max_iter` or `update_weights_every` that is not a
            positive int, or a negative or non-numeric `max_norm`.

    Example:
        >>> model.compile("adam", losses, loss_weighting=NashMTL(max_norm=1.0))

    Reference:
        Navon, Shamsian, Achituve, Maron, Kawaguchi, Chechik & Fetaya, "Multi-Task Learning as a
        Bargaining Game", ICML 2022.
    """

    name = "nash_mtl"

    def __init__(
        self, max_iter: int = 20, max_norm: float | None = 1.0, update_weights_every: int = 1
    ) -> None:
        super().__init__()
        self.max_iter = _utils.check_positive_int(max_iter, "max_iter")
        self.max_norm = (
            0.0 if max_norm is None else _utils.check_positive(max_norm, "max_norm", True)
        )
        self.update_weights_every = _utils.check_positive_int(
            update_weights_every, "update_weights_every"
        )

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        t = (len(task_names),)
        self.alpha = state_variable(state, "nash_mtl_alpha", t, 1.0)
        self.pending_alpha = state_variable(state, "nash_mtl_pending_alpha", t, 1.0)
        self.step = state_variable(state, "nash_mtl_step", (), 0, "int64")

    def task_weights(self, gram, losses):
        if self.update_weights_every == 1:
            alpha = _nash_mtl_weights_xla(gram, self.max_iter)
        else:
            alpha = tf.cond(
                tf.equal(self.step % self.update_weights_every, 0),
                lambda: _nash_mtl_weights_xla(gram, self.max_iter),
                lambda: tf.identity(self.alpha.value),
            )
        self.pending_alpha.assign(alpha)
        return alpha * clip_factor(alpha, gram, self.max_norm)

    def update(self, losses):
        self.alpha.assign(self.pending_alpha)
        self.step.assign_add(1)

    def get_config(self):
        return {
            "max_iter": self.max_iter,
            "max_norm": self.max_norm,
            "update_weights_every": self.update_weights_every,
        }
