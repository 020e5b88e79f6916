"""MoCo (Fernando et al., ICLR 2023): tracked gradient estimates in step state
(`keras_fastloop.weighting._gradient`)."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from keras_fastloop import _replicas
from keras_fastloop._replicas import state_variable
from keras_fastloop.weighting import _gradient, _utils
from keras_fastloop.weighting._gradient import GradientWeighting
from keras_fastloop.weighting.base import _PACKAGE


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MoCo(GradientWeighting):
    """MoCo: MGDA on tracked (bias-corrected) gradient estimates (`moco`).

    Algorithm, as LibMTL's code, at the `n`-th applied step (`n = 1, 2, ...`): every task's
    shared gradient is normalised and scaled by its loss, `h_i = L_i g_i / (|g_i| + 1e-8)`;
    the estimates move towards it, `y_i <- y_i - beta / n^beta_sigma (y_i - h_i)` (start 0);
    the weights take one step on the min-norm objective,
    `lambda <- softmax(lambda - gamma / n^gamma_sigma (Y Y^T + rho I) lambda)` (start
    `1/T`; `Y` = the rows `y_i`), and the shared variables get `Y^T lambda`, not a
    combination of this step's gradients. The paper projects `lambda` onto the simplex
    where LibMTL's code takes a softmax; we follow the code. Heads get weight 1; the logged
    `{task}_weight` is `lambda`.

    State: `y` is `T` copies of the shared variables (`moco_y_<k>`, float32), created at
    `compile()` for `compile(shared_variables=...)` or else for every trainable variable
    (the shared ones are known only when the step is traced), plus `lambda` and `n`. The new
    values are committed after applied steps only, from the step's own tensors (no second
    copy of `y`). Under `tf.distribute` `y` is built from the all-reduced gradients and the
    global losses, the same on every replica.

    Args:
        beta: positive float, default `0.5` (LibMTL's `MoCo_beta`): the estimates' rate.
        beta_sigma: non-negative float, default `0.5` (`MoCo_beta_sigma`): its decay.
        gamma: positive float, default `0.1` (`MoCo_gamma`): the weights' rate.
        gamma_sigma: non-negative float, default `0.5` (`MoCo_gamma_sigma`): its decay.
        rho: non-negative float, default `0.0` (`MoCo_rho`): `l2` regularization of the
            weights' step.

    Raises:
        ValueError: at construction, for a negative or non-numeric argument (zero `beta`
            or `gamma`).

    Example:
        >>> model.compile("adam", losses, loss_weighting=MoCo(beta=0.5, gamma=0.1))

    Reference:
        Fernando, Shen, Liu, Chaudhury, Murugesan & Chen, "Mitigating Gradient Bias in
        Multi-objective Learning: A Provably Convergent Approach", ICLR 2023.
    """

    name = "moco"

    def __init__(
        self,
        beta: float = 0.5,
        beta_sigma: float = 0.5,
        gamma: float = 0.1,
        gamma_sigma: float = 0.5,
        rho: float = 0.0,
    ) -> None:
        super().__init__()
        self.beta = _utils.check_positive(beta, "beta")
        self.beta_sigma = _utils.check_positive(beta_sigma, "beta_sigma", allow_zero=True)
        self.gamma = _utils.check_positive(gamma, "gamma")
        self.gamma_sigma = _utils.check_positive(gamma_sigma, "gamma_sigma", allow_zero=True)
        self.rho = _utils.check_positive(rho, "rho", allow_zero=True)
        self._pending = None

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        t = len(task_names)
        self.lambd = state_variable(state, "moco_lambda", (t,), 1.0 / t)
        self.step = state_variable(state, "moco_step", (), 0, "int64")
        self.estimates = {}
        for n, variable in enumerate(self.compiled_candidates(model)):
            size = int(np.prod(variable.shape))
            self.estimates[id(variable)] = state_variable(state, f"moco_y_{n}", (t, size))
        self._pending = None

    def _estimate(self, variable):
        if id(variable) not in self.estimates:
            raise self.unknown_at_compile(variable)
        return self.estimates[id(variable)]

    def gradients(self, tape, losses, objective, variables, scale_loss):
        variables = list(variables)
        grads, scale = self.task_gradients(tape, losses, variables, scale_loss)
        per_task, shared, rows = grads.per_task, grads.shared, grads.flat
        norms = ops.sqrt(sum(ops.sum(ops.square(r), axis=1) for r in rows))
        coefficients = grads.losses / (norms + 1e-8)
        n = ops.cast(self.step + 1, "float32")
        rate = self.beta / ops.power(n, self.beta_sigma)
        estimates = [
            tf.identity(self._estimate(variables[k]).value) * (1.0 - rate)
            + rate * coefficients[:, None] * r
            for k, r in zip(shared, rows)
        ]
        yy = sum(ops.matmul(y, ops.transpose(y)) for y in estimates)
        yy = yy + self.rho * ops.eye(self.num_tasks)
        lambd = tf.identity(self.lambd.value)
        step = self.gamma / ops.power(n, self.gamma_sigma)
        lambd = ops.softmax(lambd - step * ops.matmul(yy, lambd[:, None])[:, 0])
        self.weights.assign(lambd)
        self._pending = (lambd, [(variables[k], y) for k, y in zip(shared, estimates)])
        # Every replica returns its 1/R share: the step sums the replicas' gradients.
        share = scale / float(_replicas.num_replicas())
        shared_terms = {
            k: ops.cast(
                share * ops.reshape(ops.matmul(lambd[None], y)[0], variables[k].shape),
                variables[k].dtype,
            )
            for k, y in zip(shared, estimates)
        }
        ones = ops.ones((self.num_tasks,), "float32")
        return _gradient.assemble(
            tape,
            objective,
            variables,
            lambda k: _gradient.weighted_sum(per_task, k, ones),
            shared_terms,
        )

    def update(self, losses):
        if self._pending is None:
            raise RuntimeError(
                "MoCo's state update needs the same step's `gradients` call before it. "
                "Received: update() without gradients()"
            )
        lambd, estimates = self._pending
        self.lambd.assign(lambd)
        for variable, y in estimates:
            self._estimate(variable).assign(y)
        self.step.assign_add(1)

    def get_config(self):
        return {
            "beta": self.beta,
            "beta_sigma": self.beta_sigma,
            "gamma": self.gamma,
            "gamma_sigma": self.gamma_sigma,
            "rho": self.rho,
        }
