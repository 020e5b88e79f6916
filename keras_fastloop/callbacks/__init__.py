"""Callbacks: step-gated validation, learning-rate logging, throughput/memory/profiler monitors, save on preemption."""

from keras_fastloop.callbacks.lr_logger import LearningRateLogger
from keras_fastloop.callbacks.monitors import MemoryMonitor, ProfilerWindow, ThroughputMonitor
from keras_fastloop.callbacks.periodic_validation import PeriodicValidation
from keras_fastloop.callbacks.preemption import PREEMPTED_EXIT_CODE, SaveOnPreemption

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "LearningRateLogger",
    "MemoryMonitor",
    "PeriodicValidation",
    "ProfilerWindow",
    "SaveOnPreemption",
    "ThroughputMonitor",
]
