"""OptimizedModel: ``keras.Model`` with the training step an expert writes by hand.

The step, in order (each stage lives in its own module; this file only orchestrates):

unpack ``(x, y, sample_weight)`` -> forward in the tape -> per-task losses (:mod:`.losses`) ->
weighting (:mod:`.weighting`, weights read from variables) -> ``optimizer.scale_loss`` ->
gradients (unconnected ones become zeros) -> micro-batch accumulation (:mod:`.micro_batching`) ->
sum across replicas (:mod:`.distributed`) -> unscale (:mod:`.scaling`) -> finite check ->
clip (:mod:`.clipping`) -> ``optimizer.apply`` (skipped as a whole when not finite) -> metrics.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf
from keras import ops

from keras_fastloop import _keras_internals as internals
from keras_fastloop import clipping as clipping_module
from keras_fastloop import distributed, fit_loop, guards, scaling, tuning
from keras_fastloop import micro_batching as micro_batching_module
from keras_fastloop import resume as _resume  # noqa: F401 - registers exact resume with fit_loop
from keras_fastloop import weighting as weighting_module
from keras_fastloop.losses import TaskLosses
from keras_fastloop.state import StepState

NONFINITE_POLICIES = ("skip", "raise", "terminate")


def _check_optimizer_clipping(optimizer, gradient_clipping):
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    set_on_optimizer = {
        name: getattr(inner, name, None)
        for name in ("clipnorm", "global_clipnorm", "clipvalue")
        if getattr(inner, name, None) is not None
    }
    if gradient_clipping is not None and set_on_optimizer:
        raise ValueError(
            "Gradient clipping is set twice: on the optimizer "
            f"({', '.join(f'{k}={v}' for k, v in set_on_optimizer.items())}) and in "
            "`compile(gradient_clipping=...)`. Set it in one place only (prefer "
            "`gradient_clipping`, which clips the gradient summed across replicas). "
            f"Received: gradient_clipping={gradient_clipping!r}"
        )


_FUNCTIONAL_VARIANTS = {}


def _functional_variant(cls):
    """``cls`` with Keras' ``Functional`` mixed in, created once per class.

    ``keras.Model`` supports functional construction of a subclass by rewriting the subclass'
    ``__bases__`` in place (``inject_functional_model_class``), which would break every later
    subclassed (non-functional) use of ``OptimizedModel`` in the same process. Building a
    separate class leaves ``OptimizedModel`` untouched. The variant is registered under the same
    name as ``cls`` so saved models load back as ``cls``.
    """
    if cls not in _FUNCTIONAL_VARIANTS:
        variant = type(cls.__name__, (cls, internals.Functional), {"__module__": cls.__module__})
        registered = keras.saving.get_registered_name(cls)
        if ">" in registered:
            package, name = registered.split(">", 1)
            keras.saving.register_keras_serializable(package=package, name=name)(variant)
        _FUNCTIONAL_VARIANTS[cls] = variant
    return _FUNCTIONAL_VARIANTS[cls]


@keras.saving.register_keras_serializable(package="keras_fastloop")
class OptimizedModel(keras.Model):
    """A ``keras.Model`` whose ``train_step``/``test_step`` carry an expert's training loop.

    Build it exactly like ``keras.Model`` (functional ``OptimizedModel(inputs, outputs)`` or
    subclassed) and call ``compile``/``fit``/``evaluate``/``predict`` as usual. ``compile`` takes
    Keras' arguments plus the keyword-only arguments below. With all of them at their defaults
    training is numerically the same as ``keras.Model.fit``.

    Logs, every step: ``loss`` (weighted sum of task losses + regularization, never loss-scaled),
    ``{task}_loss`` (unweighted, multi-output models), ``{task}_weight`` (when ``loss_weighting``
    is given), ``grad_norm`` (global L2 norm of the unscaled, cross-replica gradient before
    clipping), ``skipped_steps`` (updates skipped for non-finite gradients) and, with a
    ``LossScaleOptimizer`` (automatic under ``mixed_float16``), ``loss_scale``.

    Example:
        >>> inputs = keras.Input((64,))
        >>> outputs = keras.layers.Dense(10, activation="softmax")(inputs)
        >>> model = OptimizedModel(inputs, outputs)
        >>> model.compile("adam", "sparse_categorical_crossentropy", gradient_clipping=1.0)
    """

    def __new__(cls, *args, **kwargs):
        if internals.functional_init_arguments(args, kwargs) and not issubclass(
            cls, internals.Functional
        ):
            cls = _functional_variant(cls)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args, **kwargs):
        if isinstance(self, internals.Functional):
            internals.Trainer.__init__(self)
            internals.Functional.__init__(self, *args, **kwargs)
        else:
            super().__init__(*args, **kwargs)

    def compile(
        self,
        optimizer="rmsprop",
        loss=None,
        loss_weights=None,
        metrics=None,
        weighted_metrics=None,
        run_eagerly=False,
        steps_per_execution=1,
        jit_compile="auto",
        auto_scale_loss=True,
        *,
        gradient_clipping=None,
        loss_weighting=None,
        shared_variables=None,
        micro_batch_size=None,
        nonfinite="skip",
    ):
        """Configure the model for training.

        Args:
            optimizer, loss, loss_weights, metrics, weighted_metrics, run_eagerly,
            steps_per_execution, jit_compile, auto_scale_loss: as ``keras.Model.compile``. Under
                a ``mixed_float16`` policy the optimizer becomes a ``LossScaleOptimizer``.
                ``steps_per_execution`` may also be ``"auto"``: tuned while ``fit`` runs, never
                past a step-gated callback's next event or the epoch end
                (:mod:`keras_fastloop.tuning`).
            gradient_clipping: ``None`` (default), a positive float (global-norm threshold) or a
                ``keras_fastloop.clipping`` object. Applied once, to the unscaled gradient summed
                across replicas.
            loss_weighting: ``None`` (default: fixed ``loss_weights`` as in Keras, but held in a
                variable), a method id from ``keras_fastloop.weighting.METHODS`` or a
                ``LossWeighting`` object.
            shared_variables: optional list of variables that gradient-based weighting methods
                treat as shared; default: inferred (variables reached by more than one task).
            micro_batch_size: ``None`` (default) or a positive int: split every batch into
                micro-batches of this many samples, accumulate their gradients and apply one
                update, identical to the full batch.
            nonfinite: what to do with a non-finite gradient: ``"skip"`` (default; skip the
                whole update on every replica and count it in ``skipped_steps``), ``"raise"``
                (stop with an error naming the step) or ``"terminate"`` (skip the update and stop
                training cleanly, like ``TerminateOnNaN``).

        Raises:
            ValueError: ``steps_per_execution`` neither ``"auto"`` nor a positive int;
                clipping set both here and on the optimizer; a non-positive
                ``micro_batch_size``; an unknown ``nonfinite`` policy or weighting id; loss or
                loss weights that do not match the outputs; weighting with a single task.
            TypeError: an argument of the wrong kind.
        """
        clipper = clipping_module.get(gradient_clipping)
        weighting = weighting_module.get(loss_weighting)
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"`nonfinite` must be one of {NONFINITE_POLICIES}. Received: nonfinite={nonfinite!r}"
            )
        micro_batch_size = micro_batching_module.validate_micro_batch_size(micro_batch_size)
        if micro_batch_size and weighting.requires_task_gradients:
            raise ValueError(
                "Gradient-based loss weighting cannot be combined with `micro_batch_size` "
                "(per-task gradients are not accumulated across micro-batches). "
                f"Received: loss_weighting={loss_weighting!r}, micro_batch_size={micro_batch_size}"
            )
        optimizer = keras.optimizers.get(optimizer)
        _check_optimizer_clipping(optimizer, clipper)
        if loss is None:
            raise ValueError("OptimizedModel needs a `loss` in `compile()`. Received: loss=None")

        # "auto": Keras runs 1 step per slot; tuning.py groups slots into executions.
        keras_steps_per_execution, auto_spe = tuning.resolve_steps_per_execution(
            steps_per_execution
        )
        super().compile(
            optimizer=optimizer,
            loss=None,
            metrics=metrics,
            weighted_metrics=weighted_metrics,
            run_eagerly=run_eagerly,
            steps_per_execution=keras_steps_per_execution,
            jit_compile=jit_compile,
            auto_scale_loss=auto_scale_loss,
        )
        self.loss = loss
        output_names = getattr(self, "output_names", None)
        self._task_losses = TaskLosses(loss, loss_weights, output_names)
        self._gradient_clipping = clipper
        self._loss_weighting_given = loss_weighting is not None
        # untracked: Keras would otherwise adopt the listed variables/layers as the model's own
        object.__setattr__(self, "_shared_variables", shared_variables)
        self._micro_batch_size = micro_batch_size
        self._nonfinite = nonfinite
        self._warned_unconnected = False
        object.__setattr__(self, "_fastloop_auto_spe", auto_spe)  # untracked runtime state
        # The step's state is built here, under the caller's distribution strategy scope.
        state = StepState()
        object.__setattr__(self, "_fastloop_state", state)  # untracked: not in model.weights
        if clipper is not None:
            clipper.build(state)
        self._loss_weighting = weighting
        if self._task_losses.built:
            self._build_weighting()
        self._compile_config = internals.serialization_lib.SerializableDict(
            optimizer=optimizer,
            loss=loss,
            loss_weights=loss_weights,
            metrics=metrics,
            weighted_metrics=weighted_metrics,
            run_eagerly=run_eagerly,
            steps_per_execution=steps_per_execution,
            jit_compile=self.jit_compile,
            gradient_clipping=clipper,
            loss_weighting=weighting if loss_weighting is not None else None,
            micro_batch_size=micro_batch_size,
            nonfinite=nonfinite,
        )

    def _build_weighting(self):
        tasks = self._task_losses
        self._loss_weighting.build(self, self._fastloop_state, tasks.names, tasks.static_weights)

    # ----------------------------------------------------------------------------- properties

    @property
    def loss_weighting(self):
        """The :class:`~keras_fastloop.weighting.LossWeighting` in use (``None`` before compile)."""
        return getattr(self, "_loss_weighting", None)

    @property
    def skipped_steps(self):
        """Variable counting updates skipped for non-finite gradients."""
        return self._fastloop_state.skipped_steps

    @property
    def metrics(self):
        metrics = super().metrics
        task_losses = getattr(self, "_task_losses", None)
        if task_losses is not None and task_losses.trackers:
            at = 2 if self._compile_metrics is not None else 1
            metrics = metrics[:at] + list(task_losses.trackers) + metrics[at:]
        return metrics

    # ------------------------------------------------------------------------------ the steps

    def _forward_losses(self, x, y, sample_weight, training):
        """Forward pass, per-task losses, weighted total (+ regularization) and weights."""
        if self._call_has_training_arg:
            y_pred = self(x, training=training)
        else:
            y_pred = self(x)
        losses = self._task_losses(y, y_pred, sample_weight)
        if not self._loss_weighting.task_names:
            self._build_weighting()
        combined, weights = self._loss_weighting.combine(losses)
        extra = [
            internals.scale_loss_for_distribution(ops.sum(ops.cast(r, "float32")))
            for r in self.losses
        ]
        total = ops.sum([combined, *extra]) if extra else combined
        return y_pred, losses, total, weights

    def _gradients(self, x, y, sample_weight, variables):
        """Loss-scaled gradients of one (micro-)batch, with the values the logs need."""
        weighting = self._loss_weighting
        with tf.GradientTape(persistent=weighting.requires_task_gradients) as tape:
            y_pred, losses, total, weights = self._forward_losses(
                x, y, sample_weight, training=True
            )
            scaled = self.optimizer.scale_loss(total)
        grads = weighting.gradients(tape, losses, scaled, variables, self.optimizer.scale_loss)
        if weighting.requires_task_gradients:  # weights decided from this step's gradients
            weights = weighting.read_weights()
        grads = self._zeros_for_unconnected(grads, variables)
        return grads, y_pred, losses, total, weights

    def _zeros_for_unconnected(self, grads, variables):
        missing = [v.path for g, v in zip(grads, variables) if g is None]
        if missing and not self._warned_unconnected:
            self._warned_unconnected = True
            warnings.warn(
                f"{len(missing)} trainable variable(s) get no gradient from the loss and are "
                f"updated with zero gradients: {missing}",
                stacklevel=3,
            )
        return [ops.zeros_like(v) if g is None else g for g, v in zip(grads, variables)]

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if not all(layer.built for layer in self._flatten_layers()):
            # A subclassed model creates its variables in its first call; that happens in the
            # first (variable-creating) trace only, which tf.function then traces again.
            self(x, training=False)
        variables = self.trainable_variables
        if self._micro_batch_size:
            grads, logs = micro_batching_module.accumulate(
                self, x, y, sample_weight, variables, self._micro_batch_size
            )
            weights, losses = logs.pop("_weights"), logs.pop("_losses")
        else:
            grads, y_pred, losses, total, weights = self._gradients(x, y, sample_weight, variables)
            logs = self._update_metrics(x, y, y_pred, sample_weight, losses, total)
        grads = distributed.all_reduce_sum(grads)
        scale = scaling.current_scale(self.optimizer)
        grads = scaling.unscale(grads, scale)
        grad_norm = tf.linalg.global_norm(grads)
        # inf/NaN anywhere makes the norm non-finite; so does a norm beyond float32's range
        # (~1.8e19), which is treated as a divergence too. One check instead of one per variable.
        finite = ops.isfinite(grad_norm)
        # Under loss scaling an overflow is routine; "raise"/"terminate" then watch the loss.
        loss_finite = (
            ops.all(ops.isfinite(ops.stack(losses)))
            if scaling.is_loss_scale_optimizer(self.optimizer)
            else None
        )
        allowed = guards.check(
            self._nonfinite,
            self._fastloop_state,
            finite,
            loss_finite,
            grads,
            variables,
            self.optimizer.iterations,
        )
        if self._gradient_clipping is not None:
            grads = self._gradient_clipping(grads, variables, grad_norm)
        applied = finite if allowed is None else ops.logical_and(finite, allowed)
        self._apply(grads, variables, applied, scale, allowed)
        self._fastloop_state.skipped_steps.assign_add(ops.cast(ops.logical_not(applied), "int64"))
        # The weighting's state follows the global batch's task losses (the per-replica losses
        # are already divided by the number of replicas, so their sum is the global mean).
        if self._loss_weighting.has_state_update:
            global_losses = distributed.all_reduce_sum(losses)
            distributed.cond(applied, self._loss_weighting.update, args=(list(global_losses),))
        return self._step_logs(logs, grad_norm, weights, finite)

    def _apply(self, grads, variables, applied, scale, allowed):
        """Apply the update, or skip it entirely (weights, slots, ``iterations``).

        ``applied``: the gradient is finite and the non-finite policy allows updates;
        ``allowed``: the policy's own condition (``None``: always).
        """
        optimizer = self.optimizer
        if not optimizer.built:  # subclassed models are built by their first call, in the trace
            optimizer.build(variables)
        grads = scaling.rescale(grads, scale)
        with distributed.gradients_already_reduced(optimizer):
            if scaling.is_loss_scale_optimizer(optimizer):
                # Keras' LossScaleOptimizer skips non-finite updates and halves its scale itself.
                if allowed is None:
                    optimizer.apply(grads, variables)
                else:
                    distributed.cond(
                        allowed, lambda g: optimizer.apply(g, variables), args=(grads,)
                    )
            else:
                distributed.cond(applied, lambda g: optimizer.apply(g, variables), args=(grads,))

    def _update_metrics(self, x, y, y_pred, sample_weight, losses, total):
        batch_size = ops.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]
        self._loss_tracker.update_state(
            internals.unscale_loss_for_distribution(total), sample_weight=batch_size
        )
        self._task_losses.update_trackers(losses, batch_size)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _step_logs(self, logs, grad_norm, weights, finite):
        logs = dict(logs)
        if self._loss_weighting_given:
            for i, name in enumerate(self._task_losses.names):
                logs[f"{name}_weight"] = weights[i]
        logs["grad_norm"] = grad_norm
        logs["skipped_steps"] = self._fastloop_state.skipped_steps
        if scaling.is_loss_scale_optimizer(self.optimizer):
            logs["loss_scale"] = self.optimizer.dynamic_scale
        return logs

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, losses, total, _ = self._forward_losses(x, y, sample_weight, training=False)
        return self._update_metrics(x, y, y_pred, sample_weight, losses, total)

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
        """``keras.Model.fit`` run by :mod:`keras_fastloop.fit_loop` (arguments and return as Keras').

        It adds the internal callbacks (non-finite policy, exact mid-epoch resume) and, under
        ``steps_per_execution="auto"``, groups steps into executions up to the next step event.
        """
        return fit_loop.fit(self, super().fit, args, kwargs)

    def make_train_function(self, force=False):
        return fit_loop.make_train_function(self, super().make_train_function, force)

    def _with_guard_callback(self, callbacks):
        return fit_loop.with_internal_callbacks(self, callbacks)

    # -------------------------------------------------------------------------- serialization

    def get_compile_config(self):
        if self.compiled and hasattr(self, "_compile_config"):
            return self._compile_config.serialize()
        return {}

    def compile_from_config(self, config):
        config = internals.serialization_lib.deserialize_keras_object(config)
        self.compile(**config)
        if self.built:
            self.optimizer.build(self.trainable_variables)
