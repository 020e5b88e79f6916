"""Callbacks: step-gated validation (named sets, EMA weights), learning-rate logging, throughput/memory/profiler monitors, save on preemption.

A callback of your own that must see the model after given optimizer steps or batches (to
validate, save, log or profile there) declares them as step events, and
`steps_per_execution="auto"` ends its executions there: a method
`steps_until_next_event(step)` or `batches_until_next_event(batch)`, or an int attribute
`every_n_steps`. The protocol: `keras_fastloop.callbacks.events`.
"""

from keras_fastloop.callbacks import events  # noqa: F401 - the step-event protocol
from keras_fastloop.callbacks.ema import EMAValidation, ema_weights, use_ema_warmup
from keras_fastloop.callbacks.lr_logger import LearningRateLogger
from keras_fastloop.callbacks.monitors import MemoryMonitor, ProfilerWindow, ThroughputMonitor
from keras_fastloop.callbacks.periodic_validation import PeriodicValidation
from keras_fastloop.callbacks.preemption import PREEMPTED_EXIT_CODE, SaveOnPreemption

__all__ = [
    "EMAValidation",
    "PREEMPTED_EXIT_CODE",
    "LearningRateLogger",
    "MemoryMonitor",
    "PeriodicValidation",
    "ProfilerWindow",
    "SaveOnPreemption",
    "ThroughputMonitor",
    "ema_weights",
    "use_ema_warmup",
]
