"""`compile` is "check, then build": every check in `validate_compile_arguments`."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import keras
import pytest

from keras_fastloop import OptimizedModel, _trainer
from keras_fastloop import _compile_settings as compile_settings
from keras_fastloop import step as step_module


def _model():
    inputs = keras.Input((3,))
    return OptimizedModel(inputs, keras.layers.Dense(2)(inputs))


def _arguments(**changes):
    arguments = dict(
        optimizer="sgd",
        loss="mse",
        loss_weights=None,
        metrics=None,
        weighted_metrics=None,
        run_eagerly=False,
        steps_per_execution=1,
        jit_compile=False,
        auto_scale_loss=True,
        gradient_clipping=None,
        loss_weighting=None,
        shared_variables=None,
        micro_batch_size=None,
        nonfinite="skip",
        log_metrics=None,
    )
    return {**arguments, **changes}


def test_settings_are_frozen_and_validation_leaves_the_model_as_it_was():
    model = _model()
    settings = compile_settings.validate_compile_arguments(
        model, overrides_compute_loss=False, **_arguments(gradient_clipping=1.0)
    )
    assert isinstance(settings.optimizer, keras.optimizers.SGD)
    assert settings.clipper is not None and settings.weighting.name == "static"
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.nonfinite = "raise"
    assert not model.compiled and model.fastloop_step is None


@pytest.mark.parametrize(
    "changes",
    [
        {"nonfinite": "ignore"},
        {"micro_batch_size": 0},
        {"steps_per_execution": 0},
        {"log_metrics": ["nope"]},
        {"loss": None, "loss_weighting": "dwa"},
    ],
)
def test_each_refusal_is_raised_by_the_validation_with_received(changes):
    model = _model()
    with pytest.raises(ValueError, match="Received: "):
        compile_settings.validate_compile_arguments(
            model, overrides_compute_loss=False, **_arguments(**changes)
        )
    assert not model.compiled


def _raises(function):
    source = inspect.cleandoc("\n" + inspect.getsource(function))
    return [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Raise)]


def test_the_build_half_of_compile_raises_nothing_itself():
    # The refusals are `bind_keras_arguments`' and `validate_compile_arguments`'.
    build_half = (
        _trainer.OptimizedTrainer.compile,
        compile_settings.compile_model,
        compile_settings._resolved_by_class,
        step_module.TrainingStep.__init__,
    )
    for function in build_half:
        assert not _raises(function), function.__qualname__
    assert _raises(compile_settings.bind_keras_arguments)  # the check can see a raise


class _Task(keras.Model):
    """A KerasHub-like task: its own `compile` fills in defaults (a class beside ours)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.head = keras.layers.Dense(2, activation="softmax")

    def call(self, x):
        return self.head(x)

    def compile(self, optimizer="auto", loss="auto", **kwargs):
        optimizer = keras.optimizers.Adam(0.01) if optimizer == "auto" else optimizer
        loss = "sparse_categorical_crossentropy" if loss == "auto" else loss
        super().compile(optimizer=optimizer, loss=loss, **kwargs)


def _compile_state(model):
    config = model.get_compile_config()
    step = model.fastloop_step
    return model.optimizer, model.loss, step, config, list(model.metrics), model.compiled


@pytest.mark.parametrize("through_class", [False, True], ids=["keras", "class_beside"])
@pytest.mark.parametrize(
    "refused",
    [
        dict(nonfinite="bogus"),
        dict(optimizer="adam", loss="mse", gradient_clipping="bogus"),
        dict(optimizer="adam", loss="mse", metrics=["mae"], micro_batch_size=-1),
    ],
)
def test_a_refused_compile_after_one_leaves_the_model_as_it_was(through_class, refused):
    import keras_fastloop as kf

    if through_class:
        model = kf.optimized(_Task())
        assert compile_settings.class_compile_beside(type(model), _trainer.OptimizedTrainer)
    else:
        inputs = keras.Input((3,))
        model = OptimizedModel(inputs, keras.layers.Dense(2, activation="softmax")(inputs))
    model(keras.ops.ones((1, 3)))
    model.compile(keras.optimizers.SGD(), "sparse_categorical_crossentropy")
    before = _compile_state(model)
    with pytest.raises((ValueError, TypeError), match="Received"):
        model.compile(**refused)
    after = _compile_state(model)
    for was, now in zip(before, after):
        assert was is now or was == now
    model.fit(keras.ops.ones((4, 3)), keras.ops.zeros((4,)), verbose=0)  # still trains
