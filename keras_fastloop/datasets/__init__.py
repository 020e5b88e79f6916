"""Real data sets that ship offline (no download): Python standard-library source code, digits.

Like `keras.datasets`, each loader returns NumPy arrays; `keras_fastloop.data` turns them into
bucketed `tf.data` pipelines.
"""

from keras_fastloop.datasets.digits import load_digits_data
from keras_fastloop.datasets.stdlib_code import (
    DEFAULT_STDLIB_GROUPS,
    OOV_ID,
    PAD_ID,
    StdlibCode,
    load_stdlib_code,
    tokenize_source,
)

__all__ = [
    "DEFAULT_STDLIB_GROUPS",
    "OOV_ID",
    "PAD_ID",
    "StdlibCode",
    "load_digits_data",
    "load_stdlib_code",
    "tokenize_source",
]
