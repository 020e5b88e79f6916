"""The step-event protocol, kept importable here; it lives in `keras_fastloop.callbacks.events`."""

from keras_fastloop.callbacks.events import (  # noqa: F401
    batches_until_next_event,
    counts_calls,
    event_periods,
    reads_optimizer_step,
    steps_until_next_event,
)

__all__ = [
    "batches_until_next_event",
    "counts_calls",
    "event_periods",
    "reads_optimizer_step",
    "steps_until_next_event",
]
