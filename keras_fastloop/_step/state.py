"""The step's own state: a Keras layer that holds counters and the features' variables.

It is attached to the model as an attribute that Keras' layer tracking does not see, so its
variables are not among `model.weights` (`set_weights` from a plain `keras.Model` keeps
working), yet `model.save`, `save_weights` and `BackupAndRestore` store and restore it,
because Keras' saving walks the model's attributes.
"""

from __future__ import annotations

import keras


class StepState(keras.layers.Layer):
    """Non-trainable variables of OptimizedModel's step (`skipped_steps` and the features').

    Variables use `aggregation="only_first_replica"`: every replica computes the same value
    (decisions are taken on the all-reduced gradient), so the first replica's value is kept.
    """

    def __init__(self, **kwargs):
        super().__init__(name="fastloop_state", trainable=False, **kwargs)
        self.skipped_steps = self.add_weight(
            shape=(),
            initializer="zeros",
            dtype="int64",
            trainable=False,
            name="skipped_steps",
            aggregation="only_first_replica",
        )
        # Set by compile(nonfinite="terminate") once a step diverged: blocks every later update.
        self.halted = self.add_weight(
            shape=(),
            initializer="zeros",
            dtype="bool",
            trainable=False,
            name="halted",
            aggregation="only_first_replica",
        )

    def call(self, inputs):  # pragma: no cover - never called, holds state only
        return inputs
