"""GradVac (Wang et al., ICLR 2021): a gradient-based method with a Gram matrix per group of
shared variables (`keras_fastloop.weighting._gradient`)."""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop._replicas import state_variable
from keras_fastloop.weighting import _gradient, _utils
from keras_fastloop.weighting._gradient import GradientWeighting
from keras_fastloop.weighting.base import _PACKAGE

_GRANULARITIES = ("model", "layer", "variable")


def gradvac_weights(grams, targets, order, beta):
    """GradVac as coefficients on the original task gradients, one set per group of variables.

    For every task `i` (`c = e_i`, per group `k`) and every other task `j` in `order[i]`:
    `rho = <g_i^vac, g_j> / (|g_i^vac| |g_j| + 1e-8)` on group `k`; if `rho < phi` (the
    target `targets[i, j, k]`),
    `g_i^vac += |g_i^vac| (phi sqrt(1 - rho^2) - rho sqrt(1 - phi^2)) /
    (|g_j| sqrt(1 - phi^2) + 1e-8) g_j`; then (always) `phi <- (1 - beta) phi + beta rho`.
    Every vector is a combination of the original gradients, tracked by its coefficients from
    the group's Gram matrix.

    Args:
        grams: `(K, T, T)` Gram matrices of the task gradients, one per group.
        targets: `(T, T, K)` EMA targets `phi` (LibMTL's `rho_T`).
        order: `(T, T)` int tensor; row `i` is the order in which task `i` visits the tasks
            (its own index is skipped).
        beta: float, the EMA rate.

    Returns:
        `(coefficients, targets)`: `(K, T)` with group `k`'s update
        `sum_i g_i^vac = sum_m coefficients[k, m] g_m`, and the new targets.
    """
    t = grams.shape[1]
    dtype = grams.dtype
    eye = tf.eye(t, dtype=dtype)
    norms = tf.sqrt(tf.maximum(tf.linalg.diag_part(grams), 0.0))  # (K, T): |g_m| per group
    total = tf.zeros((grams.shape[0], t), dtype)
    for i in range(t):
        c = tf.zeros_like(total) + eye[i]
        for position in range(t):
            j = order[i, position]
            column = tf.gather(grams, j, axis=2)  # (K, T): <g_m, g_j>
            dot = tf.reduce_sum(c * column, axis=1)
            c_norm = tf.sqrt(tf.maximum(tf.reduce_sum(c * tf.linalg.matvec(grams, c), 1), 0.0))
            j_norm = tf.gather(norms, j, axis=1)
            rho = dot / (c_norm * j_norm + 1e-8)
            phi = tf.gather_nd(targets, tf.stack([i, j]))  # (K,)
            root_phi = tf.sqrt(tf.maximum(1.0 - phi * phi, 0.0))
            root_rho = tf.sqrt(tf.maximum(1.0 - rho * rho, 0.0))
            w = c_norm * (phi * root_rho - rho * root_phi) / (j_norm * root_phi + 1e-8)
            other = tf.not_equal(j, i)
            w = tf.where(tf.logical_and(other, rho < phi), w, 0.0)
            c = c + w[:, None] * tf.gather(eye, j)[None, :]
            new_phi = tf.where(other, (1.0 - beta) * phi + beta * rho, phi)
            targets = tf.tensor_scatter_nd_update(targets, tf.stack([i, j])[None], new_phi[None])
        total = total + c
    return total, targets


