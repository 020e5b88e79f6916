"""`keras-fastloop bench --suite text`: a small Transformer encoder on variable-length text.

Data: the standard library's own source (`keras_fastloop.datasets.load_stdlib_code`: real
code, 6 package labels, lengths ~8-500 tokens, no download). Model: token embedding
(`mask_zero=True`) plus a learned position embedding, one Transformer encoder block (Vaswani et
al., 2017, "Attention Is All You Need": 2-head self-attention masked at the padding, a
128-unit feed-forward layer, post-layer normalisation), masked average pooling, float32
softmax.

Contenders, all on the same bucket boundaries (`geometric_boundaries`, ratio 1.2):

- plain `fit` in float32 on `padded_batch` (the baseline: Keras' plain pipeline);
- plain `fit` at the recommended policy on tf.data's own `bucket_by_sequence_length` (pad to
  the batch's longest, tf.data's default), `steps_per_execution` 1, 8, 32: Keras at its best;
- `OptimizedModel`, recommended setup + `keras_fastloop.data.bucket_by_length` (pad to the
  bucket boundary: at most one traced shape per bucket);
- the same with a token budget per batch (`tokens_per_batch`: short buckets get more
  sequences).

Keras on JAX is not run here: `jax.jit` compiles once per batch shape, and bucketing without
padding to fixed boundaries gives it hundreds.
"""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from keras_fastloop.data import (
    apply_bucket_plan,
    bucket_by_length,
    geometric_boundaries,
    plan_buckets,
    sequences_to_dataset,
)
from keras_fastloop.datasets import load_stdlib_code
from keras_fastloop_bench import workloads

BATCH_SIZE = 32
LEARNING_RATE = 1e-3
EMBED_DIM = 64
BUCKETING = "OptimizedModel, recommended setup + bucket_by_length"
TOKEN_BUDGET = "OptimizedModel, recommended setup + bucket_by_length (token budget)"


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position (`max_length` positions) to `(batch, length,
    dim)` inputs; passes the padding mask through."""

    def __init__(self, max_length, dim, **kwargs):
        super().__init__(**kwargs)
        self.max_length, self.dim = max_length, dim
        self.positions = keras.layers.Embedding(max_length, dim)
        self.supports_masking = True

    def build(self, input_shape):
        self.positions.build((None,))

    def call(self, x):
        length = keras.ops.shape(x)[1]
        return x + keras.ops.cast(self.positions(keras.ops.arange(length)), x.dtype)

    def get_config(self):
        return {**super().get_config(), "max_length": self.max_length, "dim": self.dim}


def build_encoder(model_cls=keras.Model, vocab_size=2000, num_classes=6, max_length=512):
    """Embedding + positions -> one encoder block (2 heads) -> masked mean -> softmax."""
    inputs = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(vocab_size, EMBED_DIM, mask_zero=True)(inputs)
    h = PositionEmbedding(max_length, EMBED_DIM)(h)
    attention = keras.layers.MultiHeadAttention(2, EMBED_DIM // 2)(h, h)
    h = keras.layers.LayerNormalization()(keras.layers.Add()([h, attention]))
    ff = keras.layers.Dense(128, activation="relu")(h)
    ff = keras.layers.Dense(EMBED_DIM)(ff)
    h = keras.layers.LayerNormalization()(keras.layers.Add()([h, ff]))
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(num_classes, activation="softmax", dtype="float32")(h)
    return model_cls(inputs, outputs)


class TextData:
    """The sequences and their pipelines (the same shuffle seed every run)."""

    def __init__(self, quick=False):
        self.data = load_stdlib_code()
        x, y = self.data.x_train, self.data.y_train
        x_val, y_val = self.data.x_val, self.data.y_val
        if quick:
            x, y, x_val, y_val = x[:160], y[:160], x_val[:64], y_val[:64]
        self.x, self.y, self.x_val, self.y_val = x, y, x_val, y_val
        self.max_length = max(len(s) for s in list(x) + list(x_val))
        self.boundaries = list(geometric_boundaries(self.max_length))
        mean = float(np.mean([len(s) for s in x]))
        self.tokens_per_batch = int(BATCH_SIZE * mean)  # the same tokens per batch on average

    def _base(self):
        ds = sequences_to_dataset(self.x, self.y)
        return ds.shuffle(len(self.x), seed=0, reshuffle_each_iteration=True)

    def padded_batch(self):
        return self._base().padded_batch(BATCH_SIZE).prefetch(tf.data.AUTOTUNE)

    def tf_bucketing(self):
        """tf.data's `bucket_by_sequence_length` on the same buckets (its boundaries are
        exclusive upper bounds, ours inclusive: `b + 1`), padded to the batch's longest."""
        bounds = [b + 1 for b in self.boundaries[:-1]]
        return (
            self._base()
            .bucket_by_sequence_length(
                lambda x, y: tf.shape(x)[0], bounds, [BATCH_SIZE] * (len(bounds) + 1)
            )
            .prefetch(tf.data.AUTOTUNE)
        )

    def _planned(self, **batching):
        """`bucket_by_length` on the shuffled data, planned on the unshuffled data: the plan's
        scan of the lengths (which gives `fit` the epoch length) would otherwise draw one
        shuffle order, and every epoch would train the order after the stock rows' one."""
        plan = plan_buckets(
            sequences_to_dataset(self.x, self.y), bucket_boundaries=self.boundaries, **batching
        )
        return apply_bucket_plan(self._base(), plan)

    def bucketing(self):
        return self._planned(batch_size=BATCH_SIZE)

    def token_budget(self):
        return self._planned(tokens_per_batch=self.tokens_per_batch)

    def val(self):
        return bucket_by_length(
            sequences_to_dataset(self.x_val, self.y_val),
            bucket_boundaries=self.boundaries,
            batch_size=256,
        )


