"""keras_fastloop: an expert training step for Keras 3 on TensorFlow.

Swap `keras.Model` for `OptimizedModel` and keep calling `compile`/`fit`.
"""

from keras_fastloop import (
    _registry,
    callbacks,
    clipping,
    cluster,
    data,
    datasets,
    mixed_precision,
    schedules,
    tuning,
    weighting,
)
from keras_fastloop._fit_callbacks import NonFiniteError
from keras_fastloop._trainer import OptimizedTrainer
from keras_fastloop._warnings import FastloopWarning
from keras_fastloop.model import OptimizedModel, OptimizedSequential, optimized
from keras_fastloop.step import TrainingStep

_registry.snapshot()  # every serializable class above, for loading after a registry clear

# The one place the version is written: pyproject.toml reads it (setuptools `attr:`) and so
# does `keras-fastloop --version` (statically, without importing TensorFlow).
__version__ = "0.1.0"

__all__ = [
    "FastloopWarning",
    "NonFiniteError",
    "OptimizedModel",
    "OptimizedSequential",
    "OptimizedTrainer",
    "TrainingStep",
    "__version__",
    "callbacks",
    "clipping",
    "cluster",
    "data",
    "datasets",
    "mixed_precision",
    "optimized",
    "schedules",
    "tuning",
    "weighting",
]
