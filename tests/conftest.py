"""Shared test setup: quiet TensorFlow, two logical CPU devices, fixed seeds."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from _helpers import two_replica_strategy  # noqa: E402

# Two logical CPU devices so MirroredStrategy tests can run on one CPU. This must happen
# before TensorFlow initialises its devices, i.e. at collection time.
_cpus = tf.config.list_physical_devices("CPU")
try:
    tf.config.set_logical_device_configuration(
        _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )
except RuntimeError:  # devices already initialised (e.g. by a plugin); tests that need two skip
    pass


@pytest.fixture(autouse=True)
def _seed_and_policy():
    """Every test starts from the same seeds, the float32 policy and a clean Keras session."""
    keras.utils.set_random_seed(1234)
    np.random.seed(1234)
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()


@pytest.fixture
def mirrored_strategy():
    """Fixture form of `two_replica_strategy`."""
    return two_replica_strategy()
