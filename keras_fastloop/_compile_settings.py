"""The checks of `OptimizedModel.compile`: every argument is validated here, once.

`validate_compile_arguments` is the single place where `compile` refuses its arguments (each
error says what must hold and ends with `Received: ...`); it returns a `CompileSettings`,
from which `compile` then builds Keras' compile state and the step's components without
further checks. Nothing is changed on the model before every check has passed, so a refused
`compile` leaves the model as it was (optimizer, clipping, step state).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import warnings
from typing import Any

import keras
import tensorflow as tf

from keras_fastloop import _compile_checks as checks
from keras_fastloop import _keras_internals as internals
from keras_fastloop import _validation as validation
from keras_fastloop import clipping as clipping_module
from keras_fastloop import tuning
from keras_fastloop import weighting as weighting_module
from keras_fastloop._step import losses, scaling, user_metrics
from keras_fastloop._step.results import LOG_METRICS
from keras_fastloop._warnings import FastloopWarning

__all__ = [
    "KERAS_DEFAULTS",
    "NONFINITE_POLICIES",
    "CompileSettings",
    "bind_keras_arguments",
    "class_compile_beside",
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


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    """`compile`'s arguments once validated.

    The Keras arguments are as given (`optimizer` resolved to an `Optimizer`); `clipper` is
    the `GradientClipping` or `None`, `weighting` the `LossWeighting` (`Static` when
    `loss_weighting` is `None`), `micro_batch_size` `None` or a positive int, and `layout`
    `(task names, static weights)` when the tasks are known at compile, else `None`.
    `gradient_clipping`, `loss_weighting` and `log_metrics` keep the values given.
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

    def compile_config(self, jit_compile):
        """The `get_compile_config()` of the model, given Keras' resolved `jit_compile`.

        Only the features that are on: with every feature off the config is a keras.Model
        one, which Keras' own code applies to plain models (clone_model of a Sequential).
        """
        features = {
            "gradient_clipping": self.clipper,
            "loss_weighting": self.weighting if self.loss_weighting is not None else None,
            "micro_batch_size": self.micro_batch_size,
            "nonfinite": None if self.nonfinite == "skip" else self.nonfinite,
            "log_metrics": self.log_metrics,
            "sam_rho": self.sam_rho,
            "sam_adaptive": self.sam_adaptive or None,
        }
        return internals.serialization_lib.SerializableDict(
            optimizer=self.optimizer,
            loss=self.loss,
            loss_weights=self.loss_weights,
            metrics=self.metrics,
            weighted_metrics=self.weighted_metrics,
            run_eagerly=self.run_eagerly,
            steps_per_execution=self.steps_per_execution,
            jit_compile=jit_compile,
            **{name: value for name, value in features.items() if value is not None},
        )


def check_remat_scopes(model):
    """The `keras.RematScope` arguments the model's layers were built under, checked at compile.

    Keras checks `mode` when the scope is made but not `output_size_threshold` or
    `layer_names`, which would fail (or act on nothing) deep inside the first step.

    Raises:
        ValueError: `output_size_threshold` not a non-negative integer (`"larger_than"`), or
            `layer_names` not a list of strings (`"list_of_layers"`).

    Warns:
        FastloopWarning: a `"list_of_layers"` scope none of whose `layer_names` is the name of
            a layer built under it (it rematerializes nothing).
    """
    found = internals.remat_modes(model)
    for layer_name, remat_mode in found:
        if remat_mode.mode == "larger_than":
            threshold = remat_mode.output_size_threshold
            if not validation.is_int(threshold) or threshold < 0:
                validation.fail(
                    "output_size_threshold",
                    'a non-negative integer (the `keras.RematScope(mode="larger_than")` '
                    f"layer '{layer_name}' was built under)",
                    threshold,
                )
        elif remat_mode.mode == "list_of_layers":
            names = remat_mode.layer_names
            if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
                validation.fail(
                    "layer_names",
                    "a list of layer names (strings) (the `keras.RematScope(mode="
                    f"\"list_of_layers\")` layer '{layer_name}' was built under)",
                    names,
                )
    scopes = {}
    for layer_name, remat_mode in found:
        if remat_mode.mode == "list_of_layers":
            # one RematMode per layer: scopes made with the same arguments count as one
            key = tuple(remat_mode.layer_names)
            scopes.setdefault(key, (remat_mode, set()))[1].add(layer_name)
    for remat_mode, built in scopes.values():
        if not built & set(remat_mode.layer_names):
            warnings.warn(
                'A `keras.RematScope(mode="list_of_layers")` names no layer built under it, so '
                f"it rematerializes nothing. Layers built under it: {sorted(built)}. "
                f"Received: layer_names={list(remat_mode.layer_names)}",
                FastloopWarning,
                stacklevel=3,
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
    check_remat_scopes(model)
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
        _check_custom_step(type(model).__name__, weighting, loss_weighting, micro_batch_size)
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
    _check_optimizer_clipping(optimizer, clipper)
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
    )


