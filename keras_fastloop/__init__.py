"""keras_fastloop: an expert training step for Keras 3 on TensorFlow.

Swap ``keras.Model`` for :class:`OptimizedModel` and keep calling ``compile``/``fit``.
"""

from keras_fastloop import (
    callbacks,
    clipping,
    data,
    mixed_precision,
    schedules,
    tuning,
    weighting,
)
from keras_fastloop.model import OptimizedModel, OptimizedSequential

__version__ = "0.1.0"

__all__ = [
    "OptimizedModel",
    "OptimizedSequential",
    "__version__",
    "callbacks",
    "clipping",
    "data",
    "mixed_precision",
    "schedules",
    "tuning",
    "weighting",
]
