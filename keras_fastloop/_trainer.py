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

from keras_fastloop import _compile_config as compile_config
from keras_fastloop import _compile_settings as compile_settings
from keras_fastloop import _fit_loop as fit_loop
from keras_fastloop import _keras_internals as internals
from keras_fastloop import clipping as clipping_module
from keras_fastloop import mixed_precision, tuning
from keras_fastloop import weighting as weighting_module
from keras_fastloop._step import (
    distributed,
    gradients,
    guards,
    loss_shares,
    losses,
    objective,
    prebuild,
    scaling,
    update,
    user_metrics,
)
from keras_fastloop._step import micro_batching as micro_batching_module
from keras_fastloop._step.results import StepMetrics
from keras_fastloop._step.state import StepState


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
        object.__setattr__(self, "_fastloop_warned_unconnected", False)
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
        scaling, the loss-scale overflows (expected: the `LossScaleOptimizer` halves its scale).
        Never silent: `fit` issues a `FastloopWarning` at the end of each epoch with skipped
        steps (`train_on_batch` after each call that skipped one), overflows counted apart;
        `keras_fastloop._step.guards.report_skips` gives the message. Silence overflow-only
        reports with `warnings.filterwarnings("ignore", "Loss-scale overflows only")`. Saved
        with the model's step state (`model.save`, `BackupAndRestore`).
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
        return objective.compute_loss(self, y, y_pred, sample_weight)

    # ------------------------------------------------------------------------------ the steps

    def train_step(self, data):
        """One optimizer step, each stage one call (docs/design.md, "The training step")."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        prebuild.build_layers(self, x)
        variables = self.trainable_variables
        # forward, loss and the loss-scaled gradient: full batch or micro-batched
        result = gradients.compute(self, x, y, sample_weight, variables)
        grads, variables = gradients.connected(self, result.grads, variables)
        if not variables:
            warnings.warn("The model does not have any trainable weights.", stacklevel=2)
            update.record_metrics(self, result, tf.constant(True), None)
            return self.get_metrics_result()
        grads = distributed.all_reduce_sum(grads)
        scale = scaling.current_scale(self.optimizer)
        grads = scaling.unscale(grads, scale)
        unique_rows, grad_norm = clipping_module.deduplicated_norm(grads)
        global_losses = None
        if update.needs_global_losses(self):
            global_losses = loss_shares.global_losses(result)
        decision = guards.decide(self, grad_norm, global_losses, grads, variables)
        if self._gradient_clipping is not None:  # else the optimizer gets Keras' gradient
            grads = self._gradient_clipping(unique_rows, variables, grad_norm)
        update.apply(self, grads, variables, decision, scale, global_losses)
        guards.record_skip(self, decision, unique_rows, variables)
        update.record_metrics(self, result, decision.applied, grad_norm)
        if user_metrics.overrides_compute_metrics(self):
            return user_metrics.compute_metrics(
                self, x, y, result.y_pred, sample_weight, decision.applied
            )
        return self.get_metrics_result()

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = objective.forward(self, x, training=False)
        _, logged, record = objective.loss_terms(self, x, y, y_pred, sample_weight, training=False)
        batch_size = gradients.batch_size(x) if record is None else record.batch_size
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
        return compile_config.get_compile_config(self)

    def compile_from_config(self, config):
        custom_compile = type(self).compile is not OptimizedTrainer.compile
        compile_config.compile_from_config(self, config, custom_compile)

    # The steps `keras_fastloop._step.prebuild` builds for before the first trace: a class
    # that overrides either is not pre-built.
    _fastloop_default_steps = (train_step, test_step)
