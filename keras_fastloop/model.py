"""OptimizedModel and OptimizedSequential: Keras' model classes with the trainer mixin.

The step itself lives in `keras_fastloop._trainer`; this module only combines it with
`keras.Model` (functional and subclassed) and `keras.Sequential`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import keras

from keras_fastloop import _keras_internals as internals
from keras_fastloop import _registry
from keras_fastloop._trainer import OptimizedTrainer

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["OptimizedModel", "OptimizedSequential", "optimized"]

_FUNCTIONAL_VARIANTS = {}


@contextlib.contextmanager
def _bases_kept(cls):
    """Restores `cls.__bases__` if Keras rewrote them meanwhile.

    `keras.Model.__init__` given inputs and outputs by a class beside ours (a KerasHub task
    whose `Functional` base was not injected yet) rewrites the bases of every class of the
    instance's hierarchy (`inject_functional_model_class`), `OptimizedModel`'s included, which
    would make every later subclassed `OptimizedModel` functional.
    """
    bases = cls.__bases__
    try:
        yield
    finally:
        if cls.__bases__ != bases:
            cls.__bases__ = bases


def _functional_variant(cls):
    """`cls` with Keras' `Functional` mixed in, created once per class.

    `keras.Model` supports functional construction of a subclass by rewriting the subclass'
    `__bases__` in place (`inject_functional_model_class`), which would break every later
    subclassed (non-functional) use of `OptimizedModel` in the same process. Building a
    separate class leaves `OptimizedModel` untouched. The variant has `cls`' name (and is
    registered under `cls`' registered name, where a user registered `cls`), so saved models
    load back as `cls`.
    """
    if cls not in _FUNCTIONAL_VARIANTS:
        variant = type(
            cls.__name__,
            (cls, internals.Functional),
            # pickle finds the variant by reference as `cls._fastloop_functional`
            {
                "__module__": cls.__module__,
                "__qualname__": f"{cls.__qualname__}._fastloop_functional",
            },
        )
        cls._fastloop_functional = variant
        registered = keras.saving.get_registered_name(cls)
        if ">" in registered:
            package, name = registered.split(">", 1)
            keras.saving.register_keras_serializable(package=package, name=name)(variant)
        _FUNCTIONAL_VARIANTS[cls] = variant
    return _FUNCTIONAL_VARIANTS[cls]


@_registry.register_model_class
class OptimizedModel(OptimizedTrainer, keras.Model):
    """A `keras.Model` whose `train_step`/`test_step` carry an expert's training loop.

    Build it exactly like `keras.Model` (functional `OptimizedModel(inputs, outputs)` or
    subclassed) and call `compile`/`fit`/`evaluate`/`predict` as usual. `compile` takes
    Keras' arguments plus the keyword-only arguments below. With all of them at their defaults
    training is numerically the same as `keras.Model.fit`.

    Logs, every step: `loss` (task losses weighted by the static `loss_weights`, plus
    regularization: what `keras.Model` reports, never loss-scaled, the same for every
    weighting method), `{task}_loss` (unweighted, multi-output models), and only when the
    feature is on (or asked for with `compile(log_metrics=[...])`): `objective` and
    `{task}_weight` (with `loss_weighting`: the method's own objective and weights),
    `grad_norm` (global L2 norm of the unscaled, cross-replica gradient before clipping),
    `skipped_steps` (updates skipped for non-finite gradients) and `loss_scale`. The step
    statistics are not in `model.metrics` (only the step writes them); they are synchronised
    across replicas and reset every epoch like Keras' own metrics.

    Example:
        >>> inputs = keras.Input((64,))
        >>> outputs = keras.layers.Dense(10, activation="softmax")(inputs)
        >>> model = OptimizedModel(inputs, outputs)
        >>> model.compile("adam", "sparse_categorical_crossentropy", gradient_clipping=1.0)
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        if cls is OptimizedModel and args and isinstance(args[0], keras.Model):
            raise TypeError(
                "OptimizedModel(model) does not take an existing model: "
                "`keras_fastloop.optimized(model)` gives it the step in place, keeping its "
                "class, weights, compile state and methods. "
                f"Received: {type(args[0]).__name__} instance"
            )
        # As `keras.Model.__new__`: only the class itself turns `(inputs, outputs)` into a
        # functional model here. A subclass' constructor arguments are its own (a VAE's
        # `(encoder, decoder)`); it becomes functional in `__init__`, when its own `__init__`
        # passes inputs and outputs on to `super().__init__`, as in `keras.Model.__init__`.
        if cls is OptimizedModel and internals.functional_init_arguments(args, kwargs):
            cls = _functional_variant(cls)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not internals.functional_init_arguments(args, kwargs):
            # Subclassed, or a class beside ours with its own constructor (a KerasHub task,
            # which builds its layers, then passes inputs/outputs on to keras.Model).
            with _bases_kept(OptimizedModel):
                super().__init__(*args, **kwargs)
            return
        if not isinstance(self, internals.Functional):
            # A subclass whose own __init__ passes inputs/outputs to super().__init__: Keras
            # would rewrite the class hierarchy in place (breaking every later OptimizedModel);
            # the instance becomes its class' functional variant instead.
            self.__class__ = _functional_variant(type(self))
        internals.Trainer.__init__(self)
        internals.Functional.__init__(self, *args, **kwargs)


@_registry.register_model_class
class OptimizedSequential(OptimizedTrainer, keras.Sequential):
    """A `keras.Sequential` with `OptimizedModel`'s training step.

    Same constructor as `keras.Sequential` (`layers`, `trainable`, `name`) and the same
    `compile` arguments as `OptimizedModel`; saves and loads as itself. To give an
    existing model the step, call `keras_fastloop.optimized(model)`.

    Example:
        >>> model = OptimizedSequential([keras.Input((8,)), keras.layers.Dense(1)])
        >>> model.compile("sgd", "mse", gradient_clipping=1.0)
    """


def _optimized_class(cls):
    """The class a model of class `cls` becomes under `optimized`.

    Keras' own `Functional` and `Sequential` become `OptimizedModel` (functional) and
    `OptimizedSequential`: registered classes whose `compile` knows the step's options, so the
    saved file loads back with the step, its options and its state (a file naming `Functional`
    would be compiled by `keras.Model.compile`, which refuses them). Any other class becomes
    its trainer variant (`_trainer_variant`).
    """
    if cls is internals.Functional:
        return _functional_variant(OptimizedModel)
    if cls is keras.Sequential:
        return OptimizedSequential
    return _trainer_variant(cls)


_TRAINER_VARIANTS = {}
# Methods a model's own class keeps over the trainer's (its step, its loss, its metrics).
_CLASS_OWN = ("train_step", "test_step", "compute_loss", "compute_metrics")
# The config key naming the model's own class (its registered name) in a variant's config.
CLASS_KEY = "keras_fastloop_class"
_VARIANT_NAME = f"{_registry.PACKAGE}>OptimizedSubclass"


def _trainer_variant(cls):
    """`cls` with the trainer mixin first, created once per class.

    It has `cls`' name and module; the methods of `_CLASS_OWN` that `cls` (or a non-Keras
    base) defines stay `cls`' own. It saves under the registered name
    `"keras_fastloop>OptimizedSubclass"` with `cls`' registered name in its config
    (`CLASS_KEY`), so `keras.saving.load_model` rebuilds the variant, whose `compile` knows
    the step's options (`cls`' own `compile` would refuse them); `cls` must be registered
    with `keras.saving.register_keras_serializable`, as Keras requires of any subclass.
    """
    if cls not in _TRAINER_VARIANTS:

        def get_config(self):
            config = super(variant, self).get_config()
            return {**config, CLASS_KEY: keras.saving.get_registered_name(cls)}

        @classmethod
        def from_config(klass, config, **kwargs):
            config = {key: value for key, value in config.items() if key != CLASS_KEY}
            return super(variant, klass).from_config(config, **kwargs)

        namespace = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "get_config": get_config,
            "from_config": from_config,
        }
        for name in _CLASS_OWN:
            owner = next(klass for klass in cls.__mro__ if name in vars(klass))
            if not owner.__module__.startswith("keras."):
                namespace[name] = vars(owner)[name]
        variant = type(cls.__name__, (OptimizedTrainer, cls), namespace)
        internals.save_as(variant, _VARIANT_NAME)
        _TRAINER_VARIANTS[cls] = variant
    return _TRAINER_VARIANTS[cls]


