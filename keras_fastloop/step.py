"""`TrainingStep`: the stages of an expert's training step, for any training step.

`compile()` builds one `TrainingStep` per model from its validated settings
(`model.fastloop_step`). It holds the step's configuration (clipping, loss weighting,
micro-batching, the non-finite policy) and state (`StepState`, the step metrics), and it is
passed explicitly to the traced stages of `keras_fastloop._step`. The library's default
`train_step` and a user's own `train_step` reach the same stages through the same method,
`apply`: one implementation. The step's order is described once, in docs/design.md
("The training step").
"""

from __future__ import annotations

import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from keras_fastloop import _compile_settings as compile_settings
from keras_fastloop import _keras_internals as internals
from keras_fastloop import _replicas, mixed_precision, tuning
from keras_fastloop import clipping as clipping_module
from keras_fastloop._step import (
    gradients,
    guards,
    loss_shares,
    overwrite,
    prebuild,
    sam,
    scaling,
    update,
    user_metrics,
)
from keras_fastloop._step import micro_batching as micro_batching_module
from keras_fastloop._step.results import StepMetrics
from keras_fastloop._step.state import StepState
from keras_fastloop._warnings import FastloopWarning

__all__ = ["TrainingStep"]


class TrainingStep:
    """Loss scaling, one cross-replica sum, the finite check, clipping and step metrics.

    Built by `compile()` from its validated arguments; never constructed by hand. A model's own
    `train_step` (a GAN, a VAE, a distiller) reaches the compiled policies with one call in
    place of `tape.gradient` + `optimizer.apply`:

        self.fastloop_step.minimize(loss, variables, tape)                    # model.optimizer
        self.fastloop_step.minimize(d_loss, d_vars, tape, self.d_optimizer)  # any other one

    Each call, in order: the gradient of the loss scaled by the optimizer's
    `LossScaleOptimizer` (if any), summed across replicas once, unscaled, checked for
    non-finite values (`compile(nonfinite=...)`), clipped (`compile(gradient_clipping=...)`),
    applied (or skipped as a whole), then `grad_norm`, `skipped_steps` and `loss_scale`
    recorded when logged. A `train_step` that calls neither `minimize` nor `apply_gradients`
    while `compile` was given `gradient_clipping`, `nonfinite` or `log_metrics` gets a
    `FastloopWarning` at its first trace.

    The library's own `train_step` is `train`; the order of its stages is described once, in
    docs/design.md ("The training step").

    Attributes:
        settings: the configuration fixed at `compile()` (`keras_fastloop._compile_settings.StepSettings`); `clipper`,
            `weighting`, `micro_batch_size` and `nonfinite` read it.
        state: the `StepState` layer holding the step's variables (saved with the model).
        metrics: the optional step metrics (`StepMetrics`).
    """

    def __init__(self, model: keras.Model, settings: compile_settings.CompileSettings) -> None:
        """The step of `model` (just compiled by Keras) from its validated `settings`.

        All step state is created here (or, for models whose outputs are unknown until their
        first call, in Keras' symbolic build before training), under the caller's scope.
        """
        self._model = weakref.ref(model)
        self.settings = compile_settings.StepSettings.from_compile(settings, model.optimizer)
        self.state = StepState()
        if settings.clipper is not None:
            settings.clipper.build(self.state)
        guards.build(self.state, settings.nonfinite)
        self.metrics = StepMetrics(self.settings.log_metrics)
        self.largest_batch = (
            micro_batching_module.largest_batch_variable() if settings.micro_batch_size else None
        )
        # Updates applied and skipped since the metrics were last reset: an epoch with skipped
        # steps and none applied logs NaN.
        self.applied_in_epoch, self.skipped_in_epoch = (
            keras.Variable(0, dtype="int64", trainable=False, aggregation="only_first_replica")
            for _ in range(2)
        )
        self.warned = set()  # the once-only warnings given ("small_batch", "unconnected", ...)
        self._reached = 0
        self.evaluating = 0  # inside evaluate/test_on_batch: the step metrics are left out
        # "auto": Keras runs 1 step per slot; the fit loop groups slots into executions
        # (tuning's `AutoSteps`, else `None`).
        self.auto_steps = tuning.resolve_steps_per_execution(settings.steps_per_execution)[1]
        if settings.loss is not None and model.dtype_policy.name in (
            "mixed_float16",
            "mixed_bfloat16",
        ):
            # Keras' mixed-precision guide: outputs that feed a loss should be float32.
            mixed_precision.check_output_dtypes(model, model.dtype_policy.name)
        if settings.layout is not None:
            self.build_weighting(settings.layout)

    @property
    def clipper(self):
        return self.settings.clipper

    @property
    def weighting(self):
        return self.settings.weighting

    @property
    def micro_batch_size(self):
        return self.settings.micro_batch_size

    @property
    def nonfinite(self):
        return self.settings.nonfinite

    @property
    def weighting_given(self):
        return self.settings.weighting_given

    @property
    def tasks_known_at_compile(self):
        return self.settings.tasks_known_at_compile

    @property
    def warned_small_batch(self):
        return "small_batch" in self.warned

    @property
    def model(self):
        return self._model()

    # ------------------------------------------------------------------ for any train_step

    def minimize(self, loss, variables, tape, optimizer=None):
        """Gradient of `loss`, then `apply_gradients` with it: the call a custom `train_step`
        makes.

        Replaces `grads = tape.gradient(loss, variables)` and
        `optimizer.apply(grads, variables)` of the Keras guide's step. Under a
        `LossScaleOptimizer` the backward pass is seeded with its scale (the gradient of
        `scale * loss`, without changing the loss the step logs).

        Args:
            loss: the loss to minimize (float tensor: a scalar, or per-sample values that are
                summed as `tape.gradient` sums them), computed under `tape`.
            variables: the variables to update (a list of `keras.Variable`).
            tape: the `tf.GradientTape` that recorded `loss` (closed or still open).
            optimizer: the optimizer to apply with; default `model.optimizer`. A model with
                several optimizers (a GAN's `d_optimizer` and `g_optimizer`) passes each.

        Returns:
            Scalar bool tensor: whether the update was applied (`False`: skipped for a
            non-finite loss or gradient, or a loss-scale overflow).
        """
        optimizer = self._optimizer(optimizer)
        variables = _check_arguments("minimize", variables, optimizer)
        if not isinstance(tape, tf.GradientTape):
            raise TypeError(
                "`tape` must be the `tf.GradientTape` under which `loss` was computed. "
                f"Received: tape={tape!r}"
            )
        if not tf.is_tensor(loss) or not tf.as_dtype(loss.dtype).is_floating:
            raise TypeError(
                "`loss` must be a float tensor computed under `tape` (a scalar or per-sample "
                f"values). Received: loss={loss!r}"
            )
        self._check_scaling(optimizer)
        scale = scaling.current_scale(optimizer)
        seed = None
        if scale is not None:
            seed = ops.ones_like(loss) * ops.cast(scale, loss.dtype)
        grads = tape.gradient(
            loss,
            list(variables),
            output_gradients=seed,
            unconnected_gradients=tf.UnconnectedGradients.NONE,
        )
        if all(g is None for g in grads):
            raise ValueError(
                "No gradients provided for any variable: `loss` must be computed under "
                "`tape` from `variables` (inside `with tf.GradientTape() as tape:`). "
                f"Received: variables={[v.path for v in variables]}"
            )
        return self.apply_gradients(grads, variables, optimizer, loss)

    def apply_gradients(self, grads, variables, optimizer=None, loss=None):
        """The stages after the gradient: sum, unscale, check, clip, apply, record.

        Args:
            grads: the gradients of `optimizer.scale_loss(loss)` (Keras' own `train_step`
                pattern; without a `LossScaleOptimizer` that is the gradient of the loss), one
                per variable (`None`: left out of the update, as in Keras).
            variables: the variables to update.
            optimizer: default `model.optimizer`.
            loss: optional, the (per-replica) loss; under a `LossScaleOptimizer` a non-finite
                loss is then told apart from a scale overflow (default: every skipped step
                counts as an overflow, which halves the scale).

        Returns:
            Scalar bool tensor: whether the update was applied.
        """
        optimizer = self._optimizer(optimizer)
        variables = _check_arguments("apply_gradients", variables, optimizer)
        grads = list(grads)
        if len(grads) != len(variables):
            raise ValueError(
                "`grads` must hold one gradient per variable. "
                f"Received: len(grads)={len(grads)}, len(variables)={len(variables)}"
            )
        if all(g is None for g in grads):
            raise ValueError(
                "No gradients provided for any variable: every gradient is None. "
                f"Received: variables={[v.path for v in variables]}"
            )
        global_losses = None
        if scaling.is_loss_scale_optimizer(optimizer) and loss is not None:
            global_losses = _replicas.all_reduce_sum([ops.sum(ops.cast(loss, "float32"))])
        grads, variables = gradients.connected(self, list(grads), list(variables))
        if not variables:
            return tf.constant(False)
        decision, grad_norm = self.apply(grads, variables, optimizer, global_losses)
        update.record_step_metrics(self, optimizer, decision.applied, grad_norm)
        return decision.applied

    # ------------------------------------------------------------- the library's own step

    def train(self, model, data):
        """The library's `train_step` on one batch: forward, loss, gradient, the shared
        stages (`apply`), the weighting's update and the metrics; returns the step's logs
        (internal; traced; the order: docs/design.md, "The training step")."""
        optimizer = model.optimizer
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        prebuild.build_layers(model, x)
        variables = model.trainable_variables
        # forward, loss and the loss-scaled gradient: full batch or micro-batched
        result = gradients.compute(model, self, x, y, sample_weight, variables)
        if not optimizer.built:  # every trainable variable, the weighting's created just now
            optimizer.build(model.trainable_variables)
        grads, variables = gradients.connected(self, result.grads, variables)
        if self.settings.sam_rho is not None and variables:  # SAM: the gradient at w + e
            grads = sam.second_gradient(
                model, self, x, y, sample_weight, grads, variables, optimizer
            )
        if not variables:
            warnings.warn("The model does not have any trainable weights.", stacklevel=3)
            update.record_metrics(model, self, result, tf.constant(True))
            return model.get_metrics_result()
        global_losses = None
        if update.needs_global_losses(self, optimizer):
            global_losses = loss_shares.global_losses(result)
        decision, grad_norm = self.apply(grads, variables, optimizer, global_losses)
        update.update_weighting(self, decision, global_losses)
        update.record_step_metrics(self, optimizer, decision.applied, grad_norm)
        # a loss-scale overflow is routine: its (finite) loss is recorded, as in keras.Model
        recorded = ops.logical_or(decision.applied, guards.overflowed(decision))
        update.record_metrics(model, self, result, recorded)
        if user_metrics.overrides_compute_metrics(model):
            logs = user_metrics.compute_metrics(model, x, y, result.y_pred, sample_weight, recorded)
            if isinstance(logs, dict):
                logs = {**logs, **{k: v for k, v in self.logs().items() if k not in logs}}
            return logs
        return model.get_metrics_result()

    # --------------------------------------------------------------------- the one path

    def apply(self, grads, variables, optimizer, global_losses):
        """The stages every step shares: `(Decision, grad_norm)` (internal; traced).

        `grads` are the loss-scaled gradients of the connected `variables`; `global_losses`
        `[logged_loss, *task losses]` of the global batch or `None`.
        """
        self._reached += 1
        grads = overwrite.all_reduce(grads, variables)
        grads, variables, overwritten = overwrite.split(grads, variables)
        scale = scaling.current_scale(optimizer)
        grads = scaling.unscale(grads, scale)
        unique_rows, grad_norm = clipping_module.deduplicated_norm(grads)
        decision = guards.decide(self, optimizer, grad_norm, global_losses, grads, variables)
        if self.clipper is not None:  # else the optimizer gets Keras' gradient
            grads = self.clipper(unique_rows, variables, grad_norm)
        update.apply(optimizer, grads, variables, decision, scale, overwritten)
        self.applied_in_epoch.assign_add(ops.cast(decision.applied, "int64"))
        faulty = ops.logical_and(decision.skipped, ops.logical_not(guards.overflowed(decision)))
        self.skipped_in_epoch.assign_add(ops.cast(faulty, "int64"))
        guards.record_skip(self, optimizer, decision, unique_rows, variables)
        return decision, grad_norm

    def _optimizer(self, optimizer):
        return self.model.optimizer if optimizer is None else optimizer

    def _check_scaling(self, optimizer):
        """Under `mixed_float16`, an optimizer without loss scaling is said once."""
        model = self.model
        if (
            model.dtype_policy.name != "mixed_float16"
            or scaling.current_scale(optimizer) is not None
        ):
            return
        if ("unscaled", id(optimizer)) in self.warned:
            return
        self.warned.add(("unscaled", id(optimizer)))
        warnings.warn(
            f"The optimizer '{optimizer.name}' has no loss scaling under the mixed_float16 "
            "policy: float16 gradients may underflow. Wrap it as Keras' compile does: "
            f"`keras.optimizers.LossScaleOptimizer({optimizer.name})`. "
            f"Received: optimizer={type(optimizer).__name__}",
            FastloopWarning,
            stacklevel=3,
        )

    # ------------------------------------------------------------ a custom step's trace

    def run_custom(self, train_step, model, data):
        """A class's own `train_step`, watched: its logs gain the step metrics when it
        reached the stages, and a `FastloopWarning` says once when it never did."""
        reached = self._reached
        logs = train_step(model, data)
        if self._reached != reached:
            if isinstance(logs, dict):
                extra = {k: v for k, v in self.logs().items() if k not in logs}
                logs = {**logs, **extra}
            return logs
        if "unreached" not in self.warned and self.settings.stage_options:
            self._warn_unreached(f"{type(model).__name__}.train_step")
        return logs

    def _warn_unreached(self, step_name):
        self.warned.add("unreached")
        given = ", ".join(f"{k}={v!r}" for k, v in self.settings.stage_options.items())
        warnings.warn(
            f"{step_name} never calls the step's stages, so compile({given}) does nothing "
            "for it. Replace `grads = tape.gradient(loss, variables)` and "
            "`optimizer.apply(grads, variables)` with "
            "`self.fastloop_step.minimize(loss, variables, tape)` (pass `optimizer=` for "
            f"another optimizer). Received: {given}",
            FastloopWarning,
            stacklevel=2,
        )

    def logs(self):
        """The step metrics' results, once the step has reached the stages (else `{}`).

        They are not in `model.metrics`, so a custom step's loop over `self.metrics` never
        updates them: only the stages write them.
        """
        if not self._reached:
            return {}
        return {m.name: m.result() for m in self.metrics.all()}

    def reset(self):
        """Start of an epoch (`model.reset_metrics`): the step metrics and epoch counters."""
        for metric in self.metrics.all():
            metric.reset_state()
        self.applied_in_epoch.assign(0)
        self.skipped_in_epoch.assign(0)

    def epoch_logs(self, logs):
        """`logs` with NaN for every training value when steps were skipped for a non-finite
        value and none applied since the metrics were reset: a Keras `Mean` over zero batches
        reads 0.0, a perfect loss where nothing trained. Loss-scale overflows do not count
        (the loss was finite and is recorded, as `keras.Model` records it). The step's state
        (`skipped_steps`, `loss_scale`, `{task}_weight`) is kept.

        `logs` values may be tensors, `keras.Variable`s, NumPy values or Python numbers.
        """
        kept = {m.name for m in (self.metrics.skipped_steps, self.metrics.loss_scale) if m}
        kept.update(m.name for m in self.metrics.weights)
        none = ops.logical_and(
            ops.equal(self.applied_in_epoch, 0), ops.greater(self.skipped_in_epoch, 0)
        )
        return {
            name: _nan_if(none, value) if name not in kept else value
            for name, value in logs.items()
        }

    # ------------------------------------------------------------------ loss weighting

    def build_weighting(self, layout=None):
        """Create the weighting's state once the tasks are known (never inside a trace).

        `layout`: `(task names, static weights)`; default: the compiled loss' own, known
        after its first call.
        """
        weighting, model = self.weighting, self.model
        if weighting.task_names is not None:
            return
        names, static_weights = layout or (
            internals.compile_loss(model).names,
            internals.compile_loss(model).static_weights,
        )
        weighting.shared_variables = self.settings.shared_variables
        weighting.build(model, self.state, names, static_weights)
        if self.settings.weighting_given:
            self.metrics.add_weighting(names, objective=not self.settings.loss_is_objective)


