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
from keras_fastloop.model import OptimizedModel
from keras_fastloop_cli import version as _version

# The one version source is pyproject.toml, read from the installed distribution's metadata.
__version__ = _version()

__all__ = [
    "OptimizedModel",
    "__version__",
    "callbacks",
    "clipping",
    "data",
    "mixed_precision",
    "schedules",
    "tuning",
    "weighting",
]
