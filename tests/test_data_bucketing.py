"""Tests for keras_fastloop.data.bucketing and keras_fastloop.data.stats."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_fastloop.data.bucketing import (
    BucketPlan,
    apply_bucket_plan,
    bucket_by_length,
    geometric_boundaries,
    plan_buckets,
    quantile_boundaries,
    token_budget_batch_sizes,
)
from keras_fastloop.data.stats import PaddingStats, padding_stats

C15_BOUNDARIES = [16, 32, 64, 128, 256]
C15_TOTAL_TOKENS = 200 * 201 // 2  # lengths 1..200


def _c15_sequences(seed=0):
    """200 sequences with the distinct lengths 1..200, in a shuffled order; no token is 0."""
    lengths = np.random.default_rng(seed).permutation(np.arange(1, 201))
    return [(np.arange(n) % 63 + 1).astype(np.int32) for n in lengths]


def _c15_dataset(seed=0, labels=True):
    seqs = _c15_sequences(seed)

    def gen():
        for s in seqs:
            yield (s, np.int32(len(s) % 2)) if labels else s

    if labels:
        sig = (tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int32))
    else:
        sig = tf.TensorSpec([None], tf.int32)
    return tf.data.Dataset.from_generator(gen, output_signature=sig), seqs


def _strip(batch_x):
    """Rows of a padded batch without their trailing zeros, as tuples."""
    return [tuple(int(v) for v in row[row != 0]) for row in np.asarray(batch_x)]


# ------------------------------------------------------------------------------------------
# bounded shapes, no token lost, overflow handled at build time.
# ------------------------------------------------------------------------------------------


def test_c15_at_most_five_padded_shapes_and_no_token_lost():
    ds, seqs = _c15_dataset()
    batches = list(bucket_by_length(ds, bucket_boundaries=C15_BOUNDARIES, batch_size=8))
    lengths = {int(x.shape[1]) for x, _ in batches}
    assert lengths == set(C15_BOUNDARIES)  # padded exactly to the (inclusive) boundaries
    assert len({tuple(x.shape) for x, _ in batches}) <= 5
    for x, _ in batches:  # each batch is padded to the smallest boundary holding its longest row
        longest = int(np.max(np.sum(np.asarray(x) != 0, axis=1)))
        assert x.shape[1] == min(b for b in C15_BOUNDARIES if b >= longest)
    # No token dropped or truncated: the multiset of sequences comes back unchanged.
    got = sorted(row for x, _ in batches for row in _strip(x))
    assert got == sorted(tuple(int(v) for v in s) for s in seqs)
    assert sum(int(np.count_nonzero(x)) for x, _ in batches) == C15_TOTAL_TOKENS
    # Labels travel with their sequence.
    for x, y in batches:
        np.testing.assert_array_equal(np.count_nonzero(np.asarray(x), axis=1) % 2, y)


def test_c15_tf_semantics_are_exclusive_and_shifted_by_one():
    """Documents why the module shifts boundaries: tf.data pads to `boundary - 1`."""
    ds, _ = _c15_dataset(labels=False)
    raw = ds.bucket_by_sequence_length(
        lambda x: tf.shape(x)[0],
        bucket_boundaries=C15_BOUNDARIES,
        bucket_batch_sizes=[8] * 6,
        pad_to_bucket_boundary=True,
    )
    assert {int(x.shape[1]) for x in raw} == {15, 31, 63, 127, 255}
    ours = bucket_by_length(ds, bucket_boundaries=C15_BOUNDARIES, batch_size=8)
    assert {int(x.shape[1]) for x in ours} == {16, 32, 64, 128, 256}


@keras.saving.register_keras_serializable(package="keras_fastloop_tests")
class CountingModel(keras.Model):
    """Counts train_step traces (Python int) and, at run time, tokens and padded lengths."""

    def __init__(self, max_len=256, **kwargs):
        super().__init__(**kwargs)
        self.emb = keras.layers.Embedding(64, 4, mask_zero=True)
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.head = keras.layers.Dense(2)
        self.trace_count = 0
        self.tokens_seen = self.add_weight(
            shape=(), dtype="int32", initializer="zeros", trainable=False, name="tokens_seen"
        )
        self.length_hist = self.add_weight(
            shape=(max_len + 1,), dtype="int32", initializer="zeros", trainable=False, name="hist"
        )

    def call(self, x):
        return self.head(self.pool(self.emb(x)))

    def train_step(self, data):
        self.trace_count += 1  # runs once per trace, never per step
        x, _ = data
        self.tokens_seen.assign_add(tf.reduce_sum(tf.cast(tf.not_equal(x, 0), "int32")))
        self.length_hist.assign(tf.tensor_scatter_nd_add(self.length_hist, [[tf.shape(x)[1]]], [1]))
        return super().train_step(data)


def _compiled_counting_model(jit_compile):
    model = CountingModel()
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


def test_c15_fit_traces_bounded_and_sees_every_token():
    ds, _ = _c15_dataset()
    train = bucket_by_length(ds, bucket_boundaries=C15_BOUNDARIES, batch_size=8)
    model = _compiled_counting_model(jit_compile=False)
    history = model.fit(train, epochs=2, verbose=0, shuffle=False)
    assert np.all(np.isfinite(history.history["loss"]))
    assert 1 <= model.trace_count <= 5
    assert int(model.tokens_seen.numpy()) == 2 * C15_TOTAL_TOKENS
    seen_lengths = set(np.flatnonzero(model.length_hist.numpy()).tolist())
    assert seen_lengths == set(C15_BOUNDARIES)
    # 25 batches per epoch: 2 + 2 + 4 + 8 + 9.
    assert int(model.length_hist.numpy().sum()) == 2 * 25


def test_c15_jit_compile_shape_bound():
    """With jit_compile=True, XLA compiles once per distinct input shape: bounded by buckets.

    Keras' own train function relaxes shapes to [None, None] (one trace), and XLA then compiles
    per concrete shape at run time, which is invisible from Python; a tf.function without
    `reduce_retracing` traces exactly once per concrete shape, so its tracing count is the number
    of XLA compilations.
    """
    ds, _ = _c15_dataset()
    train = bucket_by_length(ds, bucket_boundaries=C15_BOUNDARIES, batch_size=8)
    inp = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(64, 4, mask_zero=True)(inp)
    out = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(inp, out)  # a plain keras.Model
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    model.optimizer.build(model.trainable_variables)
    before = [v.numpy().copy() for v in model.trainable_variables]
    step = tf.function(model.train_step, jit_compile=True)
    shapes = set()
    for batch in train:
        logs = step(batch)
        shapes.add(tuple(batch[0].shape))
    assert np.isfinite(float(logs["loss"]))
    assert any(not np.allclose(a, v.numpy()) for a, v in zip(before, model.trainable_variables))
    assert step.experimental_get_tracing_count() == len(shapes) == 5 == len(C15_BOUNDARIES)
    # The baseline bucketing fixes: padding to the longest sequence of each batch gives a new
    # shape (a new trace / XLA compilation) almost every batch. Traced without XLA and on 8
    # batches only, to keep the test fast; the tracing count is the same.
    baseline = tf.function(model.train_step)
    for batch in ds.padded_batch(8).take(8):
        baseline(batch)
    assert baseline.experimental_get_tracing_count() > 5


def test_c15_overflow_extends_with_an_extra_bucket():
    ds, seqs = _c15_dataset()
    plan = plan_buckets(ds, bucket_boundaries=[16, 32, 64, 128], batch_size=8)
    assert plan == BucketPlan(
        (16, 32, 64, 128, 200), (8,) * 5, 200, True, True, bucket_counts=(16, 16, 32, 64, 72)
    )
    batches = list(bucket_by_length(ds, bucket_boundaries=[16, 32, 64, 128], batch_size=8))
    assert {int(x.shape[1]) for x, _ in batches} == {16, 32, 64, 128, 200}
    assert sum(int(np.count_nonzero(x)) for x, _ in batches) == C15_TOTAL_TOKENS
    # apply_bucket_plan with the same plan gives the same batches.
    again = list(apply_bucket_plan(ds, plan))
    assert [x.shape for x, _ in again] == [x.shape for x, _ in batches]


def test_c15_overflow_error_at_build_time():
    ds, _ = _c15_dataset()
    with pytest.raises(ValueError, match=r"largest value of `bucket_boundaries`.*200 tokens"):
        bucket_by_length(ds, bucket_boundaries=[16, 32, 64, 128], batch_size=8, on_overflow="error")
    # A scan that finds a sequence longer than the given `max_length` also fails at build time.
    with pytest.raises(ValueError, match="longer than `max_length`"):
        bucket_by_length(ds, batch_size=8, max_length=100)
    # With boundaries and `max_length` there is no scan; `max_length` alone decides.
    with pytest.raises(ValueError, match=r"longest sequence \(300 tokens\)"):
        plan_buckets(
            ds, bucket_boundaries=[16, 256], batch_size=8, max_length=300, on_overflow="error"
        )
    plan = plan_buckets(ds, bucket_boundaries=[16, 256], batch_size=8, max_length=300)
    assert plan.bucket_boundaries == (16, 256, 300) and not plan.scanned_all


def test_raw_tf_overflow_fails_only_while_iterating():
    """Documents the opaque mid-iteration failure that build-time checks prevent."""
    ds, _ = _c15_dataset(labels=False)
    raw = ds.bucket_by_sequence_length(
        lambda x: tf.shape(x)[0], [16, 32, 64, 128], [8] * 5, pad_to_bucket_boundary=True
    )
    with pytest.raises(tf.errors.OpError, match="pad_to_bucket_boundary=True"):
        for _ in raw:
            pass


def test_overflow_beyond_scanned_elements_gives_a_clear_runtime_error():
    seqs = [np.ones([n], np.int32) for n in range(1, 201)]  # ascending: the scan sees 1..50
    ds = tf.data.Dataset.from_generator(
        lambda: iter(seqs), output_signature=tf.TensorSpec([None], tf.int32)
    )
    plan = plan_buckets(ds, bucket_boundaries=[16, 128], batch_size=4, num_boundary_samples=50)
    assert plan.scanned_all is False and plan.bucket_boundaries == (16, 128)
    batched = bucket_by_length(
        ds, bucket_boundaries=[16, 128], batch_size=4, num_boundary_samples=50
    )
    with pytest.raises(tf.errors.OpError, match="largest bucket boundary \\(128\\)"):
        for _ in batched:
            pass


# ------------------------------------------------------------------------------------------
# Token budget, automatic boundaries, structures, shuffling.
# ------------------------------------------------------------------------------------------


def test_token_budget_shrinks_batch_size():
    assert token_budget_batch_sizes(C15_BOUNDARIES, 256) == (16, 8, 4, 2, 1)
    assert token_budget_batch_sizes([10, 30], 100) == (10, 3)
    with pytest.warns(UserWarning, match="exceed the token budget"):
        assert token_budget_batch_sizes([10, 300], 100) == (10, 1)

    ds, _ = _c15_dataset()
    batches = list(bucket_by_length(ds, bucket_boundaries=C15_BOUNDARIES, tokens_per_batch=256))
    by_len = {}
    for x, _ in batches:
        assert x.shape[0] * x.shape[1] <= 256
        by_len.setdefault(int(x.shape[1]), set()).add(int(x.shape[0]))
    # Full batches have the budgeted size; a bucket's last batch may be smaller.
    assert {k: max(v) for k, v in by_len.items()} == {16: 16, 32: 8, 64: 4, 128: 2, 256: 1}
    assert sum(int(np.count_nonzero(x)) for x, _ in batches) == C15_TOTAL_TOKENS


def test_quantile_boundaries_by_hand():
    by_count = functools.partial(quantile_boundaries, weighting="sequences")
    assert by_count(np.arange(1, 201), 4) == (50, 100, 150, 200)
    assert by_count([3, 1, 2, 10], 2) == (2, 10)
    assert by_count([7] * 20, 4) == (7,)  # duplicates merged
    assert by_count([0, 0, 5], 3) == (1, 5)  # boundaries stay positive
    # Token-weighted (default): 1..200 hold 20100 tokens; 1+..+100 = 5050 >= 20100/4,
    # 1+..+142 = 10153 >= 20100/2 > 1+..+141 = 10011, 1+..+174 = 15225 >= 15075 > 15051.
    assert quantile_boundaries(np.arange(1, 201), 4) == (100, 142, 174, 200)
    # [3, 1, 2, 10]: 16 tokens; sorted cumulative 1, 3, 6, 16: the first >= 8 is at length 10.
    assert quantile_boundaries([3, 1, 2, 10], 2) == (10,)
    # Exactly on a quantile: [1, 1, 2] hold 4 tokens, cumulative 1, 2, 4: half (2) is reached
    # exactly at the second 1, so the first boundary is 1 (>=, not >).
    assert quantile_boundaries([1, 1, 2], 2) == (1, 2)
    assert quantile_boundaries([2, 2, 4], 2) == (2, 4)  # cumulative 2, 4, 8: 4 >= 8/2 at 2
    assert quantile_boundaries([0, 0], 3) == (1,)  # only empty sequences
    assert quantile_boundaries([7] * 20) == (7,)
    with pytest.raises(ValueError, match="at least one"):
        quantile_boundaries([], 2)
    with pytest.raises(ValueError, match="num_buckets"):
        quantile_boundaries([1, 2], 0)
    with pytest.raises(ValueError, match=r'"tokens" or "sequences". Received: weighting=\'x\''):
        quantile_boundaries([1, 2], 2, weighting="x")


def test_geometric_boundaries_by_hand():
    # 16; 19.2 -> 24; 23.04 -> 24; 27.65 -> 32; 33.18 -> 40 is not < 40; then max 40.
    assert geometric_boundaries(40) == (16, 24, 32, 40)
    assert geometric_boundaries(10) == (10,)  # nothing below max_length
    assert geometric_boundaries(100, first=10, ratio=2.0, multiple=1) == (10, 20, 40, 80, 100)
    bounds = geometric_boundaries(508)
    assert bounds[-1] == 508 and list(bounds) == sorted(set(bounds))
    assert all(b % 8 == 0 for b in bounds[:-1])
    assert all(b2 / b1 <= 1.5 for b1, b2 in zip(bounds, bounds[1:]))
    for kwargs, pattern in (
        ({"max_length": 0}, "max_length"),
        ({"max_length": 40, "ratio": 1.0}, r"ratio.*> 1\. Received: ratio=1\.0"),
        ({"max_length": 40, "ratio": float("inf")}, "ratio"),
        ({"max_length": 40, "first": 0}, "first"),
        ({"max_length": 40, "multiple": 2.5}, "multiple"),
    ):
        with pytest.raises(ValueError, match=pattern):
            geometric_boundaries(**kwargs)


def test_auto_boundaries_from_quantiles():
    ds, _ = _c15_dataset()
    plan = plan_buckets(ds, batch_size=8, num_buckets=4)
    assert plan.bucket_boundaries == (100, 142, 174, 200)  # token-weighted, see above
    assert plan.scanned_all and not plan.extended and plan.max_length == 200
    assert plan.bucket_counts == (100, 42, 32, 26)
    assert plan_buckets(ds, batch_size=8).num_buckets == 16  # the default
    batches = list(bucket_by_length(ds, batch_size=10, num_buckets=4))
    assert {int(x.shape[1]) for x, _ in batches} == {100, 142, 174, 200}
    assert sum(int(np.count_nonzero(x)) for x, _ in batches) == C15_TOTAL_TOKENS
    # Boundaries from a sample of the first 20 lengths, extended to the true maximum.
    first = [len(s) for s in _c15_sequences()][:20]
    sampled = plan_buckets(ds, batch_size=8, num_buckets=2, num_boundary_samples=20)
    expected = quantile_boundaries(first, 2)
    assert sampled.bucket_boundaries[: len(expected)] == expected
    assert sampled.scanned_all is False


def test_tuple_with_sample_weight_and_dict_elements():
    lengths = [3, 1, 5, 2]
    xs = [np.arange(1, n + 1, dtype=np.float32) for n in lengths]

    def gen():
        for x in xs:
            yield x, x * 10, np.float32(len(x))  # per-token labels, per-sequence weight

    sig = (
        tf.TensorSpec([None], tf.float32),
        tf.TensorSpec([None], tf.float32),
        tf.TensorSpec([], tf.float32),
    )
    ds = tf.data.Dataset.from_generator(gen, output_signature=sig)
    batches = list(bucket_by_length(ds, bucket_boundaries=[2, 5], batch_size=2, padding_values=-1))
    assert len(batches) == 2
    for x, y, w in batches:
        assert x.shape == y.shape and x.shape[0] == w.shape[0]
        real = np.asarray(x) != -1
        np.testing.assert_array_equal(real.sum(axis=1), w)  # weights stayed with their rows
        np.testing.assert_array_equal(np.asarray(y)[real], np.asarray(x)[real] * 10)
        np.testing.assert_array_equal(np.asarray(y)[~real], -1)

    dict_ds = tf.data.Dataset.from_generator(
        lambda: ({"tokens": x.astype(np.int32), "id": np.int32(i)} for i, x in enumerate(xs)),
        output_signature={
            "tokens": tf.TensorSpec([None], tf.int32),
            "id": tf.TensorSpec([], tf.int32),
        },
    )
    out = list(bucket_by_length(dict_ds, bucket_boundaries=[2, 5], batch_size=4))
    assert sorted(int(b["tokens"].shape[1]) for b in out) == [2, 5]
    assert sorted(i for b in out for i in b["id"].numpy().tolist()) == [0, 1, 2, 3]


def test_custom_element_length_func_and_ragged_input():
    ragged = tf.ragged.constant([[1, 2, 3], [4], [5, 6]])
    ds = tf.data.Dataset.from_tensor_slices((ragged, tf.constant([0, 1, 2])))
    out = list(bucket_by_length(ds, bucket_boundaries=[1, 3], batch_size=4))
    assert sorted(tuple(x.shape) for x, _ in out) == [(1, 1), (2, 3)]
    # An element_length_func that buckets by label instead of by length (custom keys honoured).
    out = list(
        bucket_by_length(
            ds,
            bucket_boundaries=[1, 3],
            batch_size=4,
            element_length_func=lambda el: el[1] + 1,
            pad_to_bucket_boundary=False,
        )
    )
    assert sorted(x.shape[0] for x, _ in out) == [1, 2]


def _first_epoch_order(ds):
    return [tuple(np.asarray(y).tolist()) for _, y in ds]


def test_shuffle_is_deterministic_with_a_seed():
    seqs = _c15_sequences()
    ds = tf.data.Dataset.from_generator(
        lambda: ((s, np.int32(i)) for i, s in enumerate(seqs)),
        output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int32)),
    )

    def build(seed, shuffle_buffer=200):
        return bucket_by_length(
            ds,
            bucket_boundaries=C15_BOUNDARIES,
            batch_size=8,
            shuffle_buffer=shuffle_buffer,
            seed=seed,
        )

    a, b, c = build(1), build(1), build(2)
    a1, b1 = _first_epoch_order(a), _first_epoch_order(b)
    assert a1 == b1
    assert a1 != _first_epoch_order(c)
    assert a1 != _first_epoch_order(build(None, shuffle_buffer=None))
    assert sorted(i for batch in a1 for i in batch) == list(range(200))
    # Reshuffled every epoch, but the same sequence of epochs for the same seed.
    a2, b2 = _first_epoch_order(a), _first_epoch_order(b)
    assert a2 != a1
    assert a2 == b2


# ------------------------------------------------------------------------------------------
# Argument validation.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (
            {"bucket_boundaries": [32, 16], "batch_size": 4},
            r"sorted.*Received: bucket_boundaries=\[32, 16\]",
        ),
        ({"bucket_boundaries": [16, 16], "batch_size": 4}, "strictly increasing"),
        ({"bucket_boundaries": [], "batch_size": 4}, "non-empty"),
        ({"bucket_boundaries": [0, 16], "batch_size": 4}, "positive"),
        ({"bucket_boundaries": [-3], "batch_size": 4}, "positive"),
        ({"bucket_boundaries": [1.5, 3], "batch_size": 4}, "integers"),
        ({"bucket_boundaries": "16", "batch_size": 4}, "list of positive integers"),
        ({"bucket_boundaries": [16], "batch_size": 4, "tokens_per_batch": 64}, "Exactly one"),
        ({"bucket_boundaries": [16]}, "Exactly one"),
        ({"bucket_boundaries": [16], "batch_size": 0}, r"positive integer.*batch_size=0"),
        ({"bucket_boundaries": [16], "tokens_per_batch": -1}, "tokens_per_batch=-1"),
        ({"bucket_boundaries": [16], "batch_size": True}, "batch_size=True"),
        ({"bucket_boundaries": [16], "batch_size": 4, "on_overflow": "truncate"}, "on_overflow"),
        ({"bucket_boundaries": [16], "batch_size": 4, "num_buckets": 3}, "not both"),
        ({"batch_size": 4, "num_buckets": 0}, "num_buckets=0"),
        ({"batch_size": 4, "num_boundary_samples": 0}, "num_boundary_samples"),
        ({"batch_size": 4, "shuffle_buffer": 0}, "shuffle_buffer=0"),
        ({"batch_size": 4, "seed": "a"}, "seed"),
        ({"batch_size": 4, "max_length": 0}, "max_length=0"),
        ({"batch_size": 4, "element_length_func": 3}, "element_length_func"),
        ({"batch_size": 4, "pad_to_bucket_boundary": "yes"}, "pad_to_bucket_boundary"),
        ({"batch_size": 4, "drop_remainder": 1}, "drop_remainder"),
    ],
)
def test_bad_arguments_raise_keras_style(kwargs, pattern):
    ds, _ = _c15_dataset()
    with pytest.raises(ValueError, match=pattern) as info:
        bucket_by_length(ds, **kwargs)
    assert "Received:" in str(info.value)


def test_bad_datasets_raise_at_build_time():
    with pytest.raises(ValueError, match="tf.data.Dataset"):
        bucket_by_length([[1, 2]], batch_size=2)
    with pytest.raises(ValueError, match="must not be empty"):
        bucket_by_length(_c15_dataset()[0].take(0), batch_size=2)
    with pytest.raises(ValueError, match="must contain a sequence"):
        bucket_by_length(tf.data.Dataset.range(5), batch_size=2)
    with pytest.raises(ValueError, match="BucketPlan"):
        apply_bucket_plan(_c15_dataset()[0], plan=(16, 32))


# ------------------------------------------------------------------------------------------
# Padding statistics.
# ------------------------------------------------------------------------------------------


def _hand_batches():
    return [
        np.array([[1, 2, 0, 0], [3, 0, 0, 0]], np.int32),
        np.array([[4, 5, 6]], np.int32),
        np.array([[7, 0, 0, 0], [8, 9, 1, 2]], np.int32),
    ]


def test_padding_stats_by_hand():
    batches = _hand_batches()
    ds = tf.data.Dataset.from_generator(
        lambda: iter(batches), output_signature=tf.TensorSpec([None, None], tf.int32)
    )
    s = padding_stats(ds)
    # real: 3 + 3 + 5 = 11; total: 8 + 3 + 8 = 19
    assert s == PaddingStats(3, 5, 11, 19, 8, 8 / 19, ((1, 3), (2, 4)), (3, 4))
    assert s.num_distinct_shapes == 2 and s.as_dict()["num_distinct_shapes"] == 2
    # (x, y) tuples, a plain list of batches, a mask and lengths give the same counts.
    pairs = [(b, np.zeros(len(b))) for b in batches]
    assert padding_stats(pairs) == s
    assert padding_stats(pairs, length_fn=lambda b: np.count_nonzero(b[0], axis=1)) == s
    assert padding_stats(batches, mask_fn=lambda b: b != 0) == s
    assert padding_stats(batches, max_batches=1).total_tokens == 8
    # pad_value: with -1 nothing is padding.
    assert padding_stats(batches, pad_value=-1).padding_fraction == 0.0


def test_padding_stats_features_and_dicts():
    x = np.zeros([2, 3, 2], np.float32)
    x[0, :2] = [[1.0, 0.0], [0.0, 2.0]]  # a real step may contain a 0 feature
    x[1, 0] = [5.0, 5.0]
    s = padding_stats([{"feat": x, "label": np.array([0, 1])}])
    assert (s.real_tokens, s.total_tokens, s.padded_tokens) == (3, 6, 3)
    assert s.distinct_shapes == ((2, 3, 2),)
    assert padding_stats([]).padding_fraction == 0.0


def test_padding_stats_bad_arguments():
    with pytest.raises(ValueError, match="at most one"):
        padding_stats([], length_fn=len, mask_fn=len)
    with pytest.raises(ValueError, match="max_batches"):
        padding_stats([], max_batches=0)
    with pytest.raises(ValueError, match="rank >= 2"):
        padding_stats([np.array([1, 2, 3])])
    with pytest.raises(ValueError, match="shape"):
        padding_stats([np.ones([2, 3])], mask_fn=lambda b: np.ones([2, 4]))


def test_bucketing_reduces_padding_vs_padded_batch():
    ds, _ = _c15_dataset(labels=False)
    naive = padding_stats(ds.padded_batch(8))
    bucketed = padding_stats(bucket_by_length(ds, bucket_boundaries=C15_BOUNDARIES, batch_size=8))
    assert naive.real_tokens == bucketed.real_tokens == C15_TOTAL_TOKENS
    assert bucketed.num_distinct_shapes == 5 < naive.num_distinct_shapes
    # Padded tokens per bucket by hand: each bucket of lengths (lo, hi] padded to hi.
    padded = 0
    for lo, hi in zip([0] + C15_BOUNDARIES, C15_BOUNDARIES):
        padded += sum(hi - n for n in range(lo + 1, min(hi, 200) + 1))
    assert bucketed.padded_tokens == padded


# ------------------------------------------------------------------------------------------
# masked loss is independent of the padded length.
# ------------------------------------------------------------------------------------------


def test_c16_masked_mae_identity_model():
    inp = keras.Input((None, 1))
    model = keras.Model(inp, keras.layers.Masking(mask_value=-1.0)(inp))
    model.compile(loss="mae")
    x = np.array([[[0.0], [-1.0], [0.0]]], np.float32)  # the middle step is masked
    y = np.array([[[0.0], [1.0], [1.0]]], np.float32)
    assert model.evaluate(x, y, verbose=0) == pytest.approx(0.5, abs=1e-7)
    # Without the mask the middle step counts: (|0 - 0| + |1 - (-1)| + |1 - 0|) / 3.
    plain = keras.Model(inp, keras.layers.Identity()(inp))
    plain.compile(loss="mae")
    assert plain.evaluate(x, y, verbose=0) == pytest.approx(1.0, abs=1e-6)


def _c16_batch(boundary):
    """Two sequences (lengths 3 and 5) padded to `boundary` with -1 via bucket_by_length."""
    xs = [np.array([0.5, -0.25, 1.0]), np.array([2.0, 0.0, -1.5, 0.75, 3.0])]
    ys = [np.array([1.0, 0.0, 0.0]), np.array([0.0, 1.0, -1.0, 2.0, 0.5])]

    def gen():
        for x, y in zip(xs, ys):
            yield x[:, None].astype(np.float32), y[:, None].astype(np.float32)

    sig = (tf.TensorSpec([None, 1], tf.float32), tf.TensorSpec([None, 1], tf.float32))
    ds = tf.data.Dataset.from_generator(gen, output_signature=sig)
    (batch,) = list(
        bucket_by_length(ds, bucket_boundaries=[boundary], batch_size=2, padding_values=-1.0)
    )
    assert batch[0].shape == (2, boundary, 1)
    return batch, np.concatenate(xs), np.concatenate(ys)


def _c16_model():
    inp = keras.Input((None, 1))
    h = keras.layers.Masking(mask_value=-1.0)(inp)
    out = keras.layers.Dense(
        1,
        kernel_initializer=keras.initializers.Constant(0.5),
        bias_initializer=keras.initializers.Constant(0.1),
    )(h)
    model = keras.Model(inp, out)
    model.compile(loss="mae", optimizer=keras.optimizers.SGD(0.1))
    return model


def _loss_and_grads(model, x, y, sample_weight=None):
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
    grads = tape.gradient(loss, model.trainable_variables)
    return float(loss), [g.numpy() for g in grads]


def test_c16_padding_to_8_or_16_gives_identical_loss_and_gradients():
    model = _c16_model()
    (x8, y8), xr, yr = _c16_batch(8)
    (x16, y16), _, _ = _c16_batch(16)
    loss8, g8 = _loss_and_grads(model, x8, y8)
    loss16, g16 = _loss_and_grads(model, x16, y16)
    # NumPy reference: Keras 3 divides the masked sum by the number of unmasked steps in the
    # whole batch (a token-level mean, not a mean of per-sequence means).
    pred = 0.5 * xr + 0.1
    assert loss8 == pytest.approx(np.mean(np.abs(pred - yr)), abs=1e-6)
    sign = np.sign(pred - yr)
    np.testing.assert_allclose(g8[0].ravel(), [np.mean(sign * xr)], atol=1e-6)
    np.testing.assert_allclose(g8[1].ravel(), [np.mean(sign)], atol=1e-6)
    assert loss16 == pytest.approx(loss8, abs=1e-6)
    for a, b in zip(g8, g16):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # evaluate() on the two paddings agrees as well.
    assert model.evaluate(x8, y8, verbose=0) == pytest.approx(
        model.evaluate(x16, y16, verbose=0), abs=1e-6
    )
    # A mean of per-sequence means would differ (guards the reduction documented above).
    per_seq = np.mean([np.mean(np.abs(pred[:3] - yr[:3])), np.mean(np.abs(pred[3:] - yr[3:]))])
    assert abs(per_seq - loss8) > 1e-3


def test_c16_sample_weight_masks_need_mean_with_sample_weight():
    """Masks given as sample_weight (no Masking layer): the default reduction divides by all
    positions, padding included, so the loss depends on the padded length;
    `reduction="mean_with_sample_weight"` divides by the weight sum and does not."""
    inp = keras.Input((None, 1))
    dense = keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="zeros")
    model = keras.Model(inp, dense(inp))
    (x8, y8), xr, yr = _c16_batch(8)
    (x16, y16), _, _ = _c16_batch(16)
    w8 = tf.cast(tf.not_equal(x8[..., 0], -1.0), tf.float32)
    w16 = tf.cast(tf.not_equal(x16[..., 0], -1.0), tf.float32)
    token_mean = np.mean(np.abs(xr - yr))
    model.compile(loss="mae")
    loss8 = _loss_and_grads(model, x8, y8, w8)[0]
    loss16 = _loss_and_grads(model, x16, y16, w16)[0]
    assert loss8 == pytest.approx(token_mean * 8 / 16, abs=1e-6)  # 8 real of 2*8 positions
    assert loss16 == pytest.approx(token_mean * 8 / 32, abs=1e-6)
    model.compile(loss=keras.losses.MeanAbsoluteError(reduction="mean_with_sample_weight"))
    l8, g8 = _loss_and_grads(model, x8, y8, w8)
    l16, g16 = _loss_and_grads(model, x16, y16, w16)
    assert l8 == pytest.approx(token_mean, abs=1e-6) and l16 == pytest.approx(token_mean, abs=1e-6)
    for a, b in zip(g8, g16):
        np.testing.assert_allclose(a, b, atol=1e-6)


# ------------------------------------------------------------------------------------------
# Known length (cardinality) and already-batched input.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bucket_boundaries": C15_BOUNDARIES, "batch_size": 8},
        {"bucket_boundaries": C15_BOUNDARIES, "batch_size": 8, "drop_remainder": True},
        {"batch_size": 8},  # quantile boundaries
        {"batch_size": 7, "num_buckets": 5, "drop_remainder": True},
        {"tokens_per_batch": 256},
        {"tokens_per_batch": 256, "num_buckets": 3, "drop_remainder": True},
        {"bucket_boundaries": [16, 64], "tokens_per_batch": 512, "shuffle_buffer": 50, "seed": 1},
    ],
)
def test_cardinality_is_declared_and_exact(kwargs):
    ds, _ = _c15_dataset()
    batches = bucket_by_length(ds, **kwargs)
    actual = sum(1 for _ in batches)
    assert int(batches.cardinality()) == actual
    assert sum(1 for _ in batches) == actual  # a second pass agrees (no cardinality error)


def test_cardinality_by_hand():
    # Lengths 1..40 with boundaries [16, 32] -> buckets of 16, 16 and (extended to 40) 8.
    ds = tf.data.Dataset.range(1, 41).map(lambda n: tf.ones([n], tf.int32))
    plan = plan_buckets(ds, bucket_boundaries=[16, 32], batch_size=6)
    assert plan.bucket_boundaries == (16, 32, 40) and plan.bucket_counts == (16, 16, 8)
    assert plan.num_batches() == 3 + 3 + 2  # ceil(16/6), ceil(16/6), ceil(8/6)
    assert plan.num_batches(drop_remainder=True) == 2 + 2 + 1
    assert int(bucket_by_length(ds, bucket_boundaries=[16, 32], batch_size=6).cardinality()) == 8
    dropped = bucket_by_length(ds, bucket_boundaries=[16, 32], batch_size=6, drop_remainder=True)
    assert int(dropped.cardinality()) == 5 == sum(1 for _ in dropped)
    # Token budget 64: batch sizes 4, 2, 1 -> 4 + 8 + 8 batches.
    budget = bucket_by_length(ds, bucket_boundaries=[16, 32], tokens_per_batch=64)
    assert int(budget.cardinality()) == 20 == sum(1 for _ in budget)


def test_cardinality_unknown_when_the_scan_did_not_cover_the_data():
    ds, _ = _c15_dataset()
    unknown = tf.data.UNKNOWN_CARDINALITY
    skipped = bucket_by_length(ds, bucket_boundaries=C15_BOUNDARIES, batch_size=8, max_length=200)
    assert int(skipped.cardinality()) == unknown  # no scan at all
    partial = bucket_by_length(ds, bucket_boundaries=[256], batch_size=8, num_boundary_samples=50)
    assert int(partial.cardinality()) == unknown  # scanned 50 of 200
    # A plan made on another dataset is not trusted for this one's length.
    full = tf.data.Dataset.range(1, 41).map(lambda n: tf.ones([n], tf.int32))
    plan = plan_buckets(full, bucket_boundaries=[16, 32], batch_size=6)
    assert int(apply_bucket_plan(full.take(10), plan).cardinality()) == unknown


def test_fit_sees_the_epoch_length_of_a_bucketed_dataset(capsys):
    ds, _ = _c15_dataset()
    batches = bucket_by_length(ds, bucket_boundaries=C15_BOUNDARIES, batch_size=8)
    expected = sum(1 for _ in batches)
    model = keras.Sequential(
        [keras.Input((None,), dtype="int32"), keras.layers.Embedding(64, 4),
         keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)]
    )  # fmt: skip
    model.compile("sgd", "mse")

    class Count(keras.callbacks.Callback):
        steps = 0

        def on_train_batch_end(self, batch, logs=None):
            Count.steps += 1

    model.fit(batches, epochs=2, verbose=0, shuffle=False, callbacks=[Count()])
    assert Count.steps == 2 * expected  # no extra, empty step per epoch
    assert int(model.optimizer.iterations) == 2 * expected
    assert "ran out of data" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "batched, name",
    [
        (lambda ds: ds.padded_batch(4), "padded_batch"),
        (lambda ds: ds.batch(1), "batch"),
        (lambda ds: ds.padded_batch(4).prefetch(2).map(lambda x, y: (x, y)), "padded_batch"),
        (lambda ds: bucket_by_length(ds, batch_size=4), "bucket_by_sequence_length"),
    ],
)
def test_already_batched_dataset_is_rejected(batched, name):
    ds, _ = _c15_dataset()
    with pytest.raises(ValueError, match=rf"not batches.*`{name}.*\.unbatch\(\)`.*Received:"):
        bucket_by_length(batched(ds), batch_size=8)
    plan = plan_buckets(ds, batch_size=8)
    with pytest.raises(ValueError, match="not batches"):
        apply_bucket_plan(batched(ds), plan)
    # After unbatch() the elements are single sequences again.
    again = bucket_by_length(ds.padded_batch(4).unbatch(), batch_size=8)
    assert all(np.ndim(x) == 2 for x, _ in again)
