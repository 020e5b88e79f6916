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


# For a test module whose tests skip steps on purpose: `pytestmark = EXPECT_SKIP_WARNINGS`
# (or `@EXPECT_SKIP_WARNINGS[0]` ... on one test) turns the skip report's FastloopWarnings
# back into ignored warnings there; every other FastloopWarning stays an error.
EXPECT_SKIP_WARNINGS = [
    pytest.mark.filterwarnings(r"ignore:\d+ training steps? skipped for a non-finite"),
    pytest.mark.filterwarnings("ignore:Loss-scale overflows only"),
]


def expect_skip_warnings():
    """Context manager for tests that skip steps on purpose: the skip report's
    `FastloopWarning`s (one per epoch with skipped steps or loss-scale overflows) are expected
    and recorded instead of failing the test (pyproject turns FastloopWarning into errors).
    Other FastloopWarnings stay errors."""
    import warnings

    manager = warnings.catch_warnings()
    manager.__enter__()
    warnings.filterwarnings("ignore", r"\d+ training steps? skipped for a non-finite")
    warnings.filterwarnings("ignore", "Loss-scale overflows only")
    return _Exit(manager)


class _Exit:
    def __init__(self, manager):
        self.manager = manager

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.manager.__exit__(*exc)


# A tiny KerasHub BERT text classifier: random weights, a hand-made vocabulary, nothing downloaded.
VOCABULARY = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + (
    "the quick brown fox jumps over lazy dog a cat sat on mat".split()
)
TEXTS = ["the quick brown fox", "a cat sat on the mat", "lazy dog", "the fox jumps over"] * 4
LABELS = np.array([0, 1, 1, 0] * 4)


def bert_classifier(cls, dropout=0.1, seed=0):
    """A one-layer KerasHub `BertTextClassifier` of class `cls` with its preprocessor (skips
    without keras_hub). `dropout` goes to the backbone and the head (0.1: KerasHub's default);
    `seed` is set with `keras.utils.set_random_seed` before the weights are made."""
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(seed)
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=VOCABULARY)
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(tokenizer, sequence_length=8)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=len(VOCABULARY),
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=8,
        dropout=dropout,
    )
    return cls(backbone=backbone, preprocessor=preprocessor, num_classes=2, dropout=dropout)


class WeightsByStep(keras.callbacks.Callback):
    """`weights[step]`: the model's weights (only the trainable ones with `trainable_only`)
    as NumPy arrays after each training batch, keyed by `optimizer.iterations`."""

    def __init__(self, trainable_only=False):
        super().__init__()
        self.trainable_only, self.weights = trainable_only, {}

    def on_train_batch_end(self, batch, logs=None):
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        variables = self.model.trainable_weights if self.trainable_only else self.model.weights
        self.weights[step] = [keras.ops.convert_to_numpy(v) for v in variables]
