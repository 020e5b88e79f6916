"""The trainer mixin shared by `OptimizedModel` and `OptimizedSequential`.

`compile()` turns its arguments into a `TrainingStep`; `train_step` calls its one method
`TrainingStep.train`. The step's order is described once, in docs/design.md ("The training
step").
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import keras

from keras_fastloop import _compile_config as compile_config
from keras_fastloop import _compile_settings as compile_settings
from keras_fastloop import _fit_callbacks as fit_callbacks
from keras_fastloop import _fit_loop as fit_loop
from keras_fastloop import _keras_internals as internals
from keras_fastloop import clipping as clipping_module
from keras_fastloop import step as step_module
from keras_fastloop import weighting as weighting_module
from keras_fastloop._step import (
    batch,
    multi_worker,
    objective,
)


def _exact_remat_method(step):
    """A step method run inside `exact_remat(self)` (see `_keras_internals.exact_remat`)."""

    @functools.wraps(step)
    def replayed(self, data):
        with internals.exact_remat(self):
            return step(self, data)

    replayed._fastloop_exact_remat = True
    return replayed


def _watched(train_step):
    """`train_step` that says, once, when it never reaches the step's stages."""

    @functools.wraps(train_step)
    def watched(self, data):
        step = self.fastloop_step
        if step is None:
            return train_step(self, data)
        return step.run_custom(train_step, self, data)

    watched._fastloop_own = True
    return watched


