"""`keras_fastloop.launch`: the multi-worker launcher (lives in `keras_fastloop_cli.launch`).

The launcher uses only the standard library; it lives in the TensorFlow-free
`keras_fastloop_cli` package so that `keras-fastloop launch` starts its workers without
importing TensorFlow in the parent process. This module keeps the historical import path.
"""

from keras_fastloop_cli.launch import DEFAULT_TIMEOUT, free_ports, launch, main, tf_config

__all__ = ["DEFAULT_TIMEOUT", "free_ports", "launch", "main", "tf_config"]
