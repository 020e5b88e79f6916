"""Tests for keras_fastloop.datasets.stdlib_code (standard-library source code as a text data set)."""

import collections

import numpy as np
import pytest
import tensorflow as tf

from keras_fastloop.data.bucketing import (
    bucket_by_length,
    geometric_boundaries,
    quantile_boundaries,
)
from keras_fastloop.data.sequences import sequences_to_dataset
from keras_fastloop.data.stats import padding_stats
from keras_fastloop.datasets import stdlib_code as datasets
from keras_fastloop.datasets.stdlib_code import (
    DEFAULT_STDLIB_GROUPS,
    OOV_ID,
    PAD_ID,
    load_stdlib_code,
    tokenize_source,
)


@pytest.fixture(scope="module")
def data():
    return load_stdlib_code()


def test_tokenize_source_by_hand():
    src = "@deco\ndef f(a, b=1):  # comment\n\n    return a + b\n"
    assert tokenize_source(src) == [
        "@", "deco", "<newline>",
        "def", "f", "(", "a", ",", "b", "=", "1", ")", ":", "<newline>",
        "<indent>", "return", "a", "+", "b", "<newline>", "<dedent>",
    ]  # fmt: skip


def test_deterministic_across_fresh_parses(data):
    datasets._parse_groups.cache_clear()  # re-read the files, not the in-memory cache
    again = load_stdlib_code()
    assert again.vocab == data.vocab and again.names_train == data.names_train
    assert again.names_val == data.names_val
    np.testing.assert_array_equal(again.y_train, data.y_train)
    for a, b in zip(again.x_train[:50] + again.x_val[:50], data.x_train[:50] + data.x_val[:50]):
        np.testing.assert_array_equal(a, b)


def test_seed_changes_the_split_not_the_examples(data):
    other = load_stdlib_code(seed=1)
    assert set(other.names_train) != set(data.names_train)
    assert set(other.names_train) | set(other.names_val) == set(data.names_train) | set(
        data.names_val
    )
    # Stratified: per-class validation counts do not depend on the seed.
    np.testing.assert_array_equal(np.bincount(other.y_val), np.bincount(data.y_val))


def test_sanity_classes_split_and_ids(data):
    k = len(DEFAULT_STDLIB_GROUPS)
    assert data.class_names == DEFAULT_STDLIB_GROUPS
    train_counts, val_counts = (
        np.bincount(data.y_train, minlength=k),
        np.bincount(data.y_val, minlength=k),
    )
    assert np.all(train_counts >= 200) and np.all(val_counts >= 50)  # every class well populated
    # Stratified 20 % split, by hand: round(0.2 * n) per class.
    np.testing.assert_array_equal(val_counts, np.round(0.2 * (train_counts + val_counts)))
    assert len(data.x_train) == len(data.y_train) == len(data.names_train)
    assert len(data.x_val) == len(data.y_val) == len(data.names_val)
    assert not set(data.names_train) & set(data.names_val)
    assert len(set(data.names_train)) == len(data.names_train)
    # Each name's package matches its label.
    for name, label in zip(data.names_train, data.y_train):
        assert name.split("/")[0].split(".")[0] == data.class_names[label]
    # Ids: no padding inside sequences, everything inside the vocabulary.
    flat = np.concatenate(data.x_train + data.x_val)
    assert flat.dtype == np.int32 and flat.min() >= OOV_ID and flat.max() < 2000
    assert not np.any(flat == PAD_ID)
    assert len(data.vocab) == 2000 and data.vocab[:2] == ("<pad>", "<oov>")
    assert np.mean(flat == OOV_ID) < 0.15
    assert data.python_version.count(".") == 2


def test_lengths_vary_widely(data):
    lengths = np.array([len(s) for s in data.x_train + data.x_val])
    assert lengths.min() <= 12 and lengths.max() > 400 and lengths.max() <= 512
    assert len(np.unique(lengths)) > 200
    assert np.percentile(lengths, 90) > 3 * np.median(lengths)  # long tail


def test_vocab_is_frequency_ranked_on_the_training_split(data):
    counts = collections.Counter()
    for seq in data.x_train:
        counts.update(seq.tolist())
    freq = [counts[i] for i in range(2, len(data.vocab))]
    assert all(a >= b for a, b in zip(freq, freq[1:]))  # ids 2.. in decreasing frequency


def test_small_vocab_and_length_filters():
    small = load_stdlib_code(vocab_size=50, max_length=64, min_length=20, groups=("json", "http"))
    lengths = [len(s) for s in small.x_train + small.x_val]
    assert min(lengths) >= 20 and max(lengths) <= 64
    assert max(int(s.max()) for s in small.x_train) < 50 and len(small.vocab) == 50
    assert small.class_names == ("json", "http")
    everything = load_stdlib_code(max_length=None, groups=("json", "http"))
    assert len(everything.x_train) > len(small.x_train)


