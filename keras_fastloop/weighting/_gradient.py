"""Gradient-based multi-task methods: GradNorm, PCGrad, CAGrad, MGDA, IMTL, Nash-MTL,
Aligned-MTL and UPGrad.

All of them act on the gradients of the *shared* variables and reduce to weights `beta` on the
task gradients: the shared variables get `sum_i beta_i g_i` and `beta` is a function of
the tasks' Gram matrix `M_ij = <g_i, g_j>` (plus the losses and the method's state). PCGrad's
sequential projections, for instance, only ever subtract multiples of original task gradients,
so they are tracked as coefficients in Gram space; UPGrad's projections onto the dual cone and
Aligned-MTL's singular-value alignment are likewise linear maps of the task gradients whose
coefficients follow from `M` alone. The step therefore never materialises a concatenated
gradient vector: `M` is summed variable by variable and the update is one weighted sum per
variable.

Cost. `GradientWeighting.gradients` runs one backward pass per task
(`tape.gradient(L_i, variables)`). That pass has to go through task `i`'s head to reach the
shared trunk anyway, so it also yields the head's own gradient for the price of the head's
weight-gradient products; heads are then weighted directly and no extra pass over the heads is
needed (cheaper than per-task passes over the shared variables followed by a separate combined
pass). Regularization losses get their own (cheap) pass through the step's `objective`, which
for these methods carries no task-loss gradient. Solvers run on `T x T` matrices.

Shared variables. By default, inferred at trace time: a trainable variable is shared when at
least two task losses reach it (`tape.gradient` with `UnconnectedGradients.NONE` returns
`None` for the others; this is structural, no extra work at run time). `compile(
shared_variables=[...])` (variables or layers) overrides the inference; only those enter the
Gram matrix, every other variable gets the heads' weighting.

Loss scale. Per-task gradients are taken with `output_gradients=s` where `s =
scale_loss(1.0)` is the optimizer's current loss scale (`LossScaleOptimizer` under
`mixed_float16`; 1 otherwise), i.e. they are exactly the gradients of `scale_loss(L_i)` and
fp16 backward passes are protected as usual. The Gram matrix is computed from `g_i / s` (the
solvers see true gradients; GradNorm's update is not scale-invariant), while the returned
gradients are `sum_i beta_i g_i` of the *scaled* ones, so the step's single unscale, finite
check and clipping apply unchanged. An overflowing task gradient makes `beta` non-finite and
the step skips the update; stateful methods commit state only in `update` (applied steps).

Distribution. Per-task shared gradients are summed across replicas before the Gram matrix, so
every replica computes the same `beta` from the global batch; the weighted local gradients
are then summed by the step as usual.

Heads and logs. Task-specific variables get the plain task gradient (weight 1) for PCGrad,
CAGrad, MGDA, IMTL-G, Nash-MTL, Aligned-MTL and UPGrad: their weights resolve conflicts on
shared parameters, and scaling a head's gradient would only change its learning rate. This is
what LibMTL does for all of them except Nash-MTL, whose reference code back-propagates
`sum_i alpha_i L_i` and so scales the heads by `alpha` too (see `docs/weighting.md`).
GradNorm gives the heads its loss weights `w` (the paper's objective `sum_i w_i L_i`;
LibMTL leaves them at 1) and IMTL the gradients of its scaled losses, `e^{s_i} g_i`. The
logged `{task}_weight` is `beta` (the effective weight of each task's shared gradient this
step; e.g. MGDA's alphas) and the logged `loss` is `sum_i head_weight_i L_i` +
regularization (plus IMTL's `-s_i` terms).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from keras_fastloop import _replicas
from keras_fastloop.weighting.base import LossWeighting


def loss_scale(scale_loss):
    """The optimizer's current loss scale as a float32 scalar (1 without loss scaling)."""
    return ops.cast(scale_loss(ops.ones((), "float32")), "float32")


def task_gradients(tape, losses, variables, scale):
    """Per loss, the gradients of `scale * loss` for `variables`: dense tensors, `None` where
    the loss does not reach a variable."""
    none = tf.UnconnectedGradients.NONE
    return [
        [
            None if g is None else tf.convert_to_tensor(g)  # IndexedSlices -> dense
            for g in tape.gradient(
                loss, variables, output_gradients=scale, unconnected_gradients=none
            )
        ]
        for loss in losses
    ]


def shared_rows(per_task, shared, variables, scale):
    """Per shared variable (indices `shared`), the `(T, size)` float32 matrix of the task
    gradients, divided by `scale` and summed across replicas (zeros where a task does not
    reach the variable)."""
    flat = []
    for k in shared:
        rows = [
            ops.zeros((int(np.prod(variables[k].shape)),), "float32")
            if grads[k] is None
            else ops.reshape(ops.cast(grads[k], "float32"), (-1,))
            for grads in per_task
        ]
        flat.append(ops.stack(rows) / scale)
    return _replicas.all_reduce_sum(flat)


