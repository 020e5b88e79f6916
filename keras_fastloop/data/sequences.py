"""`sequences_to_dataset`: a ragged list of token-id arrays as an unbatched `tf.data.Dataset`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["sequences_to_dataset"]


def sequences_to_dataset(
    sequences: Sequence[Sequence[int] | np.ndarray],
    labels: Sequence[Any] | np.ndarray | None = None,
    sample_weights: Sequence[float] | np.ndarray | None = None,
) -> tf.data.Dataset:
    """Builds an unbatched `tf.data.Dataset` from a ragged list of 1-D token-id arrays.

    Args:
        sequences: list of 1-D int arrays (ragged). Token ids.
        labels: array-like or None (default). One label per sequence; when given the elements
            are `(x, y)` tuples.
        sample_weights: array-like or None (default). One weight per sequence; needs `labels`;
            the elements are then `(x, y, sample_weight)`.

    Returns:
        A `tf.data.Dataset` whose `x` has shape `[None]` (int32), ready for `bucket_by_length`.

    Raises:
        ValueError: if lengths of `sequences`, `labels` and `sample_weights` differ, or
            `sample_weights` is given without `labels`.

    Example:

    >>> ds = sequences_to_dataset([np.array([3, 4]), np.array([5])], labels=[0, 1])
    >>> ds.element_spec[0].shape
    TensorShape([None])
    """
    n = len(sequences)
    if sample_weights is not None and labels is None:
        raise ValueError("`sample_weights` needs `labels`. Received: labels=None")
    for name, value in (("labels", labels), ("sample_weights", sample_weights)):
        if value is not None and len(value) != n:
            raise ValueError(
                f"`{name}` must have one entry per sequence ({n}). Received: len({name})={len(value)}"
            )
    x = tf.RaggedTensor.from_row_lengths(
        np.concatenate([np.asarray(s, np.int32).reshape(-1) for s in sequences])
        if n
        else np.zeros([0], np.int32),
        np.array([len(s) for s in sequences], dtype=np.int64),
    )
    parts = [x]
    if labels is not None:
        parts.append(np.asarray(labels))
    if sample_weights is not None:
        parts.append(np.asarray(sample_weights, dtype=np.float32))
    ds = tf.data.Dataset.from_tensor_slices(tuple(parts) if len(parts) > 1 else x)

    def densify(*args):
        first = args[0]
        first = first.to_tensor() if isinstance(first, tf.RaggedTensor) else first
        return (first,) + tuple(args[1:]) if len(args) > 1 else first

    return ds.map(densify)
