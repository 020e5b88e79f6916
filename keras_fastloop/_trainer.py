"""The trainer mixin shared by `OptimizedModel` and
`OptimizedSequential`.

`compile()` turns its arguments into step components; `train_step`/`test_step` only
orchestrate them (each stage lives in its own module). The step, in order:

unpack `(x, y, sample_weight)` -> forward in the tape -> `compute_loss` (Keras' hook: per-task
losses from `TaskLoss`, combined by the loss weighting) ->
`optimizer.scale_loss` -> gradients (plain or micro-batched, a `StepResult` either way)
-> variables without a gradient leave the update (as in Keras) -> sum across replicas -> unscale
-> finite check -> clip -> `optimizer.apply` (skipped as a whole when not finite) -> metrics
(recorded only for applied steps).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop import _compile_settings as compile_settings
from keras_fastloop import _fit_loop as fit_loop
from keras_fastloop import _keras_internals as internals
from keras_fastloop import _registry, mixed_precision, tuning
from keras_fastloop import clipping as clipping_module
from keras_fastloop import weighting as weighting_module
from keras_fastloop._step import distributed, guards, loss_shares, losses, scaling, user_metrics
from keras_fastloop._step import micro_batching as micro_batching_module
from keras_fastloop._step.results import StepMetrics, StepResult
from keras_fastloop._step.state import StepState
from keras_fastloop._warnings import FastloopWarning


class OptimizedTrainer:
    """Mixin that gives a `keras.Model` class the step of an expert's hand-written loop.

    Put it before the Keras class in the bases (`class M(OptimizedTrainer, keras.Model)`).
    See `OptimizedModel` for the arguments of `compile` and the logs.
    """

    def compile(
        self,
        optimizer: str | dict[str, Any] | keras.optimizers.Optimizer = "rmsprop",
        loss: Any = None,
        loss_weights: float | Sequence[float] | Mapping[str, float] | None = None,
        metrics: Any = None,
        weighted_metrics: Any = None,
        run_eagerly: bool = False,
        steps_per_execution: int | str = 1,
        jit_compile: bool | str = "auto",
        auto_scale_loss: bool = True,
        *,
        gradient_clipping: (
            clipping_module.GradientClipping | float | str | dict[str, Any] | None
        ) = None,
        loss_weighting: weighting_module.LossWeighting | str | dict[str, Any] | None = None,
        shared_variables: Sequence[keras.Variable | keras.layers.Layer] | None = None,
        micro_batch_size: int | None = None,
        nonfinite: str = "skip",
        log_metrics: str | Sequence[str] | None = None,
    ) -> None:
        """Configure the model for training.

        Args:
            optimizer, loss, loss_weights, metrics, weighted_metrics, run_eagerly,
                steps_per_execution, jit_compile, auto_scale_loss: as `keras.Model.compile`
                (`loss=None` is valid: models trained by `add_loss` or an overridden
                `compute_loss`, or compiled for inference). Under a `mixed_float16` policy
                the optimizer becomes a `LossScaleOptimizer`. `steps_per_execution` may also
                be `"auto"`: tuned while `fit` runs, never past a step event
                (`keras_fastloop.tuning`).
            gradient_clipping: `None` (default), a positive float (global-norm threshold), a
                string id (`"auto_clip"`, `"adaptive_gradient_clipping"`) or a
                `keras_fastloop.clipping` object (see `keras_fastloop.clipping.get`). Applied
                once, to the unscaled gradient summed across replicas.
            loss_weighting: `None` (default: fixed `loss_weights` as in Keras, but held in a
                variable), a method id from `keras_fastloop.weighting.METHODS` or a
                `LossWeighting` object.
            shared_variables: optional list of variables that gradient-based weighting methods
                treat as shared; default: inferred (variables reached by more than one task).
            micro_batch_size: `None` (default) or a positive int: split every (per-replica)
                batch into micro-batches of this many samples, accumulate their gradients and
                apply one update, identical to the full batch. A batch with fewer samples runs
                as one micro-batch (exact, but no memory is saved): a `UserWarning` says so
                once, when the step is traced if the batch size is static, else at the end of
                the first epoch in which no batch was larger (a smaller last batch never warns).
            nonfinite: what to do with a non-finite gradient: `"skip"` (default; skip the
                whole update on every replica and count it in `skipped_steps`), `"raise"`
                (skip the update, then `fit`/`train_on_batch` raise
                `keras_fastloop.NonFiniteError` naming the step and the first variable)
                or `"terminate"` (skip the update and stop training cleanly, like
                `TerminateOnNaN`). Under loss scaling a non-finite loss skips the step without
                halving the scale (see `keras_fastloop._step.guards`).
            log_metrics: `None` (default) or a list from `("grad_norm", "skipped_steps",
                "loss_scale")`: extra training metrics to log. By default each is logged when
                the feature that produces it is on (`grad_norm` with `gradient_clipping`;
                `loss_scale` and `skipped_steps` with loss scaling; `skipped_steps` with
                `nonfinite` other than `"skip"`), so with every feature off the logs have
                exactly `keras.Model`'s keys.

        Raises:
            ValueError: `steps_per_execution` neither `"auto"` nor a positive int;
                clipping set both here and on the optimizer, or combined with the optimizer's
                `gradient_accumulation_steps`; a non-positive `micro_batch_size`; an unknown
                `nonfinite` policy, weighting id or `log_metrics` name; loss or loss weights
                that do not match the outputs; `loss_weights` (other than all ones) with a
                `loss_weighting` that sets its own weights; weighting with a single task; a weighting method
                or `micro_batch_size` without a compiled `loss` or with an overridden
                `compute_loss`.
            TypeError: an argument of the wrong kind.
        """
        settings = compile_settings.validate_compile_arguments(
            self,
            overrides_compute_loss=self._overrides_compute_loss(),
            optimizer=optimizer,
            loss=loss,
            loss_weights=loss_weights,
            metrics=metrics,
            weighted_metrics=weighted_metrics,
            run_eagerly=run_eagerly,
            steps_per_execution=steps_per_execution,
            jit_compile=jit_compile,
            auto_scale_loss=auto_scale_loss,
            gradient_clipping=gradient_clipping,
            loss_weighting=loss_weighting,
            shared_variables=shared_variables,
            micro_batch_size=micro_batch_size,
            nonfinite=nonfinite,
            log_metrics=log_metrics,
        )
        # Nothing below refuses the arguments: a refused compile left the model as it was.
        self._compile_keras(settings)
        self._compile_step(settings)
        self._compile_config = settings.compile_config(jit_compile=self.jit_compile)

    def _compile_keras(self, settings):
        """Keras' compile (without the loss) and the model's `TaskLoss`."""
        # "auto": Keras runs 1 step per slot; tuning.py groups slots into executions.
        keras_steps_per_execution, auto_spe = tuning.resolve_steps_per_execution(
            settings.steps_per_execution
        )
        super().compile(
            optimizer=settings.optimizer,
            loss=None,
            metrics=settings.metrics,
            weighted_metrics=settings.weighted_metrics,
            run_eagerly=settings.run_eagerly,
            steps_per_execution=keras_steps_per_execution,
            jit_compile=settings.jit_compile,
            auto_scale_loss=settings.auto_scale_loss,
        )
        object.__setattr__(self, "_fastloop_auto_spe", auto_spe)  # untracked runtime state
        loss, loss_weights = settings.loss, settings.loss_weights
        if loss is not None:  # as Keras: compile(loss=None) keeps an earlier compiled loss
            self._compile_loss = losses.TaskLoss(
                loss, loss_weights, output_names=getattr(self, "output_names", None)
            )
            self.loss = loss

    def _compile_step(self, settings):
        """The step's components and state, from validated settings."""
        clipper, weighting = settings.clipper, settings.weighting
        micro_batch_size, nonfinite = settings.micro_batch_size, settings.nonfinite
        self._gradient_clipping = clipper
        self._loss_weighting_given = settings.loss_weighting is not None
        # `loss` is what keras.Model reports: the tasks weighted by the static `loss_weights`
        # (for "static" that is the objective itself, weights assigned during fit included).
        self._loss_is_objective = weighting.name == "static"
        # untracked: Keras would otherwise adopt the listed variables/layers as the model's own
        object.__setattr__(self, "_shared_variables", settings.shared_variables)
        self._micro_batch_size = micro_batch_size
        object.__setattr__(self, "_fastloop_warned_small_batch", False)
        if micro_batch_size:  # untracked: the batch-size check of BatchSizeMonitor, never saved
            object.__setattr__(
                self, "_fastloop_largest_batch", micro_batching_module.largest_batch_variable()
            )
        self._nonfinite = nonfinite
        self._warned_unconnected = False
        # All step state is created here (or, for models whose outputs are unknown until their
        # first call, in Keras' symbolic build before training), under the caller's scope.
        state = StepState()
        object.__setattr__(self, "_fastloop_state", state)  # untracked: not in model.weights
        if clipper is not None:
            clipper.build(state)
        guards.build(state, nonfinite)
        self._loss_weighting = weighting
        names = compile_settings.log_metric_names(settings, self.optimizer)
        object.__setattr__(self, "_step_metrics", StepMetrics(names))
        object.__setattr__(self, "_fastloop_evaluating", 0)
        if settings.loss is not None and self.dtype_policy.name in (
            "mixed_float16",
            "mixed_bfloat16",
        ):
            # Keras' mixed-precision guide: outputs that feed a loss should be float32.
            mixed_precision.check_output_dtypes(self, self.dtype_policy.name)
        if settings.layout is not None:
            self._build_weighting(settings.layout)
        object.__setattr__(self, "_fastloop_tasks_known_at_compile", settings.layout is not None)

    def _overrides_compute_loss(self):
        return type(self).compute_loss is not OptimizedTrainer.compute_loss

    def _build_weighting(self, layout=None):
        """Create the weighting's state once the tasks are known (never inside a trace).

        `layout`: `(task names, static weights)`; default: the compiled loss' own, known
        after its first call.
        """
        weighting = self._loss_weighting
        if weighting.task_names is not None:
            return
        names, static_weights = layout or (
            self._compile_loss.names,
            self._compile_loss.static_weights,
        )
        weighting.build(self, self._fastloop_state, names, static_weights)
        if self._loss_weighting_given:
            self._step_metrics.add_weighting(names, objective=not self._loss_is_objective)

    # ----------------------------------------------------------------------------- properties

    @property
    def gradient_clipping(self):
        """The `GradientClipping` in use (`None`: no clipping)."""
        return getattr(self, "_gradient_clipping", None)

    @property
    def loss_weighting(self):
        """The `LossWeighting` in use (`None` before compile)."""
        return getattr(self, "_loss_weighting", None)

    @property
    def skipped_steps(self):
        """Variable (int64 scalar) counting the updates skipped, over all `fit` calls.

        It counts steps skipped for a non-finite loss or gradient and, under dynamic loss
        scaling, the loss-scale overflows (steps the `LossScaleOptimizer` skips while halving
        its scale, expected). Skipped steps are never silent: `fit` issues a
        `FastloopWarning` at the end of each epoch in which steps were skipped (at most once
        per epoch; `train_on_batch` after each call that skipped one), naming the count, the
        first skipped optimizer step and the first variable with a non-finite gradient, with
        overflows counted apart. An epoch with overflows only says so in a message that starts
        with `"Loss-scale overflows only"`; silence those with
        `warnings.filterwarnings("ignore", "Loss-scale overflows only")`. Saved with the
        model's step state (`model.save`, `BackupAndRestore`).
        """
        return self._fastloop_state.skipped_steps

    @property
    def metrics(self):
        metrics = super().metrics
        step_metrics = self.__dict__.get("_step_metrics")
        if step_metrics is not None and not self.__dict__.get("_fastloop_evaluating"):
            metrics = metrics + step_metrics.all()
        return metrics

    @contextlib.contextmanager
    def _evaluation(self):
        """The training-only step metrics are not part of `evaluate`'s metrics and logs."""
        object.__setattr__(
            self, "_fastloop_evaluating", self.__dict__.get("_fastloop_evaluating", 0) + 1
        )
        try:
            yield
        finally:
            object.__setattr__(self, "_fastloop_evaluating", self._fastloop_evaluating - 1)

    def evaluate(self, *args, **kwargs):
        with self._evaluation():
            return super().evaluate(*args, **kwargs)

    def test_on_batch(self, *args, **kwargs):
        with self._evaluation():
            return super().test_on_batch(*args, **kwargs)

    # -------------------------------------------------------------------------------- losses

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """Keras' `compute_loss`, with the task losses combined by the loss weighting.

        Returns the scalar the step differentiates: the weighting's objective over the
        compiled loss' tasks (`sum_i w_i L_i` with the weights read from a variable by
        default) plus the regularization and `add_loss` losses. With losses of
        `reduction=None` it is Keras' per-sample total, shape `(batch, ...)`, which the step
        sums (gradient) and averages (logs) as Keras does. Override it as in Keras; a model
        that does so cannot use `loss_weighting` or `micro_batch_size`. Called from a
        user's own `train_step`, it updates the `{name}_loss` trackers, as Keras does.

        Raises:
            ValueError: when there is no loss at all (no compiled loss, no `add_loss`).
        """
        del x, training
        terms, record = [], None
        regularization = [
            internals.scale_loss_for_distribution(ops.sum(ops.cast(r, "float32")))
            for r in self.losses
        ]
        if self._compile_loss is not None:
            task_terms = self._compile_loss.evaluate(y, y_pred, sample_weight)
            # Under tf.distribute: the replicas' shares of the global losses (one all-reduce,
            # which also gives the global batch size and the global losses).
            regularization_sum = ops.sum(ops.stack(regularization)) if regularization else None
            values, sync = loss_shares.replica_losses(task_terms, regularization_sum)
            self._build_weighting()
            if any(value.shape.rank for value in values):
                # reduction=None (one replica, static weights: compile checks it). As in
                # Keras the tape sums the per-sample losses and the trackers average them.
                objective, weights = _per_sample_objective(values, self._loss_weighting)
            else:
                objective, weights = self._loss_weighting.combine(values)
            reported = objective
            per_task = weights
            if not self._loss_is_objective:
                per_task = ops.convert_to_tensor(self._compile_loss.static_weights, "float32")
                reported = ops.sum(ops.stack(values) * per_task)
            record = _LossRecord(values, objective, weights, reported, sync.batch_size)
            if sync.global_losses is not None:  # the step's global losses, no second collective
                logged = ops.sum(sync.global_losses * per_task)
                if sync.global_extra is not None:
                    logged = logged + sync.global_extra
                record.global_losses = [logged, *tf.unstack(sync.global_losses)]
            terms.append(objective)
        terms += regularization
        if not terms:
            raise ValueError("No loss to compute. Provide a `loss` argument in `compile()`.")
        if record is not None and not self.__dict__.get("_fastloop_own_step"):
            # Called from a user's own train_step/test_step: update the `{name}_loss`
            # trackers here, as Keras' CompileLoss does (our steps record after the guards).
            self._compile_loss.record(values)
        object.__setattr__(self, "_loss_record", record)
        if len(terms) == 1:
            return terms[0]
        if terms[0].shape.rank:  # per-sample losses plus the (scalar) regularization
            return terms[0] + ops.sum(ops.stack(terms[1:]))
        return ops.sum(ops.stack(terms))

    def _loss_terms(self, x, y, y_pred, sample_weight, training):
        """`(total, logged loss, record)` through `compute_loss` (user overrides included)."""
        object.__setattr__(self, "_loss_record", None)
        with self._own_step():
            total = self._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
            )
        record = self.__dict__.get("_loss_record")
        object.__setattr__(self, "_loss_record", None)
        if record is None:
            return total, total, None
        return total, total + (record.reported - record.objective), record

    @contextlib.contextmanager
    def _own_step(self):
        """Marks `compute_loss` calls made by this class' steps, which record the task losses
        themselves (after the non-finite guards, or per micro-batch)."""
        before = self.__dict__.get("_fastloop_own_step", False)
        object.__setattr__(self, "_fastloop_own_step", True)
        try:
            yield
        finally:
            object.__setattr__(self, "_fastloop_own_step", before)

    def _forward(self, x, training):
        if self._call_has_training_arg:
            return self(x, training=training)
        return self(x)

    # ------------------------------------------------------------------------------ the steps

    def _full_batch(self, x, y, sample_weight, variables):
        """`StepResult` of one gradient of the whole (per-replica) batch."""
        weighting = self._loss_weighting
        with tf.GradientTape(persistent=weighting.requires_task_gradients) as tape:
            y_pred = self._forward(x, training=True)
            total, logged, record = self._loss_terms(x, y, y_pred, sample_weight, training=True)
            scaled = self.optimizer.scale_loss(total)
        if record is None:
            grads = tape.gradient(
                scaled, variables, unconnected_gradients=tf.UnconnectedGradients.NONE
            )
            task_losses = weights = objective = global_losses = None
        else:
            grads = weighting.gradients(
                tape, record.values, scaled, variables, self.optimizer.scale_loss
            )
            weights = record.weights
            if weighting.requires_task_gradients:  # weights decided from this step's gradients
                weights = weighting.read_weights()
            task_losses, objective = record.values, record.objective
            global_losses = record.global_losses
        del tape
        compile_metrics = self._compile_metrics
        if user_metrics.overrides_compute_metrics(self):
            compile_metrics = None  # the step calls the override after the update
        batch_size = _batch_size(x) if record is None else record.batch_size

        def update_metrics():
            if compile_metrics is not None:
                compile_metrics.update_state(y, y_pred, sample_weight)

        return StepResult(
            grads=list(grads),
            loss=logged,
            task_losses=task_losses,
            weights=weights,
            objective=objective,
            batch_size=batch_size,
            update_metrics=update_metrics,
            global_losses=global_losses,
            y_pred=y_pred,
        )

    def _connected(self, grads, variables):
        """Keep only the variables that get a gradient (Keras leaves the others untouched)."""
        missing = [v.path for g, v in zip(grads, variables) if g is None]
        if missing and not self._warned_unconnected:
            self._warned_unconnected = True
            warnings.warn(
                f"{len(missing)} trainable variable(s) get no gradient from the loss and are "
                f"left out of the update (as in keras.Model): {missing}",
                FastloopWarning,
                stacklevel=3,
            )
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        return [g for g, _ in pairs], [v for _, v in pairs]

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if not all(layer.built for layer in self._flatten_layers()):
            # Without a strategy Keras builds in the first trace; the variables must exist
            # before the step reads them (tf.function traces once more, with them built).
            self._forward(x, training=False)
        variables = self.trainable_variables
        if self._micro_batch_size:
            result = micro_batching_module.accumulate(
                self, x, y, sample_weight, variables, self._micro_batch_size
            )
        else:
            result = self._full_batch(x, y, sample_weight, variables)
        grads, variables = self._connected(result.grads, variables)
        if not variables:
            warnings.warn("The model does not have any trainable weights.", stacklevel=2)
            self._record_metrics(result, tf.constant(True), None)
            return self.get_metrics_result()
        grads = distributed.all_reduce_sum(grads)
        scale = scaling.current_scale(self.optimizer)
        grads = scaling.unscale(grads, scale)
        # Norms and clipping see each embedding row once (duplicate ids summed); without
        # clipping the optimizer gets the gradient as Keras would.
        unique_rows = [clipping_module.deduplicate(g) for g in grads]
        grad_norm = tf.linalg.global_norm(unique_rows)
        # inf/NaN anywhere makes the norm non-finite; so does a norm beyond float32's range
        # (~1.8e19), which is treated as a divergence too. One check instead of one per variable.
        finite = ops.isfinite(grad_norm)
        # The global-batch losses: the non-finite-loss check (same decision on every replica)
        # and the weighting's state. Per-replica losses are shares of the global losses
        # (keras_fastloop._step.loss_shares), so their sum is the global loss.
        lso = scaling.is_loss_scale_optimizer(self.optimizer)
        needs_global = lso or self._nonfinite != "skip" or self._loss_weighting.has_state_update
        global_losses = None
        if needs_global and result.global_losses is not None:
            global_losses = result.global_losses  # from the denominators' all-reduce
        elif needs_global:
            local = [result.loss] + list(result.task_losses or [])
            global_losses = distributed.all_reduce_sum(local)
        # Under loss scaling an overflow of a finite loss is routine (Keras halves the scale); a
        # non-finite loss is bad data: skipped without touching the scale.
        loss_finite = ops.all(ops.isfinite(ops.stack(global_losses))) if needs_global else None
        halted_before = guards.halted_before(self._nonfinite, self._fastloop_state)
        allowed = guards.check(
            self._nonfinite,
            self._fastloop_state,
            finite,
            loss_finite if lso else None,
            grads,
            variables,
            self.optimizer.iterations,
        )
        if self._gradient_clipping is not None:
            grads = self._gradient_clipping(unique_rows, variables, grad_norm)
        applied = finite if allowed is None else ops.logical_and(finite, allowed)
        lso_condition = None
        if lso:
            lso_condition = (
                loss_finite if allowed is None else ops.logical_and(loss_finite, allowed)
            )
        self._apply(grads, variables, applied, scale, lso_condition)
        skipped = ops.logical_not(applied)
        if halted_before is not None:  # steps blocked after a halt were not skipped for NaN
            skipped = ops.logical_and(skipped, ops.logical_not(halted_before))
        guards.record_skip(
            self._nonfinite,
            self._fastloop_state,
            skipped,
            loss_finite if lso else None,
            unique_rows,
            variables,
            self.optimizer.iterations,
        )
        if self._loss_weighting.has_state_update:
            distributed.cond(applied, self._loss_weighting.update, args=(list(global_losses[1:]),))
        self._record_metrics(result, applied, grad_norm)
        if user_metrics.overrides_compute_metrics(self):
            return user_metrics.compute_metrics(self, x, y, result.y_pred, sample_weight, applied)
        return self.get_metrics_result()

    def _apply(self, grads, variables, applied, scale, lso_condition):
        """Apply the update, or skip it entirely (weights, slots, `iterations`).

        `applied`: the gradient is finite and the non-finite policy allows updates;
        `lso_condition`: with a `LossScaleOptimizer`, when to hand it the gradient (it skips
        overflowing updates and halves its scale itself).
        """
        optimizer = self.optimizer
        if not optimizer.built:
            optimizer.build(self.trainable_variables)
        grads = scaling.rescale(grads, scale)
        condition = lso_condition if scaling.is_loss_scale_optimizer(optimizer) else applied
        with distributed.gradients_already_reduced(optimizer):
            distributed.cond(condition, lambda g: optimizer.apply(g, variables), args=(grads,))

    def _record_metrics(self, result, applied, grad_norm):
        """Metrics of an applied step; a skipped one leaves them as if the batch was not seen."""
        step_metrics = self._step_metrics

        def record():
            self._record_losses(result)
            if step_metrics.grad_norm is not None and grad_norm is not None:
                step_metrics.grad_norm.update_state(grad_norm)
            result.update_metrics()

        def skip():
            if result.undo_metrics is not None:
                result.undo_metrics()

        tf.cond(applied, record, skip)
        if step_metrics.skipped_steps is not None:
            step_metrics.skipped_steps.update_state(self._fastloop_state.skipped_steps)
        if step_metrics.loss_scale is not None:
            step_metrics.loss_scale.update_state(self.optimizer.dynamic_scale)
        if result.weights is not None:
            for metric, weight in zip(step_metrics.weights, tf.unstack(result.weights)):
                metric.update_state(weight)

    def _record_losses(self, result):
        self._loss_tracker.update_state(
            internals.unscale_loss_for_distribution(result.loss), sample_weight=result.batch_size
        )
        if result.task_losses is not None:
            self._compile_loss.record(result.task_losses)
        if self._step_metrics.objective is not None and result.objective is not None:
            self._step_metrics.objective.update_state(
                internals.unscale_loss_for_distribution(result.objective),
                sample_weight=result.batch_size,
            )

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self._forward(x, training=False)
        _, logged, record = self._loss_terms(x, y, y_pred, sample_weight, training=False)
        batch_size = _batch_size(x) if record is None else record.batch_size
        self._loss_tracker.update_state(
            internals.unscale_loss_for_distribution(logged), sample_weight=batch_size
        )
        if record is not None:
            self._compile_loss.record(record.values)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    # --------------------------------------------------------------------------- distribution

    def _make_function(self, step_function):
        # Step outputs survive MultiWorkerMirroredStrategy's reduction (keras#20585).
        return distributed.make_function(self, super()._make_function, step_function)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # fit's epoch iterator is captured here (fit_loop); multi-worker builds (keras#20585).
        return fit_loop.maybe_symbolic_build(
            self, super()._maybe_symbolic_build, iterator, data_batch
        )

    # ---------------------------------------------------------------------------- training

    def fit(self, *args, **kwargs):
        """`keras.Model.fit` run by `keras_fastloop._fit_loop` (arguments and return as Keras').

        It adds the internal callbacks (the weighting's, the non-finite policy's, exact
        mid-epoch resume) and, under `steps_per_execution="auto"`, groups steps into
        executions up to the next step event.
        """
        return fit_loop.fit(self, super().fit, args, kwargs)

    def train_on_batch(self, *args, **kwargs):
        """`keras.Model.train_on_batch`; raises `keras_fastloop.NonFiniteError` under `"raise"`.

        Warns (`FastloopWarning`) when the step was skipped, as `fit` does once per epoch.
        """
        logs = super().train_on_batch(*args, **kwargs)
        guards.raise_if_recorded(self)
        guards.report_skips(self, "this train_on_batch call")  # a FastloopWarning if skipped
        return logs

    def make_train_function(self, force=False):
        return fit_loop.make_train_function(self, super().make_train_function, force)

    # -------------------------------------------------------------------------- serialization

    def get_compile_config(self):
        if self.compiled and hasattr(self, "_compile_config"):
            config = self._compile_config.serialize()
            task_loss = getattr(self, "_compile_loss", None)
            needs_tasks = self._loss_weighting_given and not self.__dict__.get(
                "_fastloop_tasks_known_at_compile", False
            )
            if needs_tasks and isinstance(task_loss, losses.TaskLoss) and task_loss.names:
                # Lets a loaded model create its weighting state before its variables load
                # (a model whose outputs are known builds it in `compile` itself; the default
                # static weights are rebuilt from `loss_weights` at the first step).
                config["task_names"] = list(task_loss.names)
                config["task_weights"] = list(task_loss.static_weights)
            return config
        return {}

    def compile_from_config(self, config):
        if type(self).compile is not OptimizedTrainer.compile:  # as keras.Model does
            warnings.warn(
                "`compile()` was not called as part of model loading because the model's "
                "`compile()` method is custom. All subclassed Models that have `compile()` "
                "overridden should also override `get_compile_config()` and "
                "`compile_from_config(config)`. Alternatively, you can call `compile()` "
                "manually after loading.",
                stacklevel=2,
            )
            return
        config = dict(config)
        task_names = config.pop("task_names", None)
        task_weights = config.pop("task_weights", None)
        # Our own objects (clipping, weighting, ...) resolve even after
        # `keras.saving.get_custom_objects().clear()`.
        with keras.saving.custom_object_scope(_registry.library_objects()):
            config = internals.serialization_lib.deserialize_keras_object(config)
        self.compile(**config)
        if task_names is not None:
            self._build_weighting((task_names, task_weights))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    # The steps `keras_fastloop._step.prebuild` builds for before the first trace: a class
    # that overrides either is not pre-built.
    _fastloop_default_steps = (train_step, test_step)


def _batch_size(x):
    return ops.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


def _per_sample_objective(values, weighting):
    """Keras' total of unreduced task losses: `sum_i w_i * L_i` per sample, and `w`."""
    weights = weighting.read_weights()
    objective = values[0] * weights[0]
    for i, value in enumerate(values[1:], start=1):
        objective = objective + value * weights[i]
    return objective, weights


class _LossRecord:
    """What the default `compute_loss` computed, for the step that called it.

    `batch_size`: the global batch's number of samples (the `loss` tracker's weight).
    """

    def __init__(self, values, objective, weights, reported, batch_size):
        self.values = values
        self.objective, self.weights, self.reported = objective, weights, reported
        self.batch_size = batch_size
        self.global_losses = None  # [logged loss, *task losses] of the global batch (R > 1)
