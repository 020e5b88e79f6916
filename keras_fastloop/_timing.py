"""Timing without the garbage collector's pauses: one helper for every timed block.

Python's cyclic collector runs when allocation counts pass a threshold; in a process that holds
TensorFlow's object graph one collection takes 0.5-3 s and lands in whatever is being timed.
`timeit` turns the collector off while it times; so do the bench, the confirmation of the
precision policy and the multi-task step timings, through `collector_paused`.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused(collect_first: bool = False) -> Iterator[None]:
    """Runs the block with the cyclic garbage collector off (restored after, also on errors).

    Args:
        collect_first: bool, run a full `gc.collect()` before the block, so that earlier garbage
            does not wait for the end of the block. Defaults to `False` (a collection can take
            seconds in a large process: the caller decides when it pays).
    """
    if collect_first:
        gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