def _resolve_shared(model, shared):
    if shared is None:
        return None
    if not isinstance(shared, (list, tuple)) or not shared:
        raise ValueError(
            "`shared_variables` must be None or a non-empty list of variables or layers. "
            f"Received: shared_variables={shared!r}"
        )
    variables = []
    for item in shared:
        if isinstance(item, keras.layers.Layer):
            variables.extend(item.trainable_variables)
        else:
            variables.append(item)
    trainable = {id(v) for v in model.trainable_variables}
    unknown = [getattr(v, "path", repr(v)) for v in variables if id(v) not in trainable]
    if unknown:
        raise ValueError(
            "Every entry of `shared_variables` must be a trainable variable (or layer) of the "
            f"model. Received: shared_variables with unknown entries {unknown}"
        )
    return variables


class GradientWeighting(LossWeighting):
    """Base of gradient-based methods: per-task gradients, Gram matrix, weights `beta`.

    Subclasses implement `task_weights` and optionally `head_weights`.
    """

    requires_task_gradients = True

    def validate(self, model, task_names, shared_variables=None):
        super().validate(model, task_names, shared_variables)
        if model.built:
            _resolve_shared(model, shared_variables)

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        step = getattr(model, "fastloop_step", None)
        self._given_shared = _resolve_shared(model, getattr(step, "shared_variables", None))
        self.shared_variable_paths = None  # set when the step is traced

    def compiled_candidates(self, model):
        """The variables that may be shared, as known at `compile()`: `shared_variables` when
        given, else every trainable variable (the shared ones are found only when the step is
        traced). Methods with per-variable state make it for these."""
        return list(self._given_shared or model.trainable_variables)

    def unknown_at_compile(self, variable):
        """The error for a shared variable that has no per-variable state (see
        `compiled_candidates`)."""
        return ValueError(
            f"Loss weighting '{self.name}' found the shared variable {variable.path!r}, which "
            "did not exist at compile() (it has no state). Build the model before compile() "
            f"or pass `shared_variables`. Received: shared variable {variable.path!r}"
        )

    def head_weights(self):
        """Weights of the task-specific variables' gradients (default: 1 per task)."""
        return ops.ones((self.num_tasks,), "float32")

    def combine(self, losses):
        value = ops.sum(ops.stack(losses) * self.head_weights())
        return ops.stop_gradient(value), self.read_weights()

    def task_weights(self, gram, losses):
        """`beta` (shape `(T,)`) from the Gram matrix and the global losses."""
        raise NotImplementedError

    def _shared_indices(self, per_task, variables):
        if self._given_shared is not None:
            given = {id(v) for v in self._given_shared}
            shared = [k for k, v in enumerate(variables) if id(v) in given]
        else:
            shared = [
                k
                for k in range(len(variables))
                if sum(grads[k] is not None for grads in per_task) >= 2
            ]
        if not shared:
            raise ValueError(
                f"Gradient-based loss weighting '{self.name}' needs variables shared by at least "
                "two tasks, but no trainable variable is reached by more than one task loss. "
                "Pass `shared_variables` to `compile()` or use a loss-based method. "
                f"Received: tasks={self.task_names}"
            )
        self.shared_variable_paths = [variables[k].path for k in shared]
        return shared

    def gradients(self, tape, losses, objective, variables, scale_loss):
        variables = list(variables)
        scale = loss_scale(scale_loss)
        per_task = task_gradients(tape, losses, variables, scale)
        shared = self._shared_indices(per_task, variables)
        flat = shared_rows(per_task, shared, variables, scale)
        gram = ops.sum(ops.stack([ops.matmul(f, ops.transpose(f)) for f in flat]), axis=0)
        global_losses = _replicas.all_reduce_sum([ops.cast(loss, "float32") for loss in losses])
        beta = self.task_weights(gram, ops.stack(global_losses))
        self.weights.assign(beta)
        head = self.head_weights()
        regularization = tape.gradient(
            objective, variables, unconnected_gradients=tf.UnconnectedGradients.NONE
        )
        shared = set(shared)
        result = []
        for k in range(len(variables)):
            w = beta if k in shared else head
            terms = [
                ops.cast(w[i], grads[k].dtype) * grads[k]
                for i, grads in enumerate(per_task)
                if grads[k] is not None
            ]
            if regularization[k] is not None:
                terms.append(regularization[k])
            result.append(ops.sum(ops.stack(terms), axis=0) if terms else None)
        return result


# ------------------------------------------------------------------------------ the methods
