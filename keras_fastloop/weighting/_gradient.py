"""The base of every gradient-based method (`GradientWeighting`), its per-task gradients
(`task_gradients`, `shared_rows`) and the assembly of the update (`assemble`).

Gram-space methods (GradNorm, PCGrad, CAGrad, MGDA, IMTL, Nash-MTL, Aligned-MTL, UPGrad,
FairGrad) act on the gradients of the *shared* variables and reduce to weights `beta` on the
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

Element-wise rules. DB-MTL (a running average of each task's gradient), ExcessMTL (an
AdaGrad-style accumulator of each task's squared gradient) and GradDrop (a sign mask per
parameter entry) are not functions of the Gram matrix: they override `gradients`, take the
per-task gradients from `task_gradients` and return `assemble(...)`.

Per-element state. A method that keeps state per shared entry sets `buffer_prefix`; `build`
then creates, for every variable that may be shared (the given `shared_variables`, else every
trainable variable of the model at `compile()`), a `(T, size)` float32 state variable and a
second one for this step's value. The step writes the second one; `update`, which runs only on
applied steps, commits it (`commit_buffers`), so a skipped step leaves the state unchanged.
Memory: `2 T` copies of those variables.

Parts of the batch. A method that sets `sub_batches = 3` (MoDo, SDMGrad) gets every task's
loss on each of the batch's three consecutive parts (`part_losses`, see
`keras_fastloop._step.objective.part_losses`) and implements `part_weights(rows)`: `beta` and
the part whose gradients it weights, from the parts' shared rows. Heads get the mean of the
parts' head gradients (as LibMTL's MoDo). Steps whose (first replica's) batch has fewer
samples than parts, where every part is the whole batch, are counted and reported by a
`FastloopWarning` at the end of the epoch.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from keras_fastloop import _keras_internals as internals
from keras_fastloop import _replicas
from keras_fastloop._replicas import state_variable
from keras_fastloop._warnings import FastloopWarning
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


def weighted_sum(per_task, k, weights):
    """`weights[i] * per_task[i][k]` for the tasks that reach variable `k` (a list of terms,
    empty when none does)."""
    return [
        ops.cast(weights[i], grads[k].dtype) * grads[k]
        for i, grads in enumerate(per_task)
        if grads[k] is not None
    ]


def assemble(tape, objective, variables, terms, shared_update=None):
    """The step's gradients: for each variable `k` the sum of its terms and its regularization
    gradient (`None` for a variable nothing reaches).

    Args:
        tape: the step's tape; `objective` (only regularization for these methods) is
            differentiated once more for `variables`.
        terms: callable `k -> list of tensors`, e.g. `weighted_sum(per_task, k, weights)`.
        shared_update: optional dict from a variable's index to its whole (loss-scaled)
            update; it replaces `terms(k)` for those variables.
    """
    regularization = tape.gradient(
        objective, variables, unconnected_gradients=tf.UnconnectedGradients.NONE
    )
    shared_update = shared_update or {}
    result = []
    for k in range(len(variables)):
        parts = [shared_update[k]] if k in shared_update else terms(k)
        if regularization[k] is not None:
            parts = [*parts, regularization[k]]
        result.append(ops.sum(ops.stack(parts), axis=0) if parts else None)
    return result


def cross_gram(rows_a, rows_b):
    """`C_ij = <a_i, b_j>` summed over the shared variables' rows."""
    return sum(ops.matmul(a, ops.transpose(b)) for a, b in zip(rows_a, rows_b))


class _ReportWholeBatches(keras.callbacks.Callback):
    """Warns at an epoch's end when steps used their whole batch for every part."""

    def __init__(self, method):
        super().__init__()
        self.method = method

    def on_epoch_end(self, epoch, logs=None):
        self.method.report_whole_batches()


def _check_shared_list(shared):
    if not isinstance(shared, (list, tuple)) or not shared:
        raise ValueError(
            "`shared_variables` must be None or a non-empty list of variables or layers. "
            f"Received: shared_variables={shared!r}"
        )


