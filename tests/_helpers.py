"""Helpers shared by test files (import them: `from _helpers import two_replica_strategy`).

Test files import this module rather than `conftest`: pytest loads conftest.py under its own
module name, so `import conftest` can give a second copy with a second MirroredStrategy.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_fastloop as kf

_STRATEGY = []


def two_replica_strategy():
    """The process' one MirroredStrategy over the 2 logical CPUs (skips if unavailable).

    TensorFlow numbers collective instances per strategy object from the same start, so two
    MirroredStrategy objects on the same devices in one process clash ("Shape mismatch in the
    collective instance") once their collectives differ: every test shares this one. The two
    logical CPU devices are configured by tests/conftest.py at collection time.
    """
    if len(tf.config.list_logical_devices("CPU")) < 2:
        pytest.skip("needs 2 logical CPU devices (configured by tests/conftest.py)")
    if not _STRATEGY:
        _STRATEGY.append(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    return _STRATEGY[0]


def fresh_user_mlp():
    """The small classifier of the fresh-user fault reports (8 inputs, 3 classes), seed 0."""
    keras.utils.set_random_seed(0)
    i = keras.Input((8,))
    return kf.OptimizedModel(
        i, keras.layers.Dense(3, activation="softmax")(keras.layers.Dense(16, activation="relu")(i))
    )


def fresh_user_data():
    """64 samples for `fresh_user_mlp` (inputs, integer labels), seed 0."""
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 3, 64)
