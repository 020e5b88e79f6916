"""The checks of `OptimizedModel.compile`, and Keras' compile once they pass.

`validate_compile_arguments` is the single place where `compile` refuses its arguments (each
error says what must hold and ends with `Received: ...`); it returns a `CompileSettings`.
`compile_model` binds the caller's arguments, validates them, then runs Keras' compile and
installs the `TaskLoss` and the compile config, without further checks; the trainer builds the
`TrainingStep` from the settings. Nothing is changed on the model before every check has
passed, so a refused `compile` leaves the model as it was (optimizer, clipping, step state).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
from typing import Any

import keras

from keras_fastloop import _compile_checks as checks
from keras_fastloop import _keras_internals as internals
from keras_fastloop import clipping as clipping_module
from keras_fastloop import tuning
from keras_fastloop import weighting as weighting_module
from keras_fastloop._step import losses, results, user_metrics

__all__ = [
    "KERAS_DEFAULTS",
    "NONFINITE_POLICIES",
    "CompileSettings",
    "bind_keras_arguments",
    "class_compile_beside",
    "compile_model",
    "validate_compile_arguments",
]

NONFINITE_POLICIES = ("skip", "raise", "terminate")
STEP_OPTIONS = (
    "gradient_clipping",
    "loss_weighting",
    "shared_variables",
    "micro_batch_size",
    "nonfinite",
    "log_metrics",
    "sam_rho",
    "sam_adaptive",
)
_KERAS_SIGNATURE = inspect.signature(keras.Model.compile)
# `keras.Model.compile`'s arguments and defaults (optimizer="rmsprop", loss=None, ...).
KERAS_DEFAULTS = {
    name: parameter.default
    for name, parameter in _KERAS_SIGNATURE.parameters.items()
    if name != "self"
}


def bind_keras_arguments(args, kwargs):
    """The Keras arguments of a `compile` call that the caller gave, by name.

    Raises:
        TypeError: an argument `compile` does not take (naming the closest one), or too many
            positional arguments.
    """
    unknown = [name for name in kwargs if name not in KERAS_DEFAULTS]
    if unknown:
        known = [*KERAS_DEFAULTS, *STEP_OPTIONS]
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=1)
            hints.append(f"`{name}`" + (f" (did you mean `{close[0]}`?)" if close else ""))
        raise TypeError(
            f"compile() got unexpected argument(s) {', '.join(hints)}. It takes Keras' "
            f"{list(KERAS_DEFAULTS)} and the step's {list(STEP_OPTIONS)}. "
            f"Received: {', '.join(f'{name}={kwargs[name]!r}' for name in unknown)}"
        )
    try:
        bound = _KERAS_SIGNATURE.bind(None, *args, **kwargs)
    except TypeError as error:
        raise TypeError(
            f"compile() takes at most {len(KERAS_DEFAULTS)} positional arguments "
            f"({list(KERAS_DEFAULTS)}); the step's options are keyword-only. "
            f"Received: {len(args)} positional arguments"
        ) from error
    given = dict(bound.arguments)
    given.pop("self")
    return given


def class_compile_beside(cls, trainer):
    """Whether a class after `trainer` in `cls`' MRO, outside Keras, defines `compile`
    (a KerasHub task's, which fills its own `"auto"` defaults before Keras' compile)."""
    mro = cls.__mro__
    for klass in mro[mro.index(trainer) + 1 :]:
        if klass.__module__.startswith(("keras.", "keras_fastloop.")):
            continue
        if "compile" in vars(klass):
            return True
    return False


def compile_model(
    model,
    keras_compile,
    args,
    kwargs,
    options,
    *,
    through_class,
    overrides_compute_loss,
    overrides_train_step,
):
    """Validates `compile()`'s arguments, then compiles `model` by Keras with them.

    Args:
        model: the model being compiled.
        keras_compile: the `compile` of the class after ours in the model's MRO (Keras', or
            a KerasHub task's).
        args, kwargs: the caller's Keras arguments (`keras.Model.compile`'s), as given.
        options: `{name: value}` of the step's own options (`STEP_OPTIONS`).
        through_class: whether `keras_compile` is a class's own (`class_compile_beside`): it
            then compiles first with what the caller gave, and what it resolved is validated.
        overrides_compute_loss, overrides_train_step: bool, whether the model's class has its
            own `compute_loss` / `train_step`.

    Returns:
        The `CompileSettings`; the model holds Keras' compile state, the `TaskLoss` of a
        given `loss` and the compile config.

    Raises:
        TypeError, ValueError: as `bind_keras_arguments` and `validate_compile_arguments`;
            nothing on the model is changed (what a class's own `compile` set is undone).
    """
    given = bind_keras_arguments(args, kwargs)
    with _restored_if_refused(model, through_class):
        if through_class:
            # "auto" is ours: the class's compile runs 1 step per slot, tuned by our fit loop.
            auto = "steps_per_execution" in given and given["steps_per_execution"] == "auto"
            keras_compile(**{**given, "steps_per_execution": 1} if auto else given)
            arguments = _resolved_by_class(model, given)
        else:
            arguments = {**KERAS_DEFAULTS, **given}
        settings = validate_compile_arguments(
            model,
            overrides_compute_loss=overrides_compute_loss,
            overrides_train_step=overrides_train_step,
            **arguments,
            **options,
        )
    if not through_class:
        # The loss is ours (`TaskLoss`, below); "auto": Keras runs 1 step per slot.
        keras_compile(
            optimizer=settings.optimizer,
            loss=None,
            metrics=settings.metrics,
            weighted_metrics=settings.weighted_metrics,
            run_eagerly=settings.run_eagerly,
            steps_per_execution=tuning.resolve_steps_per_execution(settings.steps_per_execution)[0],
            jit_compile=settings.jit_compile,
            auto_scale_loss=settings.auto_scale_loss,
        )
    if settings.loss is not None:  # as Keras: compile(loss=None) keeps an earlier compiled loss
        task_loss = losses.TaskLoss(
            settings.loss, settings.loss_weights, output_names=getattr(model, "output_names", None)
        )
        internals.set_compile_loss(model, task_loss)
        model.loss = settings.loss
    internals.set_compile_config(model, **settings.saved, jit_compile=model.jit_compile)
    return settings


@contextlib.contextmanager
def _restored_if_refused(model, through_class):
    """Undoes what a class's own `compile` set on `model` when the arguments are refused.

    The class compiles before the validation (its defaults are known only then); its
    attributes (and the lists it appended to, such as the tracked metrics) are put back.
    """
    if not through_class:
        yield
        return
    attributes = dict(vars(model))
    contents = {id(value): list(value) for value in attributes.values() if type(value) is list}
    try:
        yield
    except Exception:
        for name in [name for name in vars(model) if name not in attributes]:
            del vars(model)[name]
        for value in attributes.values():
            if id(value) in contents:
                value[:] = contents[id(value)]
        vars(model).update(attributes)
        raise


def _resolved_by_class(model, given):
    """The Keras arguments a class's own `compile` resolved (its defaults filled in), with
    `steps_per_execution` and `auto_scale_loss` as the caller gave them."""
    resolved = internals.compile_config(model).config
    return {
        **KERAS_DEFAULTS,
        **{name: value for name, value in resolved.items() if name != "optimizer"},
        "optimizer": model.optimizer,
        **{
            name: given[name]
            for name in ("steps_per_execution", "auto_scale_loss")
            if name in given
        },
    }


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    """`compile`'s arguments once validated.

    The Keras arguments are as given (`optimizer` resolved to an `Optimizer`); `clipper` is
    the `GradientClipping` or `None`, `weighting` the `LossWeighting` (`Static` when
    `loss_weighting` is `None`), `micro_batch_size` `None` or a positive int, and `layout`
    `(task names, static weights)` when the tasks are known at compile, else `None`.
    `gradient_clipping`, `loss_weighting` and `log_metrics` keep the values given;
    `overrides_compute_loss` says whether the model's class overrides `compute_loss`.
    """

    optimizer: keras.optimizers.Optimizer
    loss: Any
    loss_weights: Any
    metrics: Any
    weighted_metrics: Any
    run_eagerly: bool
    steps_per_execution: int | str
    jit_compile: bool | str
    auto_scale_loss: bool
    clipper: Any
    loss_weighting: Any
    weighting: Any
    shared_variables: Any
    micro_batch_size: int | None
    nonfinite: str
    log_metrics: Any
    layout: tuple | None
    sam_rho: float | None = None
    sam_adaptive: bool = False
    overrides_compute_loss: bool = False

    @property
    def saved(self):
        """What `get_compile_config()` saves but `jit_compile` (which Keras resolves).

        Keras' arguments and only the step's options that are on: with every option off it is
        a `keras.Model` config, which Keras' own code applies to plain models (`clone_model`
        of a `Sequential`).
        """
        options = {
            "gradient_clipping": self.clipper,
            "loss_weighting": self.weighting if self.loss_weighting is not None else None,
            "micro_batch_size": self.micro_batch_size,
            "nonfinite": None if self.nonfinite == "skip" else self.nonfinite,
            "log_metrics": self.log_metrics,
            "sam_rho": self.sam_rho,
            "sam_adaptive": self.sam_adaptive or None,
        }
        return dict(
            optimizer=self.optimizer,
            loss=self.loss,
            loss_weights=self.loss_weights,
            metrics=self.metrics,
            weighted_metrics=self.weighted_metrics,
            run_eagerly=self.run_eagerly,
            steps_per_execution=self.steps_per_execution,
            **{name: value for name, value in options.items() if value is not None},
        )


def validate_compile_arguments(
    model,
    *,
    overrides_compute_loss,
    overrides_train_step=False,
    optimizer,
    loss,
    loss_weights,
    metrics,
    weighted_metrics,
    run_eagerly,
    steps_per_execution,
    jit_compile,
    auto_scale_loss,
    gradient_clipping,
    loss_weighting,
    shared_variables,
    micro_batch_size,
    nonfinite,
    log_metrics,
    sam_rho=None,
    sam_adaptive=False,
):
    """Checks every argument of `compile` against each other and the model.

    Args:
        model: the model being compiled (read only: its outputs, strategy, overrides).
        overrides_compute_loss: bool, whether the model's class overrides `compute_loss`.
        overrides_train_step: bool, whether the model's class has its own `train_step`.
        the others: `OptimizedModel.compile`'s arguments, as given.

    Returns:
        A `CompileSettings`.

    Raises:
        ValueError, TypeError: as listed in `OptimizedModel.compile`; nothing on the model
            is changed.
    """
    checks.check_remat_scopes(model)
    clipper = clipping_module.get(gradient_clipping)
    weighting = weighting_module.get(loss_weighting) or weighting_module.Static()
    weighting_module.check_loss_weights(weighting, loss_weights)
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(
            f"`nonfinite` must be one of {NONFINITE_POLICIES}. Received: nonfinite={nonfinite!r}"
        )
    micro_batch_size = checks.validate_micro_batch_size(micro_batch_size)
    checks.check_overwritten_variables(model, optimizer, weighting, loss_weighting)
    if micro_batch_size and weighting.requires_task_gradients:
        raise ValueError(
            "Gradient-based loss weighting cannot be combined with `micro_batch_size` "
            "(per-task gradients are not accumulated across micro-batches). "
            f"Received: loss_weighting={loss_weighting!r}, micro_batch_size={micro_batch_size}"
        )
    needs_tasks = {
        "loss_weighting": loss_weighting is not None,
        "micro_batch_size": micro_batch_size is not None,
    }
    for argument, given in needs_tasks.items():
        value = loss_weighting if argument == "loss_weighting" else micro_batch_size
        if given and loss is None:
            raise ValueError(
                f"`{argument}` needs the per-task losses of a compiled `loss`. "
                f"Received: loss=None, {argument}={value!r}"
            )
        if given and overrides_compute_loss:
            raise ValueError(
                f"`{argument}` cannot be combined with an overridden `compute_loss()`: it "
                "needs each task's loss, which only the default `compute_loss` provides. "
                f"Received: {argument}={value!r}"
            )
    if overrides_train_step:
        checks.check_custom_step(type(model).__name__, weighting, loss_weighting, micro_batch_size)
    sam_rho, sam_adaptive = checks.validate_sam(sam_rho, sam_adaptive)
    if sam_rho is not None:
        checks.check_sam_compatible(type(model).__name__, overrides_train_step, weighting, sam_rho)
    if micro_batch_size is not None and user_metrics.overrides_compute_metrics(model):
        raise ValueError(
            "`micro_batch_size` cannot be combined with an overridden `compute_metrics()`: "
            "Keras calls it once per batch with the whole batch's predictions, which "
            f"micro-batching never holds at once. Received: micro_batch_size={micro_batch_size!r}"
        )
    checks.check_loss_identifiers(loss)
    checks.check_loss_weights(loss_weights)
    checks.check_unreduced(
        loss, micro_batch_size, weighting, model.distribute_strategy.num_replicas_in_sync
    )
    if not overrides_compute_loss:
        # An overridden `compute_loss` may restructure `y_pred` before the compiled loss
        # sees it (Keras' own tests split one output in two), so the loss' structure can
        # only be checked against the outputs when the default `compute_loss` runs.
        checks.check_keys("loss", loss, model)
        checks.check_keys("loss_weights", loss_weights, model)
        checks.check_counts(loss, loss_weights, model)
    layout = losses.task_layout(loss, loss_weights, model)
    weighting.validate(model, None if layout is None else layout[0], shared_variables)
    _check_log_metrics(log_metrics)
    optimizer = keras.optimizers.get(optimizer)
    checks.check_optimizer_clipping(optimizer, clipper)
    tuning.validate_steps_per_execution(steps_per_execution, model.distribute_strategy)
    return CompileSettings(
        optimizer=optimizer,
        loss=loss,
        loss_weights=loss_weights,
        metrics=metrics,
        weighted_metrics=weighted_metrics,
        run_eagerly=run_eagerly,
        steps_per_execution=steps_per_execution,
        jit_compile=jit_compile,
        auto_scale_loss=auto_scale_loss,
        clipper=clipper,
        loss_weighting=loss_weighting,
        weighting=weighting,
        shared_variables=shared_variables,
        micro_batch_size=micro_batch_size,
        nonfinite=nonfinite,
        log_metrics=log_metrics,
        layout=layout,
        sam_rho=sam_rho,
        sam_adaptive=sam_adaptive,
        overrides_compute_loss=overrides_compute_loss,
    )


def _check_log_metrics(log_metrics):
    names = [log_metrics] if isinstance(log_metrics, str) else log_metrics
    if names is None:
        return
    if (
        not isinstance(names, (list, tuple))
        or any(name not in results.LOG_METRICS for name in names)
        or len(set(names)) != len(names)
    ):
        raise ValueError(
            f"`log_metrics` must be None or a list of distinct names from {results.LOG_METRICS}. "
            f"Received: log_metrics={log_metrics!r}"
        )


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The step's configuration, fixed at `compile()` (from `CompileSettings`).

    Attributes:
        clipper: the `GradientClipping` in use, or `None`.
        weighting: the `LossWeighting` in use (`Static` by default).
        weighting_given: whether `compile` was given `loss_weighting`.
        loss_is_objective: whether the logged `loss` is the weighting's objective (the
            static weighting; otherwise the tasks weighted by the static `loss_weights`, as
            `keras.Model` reports it).
        shared_variables: the variables given as shared, or `None`.
        micro_batch_size: `None` or a positive int.
        nonfinite: `"skip"`, `"raise"` or `"terminate"`.
        tasks_known_at_compile: whether the task layout was known at `compile()`.
        overrides_compute_loss: whether the model's class overrides `compute_loss` (the
            library's steps then call it as Keras does).
        stage_options: the options that act only through the stages, as given (named in the
            warning for a custom step that never reaches them).
        log_metrics: the optional step metrics logged (`log_metric_names`).
        sam_rho: `None` or the SAM radius (a float > 0).
        sam_adaptive: whether SAM is adaptive (ASAM).
    """

    clipper: Any
    weighting: Any
    weighting_given: bool
    loss_is_objective: bool
    shared_variables: Any
    micro_batch_size: int | None
    nonfinite: str
    tasks_known_at_compile: bool
    stage_options: dict
    overrides_compute_loss: bool
    log_metrics: tuple = ()
    sam_rho: float | None = None
    sam_adaptive: bool = False

    @classmethod
    def from_compile(cls, settings, optimizer):
        """From validated `CompileSettings` and the optimizer Keras' compile set (its loss
        scale decides the default logs)."""
        return cls(
            log_metrics=results.log_metric_names(settings, optimizer),
            clipper=settings.clipper,
            weighting=settings.weighting,
            weighting_given=settings.loss_weighting is not None,
            loss_is_objective=settings.weighting.name == "static",
            shared_variables=settings.shared_variables,
            micro_batch_size=settings.micro_batch_size,
            nonfinite=settings.nonfinite,
            tasks_known_at_compile=settings.layout is not None,
            overrides_compute_loss=settings.overrides_compute_loss,
            sam_rho=settings.sam_rho,
            sam_adaptive=settings.sam_adaptive,
            stage_options={
                name: value
                for name, value in (
                    ("gradient_clipping", settings.clipper),
                    ("nonfinite", None if settings.nonfinite == "skip" else settings.nonfinite),
                    ("log_metrics", settings.log_metrics),
                )
                if value is not None
            },
        )