def run(
    out_dir: Path,
    quick: bool = False,
    rounds: int | None = None,
    epochs: int | None = None,
    progress=print,
) -> dict:
    """Run the text suite; write `text.md`, `text.json`, `text.png` under `out_dir`.

    Args:
        out_dir: folder for the report (created if missing).
        quick: 160 sequences, 2 epochs, 1 round (tests).
        rounds: alternating rounds. Default 2 (1 when `quick`).
        epochs: epochs per run. Default 4 (2 when `quick`).
        progress: callable receiving progress lines. Default `print`.

    Returns:
        JSON-able dict with `rows` and `markdown`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rounds = rounds or (1 if quick else 2)
    epochs = epochs or (2 if quick else 4)
    data = TextData(quick)
    vocab, classes = len(data.data.vocab), len(data.data.class_names)
    w = workloads.Workload(
        build=lambda model_cls=keras.Model: build_encoder(
            model_cls, vocab, classes, data.max_length
        ),
        train=data.padded_batch,
        val=data.val,
        samples=len(data.x),
        learning_rate=LEARNING_RATE,
    )
    policy = workloads.default_policy()
    keras.utils.set_random_seed(0)
    initial = w.build().get_weights()
    contenders = workloads.base_contenders(w, policy, stock_train=data.tf_bucketing)
    del contenders[workloads.RECOMMENDED]
    contenders[BUCKETING] = workloads.recommended_contender(w, policy, train=data.bucketing)
    contenders[TOKEN_BUDGET] = workloads.recommended_contender(w, policy, train=data.token_budget)
    progress(f"[text] {len(data.x)} sequences, boundaries {data.boundaries}, policy {policy}")
    header = (
        f"Small Transformer encoder on Python {data.data.python_version} standard-library "
        f"source ({len(data.x)} train / {len(data.x_val)} validation sequences, lengths up to "
        f"{data.max_length}, {classes} labels), batch {BATCH_SIZE} (token budget "
        f"{data.tokens_per_batch} tokens), boundaries {data.boundaries}, Adam {LEARNING_RATE}, "
        f"recommended policy `{policy}`; the stock `fit` rows at that policy train on tf.data's "
        "`bucket_by_sequence_length` with the same buckets,"
    )
    notes = [
        "Keras on JAX: not run on this variable-length workload (one XLA compilation per "
        "batch shape)."
    ]
    return workloads.run_suite(
        "text",
        w,
        contenders,
        [BUCKETING, TOKEN_BUDGET],
        initial,
        epochs,
        rounds,
        out_dir,
        header,
        notes,
        progress,
    )