class _OptimizedSubclass:
    """What `"keras_fastloop>OptimizedSubclass"` loads as: a model given the step by `optimized`.

    Its `from_config` finds the model's own class by the registered name in the config,
    builds the model with it and gives it the step's class (`_trainer_variant`); Keras then
    compiles it with the saved compile config, options included.
    """

    @staticmethod
    def get_config():
        return {}

    @staticmethod
    def from_config(config, custom_objects=None):
        """Rebuilds the model of `config` (a `_trainer_variant` config) as its variant.

        Raises:
            TypeError: the model's class is not registered under the saved name.
        """
        name = config.get(CLASS_KEY)
        cls = keras.saving.get_registered_object(name, custom_objects=custom_objects)
        if not (isinstance(cls, type) and issubclass(cls, keras.Model)):
            raise TypeError(
                "This model was given the step by `keras_fastloop.optimized` and saved as an "
                "instance of its own class, which must be registered under its saved name "
                "to load: decorate it with `@keras.saving.register_keras_serializable()` and "
                "import it before loading, or pass `custom_objects={name: cls}`. "
                f"Received: {CLASS_KEY}={name!r} (found {cls!r})"
            )
        return _trainer_variant(cls).from_config(config)


keras.saving.get_custom_objects()[_VARIANT_NAME] = _OptimizedSubclass


