"""The step's own state: a Keras layer that holds counters and the features' variables.

It is attached to the model as an attribute that Keras' layer tracking does not see, so its
variables are not among `model.weights` (`set_weights` from a plain `keras.Model` keeps
working), yet `model.save`, `save_weights` and `BackupAndRestore` store and restore it,
because Keras' saving walks the model's attributes.
"""

from __future__ import annotations

import warnings

import keras

from keras_fastloop._replicas import state_variable
from keras_fastloop._warnings import FastloopWarning


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

    def save_own_variables(self, store):
        """Stores every variable under its name (which feature's state it is), not its index."""
        for variable in self.variables:
            store[variable.name] = variable

    def load_own_variables(self, store):
        """Restores the variables a checkpoint holds under their names; keeps the others.

        A checkpoint written by `keras.Model`, or by a model compiled with other features or
        another number of tasks, holds none or only some of this compile's step state: the
        model's weights load as they would into `keras.Model`, and the state the checkpoint
        lacks keeps its value, with a `FastloopWarning` that names it when the checkpoint had
        step state of its own (resuming from it is then not exact).
        """
        keys = list(store.keys())
        if not keys:
            return  # no step state in the checkpoint (keras.Model, or saved uncompiled)
        variables = self.variables
        by_name = {key: store[key] for key in keys}
        kept = []
        for variable in variables:
            value = by_name.get(variable.name)
            if value is None or tuple(value.shape) != tuple(variable.shape):
                kept.append(variable.name)
                continue
            variable.assign(value)
        if kept:
            warnings.warn(
                f"The checkpoint's step state does not match this compile's: {kept} keep "
                "their current values (saved with other features or tasks). Received: "
                f"checkpoint step state {sorted(keys)}",
                FastloopWarning,
                stacklevel=2,
            )
