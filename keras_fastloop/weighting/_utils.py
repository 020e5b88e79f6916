"""Small helpers shared by the weighting methods (state variables, global losses, seeds)."""

from __future__ import annotations

import random

import keras
from keras import ops


def state_variable(state, name, shape, value=0.0, dtype="float32"):
    """A non-trainable, checkpointed variable of the step's state, identical on every replica."""
    return state.add_weight(
        shape=shape,
        initializer=keras.initializers.Constant(value),
        dtype=dtype,
        trainable=False,
        name=name,
        aggregation="only_first_replica",
    )


def update_losses(losses):
    """The losses ``update`` receives, as a float32 vector of shape ``(T,)``.

    The step passes each task's loss on the *global* batch (summed across replicas before the
    conditional update, so every replica sees the same values and holds the same state).
    """
    return ops.stack([ops.cast(loss, "float32") for loss in losses])


def resolve_seed(seed, what="seed"):
    """``None`` -> a fresh seed drawn from Python's ``random`` (seeded by
    ``keras.utils.set_random_seed``); an int is checked and returned."""
    if seed is None:
        return random.randint(0, 2**31 - 1)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"`{what}` must be None or an int. Received: {what}={seed!r}")
    return seed


def stateless_seed(seed, counter):
    """A ``(2,)`` int64 seed for ``tf.random.stateless_*`` from a fixed seed and a step counter."""
    return ops.stack([ops.cast(seed, "int64"), ops.cast(counter, "int64")])


def check_positive(value, name, allow_zero=False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    if not ok:
        kind = "non-negative" if allow_zero else "positive"
        raise ValueError(f"`{name}` must be a {kind} number. Received: {name}={value!r}")
    return float(value)


def check_positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return value


__all__ = [
    "check_positive",
    "check_positive_int",
    "update_losses",
    "resolve_seed",
    "state_variable",
    "stateless_seed",
]
