"""Callbacks: step-gated validation, learning-rate logging, throughput/memory/profiler monitors."""

from keras_fastloop.callbacks.lr_logger import LearningRateLogger
from keras_fastloop.callbacks.monitors import MemoryMonitor, ProfilerWindow, ThroughputMonitor
from keras_fastloop.callbacks.periodic_validation import PeriodicValidation

__all__ = [
    "LearningRateLogger",
    "MemoryMonitor",
    "PeriodicValidation",
    "ProfilerWindow",
    "ThroughputMonitor",
]