_gradvac_weights_xla = tf.function(gradvac_weights, jit_compile=True, autograph=False)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class GradVac(GradientWeighting):
    """Gradient Vaccine: raise each pair's gradient similarity to its running target (`gradvac`).

    Algorithm: for every task `i` and every other task `j` in a random order, on every group
    of shared variables: `rho = cos(g_i^vac, g_j)`; if `rho` is below the target `phi_ij`
    (start 0), add the multiple of `g_j` that makes the cosine `phi_ij` exactly; then
    `phi_ij <- (1 - beta) phi_ij + beta rho` (as LibMTL's code, at every visit; its 1.1.5
    release and the paper update only on a correction). The shared variables get
    `sum_i g_i^vac`, computed from each group's Gram matrix as weights on the original task
    gradients (`gradvac_weights`). The order comes from a stateless generator keyed by
    `(seed, step)`; the targets live in step state (`gradvac_targets`, `(T, T, groups)`),
    committed after applied steps only. The logged `{task}_weight` is task `i`'s weight in
    the update (the mean over groups when there are several); heads get weight 1.

    Args:
        beta: float in `[0, 1]`, default `0.5` (LibMTL's `GradVac_beta`): the targets' EMA
            rate.
        granularity: `"model"` (default; LibMTL's `GradVac_group_type=0`: one group),
            `"layer"` (`1`: one group per layer) or `"variable"` (`2`: one per variable).
        seed: int or `None` (default: drawn from Python's `random`, which
            `keras.utils.set_random_seed` seeds). Stored in the config.

    Raises:
        ValueError: at construction, for a `beta` outside `[0, 1]` or an unknown
            `granularity`.

    Example:
        >>> model.compile("adam", losses, loss_weighting=GradVac(beta=0.5, granularity="layer"))

    Reference:
        Wang, Tsvetkov, Firat & Cao, "Gradient Vaccine: Investigating and Improving Multi-task
        Optimization in Massively Multilingual Models", ICLR 2021.
    """

    name = "gradvac"

    def __init__(
        self, beta: float = 0.5, granularity: str = "model", seed: int | None = None
    ) -> None:
        super().__init__()
        beta = _utils.check_positive(beta, "beta", allow_zero=True)
        if beta > 1.0:
            raise ValueError(f"`beta` must be in [0, 1]. Received: beta={beta!r}")
        self.beta = beta
        if granularity not in _GRANULARITIES:
            raise ValueError(
                f"`granularity` must be one of {_GRANULARITIES}. Received: "
                f"granularity={granularity!r}"
            )
        self.granularity = granularity
        self.seed = _utils.resolve_seed(seed)

    def _group_key(self, variable):
        if self.granularity == "model":
            return ""
        if self.granularity == "layer":
            return variable.path.rsplit("/", 1)[0]
        return variable.path

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        candidates = self.compiled_candidates(model)
        keys = []
        for variable in candidates:
            if self._group_key(variable) not in keys:
                keys.append(self._group_key(variable))
        self._groups = {id(v): keys.index(self._group_key(v)) for v in candidates}
        t = len(task_names)
        shape = (t, t, max(len(keys), 1))
        self.targets = state_variable(state, "gradvac_targets", shape)
        self.pending_targets = state_variable(state, "gradvac_pending_targets", shape)
        self.step = state_variable(state, "gradvac_step", (), 0, "int64")

    def _group(self, variable):
        if id(variable) not in self._groups:
            raise self.unknown_at_compile(variable)
        return self._groups[id(variable)]

    def gradients(self, tape, losses, objective, variables, scale_loss):
        variables = list(variables)
        scale = _gradient.loss_scale(scale_loss)
        per_task = _gradient.task_gradients(tape, losses, variables, scale)
        shared = self._shared_indices(per_task, variables)
        rows = _gradient.shared_rows(per_task, shared, variables, scale)
        groups = [self._group(variables[k]) for k in shared]
        used = sorted(set(groups))
        grams = ops.stack(
            [
                ops.sum(
                    ops.stack([r @ ops.transpose(r) for r, g in zip(rows, groups) if g == u]), 0
                )
                for u in used
            ]
        )
        t = self.num_tasks
        keys = tf.random.stateless_uniform((t, t), seed=_utils.stateless_seed(self.seed, self.step))
        order = tf.cast(tf.argsort(keys, axis=1), "int32")
        targets = tf.gather(self.targets.value, used, axis=2)
        coefficients, targets = _gradvac_weights_xla(grams, targets, order, self.beta)
        by_group = tf.transpose(tf.identity(self.targets.value), [2, 0, 1])
        by_group = tf.tensor_scatter_nd_update(
            by_group, [[u] for u in used], tf.transpose(targets, [2, 0, 1])
        )
        self.pending_targets.assign(tf.transpose(by_group, [1, 2, 0]))
        self.weights.assign(ops.mean(coefficients, axis=0))
        position = {u: n for n, u in enumerate(used)}
        shared_terms = {
            k: ops.sum(ops.stack(_gradient.weighted_sum(per_task, k, coefficients[position[g]])), 0)
            for k, g in zip(shared, groups)
        }
        ones = ops.ones((t,), "float32")
        return _gradient.assemble(
            tape,
            objective,
            variables,
            lambda k: _gradient.weighted_sum(per_task, k, ones),
            shared_terms,
        )

    def update(self, losses):
        self.targets.assign(self.pending_targets)
        self.step.assign_add(1)

    def get_config(self):
        return {"beta": self.beta, "granularity": self.granularity, "seed": self.seed}
