"""Input pipelines: length bucketing on tf.data and padding statistics.

The bundled data sets the examples use live in `keras_fastloop.datasets`.
"""

from keras_fastloop.data.bucketing import (
    BucketPlan,
    apply_bucket_plan,
    bucket_by_length,
    geometric_boundaries,
    plan_buckets,
    quantile_boundaries,
    token_budget_batch_sizes,
)
from keras_fastloop.data.sequences import sequences_to_dataset
from keras_fastloop.data.stats import PaddingStats, padding_stats

__all__ = [
    "BucketPlan",
    "PaddingStats",
    "apply_bucket_plan",
    "bucket_by_length",
    "geometric_boundaries",
    "padding_stats",
    "plan_buckets",
    "quantile_boundaries",
    "sequences_to_dataset",
    "token_budget_batch_sizes",
]
