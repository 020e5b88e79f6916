"""Gradient Sign Dropout (GradDrop): a gradient-based method (`keras_fastloop.weighting._gradient`)."""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop import _validation
from keras_fastloop._replicas import state_variable
from keras_fastloop.weighting import _utils
from keras_fastloop.weighting._gradient import GradientWeighting
from keras_fastloop.weighting.base import _PACKAGE


def graddrop_multipliers(grads, uniform, leak):
    """GradDrop's per-entry multipliers `leak + (1 - leak) M` of task gradients.

    Args:
        grads: float32 `(T, n)`, the tasks' gradients of `n` entries.
        uniform: float32 `(n,)`, one draw from `U[0, 1)` per entry.
        leak: float in `[0, 1]`.

    Returns:
        float32 `(T, n)`: `P = (1 + sum_i g_i / (sum_i |g_i| + 1e-7)) / 2` per entry; task
        `i` keeps entry `k` (`M = 1`) if `g_ik > 0` and `P_k > u_k`, or `g_ik < 0` and
        `P_k < u_k`.
    """
    p = 0.5 * (1.0 + ops.sum(grads, 0) / (ops.sum(ops.abs(grads), 0) + 1e-7))
    keep = ops.logical_or(
        ops.logical_and(ops.greater(p, uniform)[None], ops.greater(grads, 0.0)),
        ops.logical_and(ops.less(p, uniform)[None], ops.less(grads, 0.0)),
    )
    return leak + (1.0 - leak) * ops.cast(keep, "float32")


@keras.saving.register_keras_serializable(package=_PACKAGE)
class GradDrop(GradientWeighting):
    """Gradient Sign Dropout: keep, per entry, the gradients of one sign at random (`graddrop`).

    Algorithm, for every entry `k` of the shared variables (see `graddrop_multipliers`):
    the positive sign purity `P_k = (1 + sum_i g_ik / sum_i |g_ik|) / 2`, a draw
    `u_k ~ U[0, 1)`; the positive task gradients survive if `P_k > u_k`, the negative ones
    otherwise, and dropped entries keep a fraction `leak`. The shared variables get
    `sum_i (leak + (1 - leak) M_i) * g_i`, the task-specific ones the plain task gradient.
    The logged `{task}_weight` is the mean multiplier of task `i`'s shared entries (the
    fraction kept when `leak = 0`).

    Deviation: the paper and LibMTL apply GradDrop to the gradients with respect to the shared
    *representation* (LibMTL refuses parameter gradients), per feature, with the gradients
    summed over the batch after multiplying by the sign of the activation. Here it acts on the
    shared *variables'* gradients, per parameter entry (already batch sums, so without that
    sign factor); `compile(shared_variables=[layer])` restricts it to, e.g., the last shared
    layer. `P` and `M` come from the global batch's gradients (all-reduced; the same on every
    replica) and are applied to each replica's own gradients.

    Randomness: `u` comes from a stateless generator keyed by `(seed, t)` and the variable's
    index, `t` a checkpointed counter of applied updates (as `RLW`): reproducible under
    `keras.utils.set_random_seed` (which seeds the default `seed`), independent of
    `steps_per_execution`, and a restored checkpoint continues the sequence.

    Args:
        leak: float in `[0, 1]`, default `0.0` (LibMTL `leak`).
        seed: int or `None` (default: drawn from Python's `random`). Stored in the config.

    Raises:
        ValueError: `leak` outside `[0, 1]`, a non-int `seed`.

    Example:
        >>> model.compile("adam", losses, loss_weighting=GradDrop(leak=0.0, seed=0))

    Reference:
        Chen, Ngiam, Huang, Luong, Kretzschmar, Chai & Anguelov, "Just Pick a Sign: Optimizing
        Deep Multitask Models with Gradient Sign Dropout", NeurIPS 2020; LibMTL's `GradDrop`.
    """

    name = "graddrop"

    def __init__(self, leak: float = 0.0, seed: int | None = None) -> None:
        super().__init__()
        ok = _validation.is_real(leak) and 0 <= leak <= 1
        _validation.check(ok, "leak", "a float in [0, 1]", leak)
        self.leak = float(leak)
        self.seed = _utils.resolve_seed(seed)

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        self.step = state_variable(state, "graddrop_step", (), 0, "int64")

    def gradients(self, tape, losses, objective, variables, scale_loss):
        variables = list(variables)
        grads, _ = self.task_gradients(tape, losses, variables, scale_loss)
        key = _utils.stateless_seed(self.seed, self.step)
        shared, kept, size = {}, 0.0, 0
        for j, (k, flat) in enumerate(zip(grads.shared, grads.flat)):
            seed = tf.random.experimental.stateless_fold_in(key, j)
            uniform = tf.random.stateless_uniform(flat.shape[1:], seed=seed)
            multipliers = graddrop_multipliers(flat, uniform, self.leak)
            kept = kept + ops.sum(multipliers, axis=1)
            size += int(flat.shape[1])
            terms = [
                ops.cast(ops.reshape(multipliers[i], g[k].shape), g[k].dtype) * g[k]
                for i, g in enumerate(grads.per_task)
                if g[k] is not None
            ]
            shared[k] = ops.sum(ops.stack(terms), axis=0)
        self.weights.assign(kept / float(size))
        head = ops.ones((self.num_tasks,), "float32")
        return self.assemble(tape, objective, variables, grads, shared, head)

    def update(self, losses):
        self.step.assign_add(1)

    def get_config(self):
        return {"leak": self.leak, "seed": self.seed}