def _check_unbuilt(model, shared):
    """What can be checked of `shared_variables` before the layers' variables exist."""
    _check_shared_list(shared)
    layers = {id(layer) for layer in internals.flatten_layers(model)}
    for item in shared:
        if isinstance(item, keras.layers.Layer):
            if id(item) not in layers or item is model:
                raise ValueError(
                    "Every layer of `shared_variables` must be a layer of the model. "
                    f"Received: shared_variables with the layer {item.name!r}"
                )
            if not item.trainable:
                raise ValueError(
                    "Every layer of `shared_variables` must be trainable. "
                    f"Received: shared_variables with the frozen layer {item.name!r}"
                )
        elif not getattr(item, "trainable", False):
            raise ValueError(
                "Every entry of `shared_variables` must be a trainable variable (or layer) of "
                f"the model. Received: shared_variables with {getattr(item, 'path', item)!r}"
            )


def _resolve_shared(model, shared):
    if shared is None:
        return None
    _check_shared_list(shared)
    variables = []
    for item in shared:
        if isinstance(item, keras.layers.Layer):
            if item.built and not item.trainable_variables:
                raise ValueError(
                    "Every layer of `shared_variables` must have trainable variables. "
                    f"Received: shared_variables with the layer {item.name!r} (trainable="
                    f"{item.trainable})"
                )
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


class TaskGradients(NamedTuple):
    """One step's per-task gradients (see `GradientWeighting.task_gradients`)."""

    per_task: list  # per task, per variable: the local loss-scaled gradient or None
    shared: list  # indices of the shared variables
    flat: list  # per shared variable: (T, size) float32, summed across replicas, unscaled
    losses: object  # (T,) float32 global losses


