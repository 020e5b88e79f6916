"""How saved keras_fastloop models find their classes again, with or without Keras' registry.

Keras' own model classes are found from the `module` of a saved config; a library's classes
only through the registry (`keras.saving.get_custom_objects()`), `load_model(custom_objects=)`
or `keras.saving.custom_object_scope`, each looked up under the config's `registered_name`.
`OptimizedModel` and `OptimizedSequential` are serialized under their bare class names, so the
entry a user writes, `custom_objects={"OptimizedModel": kf.OptimizedModel}`, is the one
looked up; the same key serves legacy `.h5` files, which store `model.__class__.__name__`.
Files saved before (registered name `"keras_fastloop>OptimizedModel"`) still load: that
name stays registered as an alias.

Every other serializable object of the library (clipping, loss weighting, loss scaling,
schedules) keeps its `"keras_fastloop>Name"` registration; `library_objects()` holds them all,
taken when the package is imported, so that a model's `compile_from_config` finds them even
after the global registry has been cleared.
"""

from __future__ import annotations

import keras

PACKAGE = "keras_fastloop"
_LIBRARY_OBJECTS: dict[str, object] = {}


def register_model_class(cls):
    """Registers a model class under its bare name (and the old `"keras_fastloop>"` alias).

    Used as a class decorator in place of `keras.saving.register_keras_serializable`, which
    would make the serialized `registered_name` `"keras_fastloop>Name"`.
    """
    objects = keras.saving.get_custom_objects()
    objects[cls.__name__] = cls
    objects[f"{PACKAGE}>{cls.__name__}"] = cls
    _LIBRARY_OBJECTS[f"{PACKAGE}>{cls.__name__}"] = cls
    return cls


def snapshot():
    """Records every `"keras_fastloop>..."` entry of Keras' registry (called at import)."""
    for name, obj in keras.saving.get_custom_objects().items():
        if name.startswith(f"{PACKAGE}>"):
            _LIBRARY_OBJECTS[name] = obj


def library_objects():
    """`{registered name: object}` of the library's serializable objects (a copy)."""
    return dict(_LIBRARY_OBJECTS)
