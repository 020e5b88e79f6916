"""keras_fastloop: an expert training step for Keras 3 on TensorFlow."""

__version__ = "0.1.0"