def test_labels_carry_signal(data):
    """A multinomial naive Bayes on token counts (NumPy, by hand) beats the majority class by
    far: the labels are learnable from the tokens."""
    k, v = len(data.class_names), len(data.vocab)
    counts = np.ones([k, v])  # Laplace smoothing
    for seq, label in zip(data.x_train, data.y_train):
        counts[label] += np.bincount(seq, minlength=v)
    log_p = np.log(counts / counts.sum(axis=1, keepdims=True))
    log_prior = np.log(np.bincount(data.y_train) / len(data.y_train))
    pred = [np.argmax(log_prior + log_p @ np.bincount(seq, minlength=v)) for seq in data.x_val]
    accuracy = np.mean(np.array(pred) == data.y_val)
    majority = np.bincount(data.y_val).max() / len(data.y_val)
    assert accuracy > majority + 0.2


def test_sequences_to_dataset_round_trip(data):
    ds = sequences_to_dataset(data.x_val[:5], data.y_val[:5])
    assert ds.element_spec[0].shape.as_list() == [None]
    for (x, y), xs, ys in zip(ds, data.x_val[:5], data.y_val[:5]):
        np.testing.assert_array_equal(x, xs)
        assert int(y) == int(ys)
    only_x = sequences_to_dataset([np.array([3, 4]), np.array([5])])
    assert [v.numpy().tolist() for v in only_x] == [[3, 4], [5]]
    weighted = sequences_to_dataset([np.array([3])], [1], [0.5])
    assert len(weighted.element_spec) == 3
    with pytest.raises(ValueError, match="one entry per sequence"):
        sequences_to_dataset([np.array([1])], labels=[0, 1])
    with pytest.raises(ValueError, match="needs `labels`"):
        sequences_to_dataset([np.array([1])], sample_weights=[1.0])


def test_bucketing_on_stdlib_code_keeps_every_token_and_cuts_padding(data):
    ds = sequences_to_dataset(data.x_train, data.y_train)
    real = sum(len(s) for s in data.x_train)
    to_max = padding_stats(ds.padded_batch(32, padded_shapes=([512], [])))
    per_batch = padding_stats(ds.padded_batch(32))
    bucketed = padding_stats(
        bucket_by_length(ds, bucket_boundaries=[16, 32, 64, 128, 256, 512], batch_size=32)
    )
    for s in (to_max, per_batch, bucketed):
        assert s.real_tokens == real  # pad id 0 never occurs in the data
    assert bucketed.padding_fraction < per_batch.padding_fraction < to_max.padding_fraction
    assert len(bucketed.distinct_lengths) <= 6 < len(per_batch.distinct_lengths)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"vocab_size": 2}, "vocab_size"),
        ({"max_length": 0}, "max_length"),
        ({"min_length": 0}, "min_length"),
        ({"max_length": 5, "min_length": 10}, ">= `min_length`"),
        ({"validation_split": 1.0}, "validation_split"),
        ({"seed": "x"}, "seed"),
        ({"groups": "email"}, "groups"),
        ({"groups": ()}, "groups"),
        ({"groups": ("email", "email")}, "repeat"),
        ({"groups": ("no_such_package_xyz",)}, "not found"),
    ],
)
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        load_stdlib_code(**kwargs)
    assert "Received:" in str(info.value)


def test_default_bucketing_pads_at_most_15_percent_of_stdlib_code(data):
    """The README's claim, with no boundaries given: token-weighted quantiles, 16 buckets."""
    ds = sequences_to_dataset(data.x_train, data.y_train)
    default = padding_stats(bucket_by_length(ds, batch_size=32))
    assert default.real_tokens == sum(len(s) for s in data.x_train)  # nothing dropped
    assert default.padding_fraction <= 0.15, default
    assert len(default.distinct_lengths) <= 16
    # The previous default (4 quantiles of the sequence count) padded 58.9 %.
    lengths = [len(s) for s in data.x_train]
    old = quantile_boundaries(lengths, 4, weighting="sequences")
    old_stats = padding_stats(bucket_by_length(ds, bucket_boundaries=list(old), batch_size=32))
    assert old_stats.padding_fraction > 0.5
    geometric = geometric_boundaries(max(lengths))
    geo_stats = padding_stats(
        bucket_by_length(ds, bucket_boundaries=list(geometric), batch_size=32)
    )
    assert geo_stats.padding_fraction <= 0.15


def test_dataset_is_usable_with_tf_data(data):
    ds = sequences_to_dataset(data.x_train[:64], data.y_train[:64])
    batches = bucket_by_length(ds, tokens_per_batch=2048, num_buckets=3)
    n = sum(int(x.shape[0]) for x, _ in batches)
    assert n == 64
    assert isinstance(batches, tf.data.Dataset)


def test_digits_without_scikit_learn_names_the_extra(monkeypatch):
    import sys

    from keras_fastloop.datasets import load_digits_data

    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # as if not installed
    with pytest.raises(ImportError, match=r"keras-fastloop\[datasets\]"):
        load_digits_data()


def test_the_datasets_extra_brings_scikit_learn():
    from pathlib import Path

    import tomllib

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(r.startswith("scikit-learn") for r in extras["datasets"])
    assert "keras-fastloop[datasets]" in extras["bench"]