def _check_arguments(method, variables, optimizer):
    """The variables as a list, once `variables` and `optimizer` are what `method` needs."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"`{method}` needs a `keras.optimizers.Optimizer` instance as `optimizer` (default: "
            "`model.optimizer`); create it once, outside `train_step` (e.g. in `compile`). "
            f"Received: optimizer={optimizer!r}"
        )
    if isinstance(variables, keras.Variable) or tf.is_tensor(variables):
        variables = [variables]
    variables = list(variables)
    wrong = [v for v in variables if not isinstance(v, (keras.Variable, tf.Variable))]
    if not variables or wrong:
        raise TypeError(
            f"`{method}` needs a non-empty list of variables to update. "
            f"Received: variables={wrong or variables!r}"
        )
    return variables


def _nan_if(none, value):
    """`value` as NaN where `none` holds, for a floating value of any kind; others as given."""
    if isinstance(value, keras.Variable):
        value = value.value
    elif isinstance(value, (float, np.floating)) or (
        isinstance(value, np.ndarray) and value.dtype.kind == "f"
    ):
        value = ops.convert_to_tensor(value)
    if not tf.is_tensor(value) or not tf.as_dtype(value.dtype).is_floating:
        return value
    return ops.where(none, ops.cast(float("nan"), value.dtype), value)