def _check_custom_step(class_name, weighting, loss_weighting, micro_batch_size):
    """Options a class's own `train_step` cannot reach: refused here, not silently dropped."""
    if micro_batch_size is not None:
        raise ValueError(
            f"`micro_batch_size` needs the library's forward pass, and {class_name} has its own "
            "`train_step`, which does its own. Call `super().train_step(data)` from it, or "
            f"split the batch in it. Received: micro_batch_size={micro_batch_size!r}"
        )
    if weighting.requires_task_gradients or weighting.has_state_update:
        raise ValueError(
            f"Loss weighting '{weighting.name}' needs the library's default `train_step` (per-"
            f"task gradients or a state update each step); {class_name} has its own. Use a "
            "method that only combines the losses in `compute_loss` (`uw`, `rlw`, static "
            f"weights) or call `super().train_step(data)`. Received: loss_weighting={loss_weighting!r}"
        )


def log_metric_names(settings, optimizer):
    """The optional step metrics to log: as asked, or those of the features that are on.

    `optimizer`: the model's optimizer after Keras' compile (a `LossScaleOptimizer` under a
    `mixed_float16` policy).
    """
    log_metrics, clipper, nonfinite = settings.log_metrics, settings.clipper, settings.nonfinite
    if log_metrics is None:
        lso = scaling.is_loss_scale_optimizer(optimizer)
        names = []
        if clipper is not None:
            names.append("grad_norm")
        if lso or nonfinite != "skip":
            names.append("skipped_steps")
        if lso:
            names.append("loss_scale")
        return tuple(names)
    return (log_metrics,) if isinstance(log_metrics, str) else tuple(log_metrics)


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
    accumulation = getattr(inner, "gradient_accumulation_steps", None)
    if accumulation and tf.distribute.has_strategy():
        raise ValueError(
            "The optimizer's `gradient_accumulation_steps` does not work under tf.distribute "
            "(Keras 3.15 synchronises inside a conditional, which raises in `fit`, with "
            "keras.Model too). Use `compile(micro_batch_size=...)` to accumulate inside the "
            f"step. Received: gradient_accumulation_steps={accumulation}"
        )
    if gradient_clipping is not None and accumulation:
        raise ValueError(
            "`gradient_clipping` cannot be combined with the optimizer's "
            "`gradient_accumulation_steps`: the step would clip each batch's gradient before "
            "Keras accumulates them (a mean of clipped gradients, not the clipped mean). Use "
            "`compile(micro_batch_size=...)` to accumulate inside the step, where clipping acts "
            f"on the accumulated gradient. Received: gradient_accumulation_steps={accumulation}, "
            f"gradient_clipping={gradient_clipping!r}"
        )


def _check_log_metrics(log_metrics):
    names = [log_metrics] if isinstance(log_metrics, str) else log_metrics
    if names is None:
        return
    if (
        not isinstance(names, (list, tuple))
        or any(name not in LOG_METRICS for name in names)
        or len(set(names)) != len(names)
    ):
        raise ValueError(
            f"`log_metrics` must be None or a list of distinct names from {LOG_METRICS}. "
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
        has_loss: whether `compile` was given a loss.
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
    has_loss: bool = True
    sam_rho: float | None = None
    sam_adaptive: bool = False

    @classmethod
    def from_compile(cls, settings, optimizer, overrides_compute_loss=False):
        """From validated `CompileSettings`, the optimizer Keras' compile set (its loss scale
        decides the default logs) and whether the class overrides `compute_loss`."""
        return cls(
            log_metrics=tuple(log_metric_names(settings, optimizer)),
            has_loss=settings.loss is not None,
            clipper=settings.clipper,
            weighting=settings.weighting,
            weighting_given=settings.loss_weighting is not None,
            loss_is_objective=settings.weighting.name == "static",
            shared_variables=settings.shared_variables,
            micro_batch_size=settings.micro_batch_size,
            nonfinite=settings.nonfinite,
            tasks_known_at_compile=settings.layout is not None,
            overrides_compute_loss=overrides_compute_loss,
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
