"""`keras-fastloop` command line: `bench` (the main job) and `launch` (multi-worker).

The implementation lives in the TensorFlow-free top-level package `keras_fastloop_cli` (the
console script's entry point), so that `--help` and `--version` answer without importing
TensorFlow; this module keeps the historical import path.
"""

from keras_fastloop_cli import SUITES, build_parser, main, version

__all__ = ["SUITES", "build_parser", "main", "version"]
