"""Input pipelines: length bucketing on tf.data, padding statistics, real offline data sets."""

from keras_fastloop.data.bucketing import (
    BucketPlan,
    apply_bucket_plan,
    bucket_by_length,
    geometric_boundaries,
    plan_buckets,
    quantile_boundaries,
    token_budget_batch_sizes,
)
from keras_fastloop.data.datasets import (
    DEFAULT_STDLIB_GROUPS,
    OOV_ID,
    PAD_ID,
    StdlibCode,
    load_stdlib_code,
    sequences_to_dataset,
    tokenize_source,
)
from keras_fastloop.data.digits import load_digits_data
from keras_fastloop.data.stats import PaddingStats, padding_stats

__all__ = [
    "DEFAULT_STDLIB_GROUPS",
    "OOV_ID",
    "PAD_ID",
    "BucketPlan",
    "PaddingStats",
    "StdlibCode",
    "apply_bucket_plan",
    "bucket_by_length",
    "geometric_boundaries",
    "load_digits_data",
    "load_stdlib_code",
    "padding_stats",
    "plan_buckets",
    "quantile_boundaries",
    "sequences_to_dataset",
    "token_budget_batch_sizes",
    "tokenize_source",
]