class OptimizedTrainer:
    """Mixin that gives any `keras.Model` class the step of an expert's hand-written loop.

    `class M(OptimizedTrainer, SomeModel)` for any `keras.Model` subclass `SomeModel`, or
    with `OptimizedModel` in either order (`class M(OptimizedModel, Task)`,
    `class M(Task, OptimizedModel)`). The class keeps its own `fit`, `compile` defaults and
    methods (a KerasHub task's preprocessor and `"auto"` compile arguments): `compile` passes
    on only the Keras arguments the caller gave. `keras_fastloop.optimized(model)` does this
    for a model that already exists. See `OptimizedModel` for the options of `compile`.

    Raises:
        TypeError: at class creation, when the mixin comes after `keras.Model` in the
            method resolution order (`class M(keras.Model, OptimizedTrainer)`: Keras' own
            step would run).
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        # Keras' own class (not the name `keras.Model`, which a test harness may swap)
        if internals.Model in mro and mro.index(internals.Model) < mro.index(OptimizedTrainer):
            raise TypeError(
                "OptimizedTrainer must come before keras.Model in the bases, else Keras' own "
                f"compile and step run: `class {cls.__name__}(OptimizedTrainer, ...)`, or use "
                f"`OptimizedModel` in either order. Received: bases {[b.__name__ for b in cls.__bases__]}"
            )
        # A class with its own train_step (a GAN, a VAE, a KerasHub task's): said once, at its
        # first trace, when compile's options never reach the step's stages.
        own_step = cls.train_step
        if own_step is not OptimizedTrainer.train_step and not hasattr(own_step, "_fastloop_own"):
            cls.train_step = _watched(own_step)
        # Keras builds predict's function without `_make_function`: a class's own predict_step
        # replays rematerialization as ours does (keras#21207).
        own_predict = cls.predict_step
        if own_predict is not OptimizedTrainer.predict_step and not hasattr(
            own_predict, "_fastloop_exact_remat"
        ):
            cls.predict_step = _exact_remat_method(own_predict)

    def compile(
        self,
        *args: Any,
        gradient_clipping: (
            clipping_module.GradientClipping | float | str | dict[str, Any] | None
        ) = None,
        loss_weighting: weighting_module.LossWeighting | str | dict[str, Any] | None = None,
        shared_variables: Sequence[keras.Variable | keras.layers.Layer] | None = None,
        micro_batch_size: int | None = None,
        nonfinite: str = "skip",
        log_metrics: str | Sequence[str] | None = None,
        sam_rho: float | None = None,
        sam_adaptive: bool = False,
        **kwargs: Any,
    ) -> None:
        """Configure the model for training: Keras' arguments plus the step's options.

        Args:
            *args, **kwargs: `keras.Model.compile`'s arguments (`optimizer`, `loss`,
                `loss_weights`, `metrics`, `weighted_metrics`, `run_eagerly`,
                `steps_per_execution`, `jit_compile`, `auto_scale_loss`), passed on as given:
                a class with its own `compile` defaults (a KerasHub task's `"auto"`) keeps
                them. `loss=None` is valid (models trained by `add_loss` or an overridden
                `compute_loss`). Under a `mixed_float16` policy the optimizer becomes a
                `LossScaleOptimizer`. `steps_per_execution` may also be `"auto"`: tuned
                while `fit` runs, never past a step event (`keras_fastloop.tuning`).
            gradient_clipping: `None` (default), a positive float (global-norm threshold), a
                string id (`"auto_clip"`, `"adaptive_gradient_clipping"`) or a
                `keras_fastloop.clipping` object. Applied once, to the unscaled gradient
                summed across replicas.
            loss_weighting: `None` (default: fixed `loss_weights` as in Keras, but held in a
                variable), a method id from `keras_fastloop.weighting.METHODS` or a
                `LossWeighting` object.
            shared_variables: variables that gradient-based weighting methods treat as
                shared; default: inferred (variables reached by more than one task).
            micro_batch_size: `None` (default) or a positive int: split every (per-replica)
                batch into micro-batches of this many samples, accumulate their gradients and
                apply one update, identical to the full batch (a smaller batch runs whole,
                with a `FastloopWarning`).
            nonfinite: `"skip"` (default: skip the whole update on every replica, count it
                in `skipped_steps`, warn at the end of the epoch), `"raise"` (then `fit`
                raises `keras_fastloop.NonFiniteError`) or `"terminate"` (stop cleanly with
                the last good weights).
            log_metrics: `None` (default: those of the features that are on) or a list from
                `("grad_norm", "skipped_steps", "loss_scale")`.
            sam_rho: `None` (default) or a float > 0: sharpness-aware minimization (Foret
                et al., ICLR 2021) with this neighbourhood radius (0.05 in the paper); each step
                takes a second forward and backward pass at the weights moved by `sam_rho` along
                the normalized gradient summed across replicas, and applies that gradient.
            sam_adaptive: `False` (default) or `True`: ASAM's scale-invariant neighbourhood
                (Kwon et al., ICML 2021; its paper uses larger radii, e.g. 0.5).

        Raises:
            TypeError: an argument `compile` does not take (the message names the closest
                one), or of the wrong kind.
            ValueError: a value that cannot act (each message says what must hold and
                `Received: ...`); see docs/guide.md for the full list. The model is left as
                it was.
        """
        options = dict(
            gradient_clipping=gradient_clipping,
            loss_weighting=loss_weighting,
            shared_variables=shared_variables,
            micro_batch_size=micro_batch_size,
            nonfinite=nonfinite,
            log_metrics=log_metrics,
            sam_rho=sam_rho,
            sam_adaptive=sam_adaptive,
        )
        settings = compile_settings.compile_model(
            self,
            super().compile,
            args,
            kwargs,
            options,
            # A class beside ours with its own compile defaults (a KerasHub task) compiles
            # first with what the caller gave; the step is built on what it resolved.
            through_class=compile_settings.class_compile_beside(type(self), OptimizedTrainer),
            overrides_compute_loss=self._overrides_compute_loss(),
            overrides_train_step=type(self).train_step is not OptimizedTrainer.train_step,
        )
        step = step_module.TrainingStep(self, settings)
        object.__setattr__(self, "_fastloop_step", step)  # untracked: a plain object
        # The step's variables are saved under this attribute (Keras' saving walks it).
        object.__setattr__(self, "_fastloop_state", step.state)

    def _overrides_compute_loss(self):
        return type(self).compute_loss is not OptimizedTrainer.compute_loss

    # ----------------------------------------------------------------------------- properties

    @property
    def fastloop_step(self):
        """The `keras_fastloop.TrainingStep` built by `compile()` (`None` before it).

        A custom `train_step` calls `self.fastloop_step.minimize(loss, variables, tape)`
        in place of `tape.gradient` + `optimizer.apply` to get the compiled policies.
        """
        return self.__dict__.get("_fastloop_step")

    @property
    def gradient_clipping(self):
        """The `GradientClipping` in use (`None`: no clipping)."""
        step = self.fastloop_step
        return None if step is None else step.clipper

    @property
    def loss_weighting(self):
        """The `LossWeighting` in use (`None` before compile)."""
        step = self.fastloop_step
        return None if step is None else step.weighting

    @property
    def skipped_steps(self):
        """Variable (int64 scalar) counting the updates skipped, over all `fit` calls.

        It counts steps skipped for a non-finite loss or gradient and, under dynamic loss
        scaling, the loss-scale overflows (expected: the `LossScaleOptimizer` halves its scale).
        Never silent: `fit` issues a `FastloopWarning` at the end of each epoch with skipped
        steps (`train_on_batch` after each call that skipped one), overflows counted apart;
        `keras_fastloop._fit_callbacks.report_skips` gives the message. Silence overflow-only
        reports with `warnings.filterwarnings("ignore", "Loss-scale overflows only")`. Saved
        with the model's step state (`model.save`, `BackupAndRestore`).
        """
        return self.fastloop_step.state.skipped_steps

    def reset_metrics(self):
        super().reset_metrics()
        step = self.fastloop_step
        if step is not None and not step.evaluating:
            step.reset()

    def get_metrics_result(self):
        """Keras' metric results and the step metrics (training only); NaN for the training
        values of an epoch in which no update was applied (every step skipped for a
        non-finite value), never a `Mean`'s 0.0 over no batch."""
        logs = super().get_metrics_result()
        step = self.fastloop_step
        if step is None or step.evaluating:
            return logs
        return step.epoch_logs({**logs, **step.logs()})

    @contextlib.contextmanager
    def _evaluation(self):
        """The training-only step metrics are not part of `evaluate`'s metrics and logs."""
        step = self.fastloop_step
        if step is None:
            yield
            return
        step.evaluating += 1
        try:
            yield
        finally:
            step.evaluating -= 1

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
        step = self.fastloop_step
        if step is None:  # not compiled by this class' compile: Keras' own
            return super().compute_loss(x, y, y_pred, sample_weight, training)
        del x
        return objective.compute_loss(self, step, y, y_pred, sample_weight, training)

    # ------------------------------------------------------------------------------ the steps

    def train_step(self, data):
        """One optimizer step: `TrainingStep.train` (docs/design.md, "The training step")."""
        return self.fastloop_step.train(self, data)

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = objective.forward(self, x, training=False)
        _, logged_loss, record = objective.loss_terms(
            self, self.fastloop_step, x, y, y_pred, sample_weight, training=False
        )
        batch_size = batch.batch_size(x) if record is None else record.batch_size
        internals.loss_tracker(self).update_state(
            internals.unscale_loss_for_distribution(logged_loss), sample_weight=batch_size
        )
        if record is not None:
            internals.compile_loss(self).record(record.values)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def predict_step(self, data):
        # Keras builds predict's function without `_make_function`: replayed here (keras#21207).
        with internals.exact_remat(self):
            return super().predict_step(data)

    # --------------------------------------------------------------------------- distribution

    def _make_function(self, step_function):
        # Step outputs survive MultiWorkerMirroredStrategy's reduction (keras#20585).
        return multi_worker.make_function(self, super()._make_function, step_function)

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
        fit_callbacks.raise_if_recorded(self)
        fit_callbacks.report_skips(self, "this train_on_batch call")  # a FastloopWarning if skipped
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
