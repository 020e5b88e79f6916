"""The step's own state: a Keras layer that holds counters and the features' variables.

It is attached to the model as an attribute that Keras' layer tracking does not see, so its
variables are not among `model.weights` (`set_weights` from a plain `keras.Model` keeps
working), yet `model.save`, `save_weights` and `BackupAndRestore` store and restore it,
because Keras' saving walks the model's attributes.
"""

from __future__ import annotations

import keras


def state_variable(owner, name, shape=(), value=0, dtype="float32"):
    """A non-trainable, checkpointed variable of the step's state, identical on every replica.

    `owner` is the layer that tracks it (the model's `StepState`); the value is assigned on
    every replica from all-reduced inputs, so the first replica's copy is kept
    (`aggregation="only_first_replica"`).
    """
    return owner.add_weight(
        shape=shape,
        initializer=keras.initializers.Constant(value),
        dtype=dtype,
        trainable=False,
        name=name,
        aggregation="only_first_replica",
    )


class StepState(keras.layers.Layer):
    """Non-trainable variables of OptimizedModel's step (`skipped_steps` and the features').

    Variables use `aggregation="only_first_replica"`: every replica computes the same value
    (decisions are taken on the all-reduced gradient), so the first replica's value is kept.
    """

    def __init__(self, **kwargs):
        super().__init__(name="fastloop_state", trainable=False, **kwargs)
        self.skipped_steps = state_variable(self, "skipped_steps", dtype="int64")
        # Set by compile(nonfinite="terminate") once a step diverged: blocks every later update.
        self.halted = state_variable(self, "halted", value=False, dtype="bool")

    def call(self, inputs):  # pragma: no cover - never called, holds state only
        return inputs
