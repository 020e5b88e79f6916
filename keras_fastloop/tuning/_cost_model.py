"""The alpha-beta cost model of an execution: `T(k) = a + b * k` (Hockney, 1994).

`a` is the host's work per execution (Keras' loop, the callbacks, the function call), `b` the
work per step. `StepsPerExecutionTuner` fits it to two paired medians and settles on the count
whose overhead share `a / T(k)` is small enough (`docs/fit_loop.md`, "Pairing from the first
execution, then a cost model").

Reference: Hockney, "The communication challenge for MPP: Intel Paragon and Meiko CS-2",
Parallel Computing 20(3), 1994.
"""

from __future__ import annotations

import math

__all__ = ["overhead_count"]


def overhead_count(best, candidate, overhead_tolerance, max_seconds_per_execution, cap):
    """The count where the fitted `T(k) = a + b * k` puts the overhead share at the tolerance.

    Args:
        best, candidate: `(steps, median seconds per execution)` of the two paired counts.
        overhead_tolerance: float in (0, 1), the share of an execution's time `a / T(k)` the
            overhead may keep.
        max_seconds_per_execution: float > 0, seconds no execution may exceed.
        cap: int >= 1, the largest count allowed.

    Returns:
        The count, at least the candidate's and at most `cap`, within
        `max_seconds_per_execution`; `None` where the fit cannot extrapolate (no positive
        overhead, or timings beyond float range).

    Example:
        >>> overhead_count((1, 0.010), (4, 0.020), 0.005, 1.0, 64)  # a = 6.7 ms, b = 3.3 ms
        64
    """
    (k1, t1), (k2, t2) = best, candidate
    per_step = (t2 - t1) / (k2 - k1)
    overhead = t1 - per_step * k1
    if not (math.isfinite(per_step) and math.isfinite(overhead)):
        return None  # timings beyond float range: no extrapolation
    if per_step <= 0:  # no measurable cost per step: only the time bound, at the
        # candidate's own time per step
        wanted, in_time = math.inf, max_seconds_per_execution * k2 / t2
    elif overhead <= 0:  # the gain was not the overhead's (noise): no extrapolation
        return None
    else:
        denominator = per_step * overhead_tolerance  # > 0 unless it underflows
        wanted = overhead * (1 - overhead_tolerance) / denominator if denominator > 0 else math.inf
        in_time = (max_seconds_per_execution - overhead) / per_step
    return max(k2, min(math.ceil(min(wanted, cap) - 1e-9), math.floor(min(in_time, cap))))
