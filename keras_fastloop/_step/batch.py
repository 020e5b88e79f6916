"""What the step reads off a batch and off the model's own losses (one place for each)."""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from keras_fastloop import _keras_internals as internals


def first_tensor(structure):
    """The first tensor of a nest (`tf.nest.flatten` order), skipping `None`s."""
    return next(t for t in tf.nest.flatten(structure) if t is not None)


def batch_size(structure):
    """The batch's number of samples: axis 0 of the nest's first tensor (int32 scalar)."""
    return tf.shape(first_tensor(structure), out_type=tf.int32)[0]


def regularization_terms(model):
    """The model's own losses (`model.losses`: regularizers, `add_loss`), each a float32
    scalar scaled for distribution as Keras scales them."""
    return [
        internals.scale_loss_for_distribution(ops.sum(ops.cast(r, "float32"))) for r in model.losses
    ]
