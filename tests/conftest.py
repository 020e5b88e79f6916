"""Shared test setup: quiet TensorFlow, two logical CPU devices, fixed seeds."""

import gc
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


_TESTS_PER_GARBAGE_COLLECTION = 50
_tests_since_collection = 0


@pytest.fixture(autouse=True)
def _seed_and_policy():
    """Every test starts from the same seeds, the float32 policy and a clean Keras session.

    `clear_session(free_memory=False)`: a full `gc.collect()` after every test took half of the
    suite's time (0.6-3 s a test once TensorFlow's object graph is large); one every
    `_TESTS_PER_GARBAGE_COLLECTION` tests keeps memory bounded.
    """
    global _tests_since_collection
    keras.utils.set_random_seed(1234)
    np.random.seed(1234)
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session(free_memory=False)
    _tests_since_collection += 1
    if _tests_since_collection >= _TESTS_PER_GARBAGE_COLLECTION:
        _tests_since_collection = 0
        gc.collect()


@pytest.fixture
def mirrored_strategy():
    """Fixture form of `two_replica_strategy`."""
    return two_replica_strategy()