class GradientWeighting(LossWeighting):
    """Base of gradient-based methods: per-task gradients, Gram matrix, weights `beta`.

    Subclasses implement `task_weights` and optionally `head_weights`; a method with an
    element-wise rule overrides `gradients` and sets `buffer_prefix` for per-element state
    (see the module docstring).
    """

    requires_task_gradients = True
    buffer_prefix = None

    def validate(self, model, task_names, shared_variables=None):
        super().validate(model, task_names, shared_variables)
        if shared_variables is not None:
            _check_unbuilt(model, shared_variables)
        if model.built:
            _resolve_shared(model, shared_variables)

    def build(self, model, state, task_names, static_weights):
        super().build(model, state, task_names, static_weights)
        self._given_shared = _resolve_shared(model, self.shared_variables)
        self.shared_variable_paths = None  # set when the step is traced
        if self.sub_batches > 1:
            name = f"{self.name}_whole_batches"
            self.whole_batches = state_variable(state, name, (), 0, "int64")
        self._buffers = []
        self._shared_in_trace = []
        if self.buffer_prefix is None:
            return
        candidates = self.compiled_candidates(model)
        if not candidates:
            raise ValueError(
                f"Loss weighting '{self.name}' keeps per-task state for every shared variable "
                "and needs the model's variables at compile(): build the model first (call it "
                "on a batch, or `model.build(input_shape)`) or pass `shared_variables`. "
                f"Received: a model without trainable variables ({model.name})"
            )
        t = len(task_names)
        for k, variable in enumerate(candidates):
            size = int(np.prod(variable.shape))
            current = state_variable(state, f"{self.buffer_prefix}_{k}", (t, size))
            pending = state_variable(state, f"{self.buffer_prefix}_{k}_pending", (t, size))
            self._buffers.append((variable, current, pending))

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

    def buffers(self, variable):
        """`(state, pending)` variables of `variable`; a clear error for an unknown one."""
        for candidate, current, pending in self._buffers:
            if candidate is variable:
                return current, pending
        raise self.unknown_at_compile(variable)

    def commit_buffers(self):
        """Copy this step's pending per-element state into the state (in `update`)."""
        for current, pending in self._shared_in_trace:
            current.assign(pending)

    def task_gradients(self, tape, losses, variables, scale_loss):
        """Per-task gradients: `(TaskGradients, scale)`; `scale` is the loss scale."""
        scale = loss_scale(scale_loss)
        per_task = task_gradients(tape, losses, variables, scale)
        shared = self._shared_indices(per_task, variables)
        flat = shared_rows(per_task, shared, variables, scale)
        global_losses = _replicas.all_reduce_sum([ops.cast(loss, "float32") for loss in losses])
        if self.buffer_prefix is not None:
            self._shared_in_trace = [self.buffers(variables[k]) for k in shared]
        return TaskGradients(per_task, shared, flat, ops.stack(global_losses)), scale

    def assemble(self, tape, objective, variables, grads, shared_update, head_weights):
        """The step's gradients: `shared_update[k]` (local, loss-scaled) for shared variable
        `k`, `sum_i head_weights_i g_i` for the others, plus the regularization gradients."""
        return assemble(
            tape,
            objective,
            variables,
            lambda k: weighted_sum(grads.per_task, k, head_weights),
            shared_update,
        )

    def weighted_sum(self, grads, k, weights):
        """`sum_i weights_i g_i` of the local loss-scaled gradients of variable `k`."""
        return ops.sum(ops.stack(weighted_sum(grads.per_task, k, weights)), axis=0)

    def callbacks(self):
        return [_ReportWholeBatches(self)] if self.sub_batches > 1 else []

    def report_whole_batches(self):
        """Warn (eagerly) if steps since the last report had batches of fewer than 3 samples."""
        count = int(self.whole_batches.numpy())
        if count:
            self.whole_batches.assign(0)
            warnings.warn(
                f"{count} step(s) of '{self.name}' had batches of fewer than "
                f"{self.sub_batches} samples (per replica): each of its {self.sub_batches} "
                "parts was the whole batch, so its gradient estimates were not independent. "
                f"Use a larger batch or drop the last partial batch. Received: "
                f"loss_weighting='{self.name}'",
                FastloopWarning,
                stacklevel=2,
            )

    def part_weights(self, rows):
        """`(beta, part)` from `rows[p][k]`, the `(T, size)` shared rows of part `p`."""
        raise NotImplementedError

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

    def gradients(
        self, tape, losses, objective, variables, scale_loss, part_losses=None, batch_size=None
    ):
        if self.sub_batches > 1:
            return self.part_gradients(
                tape, losses, objective, variables, scale_loss, part_losses, batch_size
            )
        variables = list(variables)
        grads, _ = self.task_gradients(tape, losses, variables, scale_loss)
        gram = ops.sum(ops.stack([ops.matmul(f, ops.transpose(f)) for f in grads.flat]), axis=0)
        beta = self.task_weights(gram, grads.losses)
        self.weights.assign(beta)
        head = self.head_weights()
        shared = set(grads.shared)
        return assemble(
            tape,
            objective,
            variables,
            lambda k: weighted_sum(grads.per_task, k, beta if k in shared else head),
        )

    def part_gradients(
        self, tape, losses, objective, variables, scale_loss, part_losses=None, batch_size=None
    ):
        """The update of a method with `sub_batches > 1` (see the module docstring)."""
        if part_losses is None or len(part_losses) != self.sub_batches:
            raise RuntimeError(
                f"Loss weighting '{self.name}' needs the tasks' losses on "
                f"{self.sub_batches} parts of the batch, which OptimizedModel's step passes "
                f"as `part_losses`. Received: part_losses={part_losses!r}"
            )
        if batch_size is not None:
            whole = ops.cast(ops.less(batch_size, self.sub_batches), "int64")
            self.whole_batches.assign_add(whole)
        variables = list(variables)
        scale = loss_scale(scale_loss)
        parts = [task_gradients(tape, part, variables, scale) for part in part_losses]
        shared = self._shared_indices(parts[0], variables)
        rows = [shared_rows(part, shared, variables, scale) for part in parts]
        beta, used = self.part_weights(rows)
        self.weights.assign(beta)
        shared_terms = {
            k: ops.sum(ops.stack(weighted_sum(parts[used], k, beta)), axis=0) for k in shared
        }
        mean = ops.full((self.num_tasks,), 1.0 / len(parts), "float32")
        return assemble(
            tape,
            objective,
            variables,
            lambda k: [term for part in parts for term in weighted_sum(part, k, mean)],
            shared_terms,
        )
