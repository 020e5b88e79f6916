"""Dual-Balancing MTL (DB-MTL): a gradient-based method (`keras_fastloop.weighting._gradient`)."""

from __future__ import annotations

import keras
from keras import ops

from keras_fastloop import _replicas, _validation
from keras_fastloop._replicas import state_variable
from keras_fastloop.weighting import _utils
from keras_fastloop.weighting._gradient import GradientWeighting
from keras_fastloop.weighting.base import _PACKAGE

_EPS = 1e-8


@keras.saving.register_keras_serializable(package=_PACKAGE)
class DBMTL(GradientWeighting):
    """Dual-Balancing MTL: log-losses, then equal norms of averaged task gradients (`db_mtl`).

    Algorithm, at applied update `t = 1, 2, ...` (LibMTL's code):

    - loss balancing: each task's gradient is that of `log(L_i + 1e-8)`,
      `h_i = g_i / (L_i + 1e-8)`;
    - a running average per task of the shared part, `m_i <- h_i + b_t (m_i - h_i)` with
      `b_t = beta / t^beta_sigma` and `m_i = 0` at the start (no bias correction, as
      LibMTL);
    - gradient balancing: `alpha_i = max_j |m_j| / (|m_i| + 1e-8)`; the shared variables get
      `sum_i alpha_i m_i`, the task-specific ones `h_i` (LibMTL's heads get the plain
      log-loss gradient).

    The logged `{task}_weight` is `alpha_i` (LibMTL reports ones). `m` lives in step-state
    variables, a `(T, size)` float32 array per shared variable plus this step's value, committed
    on applied updates only (see `_gradient`): the state is `2 T` times the shared
    variables' size, and it is created at `compile()` for every trainable variable that may be
    shared (only `shared_variables` when given). Norms are over all shared variables; under
    `tf.distribute` the averages are of the global batch's gradients and losses.

    Args:
        beta: float in `[0, 1)`, default `0.9` (LibMTL `DB_beta`): the average's decay.
        beta_sigma: non-negative float, default `0.0` (LibMTL `DB_beta_sigma`): decay of
            `beta` with `t`.

    Raises:
        ValueError: `beta` outside `[0, 1)`, a negative `beta_sigma`; at `compile()`, a
            model without variables.

    Example:
        >>> model.compile("adam", losses, loss_weighting="db_mtl")

    Reference:
        Lin, Jiang, Ye, Zhang, Chen, Chen, Liu & Kwok, "Dual-Balancing for Multi-Task
        Learning", arXiv:2308.12029, 2023; LibMTL's `DB_MTL`.
    """

    name = "db_mtl"
    buffer_prefix = "db_mtl_average"

    def __init__(self, beta: float = 0.9, beta_sigma: float = 0.0) -> None:
        super().__init__()
        if not _validation.is_real(beta) or not 0 <= beta < 1:
            raise ValueError(f"`beta` must be a float in [0, 1). Received: beta={beta!r}")
        self.beta = float(beta)
        self.beta_sigma = _utils.check_positive(beta_sigma, "beta_sigma", allow_zero=True)

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        self.step = state_variable(state, "db_mtl_step", (), 0, "int64")  # exact past 2**24

    def gradients(self, tape, losses, objective, variables, scale_loss):
        variables = list(variables)
        grads, scale = self.task_gradients(tape, losses, variables, scale_loss)
        inverse = 1.0 / (grads.losses + _EPS)
        decay = self.beta / ops.power(ops.cast(self.step, "float32") + 1.0, self.beta_sigma)
        averages = []
        for flat, (current, pending) in zip(grads.flat, self._shared_in_trace):
            h = flat * inverse[:, None]
            average = h + decay * (current - h)
            pending.assign(average)
            averages.append(average)
        norms = ops.sqrt(ops.sum(ops.stack([ops.sum(ops.square(m), axis=1) for m in averages]), 0))
        alpha = ops.max(norms) / (norms + _EPS)
        self.weights.assign(alpha)
        # sum_i alpha_i m_i is a global (summed) unscaled gradient: each replica returns its
        # 1/R share, loss-scaled like the others.
        factor = scale / float(_replicas.num_replicas())
        shared = {
            k: ops.cast(
                ops.reshape(factor * ops.matmul(alpha[None, :], m)[0], variables[k].shape),
                variables[k].dtype,
            )
            for k, m in zip(grads.shared, averages)
        }
        return self.assemble(tape, objective, variables, grads, shared, inverse)

    def update(self, losses):
        self.commit_buffers()
        self.step.assign_add(1)

    def get_config(self):
        return {"beta": self.beta, "beta_sigma": self.beta_sigma}
