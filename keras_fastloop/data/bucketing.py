# Over 500 lines on purpose: `bucket_by_length`, its boundaries and `BucketPlan` share the
# inclusive-boundary convention and the argument checks; half the file is their docstrings.
"""Length bucketing for variable-length sequences, on top of tf.data's `bucket_by_sequence_length`.

A bucket boundary is the *inclusive* maximum length of its bucket, and with
`pad_to_bucket_boundary=True` every batch of the bucket is padded to exactly that boundary: with
`bucket_boundaries=[16, 32]` lengths 0..16 are padded to 16 and lengths 17..32 to 32 (tf.data's
own boundaries are exclusive). Sequences longer than the last boundary get an extra bucket
ending at the longest length found (`on_overflow="extend"`) or raise a `ValueError` when the
dataset is built (`on_overflow="error"`).

Without `bucket_boundaries`, boundaries are the token-weighted quantiles of the scanned lengths
(`quantile_boundaries`, 16 buckets). When the build-time scan read the whole dataset, the number
of batches is declared, so `fit` and `evaluate` know the epoch length. Measurements and the
mapping onto tf.data: `docs/design.md`, section "Length bucketing".
"""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from keras_fastloop import _tf_internals as tf_internals
from keras_fastloop import _validation
from keras_fastloop._warnings import FastloopWarning

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

__all__ = [
    "BucketPlan",
    "apply_bucket_plan",
    "bucket_by_length",
    "geometric_boundaries",
    "plan_buckets",
    "quantile_boundaries",
    "token_budget_batch_sizes",
]

