"""Padding statistics of a batched dataset: how much of every batch is padding, how many shapes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from keras_fastloop import _validation
from keras_fastloop.data.bucketing import _features_of

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

__all__ = ["PaddingStats", "padding_stats"]


@dataclasses.dataclass(frozen=True)
class PaddingStats:
    """Padding statistics of a batched dataset (one pass).

    Attributes:
        num_batches: int. Batches read.
        num_sequences: int. Sequences (rows) read, summed over batches.
        real_tokens: int. Positions holding real tokens.
        total_tokens: int. Positions in the padded batches (sum of `batch * length`).
        padded_tokens: int. `total_tokens - real_tokens`.
        padding_fraction: float in [0, 1]. `padded_tokens / total_tokens` (0.0 when empty).
        distinct_shapes: tuple of int tuples, sorted. Distinct full shapes of the sequence
            tensor; with `distinct_lengths` the number of compilations a shape-specialising
            (`jit_compile=True`) step needs.
        distinct_lengths: tuple of ints, sorted. Distinct padded lengths (axis 1).
    """

    num_batches: int
    num_sequences: int
    real_tokens: int
    total_tokens: int
    padded_tokens: int
    padding_fraction: float
    distinct_shapes: tuple[tuple[int, ...], ...]
    distinct_lengths: tuple[int, ...]

    @property
    def num_distinct_shapes(self) -> int:
        """Number of distinct full shapes of the sequence tensor."""
        return len(self.distinct_shapes)

    def as_dict(self) -> dict[str, Any]:
        """Returns the statistics as a plain dict (with `num_distinct_shapes`)."""
        out = dataclasses.asdict(self)
        out["num_distinct_shapes"] = self.num_distinct_shapes
        return out


def _default_sequence(batch):
    leaves = [t for t in tf.nest.flatten(_features_of(batch)) if np.ndim(t) >= 2]
    if not leaves:
        raise ValueError(
            "`padding_stats` needs a batched sequence tensor of rank >= 2 ([batch, length, ...]) "
            "in `x` of each batch (the batch itself, `x` of an (x, y[, sample_weight]) tuple, or a "
            "value of a dict). Received: a batch whose tensors have shapes "
            f"{[np.shape(t) for t in tf.nest.flatten(batch)]}"
        )
    return leaves[0]


def padding_stats(
    dataset: tf.data.Dataset | Iterable[Any],
    pad_value: float = 0,
    length_fn: Callable[[Any], ArrayLike] | None = None,
    mask_fn: Callable[[Any], ArrayLike] | None = None,
    sequence_fn: Callable[[Any], ArrayLike] | None = None,
    max_batches: int | None = None,
) -> PaddingStats:
    """Measures the share of padding and the number of distinct batch shapes of a dataset.

    Works on any batched dataset (from `padded_batch`, `bucket_by_length`, a generator, ...).
    Which positions are real is decided by, in order of precedence: `mask_fn`, `length_fn`,
    then `pad_value` (a position is padding when all its features equal `pad_value`; real
    tokens equal to `pad_value` are then counted as padding, so prefer `length_fn`/`mask_fn`
    when the pad id can occur in the data).

    Args:
        dataset: `tf.data.Dataset` (or any iterable) of batches: a tensor, an `(x, y)` or
            `(x, y, sample_weight)` tuple, or a dict. Values may be tensors or NumPy arrays.
        pad_value: scalar, default 0. Padding value of the sequence tensor.
        length_fn: callable or None (default). Maps a batch to its true lengths, shape
            `[batch]`.
        mask_fn: callable or None (default). Maps a batch to a boolean mask of real positions,
            shape `[batch, length]`.
        sequence_fn: callable or None (default). Maps a batch to its sequence tensor
            `[batch, length, ...]`; default: the first tensor of rank >= 2 in `x` (in
            `tf.nest.flatten` order).
        max_batches: positive int or None (default: the whole dataset). Batches to read.

    Returns:
        A `PaddingStats` (tokens are positions along axis 1 of the sequence tensor).

    Raises:
        ValueError: if both `length_fn` and `mask_fn` are given, if `max_batches` is not a
            positive int, or if a batch has no sequence tensor of rank >= 2.

    Example:

    >>> ds = tf.data.Dataset.from_tensor_slices(tf.ragged.constant([[1, 2, 3], [4]]))
    >>> s = padding_stats(ds.map(lambda r: r).padded_batch(2))
    >>> s.padding_fraction   # [[1, 2, 3], [4, 0, 0]]: 2 of 6 positions are padding
    0.3333333333333333
    """
    if length_fn is not None and mask_fn is not None:
        raise ValueError(
            "Pass at most one of `length_fn` and `mask_fn`. "
            f"Received: length_fn={length_fn!r}, mask_fn={mask_fn!r}"
        )
    for name, fn in (("length_fn", length_fn), ("mask_fn", mask_fn), ("sequence_fn", sequence_fn)):
        if fn is not None and not callable(fn):
            raise ValueError(f"`{name}` must be callable or None. Received: {name}={fn!r}")
    max_batches = _validation.check_int(
        "max_batches",
        max_batches,
        minimum=1,
        allow_none=True,
        requirement="a positive integer or None",
    )

    num_batches = num_sequences = real = total = 0
    shapes = set()
    for batch in dataset:
        if max_batches is not None and num_batches >= max_batches:
            break
        seq = np.asarray(sequence_fn(batch) if sequence_fn else _default_sequence(batch))
        if seq.ndim < 2:
            raise ValueError(
                "The sequence tensor must have rank >= 2 ([batch, length, ...]). "
                f"Received: shape={seq.shape}"
            )
        rows, length = int(seq.shape[0]), int(seq.shape[1])
        if mask_fn is not None:
            mask = np.asarray(mask_fn(batch)).astype(bool)
            if mask.shape != (rows, length):
                raise ValueError(
                    f"`mask_fn` must return a mask of shape {(rows, length)} ([batch, length]). "
                    f"Received: shape={mask.shape}"
                )
            n_real = int(mask.sum())
        elif length_fn is not None:
            lengths = np.asarray(length_fn(batch)).reshape(-1)
            if lengths.shape[0] != rows:
                raise ValueError(
                    f"`length_fn` must return one length per sequence ({rows}). "
                    f"Received: shape={lengths.shape}"
                )
            n_real = int(np.minimum(lengths, length).sum())
        else:
            not_pad = seq != pad_value
            if not_pad.ndim > 2:
                not_pad = not_pad.reshape(rows, length, -1).any(axis=-1)
            n_real = int(not_pad.sum())
        num_batches += 1
        num_sequences += rows
        real += n_real
        total += rows * length
        shapes.add(tuple(int(d) for d in seq.shape))
    padded = total - real
    return PaddingStats(
        num_batches=num_batches,
        num_sequences=num_sequences,
        real_tokens=real,
        total_tokens=total,
        padded_tokens=padded,
        padding_fraction=float(padded / total) if total else 0.0,
        distinct_shapes=tuple(sorted(shapes)),
        distinct_lengths=tuple(sorted({s[1] for s in shapes})),
    )