def optimized(model: keras.Model, **options: Any) -> keras.Model:
    """Give a model that already exists the library's training step, in place.

    Works for functional, Sequential and subclassed models, KerasHub tasks and models loaded
    with `keras.saving.load_model` (their optimizer state included). The model keeps its
    weights, its class' behaviour (a task's preprocessor, `generate`, custom methods; its own
    `train_step` if it has one) and saves and loads as its class with the step and its
    options; Keras' own functional and Sequential models become `OptimizedModel` and
    `OptimizedSequential` (their file names the class whose `compile` knows the options, so
    `keras.saving.load_model` needs no `custom_objects`); a model of any other class saves
    under `"keras_fastloop>OptimizedSubclass"` with its class' registered name, and loads
    back with the step once that class is registered (as Keras requires of any subclass;
    `get_config()` holds the key `"keras_fastloop_class"`). With every option off it trains
    exactly as before. A compiled model is compiled again with its own arguments (the
    same optimizer object, so its state is kept) plus `options`.

    Args:
        model: a `keras.Model` instance.
        **options: the step's `compile` options (`gradient_clipping`, `loss_weighting`,
            `shared_variables`, `micro_batch_size`, `nonfinite`, `log_metrics`, `sam_rho`,
            `sam_adaptive`); for a model
            that is not compiled yet, pass them to its `compile()` instead.

    Returns:
        `model` itself, now an instance of its class with `OptimizedTrainer` mixed in
        (`OptimizedModel`/`OptimizedSequential` for a stock functional/Sequential model).

    Raises:
        TypeError: `model` is not a `keras.Model`.
        ValueError: `options` for a model that is not compiled.

    Example:
        >>> model = keras.saving.load_model("stock.keras")  # doctest: +SKIP
        >>> kf.optimized(model, gradient_clipping=1.0).fit(x, y)  # doctest: +SKIP
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"optimized() takes a keras.Model. Received: {type(model).__name__}")
    if options and not model.compiled:
        raise ValueError(
            "The step's options act through compile(): the model is not compiled, so pass "
            f"them to `model.compile(...)`. Received: {sorted(options)}"
        )
    if not isinstance(model, OptimizedTrainer):
        model.__class__ = _optimized_class(type(model))
    if model.compiled:
        config = dict(internals.compile_config(model).config)
        config["optimizer"] = model.optimizer  # the same object: its state is kept
        model.compile(**config, **options)
    return model