_DEFAULT_NUM_BUCKETS = 16
_DEFAULT_NUM_BOUNDARY_SAMPLES = 100_000
_SCAN_BATCH = 8192


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """The resolved bucketing of a dataset: boundaries, batch sizes and the longest length seen.

    Attributes:
        bucket_boundaries: tuple of ints. Inclusive maximum length of each bucket (tokens); with
            `pad_to_bucket_boundary=True` also the padded length of the bucket's batches.
        bucket_batch_sizes: tuple of ints, one per bucket: the number of sequences per batch.
        max_length: int or None. Longest length found by the build-time scan (or the
            user-given `max_length`); None if no scan was needed and none was given.
        scanned_all: bool. True when the build-time scan read the whole dataset, so that no
            sequence can exceed the last boundary at run time.
        extended: bool. True when a bucket was appended because sequences were longer than the
            largest given or chosen boundary.
        bucket_counts: tuple of ints (sequences per bucket) or None. Known when the scan read
            the whole dataset (`scanned_all`); None otherwise.
    """

    bucket_boundaries: tuple[int, ...]
    bucket_batch_sizes: tuple[int, ...]
    max_length: int | None = None
    scanned_all: bool = False
    extended: bool = False
    bucket_counts: tuple[int, ...] | None = None

    @property
    def num_buckets(self) -> int:
        """Number of buckets (and, with padding to boundaries, the bound on distinct shapes)."""
        return len(self.bucket_boundaries)

    def num_batches(self, drop_remainder: bool = False) -> int | None:
        """Batches per pass over the scanned dataset, or None when `bucket_counts` is unknown.

        `sum_b ceil(n_b / batch_b)`, or `sum_b floor(n_b / batch_b)` with `drop_remainder`,
        where `n_b` is the number of sequences of bucket `b` and `batch_b` its batch size.

        Args:
            drop_remainder: bool, default False. Whether each bucket's last, smaller batch is
                dropped.

        Returns:
            int or None.

        Example:

        >>> BucketPlan((16, 32), (8, 4), bucket_counts=(10, 9)).num_batches()   # 2 + 3
        5
        """
        if self.bucket_counts is None:
            return None
        if drop_remainder:
            return sum(n // b for n, b in zip(self.bucket_counts, self.bucket_batch_sizes))
        return sum(-(-n // b) for n, b in zip(self.bucket_counts, self.bucket_batch_sizes))


# --------------------------------------------------------------------------------------------
# Argument checks (Keras style: what must hold, then `Received: name=value`).
# --------------------------------------------------------------------------------------------


_is_int = _validation.is_int


def _check_positive_int(name, value, allow_none=True):
    _validation.check_int(
        name, value, minimum=1, allow_none=allow_none, requirement="a positive integer"
    )


def _element_length_func(element_length_func):
    """`element_length_func`, checked: a callable or `None`."""
    if element_length_func is not None and not callable(element_length_func):
        _validation.fail("element_length_func", "callable or None", element_length_func)
    return element_length_func


def _check_boundaries(bucket_boundaries):
    name = "bucket_boundaries"
    if isinstance(bucket_boundaries, (str, bytes, Mapping)) or not isinstance(
        bucket_boundaries, (Sequence, np.ndarray)
    ):
        raise ValueError(
            f"`{name}` must be a non-empty list of positive integers. "
            f"Received: {name}={bucket_boundaries!r}"
        )
    values = (
        list(np.asarray(bucket_boundaries).tolist())
        if isinstance(bucket_boundaries, np.ndarray)
        else list(bucket_boundaries)
    )
    if not values:
        raise ValueError(
            f"`{name}` must be a non-empty list of positive integers. Received: {name}={values!r}"
        )
    if not all(_is_int(b) for b in values):
        raise ValueError(f"`{name}` must contain only integers. Received: {name}={values!r}")
    if any(b <= 0 for b in values):
        raise ValueError(
            f"`{name}` must contain only positive integers. Received: {name}={values!r}"
        )
    if any(b2 <= b1 for b1, b2 in zip(values, values[1:])):
        raise ValueError(
            f"`{name}` must be sorted in strictly increasing order (no duplicates). "
            f"Received: {name}={values!r}"
        )
    return tuple(int(b) for b in values)


def _check_batching(batch_size, tokens_per_batch):
    if (batch_size is None) == (tokens_per_batch is None):
        raise ValueError(
            "Exactly one of `batch_size` and `tokens_per_batch` must be given. "
            f"Received: batch_size={batch_size!r}, tokens_per_batch={tokens_per_batch!r}"
        )
    _check_positive_int("batch_size", batch_size)
    _check_positive_int("tokens_per_batch", tokens_per_batch)


def _check_on_overflow(on_overflow):
    if on_overflow not in ("extend", "error"):
        raise ValueError(
            f'`on_overflow` must be "extend" or "error". Received: on_overflow={on_overflow!r}'
        )


# --------------------------------------------------------------------------------------------
# Pure helpers.
# --------------------------------------------------------------------------------------------


def quantile_boundaries(
    lengths: ArrayLike, num_buckets: int = _DEFAULT_NUM_BUCKETS, weighting: str = "tokens"
) -> tuple[int, ...]:
    """Chooses bucket boundaries at the quantiles of a sample of sequence lengths.

    With `weighting="tokens"` (default) each length counts with its number of tokens:
    boundary `i` (1-based) is the smallest length `l` such that sequences of length `<= l`
    hold at least `i / num_buckets` of all tokens. Every bucket then carries about the same
    share of the tokens, so boundaries are dense among long sequences, where padding to a
    boundary wastes the most tokens. With `weighting="sequences"` each sequence counts once
    (the `i / num_buckets` quantile of the lengths, NumPy's `method="inverted_cdf"`); on
    skewed length distributions this leaves few, wide buckets in the long tail. Either way
    every boundary is a length that occurs, duplicates are merged (fewer than `num_buckets`
    boundaries come back when many lengths are equal), boundaries are at least 1 and the last
    one is always `max(lengths)`. Exact integer arithmetic (no rounding).

    Args:
        lengths: 1-D array-like of non-negative ints. Sequence lengths in tokens.
        num_buckets: positive int, default 16. Number of buckets wanted.
        weighting: `"tokens"` (default) or `"sequences"`. What each quantile counts.

    Returns:
        Tuple of strictly increasing positive ints (inclusive bucket maxima).

    Raises:
        ValueError: if `lengths` is empty or negative, `num_buckets` is not a positive int, or
            `weighting` is neither `"tokens"` nor `"sequences"`.

    Example:

    >>> quantile_boundaries(np.arange(1, 201), num_buckets=4, weighting="sequences")
    (50, 100, 150, 200)
    >>> quantile_boundaries(np.arange(1, 201), num_buckets=4)   # tokens: 1+...+100 >= 20100/4
    (100, 142, 174, 200)
    """
    _check_positive_int("num_buckets", num_buckets, allow_none=False)
    if weighting not in ("tokens", "sequences"):
        raise ValueError(
            f'`weighting` must be "tokens" or "sequences". Received: weighting={weighting!r}'
        )
    lengths = np.asarray(lengths).reshape(-1)
    if lengths.size == 0:
        raise ValueError(
            "`lengths` must hold at least one sequence length. Received: lengths of size 0"
        )
    if np.any(lengths < 0):
        raise ValueError(
            f"`lengths` must be non-negative. Received: min(lengths)={int(lengths.min())}"
        )
    ordered = np.sort(lengths.astype(np.int64))
    weights = ordered if weighting == "tokens" else np.ones_like(ordered)
    cumulative = np.cumsum(weights)
    total = int(cumulative[-1])
    if total == 0:  # only empty sequences
        return (1,)
    # Boundary i: first position whose cumulative weight reaches i/n of the total, i.e.
    # cumulative * n >= i * total (integers, so no rounding decides a boundary).
    targets = np.arange(1, num_buckets + 1, dtype=np.int64) * total
    positions = np.searchsorted(cumulative * num_buckets, targets, side="left")
    bounds = ordered[np.minimum(positions, ordered.size - 1)]
    bounds = np.unique(np.maximum(bounds, 1))
    return tuple(int(b) for b in bounds)


def geometric_boundaries(
    max_length: int, first: int = 16, ratio: float = 1.2, multiple: int = 8
) -> tuple[int, ...]:
    """Boundaries growing by a constant ratio: `first * ratio**k` rounded up, then `max_length`.

    Every value `first * ratio**k` below `max_length` is rounded up to a multiple of
    `multiple` (duplicates merged); `max_length` is appended as the last boundary. A sequence
    longer than `first` is then padded by less than about `ratio - 1` of its length (plus the
    rounding), whatever the length distribution, with a number of buckets logarithmic in
    `max_length` (18 for 497 with the defaults). The same idea as Tensor2Tensor's length
    buckets (Vaswani et al., "Tensor2Tensor for Neural Machine Translation", 2018). Needs no
    data, unlike `quantile_boundaries`; use it when the lengths are not known in advance.

    Args:
        max_length: positive int. Longest sequence length (tokens); the last boundary.
        first: positive int, default 16. The first (smallest) boundary before rounding.
        ratio: float > 1, default 1.2. Growth factor between consecutive boundaries.
        multiple: positive int, default 8. Boundaries below `max_length` are rounded up to a
            multiple of this (tensor-core and vector friendly shapes); 1 disables rounding.

    Returns:
        Tuple of strictly increasing positive ints ending with `max_length`.

    Raises:
        ValueError: if `max_length`, `first` or `multiple` is not a positive int or `ratio`
            is not a finite number > 1.

    Example:

    >>> geometric_boundaries(40)   # 16, 19.2 -> 24, 23.04 -> 24, 27.6 -> 32, 33.2 -> 40
    (16, 24, 32, 40)
    """
    _check_positive_int("max_length", max_length, allow_none=False)
    _check_positive_int("first", first, allow_none=False)
    _check_positive_int("multiple", multiple, allow_none=False)
    if (
        isinstance(ratio, bool)
        or not isinstance(ratio, numbers.Real)
        or not np.isfinite(ratio)
        or ratio <= 1
    ):
        raise ValueError(f"`ratio` must be a finite number > 1. Received: ratio={ratio!r}")
    bounds, value = set(), float(first)
    while value < max_length:
        bounds.add(int(np.ceil(value / multiple) * multiple))
        value *= ratio
    return tuple(sorted(b for b in bounds if b < max_length)) + (int(max_length),)


def token_budget_batch_sizes(
    bucket_boundaries: Sequence[int] | np.ndarray, tokens_per_batch: int
) -> tuple[int, ...]:
    """Batch size per bucket so that a padded batch holds at most `tokens_per_batch` tokens.

    `batch_size_i = max(1, tokens_per_batch // bucket_boundaries[i])`: long buckets get small
    batches, short buckets big ones. A bucket whose boundary exceeds the budget gets batch size
    1 (and then exceeds the budget; a warning says so).

    Args:
        bucket_boundaries: list of strictly increasing positive ints. Inclusive bucket maxima.
        tokens_per_batch: positive int. Token budget per padded batch (batch * padded length).

    Returns:
        Tuple of positive ints, one per boundary.

    Raises:
        ValueError: on invalid boundaries or a non-positive budget.

    Example:

    >>> token_budget_batch_sizes([16, 32, 64], tokens_per_batch=128)
    (8, 4, 2)
    """
    bounds = _check_boundaries(bucket_boundaries)
    _check_positive_int("tokens_per_batch", tokens_per_batch, allow_none=False)
    sizes = tuple(max(1, tokens_per_batch // b) for b in bounds)
    over = [b for b in bounds if b > tokens_per_batch]
    if over:
        warnings.warn(
            f"Buckets with boundaries {over} are longer than tokens_per_batch={tokens_per_batch}; "
            "they get batch size 1 and exceed the token budget.",
            FastloopWarning,
            stacklevel=2,
        )
    return sizes


# --------------------------------------------------------------------------------------------
# Element structure.
# --------------------------------------------------------------------------------------------


def _features_of(element):
    """`x` of an element: the element itself, or the first entry of an (x, y[, w]) tuple."""
    if isinstance(element, tuple) and 1 <= len(element) <= 3:
        return element[0]
    return element


def _sequence_index(element_spec):
    """Index (in `tf.nest.flatten` order of `x`) of the leaf whose first axis is the length."""
    x_spec = _features_of(element_spec)
    leaves = tf.nest.flatten(x_spec)
    ranked = [
        i
        for i, s in enumerate(leaves)
        if hasattr(s, "shape") and s.shape.rank is not None and s.shape.rank >= 1
    ]
    variable = [i for i in ranked if leaves[i].shape[0] is None]
    if variable:
        return variable[0]
    if ranked:
        return ranked[0]
    raise ValueError(
        "The dataset's elements must contain a sequence (a tensor of rank >= 1 whose first "
        "axis is the length), either as the element itself, as `x` of an (x, y) or "
        "(x, y, sample_weight) tuple, or as a value of a dict. "
        f"Received: element_spec={element_spec}"
    )


def _default_length_fn(element_spec):
    index = _sequence_index(element_spec)

    def length_fn(element):
        return tf.shape(tf.nest.flatten(_features_of(element))[index])[0]

    return length_fn


def _pack_args(args):
    # tf.data unpacks tuple elements into positional arguments.
    return args[0] if len(args) == 1 else tuple(args)


# Dataset classes (tf.data's own, by name) whose elements are batches.
_BATCHING_DATASETS = {
    "_BatchDataset": "batch",
    "_ParallelBatchDataset": "batch",
    "_PaddedBatchDataset": "padded_batch",
    "_GroupByWindowDataset": "bucket_by_sequence_length / group_by_window",
    "_RebatchDataset": "rebatch",
}
# Transformations after which elements need not be batches any more.
_UNBATCHING_DATASETS = {"_UnbatchDataset", "_FlatMapDataset", "_InterleaveDataset"}


def _batching_transformation(dataset):
    """Name of the batching transformation that produced `dataset`'s elements, or None.

    Follows each dataset's first input back to the source (tf.data's `_inputs()`), stopping
    at an `unbatch`/`flat_map`/`interleave`. Returns None when the chain cannot be read.
    """
    try:
        for _ in range(1000):
            name = type(dataset).__name__
            if name in _UNBATCHING_DATASETS:
                return None
            if name in _BATCHING_DATASETS:
                return _BATCHING_DATASETS[name]
            inputs = tf_internals.dataset_inputs(dataset)
            if not inputs:
                return None
            dataset = inputs[0]
    except Exception:  # a dataset type without `_inputs`: cannot tell
        return None
    return None


def _check_not_batched(dataset):
    batching = _batching_transformation(dataset)
    if batching is not None:
        raise ValueError(
            "`dataset` must hold single sequences, not batches: bucket_by_length makes the "
            f"batches itself. This dataset was already batched by `{batching}`, so bucketing "
            "it would stack whole batches into rank-3 tensors. Remove that call or apply "
            f"`.unbatch()` first. Received: dataset with element_spec={dataset.element_spec}"
        )


def _densify_ragged(dataset):
    """Turns ragged leaves (e.g. from `from_tensor_slices(ragged)`) into dense tensors."""
    specs = tf.nest.flatten(dataset.element_spec)
    if not any(isinstance(s, tf.RaggedTensorSpec) for s in specs):
        return dataset

    def to_dense(*args):
        element = _pack_args(args)
        return tf.nest.map_structure(
            lambda t: t.to_tensor() if isinstance(t, tf.RaggedTensor) else t, element
        )

    return dataset.map(to_dense, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _scan_lengths(dataset, length_fn, limit):
    """Reads the lengths of the first `limit` elements. Returns (lengths, read_whole_dataset)."""

    def length_of(*args):
        return tf.cast(length_fn(_pack_args(args)), tf.int64)

    lengths_ds = (
        dataset.take(limit + 1)
        .map(length_of, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        .batch(_SCAN_BATCH)
    )
    chunks = [np.asarray(chunk).reshape(-1) for chunk in lengths_ds.as_numpy_iterator()]
    lengths = np.concatenate(chunks) if chunks else np.zeros([0], np.int64)
    complete = lengths.size <= limit
    return lengths[:limit], complete


# --------------------------------------------------------------------------------------------
# Public API.
# --------------------------------------------------------------------------------------------


def plan_buckets(
    dataset: tf.data.Dataset,
    bucket_boundaries: Sequence[int] | np.ndarray | None = None,
    batch_size: int | None = None,
    tokens_per_batch: int | None = None,
    element_length_func: Callable[[Any], tf.Tensor | int] | None = None,
    num_buckets: int | None = None,
    num_boundary_samples: int = _DEFAULT_NUM_BOUNDARY_SAMPLES,
    max_length: int | None = None,
    on_overflow: str = "extend",
) -> BucketPlan:
    """Resolves bucket boundaries and per-bucket batch sizes for a dataset, without batching.

    Same arguments as `bucket_by_length` (see there). The lengths of up to
    `num_boundary_samples` leading elements are read when boundaries must be chosen or when
    `max_length` is not given (to check the longest sequence against the last boundary).

    Returns:
        A `BucketPlan`.

    Raises:
        ValueError: on invalid arguments, on an empty dataset, or (with `on_overflow="error"`)
            when a sequence is longer than the largest boundary.

    Example:

    >>> ds = tf.data.Dataset.range(1, 101).map(lambda n: tf.ones([n], tf.int32))
    >>> plan_buckets(ds, batch_size=8, num_buckets=2).bucket_boundaries  # half the tokens each
    (71, 100)
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(
            f"`dataset` must be a `tf.data.Dataset`. Received: dataset={type(dataset).__name__}"
        )
    _check_batching(batch_size, tokens_per_batch)
    _check_on_overflow(on_overflow)
    _check_positive_int("num_boundary_samples", num_boundary_samples, allow_none=False)
    _check_positive_int("max_length", max_length)
    length_fn = _element_length_func(element_length_func)
    if bucket_boundaries is not None:
        bounds = _check_boundaries(bucket_boundaries)
        if num_buckets is not None:
            raise ValueError(
                "`num_buckets` is only used to choose boundaries automatically; pass either "
                "`bucket_boundaries` or `num_buckets`, not both. "
                f"Received: bucket_boundaries={list(bounds)}, num_buckets={num_buckets!r}"
            )
    else:
        bounds = None
        _check_positive_int("num_buckets", num_buckets)
    if tf.data.experimental.INFINITE_CARDINALITY == int(dataset.cardinality()) and (
        max_length is None
    ):
        warnings.warn(
            "The dataset is infinite and `max_length` was not given: the longest sequence is "
            f"estimated from the first {num_boundary_samples} elements; a longer one raises an "
            "InvalidArgumentError at run time. Pass `max_length` to make the bound explicit.",
            FastloopWarning,
            stacklevel=3,
        )

    _check_not_batched(dataset)
    dataset = _densify_ragged(dataset)
    length_fn = length_fn or _default_length_fn(dataset.element_spec)

    need_scan = bounds is None or max_length is None
    scanned_all = False
    lengths = None
    if need_scan:
        lengths, scanned_all = _scan_lengths(dataset, length_fn, num_boundary_samples)
        if lengths.size == 0:
            raise ValueError("`dataset` must not be empty. Received: a dataset with 0 elements")
        if np.any(lengths < 0):
            raise ValueError(
                f"`element_length_func` must return non-negative lengths. Received: a length of "
                f"{int(lengths.min())}"
            )
        longest = int(lengths.max())
        if max_length is not None:
            if longest > max_length:
                raise ValueError(
                    f"A sequence of length {longest} is longer than `max_length`. "
                    f"Received: max_length={max_length}"
                )
            longest = max_length
        if bounds is None:
            bounds = quantile_boundaries(lengths, num_buckets or _DEFAULT_NUM_BUCKETS)
    else:
        longest = max_length

    extended = False
    if longest is not None and longest > bounds[-1]:
        if on_overflow == "error":
            raise ValueError(
                "Every sequence must fit in the last bucket: the largest value of "
                f"`bucket_boundaries` must be >= the longest sequence ({longest} tokens). "
                'Add a larger boundary or pass on_overflow="extend". '
                f"Received: bucket_boundaries={list(bounds)}"
            )
        bounds = bounds + (int(longest),)
        extended = True

    if tokens_per_batch is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sizes = token_budget_batch_sizes(bounds, tokens_per_batch)
        over = [b for b in bounds if b > tokens_per_batch]
        if over:
            warnings.warn(
                f"Buckets with boundaries {over} are longer than "
                f"tokens_per_batch={tokens_per_batch}; they get batch size 1 and exceed the "
                "token budget.",
                FastloopWarning,
                stacklevel=3,
            )
    else:
        sizes = tuple(batch_size for _ in bounds)
    counts = None
    if scanned_all:
        # Bucket of a length L: the first boundary >= L (inclusive maxima).
        index = np.searchsorted(np.asarray(bounds), lengths, side="left")
        counts = tuple(int(c) for c in np.bincount(index, minlength=len(bounds)))
    return BucketPlan(
        bucket_boundaries=tuple(bounds),
        bucket_batch_sizes=tuple(sizes),
        max_length=None if longest is None else int(longest),
        scanned_all=bool(scanned_all),
        extended=extended,
        bucket_counts=counts,
    )


def bucket_by_length(
    dataset: tf.data.Dataset,
    bucket_boundaries: Sequence[int] | np.ndarray | None = None,
    batch_size: int | None = None,
    tokens_per_batch: int | None = None,
    element_length_func: Callable[[Any], tf.Tensor | int] | None = None,
    pad_to_bucket_boundary: bool = True,
    padding_values: Any = None,
    drop_remainder: bool = False,
    shuffle_buffer: int | None = None,
    seed: int | None = None,
    num_buckets: int | None = None,
    num_boundary_samples: int = _DEFAULT_NUM_BOUNDARY_SAMPLES,
    max_length: int | None = None,
    on_overflow: str = "extend",
    prefetch: bool = True,
) -> tf.data.Dataset:
    """Groups sequences of similar length into padded batches (`bucket_by_sequence_length`).

    How it behaves in detail: docs/behaviour.md#bucket_by_length.

    Args:
        dataset: `tf.data.Dataset` of unbatched elements: a sequence tensor, an `(x, y)` or
            `(x, y, sample_weight)` tuple, or a dict; the sequence's first axis is its length.
        bucket_boundaries: list of strictly increasing positive ints, or None (default): chosen
            at the token-weighted quantiles of the lengths of the first `num_boundary_samples`
            elements (see `quantile_boundaries`; ~10 % padding on `load_stdlib_code()`), or
            pass `geometric_boundaries(max_length)`.
        batch_size: positive int or None (default). Sequences per batch, the same in every
            bucket. Exactly one of `batch_size` and `tokens_per_batch` must be given.
        tokens_per_batch: positive int or None (default). Token budget per padded batch; bucket
            `i` gets `max(1, tokens_per_batch // bucket_boundaries[i])` sequences.
        element_length_func: callable or None (default). Maps one element (the whole element,
            tuple or dict) to its length as a scalar int tensor, as in tf.data's
            `bucket_by_sequence_length`. Default: the first-axis length of the first tensor in
            `x` (in `tf.nest.flatten` order) whose first axis is variable.
        pad_to_bucket_boundary: bool, default True. Pad every variable axis to the bucket
            boundary (bounded number of shapes); if False, pad to the longest in each batch.
        padding_values: scalar, nested structure matching the elements, or None (default:
            0 of each dtype). A scalar is cast to every component's dtype.
        drop_remainder: bool, default False. Drop the last, smaller batch of each bucket.
        shuffle_buffer: positive int or None (default). Shuffle the unbatched elements with this
            buffer before bucketing (reshuffled every epoch).
        seed: int or None (default). Shuffle seed; the same seed gives the same order.
        num_buckets: positive int or None (default: 16 when boundaries are chosen
            automatically). Only valid without `bucket_boundaries`. Fewer buckets mean fewer
            distinct shapes (at most `2 * num_buckets` without `drop_remainder`) but more
            padding.
        num_boundary_samples: positive int, default 100000. How many leading elements are read
            at build time to choose boundaries and find the longest sequence. When the dataset
            has at most this many elements, overflow is ruled out at build time.
        max_length: positive int or None (default). Known maximum length (skips the scan).
        on_overflow: `"extend"` (default) or `"error"`. What to do at build time when the
            longest sequence exceeds the largest boundary: append a bucket ending at that length,
            or raise `ValueError`.
        prefetch: bool, default True. Append `prefetch(tf.data.AUTOTUNE)`.

    Returns:
        A `tf.data.Dataset` of padded batches with the same structure as the elements (a
        leading batch axis; variable axes padded), of known cardinality when the build-time
        scan read the whole dataset.

    Raises:
        ValueError: on invalid arguments (unsorted, empty or non-positive boundaries; both or
            neither of `batch_size`/`tokens_per_batch`; ...), on an empty dataset, on an
            already batched dataset (`batch`, `padded_batch`, `bucket_by_length`, ...: it
            would make rank-3 batches), or with `on_overflow="error"` when a sequence is
            longer than the largest boundary.

    Example:

    >>> ds = tf.data.Dataset.range(1, 41).map(lambda n: tf.ones([n], tf.int32))
    >>> batches = bucket_by_length(ds, bucket_boundaries=[16, 32], batch_size=8)
    >>> sorted({b.shape[1] for b in batches})   # 33..40 went to an extra bucket ending at 40
    [16, 32, 40]
    """
    if not isinstance(pad_to_bucket_boundary, bool):
        raise ValueError(
            "`pad_to_bucket_boundary` must be a bool. "
            f"Received: pad_to_bucket_boundary={pad_to_bucket_boundary!r}"
        )
    if not isinstance(drop_remainder, bool):
        raise ValueError(
            f"`drop_remainder` must be a bool. Received: drop_remainder={drop_remainder!r}"
        )
    if not isinstance(prefetch, bool):
        raise ValueError(f"`prefetch` must be a bool. Received: prefetch={prefetch!r}")
    _check_positive_int("shuffle_buffer", shuffle_buffer)
    if seed is not None and not _is_int(seed):
        raise ValueError(f"`seed` must be an integer or None. Received: seed={seed!r}")

    plan = plan_buckets(
        dataset,
        bucket_boundaries=bucket_boundaries,
        batch_size=batch_size,
        tokens_per_batch=tokens_per_batch,
        element_length_func=_element_length_func(element_length_func),
        num_buckets=num_buckets,
        num_boundary_samples=num_boundary_samples,
        max_length=max_length,
        on_overflow=on_overflow,
    )
    return apply_bucket_plan(
        dataset,
        plan,
        element_length_func=_element_length_func(element_length_func),
        pad_to_bucket_boundary=pad_to_bucket_boundary,
        padding_values=padding_values,
        drop_remainder=drop_remainder,
        shuffle_buffer=shuffle_buffer,
        seed=seed,
        prefetch=prefetch,
    )


def apply_bucket_plan(
    dataset: tf.data.Dataset,
    plan: BucketPlan,
    element_length_func: Callable[[Any], tf.Tensor | int] | None = None,
    pad_to_bucket_boundary: bool = True,
    padding_values: Any = None,
    drop_remainder: bool = False,
    shuffle_buffer: int | None = None,
    seed: int | None = None,
    prefetch: bool = True,
) -> tf.data.Dataset:
    """Batches a dataset according to a `BucketPlan` (the second half of `bucket_by_length`).

    Args: as in `bucket_by_length`; `plan` is a `BucketPlan` from `plan_buckets`.

    Returns:
        A `tf.data.Dataset` of padded batches.

    Raises:
        ValueError: if `plan` is not a `BucketPlan`.

    Example:

    >>> ds = tf.data.Dataset.range(1, 33).map(lambda n: tf.ones([n], tf.int32))
    >>> plan = plan_buckets(ds, bucket_boundaries=[16, 32], batch_size=8)
    >>> sorted(batch.shape[1] for batch in apply_bucket_plan(ds, plan))  # padded lengths
    [16, 16, 32, 32]
    """
    if not isinstance(plan, BucketPlan):
        raise ValueError(f"`plan` must be a `BucketPlan`. Received: plan={plan!r}")
    _check_positive_int("shuffle_buffer", shuffle_buffer)
    _check_not_batched(dataset)
    dataset = _densify_ragged(dataset)
    length_fn = _element_length_func(element_length_func)
    length_fn = length_fn or _default_length_fn(dataset.element_spec)
    bounds = plan.bucket_boundaries
    last = int(bounds[-1])

    def guarded_length(*args):
        length = tf.cast(length_fn(_pack_args(args)), tf.int32)
        check = tf.debugging.assert_less_equal(
            length,
            tf.constant(last, tf.int32),
            message=(
                f"bucket_by_length: a sequence is longer than the largest bucket boundary "
                f"({last}); it was not among the elements scanned when the dataset was built. "
                "Pass `max_length` or a larger last value in `bucket_boundaries`."
            ),
        )
        with tf.control_dependencies([check]):
            return tf.identity(length)

    if padding_values is not None and not tf.nest.is_nested(padding_values):
        value = padding_values
        padding_values = tf.nest.map_structure(
            lambda spec: tf.constant(value, dtype=spec.dtype), dataset.element_spec
        )

    if shuffle_buffer is not None:
        dataset = dataset.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    # tf.data buckets are [b_{i-1}, b_i) and pad to b_i - 1: shift by one to get inclusive maxima.
    # Its last, open-ended bucket is never reached (the plan covers the longest sequence, and the
    # guard above names the problem if the data changed); it gets batch size 1.
    num_sequences = int(dataset.cardinality())
    num_batches = plan.num_batches(drop_remainder)
    if plan.bucket_counts is not None and num_sequences >= 0:
        if num_sequences != sum(plan.bucket_counts):  # planned on another dataset
            num_batches = None
    dataset = dataset.bucket_by_sequence_length(
        element_length_func=guarded_length,
        bucket_boundaries=[b + 1 for b in bounds],
        bucket_batch_sizes=list(plan.bucket_batch_sizes) + [1],
        padding_values=padding_values,
        pad_to_bucket_boundary=pad_to_bucket_boundary,
        drop_remainder=drop_remainder,
    )
    if num_batches is not None:
        # The scan read every element, so the number of batches is known: declare it, or
        # Keras treats the dataset as of unknown length (an extra, empty step per epoch).
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(num_batches))
    if prefetch:
        dataset = dataset.prefetch(tf.data.AUTOTUNE)
    return dataset
