"""What `get_compile_config()` saves and `compile_from_config()` restores (`.keras` files).

The config is `CompileSettings.saved` with Keras' resolved `jit_compile` (only the features
that are on, so with every feature off it is a `keras.Model` one); `shared_variables`, when
given, by position (each a layer variable's index or a model weight's name, with its path
for messages; paths alone differ in a loaded subclassed model); and, for a loss
weighting whose tasks were unknown at `compile`, the task names and static weights: a loaded
model then creates its weighting state before its variables load.
"""

from __future__ import annotations

import warnings

import keras

from keras_fastloop import _keras_internals as internals
from keras_fastloop import _registry
from keras_fastloop._step import losses

# `keras.Model.compile`'s arguments: any other key of a saved config is one of the step's options.
_KERAS_COMPILE_KEYS = {
    "optimizer",
    "loss",
    "loss_weights",
    "metrics",
    "weighted_metrics",
    "run_eagerly",
    "steps_per_execution",
    "jit_compile",
    "auto_scale_loss",
}


def get_compile_config(model):
    """The model's compile config (a dict; `{}` when it is not compiled)."""
    compile_config = internals.compile_config(model)
    if not (model.compiled and compile_config is not None):
        return {}
    config = compile_config.serialize()
    task_loss = internals.compile_loss(model)
    step = model.fastloop_step
    if step.settings.shared_variables is not None:
        config["shared_variables"] = _positions(model, _variables(step.settings.shared_variables))
    needs_tasks = step.weighting_given and not step.tasks_known_at_compile
    if needs_tasks and isinstance(task_loss, losses.TaskLoss) and task_loss.names:
        # The default static weights are rebuilt from `loss_weights` at the first step.
        config["task_names"] = list(task_loss.names)
        config["task_weights"] = list(task_loss.static_weights)
    return config


def compile_from_config(model, config, custom_compile):
    """`model.compile(**config)` after deserializing it, as `keras.Model` does.

    Args:
        model: the model being loaded.
        config: what `get_compile_config` returned when the model was saved.
        custom_compile: bool, the model's class overrides `compile`; then, as in Keras,
            nothing is compiled and a `UserWarning` says so.
    """
    if custom_compile:
        options = sorted(set(config) - _KERAS_COMPILE_KEYS - {"task_names", "task_weights"})
        saved = f" The saved compile config holds the step's options {options}." if options else ""
        warnings.warn(
            "`compile()` was not called as part of model loading because the model's "
            "`compile()` method is custom. All subclassed Models that have `compile()` "
            "overridden should also override `get_compile_config()` and "
            "`compile_from_config(config)`. Alternatively, you can call `compile()` "
            f"manually after loading.{saved}",
            stacklevel=3,
        )
        return
    config = dict(config)
    task_names = config.pop("task_names", None)
    task_weights = config.pop("task_weights", None)
    # Our own objects (clipping, weighting, ...) resolve even after
    # `keras.saving.get_custom_objects().clear()`.
    with keras.saving.custom_object_scope(_registry.library_objects()):
        config = internals.serialization_lib.deserialize_keras_object(config)
    if config.get("shared_variables") is not None:
        config["shared_variables"] = _by_position(model, config["shared_variables"])
    model.compile(**config)
    if task_names is not None:
        model.fastloop_step.build_weighting((task_names, task_weights))
    if model.built:
        model.optimizer.build(model.trainable_variables)


def _variables(items):
    """The variables of `compile(shared_variables=...)`: a layer stands for its trainable ones."""
    for item in items:
        yield from item.trainable_variables if isinstance(item, keras.layers.Layer) else [item]


def _layer_variables(model):
    """The variables of the model's layers, in Keras' (deterministic) tracking order."""
    seen, found = set(), []
    for layer in model.layers:
        for variable in layer.variables:
            if id(variable) not in seen:
                seen.add(id(variable))
                found.append(variable)
    return found


def _positions(model, variables):
    """The saved form of `variables`: `{"path", "layer_variable"}`, the index among
    `_layer_variables`, for a layer's variable, else `{"path", "model_variable"}`, the name
    of one of the model's own. Paths alone do not find them again: a subclassed model's
    auto-named layers get other names when loaded, and functional sub-models' paths leave
    out the sub-model's name."""
    index = {id(variable): n for n, variable in enumerate(_layer_variables(model))}
    saved = []
    for variable in variables:
        if id(variable) in index:
            saved.append({"path": variable.path, "layer_variable": index[id(variable)]})
        else:
            saved.append({"path": variable.path, "model_variable": variable.name})
    return saved


def _by_position(model, paths):
    """The model's trainable variables at the saved `paths` (as `_positions` saved them).

    Raises:
        ValueError: one the loaded model does not have (or has not trainable).
    """
    layer_variables = _layer_variables(model)
    listed = {id(variable) for variable in layer_variables}
    own = {}
    for variable in model.variables:
        if id(variable) not in listed:
            own.setdefault(variable.name, []).append(variable)
    trainable = {id(variable) for variable in model.trainable_variables}
    found, missing = [], []
    for entry in paths:
        n, name = entry.get("layer_variable"), entry.get("model_variable")
        if n is not None:
            candidates = [layer_variables[n]] if 0 <= n < len(layer_variables) else []
        else:
            candidates = own.get(name, [])
        if len(candidates) == 1 and id(candidates[0]) in trainable:
            found.append(candidates[0])
        else:
            missing.append(entry["path"])
    if missing:
        raise ValueError(
            "The saved compile config's `shared_variables` must name trainable variables of "
            f"the loaded model ({[v.path for v in model.trainable_variables]}). Received: "
            f"shared_variables={missing}"
        )
    return found
