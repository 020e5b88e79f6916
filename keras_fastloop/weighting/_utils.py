"""Small helpers shared by the weighting methods (argument checks, global losses, seeds)."""

from __future__ import annotations

import math
import random

from keras import ops

from keras_fastloop import _validation


def update_losses(losses):
    """The losses `update` receives, as a float32 vector of shape `(T,)`.

    The step passes each task's loss on the *global* batch (summed across replicas before the
    conditional update, so every replica sees the same values and holds the same state).
    """
    return ops.stack([ops.cast(loss, "float32") for loss in losses])


def resolve_seed(seed, what="seed"):
    """`None` -> a fresh seed drawn from Python's `random` (seeded by
    `keras.utils.set_random_seed`); an int is checked and returned."""
    if seed is None:
        return random.randint(0, 2**31 - 1)
    _validation.check(_validation.is_int(seed), what, "None or an int", seed)
    return int(seed)


def stateless_seed(seed, counter):
    """A `(2,)` int64 seed for `tf.random.stateless_*` from a fixed seed and a step counter."""
    return ops.stack([ops.cast(seed, "int64"), ops.cast(counter, "int64")])


def check_positive(value, name, allow_zero=False):
    """`_validation.check_real` for a positive (or non-negative) number; returns a float."""
    kind = "non-negative" if allow_zero else "positive"
    ok = _validation.is_real(value) and (value >= 0 if allow_zero else value > 0)
    ok = ok and math.isfinite(value)  # an infinite hyperparameter makes every step NaN
    _validation.check(ok, name, f"a finite {kind} number", value)
    return float(value)


def check_positive_int(value, name):
    """`_validation.check_int` for a positive integer; returns a Python int."""
    return _validation.check_int(name, value, minimum=1)


__all__ = [
    "check_positive",
    "check_positive_int",
    "update_losses",
    "resolve_seed",
    "stateless_seed",
]
