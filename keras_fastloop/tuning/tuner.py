"""The pure `steps_per_execution` tuner: a state machine fed with `(steps, seconds)`.

It knows no clock and no model, so tests drive it with made-up numbers. How `fit` uses it is in
`keras_fastloop.tuning._glue.AutoSteps` and `docs/fit_loop.md`; the cost model it fits is
`keras_fastloop.tuning._cost_model`.

Reference: Keras 2.13 `keras/utils/steps_per_execution_tuning.py` (the runtime tuner Keras 3
dropped).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from keras_fastloop import _validation
from keras_fastloop.tuning import _cost_model as cost_model

__all__ = ["StepsPerExecutionTuner"]

# relative slack of the gain thresholds: the ratio of two equal timings can be 1 - 1e-16
_ROUNDING = 1e-9


class StepsPerExecutionTuner:
    """Chooses the number of steps per execution from measured step throughput.

    A pure state machine: `propose` says how many steps the next execution should run,
    `observe` receives how many steps the finished execution ran and how long it took.

    How it behaves in detail: docs/behaviour.md#stepsperexecutiontuner.

    Args:
        initial: int >= 1, the first best count (the first candidate is paired with it).
            Defaults to `1`.
        max_steps: int >= initial, the largest count ever proposed. Defaults to `64`.
        growth_factor: int >= 2, candidate multiplier. Defaults to `4`.
        min_gain: float in [0, 1), the relative throughput difference that counts: a larger
            count faster by more pays, one slower by more is slower, one within it ties (and
            grows). Defaults to `0.05`.
        window: int >= 1, the fewest executions in a measurement window. Defaults to `3`.
        min_window_seconds: float >= 0, the least wall time (seconds) of a measurement window.
            Defaults to `0.25`.
        warmup_executions: int >= 0, observations dropped after `begin`. Defaults to `1`.
        patience: int >= 1, slower candidates in a row before settling. Defaults to `2`.
        drift_tolerance: float > 0, relative change of the settled rate that counts as drift.
            Defaults to `0.3`.
        drift_windows: int >= 1, drifting windows in a row that trigger re-tuning. Defaults to
            `2`.
        max_seconds_per_execution: float > 0, no candidate whose execution would take longer
            (at the measured time per step). Defaults to `1.0`.
        overhead_tolerance: float in (0, 1) or `None`, the share of an execution's time the
            per-execution overhead may keep at the count the cost model chooses. Defaults to
            `0.005`; `None`: no cost model.
        max_seconds_per_step: float > 0 or `None` (default: no screening), seconds: a probe
            whose first execution's time per step exceeds it settles there (`"long step"`).
        largest_first: bool, default `False` (requires `max_seconds_per_step`): after a
            screened step, pair the largest count that fits the horizon with the best first.

    Raises:
        ValueError: an argument out of range, or `largest_first=True` without
            `max_seconds_per_step`.

    Example:
        >>> tuner = StepsPerExecutionTuner(warmup_executions=0, window=1, min_window_seconds=0)
        >>> tuner.propose()                   # the candidate, then the best, in turn
        4
        >>> tuner.observe(4, 0.020)           # 200 steps/s at k=4
        >>> tuner.propose()
        1
        >>> tuner.observe(1, 0.010)           # 100 steps/s at k=1 meanwhile: 4 pays
        >>> tuner.phase, tuner.propose()      # T(k) = 6.7 ms + 3.3 ms * k: the cap, 64
        ('settled', 64)

    References: Keras 2.13 `StepsPerExecutionTuner` (grow while the rate improves, measured
    over intervals of wall time); Hockney, "The communication challenge for MPP: Intel
    Paragon and Meiko CS-2", Parallel Computing 20(3), 1994 (the alpha-beta cost model: a
    fixed cost per call plus a cost per item).
    """

    def __init__(
        self,
        initial: int = 1,
        max_steps: int = 64,
        growth_factor: int = 4,
        min_gain: float = 0.05,
        window: int = 3,
        min_window_seconds: float = 0.25,
        warmup_executions: int = 1,
        patience: int = 2,
        drift_tolerance: float = 0.3,
        drift_windows: int = 2,
        max_seconds_per_execution: float = 1.0,
        overhead_tolerance: float | None = 0.005,
        max_seconds_per_step: float | None = None,
        largest_first: bool = False,
    ) -> None:
        check_int, check_real = _validation.check_int, _validation.check_real
        self.initial = check_int("initial", initial, minimum=1)
        self.max_steps = check_int(
            "max_steps",
            max_steps,
            minimum=self.initial,
            requirement=f"an int >= initial ({initial})",
        )
        self.growth_factor = check_int("growth_factor", growth_factor, minimum=2)
        self.min_gain = check_real(
            "min_gain", min_gain, minimum=0.0, maximum=1.0, exclusive_maximum=True
        )
        self.window = check_int("window", window, minimum=1)
        self.min_window_seconds = check_real("min_window_seconds", min_window_seconds, minimum=0.0)
        self.warmup_executions = check_int("warmup_executions", warmup_executions, minimum=0)
        self.patience = check_int("patience", patience, minimum=1)
        self.drift_tolerance = check_real(
            "drift_tolerance", drift_tolerance, minimum=0.0, exclusive_minimum=True
        )
        self.drift_windows = check_int("drift_windows", drift_windows, minimum=1)
        self.max_seconds_per_execution = check_real(
            "max_seconds_per_execution",
            max_seconds_per_execution,
            minimum=0.0,
            exclusive_minimum=True,
        )
        self.overhead_tolerance = check_real(
            "overhead_tolerance",
            overhead_tolerance,
            minimum=0.0,
            maximum=1.0,
            exclusive_minimum=True,
            exclusive_maximum=True,
            allow_none=True,
        )
        self.max_seconds_per_step = check_real(
            "max_seconds_per_step",
            max_seconds_per_step,
            minimum=0.0,
            exclusive_minimum=True,
            allow_none=True,
        )
        if not isinstance(largest_first, bool):
            raise ValueError(
                f"`largest_first` must be a bool. Received: largest_first={largest_first!r}"
            )
        if largest_first and self.max_seconds_per_step is None:
            raise ValueError(
                "`largest_first=True` needs `max_seconds_per_step`: the screened time per step "
                "bounds the first candidate's execution time. Received: largest_first=True, "
                "max_seconds_per_step=None"
            )
        self.largest_first = largest_first
        # the first measurement runs the initial count alone: a step longer than
        # max_seconds_per_step settles there before any larger count is proposed (or compiled)
        self.horizon = None
        self.phase = "probing"
        self.candidate = self.best_steps = self.initial
        self.best_rate = None
        self.reference_rate = None
        self.history = []  # (phase, steps, median steps/s) per finished window; "retune"/"settle"
        self._warmup_left = self.warmup_executions
        self._observed_counts = set()  # counts whose first executions were dropped already
        self._new_count_left = 0
        # the open windows: the candidate's rates and seconds, and the best count's measured in
        # alternation with it
        self._clear_windows()
        self._misses = 0
        self._off_size = 0
        self._drifts = 0
        self._capped = False
        self._probe_from(self.initial)
        self.begin()

    # -- inputs ----------------------------------------------------------------------------

    def begin(self, warmup: bool = True) -> None:
        """Starts a new `fit`.

        Whatever was learned is kept: the settled count, and the open measurement windows (a
        `fit` shorter than a window, e.g. one epoch per call, still completes the probe over
        several calls).

        Args:
            warmup: bool, drop the next `warmup_executions` observations (they may include
                tracing). `fit` passes `False`: it leaves out the executions that traced.
                Defaults to `True`.
        """
        self._warmup_left = self.warmup_executions if warmup else 0

    def set_horizon(self, horizon: int | None) -> None:
        """Caps every proposal at `horizon` steps (e.g. the period of a step-gated callback).

        A count settled on because of a lower cap is revisited when the cap rises (a first
        `fit` on one batch per epoch does not keep later `fit`s at one step).

        Args:
            horizon: int >= 1 or `None` (no cap besides `max_steps`).

        Raises:
            ValueError: `horizon` neither `None` nor an int >= 1.
        """
        if horizon is not None:
            horizon = _validation.check_int("horizon", horizon, minimum=1)
        self.horizon = horizon
        cap = self.cap
        if self.candidate > cap or self.best_steps > cap:
            # what was measured belongs to counts that are no longer proposed
            self._clear_windows()
            self.best_rate = self.reference_rate = None
            self._capped = True
        if self.phase == "settled" and self._capped and cap > self.candidate:
            self._revisit()  # the cap had chosen the count, and it rose
            return
        self.candidate = min(self.candidate, cap)
        self.best_steps = min(self.best_steps, cap)
        if self.phase == "probing" and self.candidate == self.best_steps:
            self._settle(reason="cap")  # no larger count fits under the cap

    @property
    def cap(self) -> int:
        """The largest count the tuner may propose: `max_steps` and the horizon."""
        return self.max_steps if self.horizon is None else min(self.max_steps, self.horizon)

    @property
    def steps(self) -> int:
        """The count under test while probing (it alternates with `best_steps`), the chosen
        count once settled."""
        return self.candidate

    def _best_due(self):
        """While probing (candidate and best in turn), whether the best count's execution
        paired with the candidate's last one is still to run."""
        return self.phase == "probing" and len(self._best_rates) < len(self._rates)

    def _due(self):
        """The count the next execution should run: while probing, candidate and best in turn
        (the best alone while the first step time is screened)."""
        if self._screening and self.phase == "probing":
            return self.best_steps
        return self.best_steps if self._best_due() else self.candidate

    def propose(self, limit: int | None = None) -> int:
        """The number of steps the next execution should run.

        Args:
            limit: int >= 1 or `None`: steps left before the next event or epoch end.

        Returns:
            `min(current count, cap, limit)`, at least 1; while probing, the candidate and
            the best count so far in turn.
        """
        k = min(self._due(), self.cap)
        if limit is not None:
            k = min(k, int(limit))
        return max(1, k)

    def observe(self, steps: int, seconds: float) -> None:
        """Feeds the measurement of one finished execution.

        An execution that did not run the count due (cut short by a limit), or whose
        `seconds` is not a finite positive number, is not a measurement; after `4 * window`
        of them in a row, across `fit`s, a probe settles on the best count so far.

        Args:
            steps: int, steps the execution ran.
            seconds: float, its wall time: training plus the per-execution overhead
                (dispatch, the callbacks' per-batch work; `fit` times an execution from its
                slot to Keras' request for the next one).
        """
        due = self._due()
        if self._warmup_left > 0:
            self._warmup_left -= 1
            if steps == due:
                self._observed_counts.add(steps)  # this was the count's first execution
            return
        if steps != due or not (math.isfinite(seconds) and seconds > 0):
            self._off_size += 1
            if self._largest_probe and self._off_size >= 2 * self.window:
                # cut short again and again by events the horizon does not know (declared by
                # a method): the ladder's smaller counts fit between them
                self._probe_from(self.best_steps, screen=False)
            elif self.phase == "probing" and self._off_size >= 4 * self.window:
                self._settle(reason="candidate cannot run in full")
            return
        self._off_size = 0
        if steps not in self._observed_counts:  # a new count's first executions: tracing
            self._observed_counts.add(steps)
            self._new_count_left = self.warmup_executions
        if self._new_count_left > 0:
            self._new_count_left -= 1
            return
        if self._screening:
            self._screening = False
            if self.phase == "probing":
                if seconds / steps > self.max_seconds_per_step:
                    self._settle(reason="long step")
                elif self.largest_first:
                    self._candidate_from_largest(steps, seconds)
            return  # a screening measurement is not part of a paired window
        probing = self.phase == "probing"
        if probing and due == self.best_steps:
            self._best_rates.append(steps / seconds)
            self._best_seconds.append(seconds)
        else:
            self._rates.append(steps / seconds)
            self._seconds.append(seconds)
        if not self._window_full(self._seconds) or (
            probing and len(self._best_seconds) < self.window
        ):
            return
        if self._best_due():
            return  # strict alternation: the best's execution paired with the last candidate's
        rate = statistics.median(self._rates)
        if probing:
            medians = (
                rate,
                statistics.median(self._seconds),
                statistics.median(c / b for c, b in zip(self._rates, self._best_rates)),
                statistics.median(self._best_rates),
                statistics.median(self._best_seconds),
            )
        self._clear_windows()
        self.history.append((self.phase, self.candidate, rate))
        if probing:
            self._probe_decision(*medians)
        else:
            self._drift_check(rate)

    def _window_full(self, seconds):
        return len(seconds) >= self.window and sum(seconds) >= self.min_window_seconds

    def _clear_windows(self):
        self._rates, self._seconds, self._best_rates, self._best_seconds = [], [], [], []

    # -- decisions --------------------------------------------------------------------------

    def _probe_decision(self, rate, seconds, gain, best_rate, best_seconds):
        """`rate`, `seconds`: the candidate's median steps/s and seconds per execution;
        `gain`: the median ratio of its rates to the paired best's; `best_rate`,
        `best_seconds`: the best's medians."""
        self.best_rate = best_rate
        largest, self._largest_probe = self._largest_probe, False
        if gain > (1.0 + self.min_gain) * (1.0 + _ROUNDING):  # it pays
            if self.overhead_tolerance is not None:
                fit = ((self.best_steps, best_seconds), (self.candidate, seconds))
                chosen = self._cost_model_count(*fit)
                if chosen is not None:
                    self._cost_fit = fit
                    self.best_steps = chosen
                    self.best_rate = rate if chosen == self.candidate else None  # not measured
                    self._settle(reason="cost model")
                    return
            self._adopt(rate, standing=1.0)  # a ladder, or a fit that cannot extrapolate
        elif largest:
            if gain >= (1.0 - self.min_gain) * (1.0 - _ROUNDING):  # a tie: the ladder's end
                # the cap, within max_seconds_per_execution at the candidate's time per step
                in_time = self._steps_in_time(self.candidate, seconds)
                fits = self.cap if in_time >= self.cap else math.floor(in_time)
                self.best_steps = max(self.candidate, fits)
                self.best_rate = rate if self.best_steps == self.candidate else None
                self._settle(reason="tie at the largest")
            else:  # slower: the ladder from the best count
                self._probe_from(self.best_steps, screen=False)
            return
        else:
            # a tie is the measurement's noise (grouping adds no work per step), unless the
            # ties since the last count that paid add up to a loss
            standing = self._standing * gain
            if standing >= (1.0 - self.min_gain) * (1.0 - _ROUNDING):
                self._adopt(rate, standing)
            else:
                self._misses += 1
                if self._misses >= self.patience:
                    self._settle(reason="slower")
                    return
        # the next candidate: by growth_factor, within the cap and, at the candidate's measured
        # time per step, within max_seconds_per_execution
        grown = min(self.candidate * self.growth_factor, self.cap)
        if grown <= self.candidate:
            self._settle(reason="cap")
            return
        in_time = self._steps_in_time(self.candidate, seconds)
        if grown > in_time:
            grown = math.floor(in_time)
        if grown > self.candidate:
            self.candidate = grown
        else:
            self._settle(reason="max seconds")

    def _candidate_from_largest(self, steps, seconds):
        """After a short screened step (`largest_first`): the first candidate is the largest
        count whose pair with the best fits between two horizon boundaries (an epoch end, a
        step event), within `max_steps` and, at the screened time per step, within
        `max_seconds_per_execution`; never below the ladder's candidate."""
        largest = self.cap
        if self.horizon is not None:  # one step to spare: an epoch's partial last batch
            largest = min(largest, self.horizon - self.best_steps - 1)
        in_time = self._steps_in_time(steps, seconds)
        if in_time < largest:  # `inf` for a time too small to divide by: no bound
            largest = math.floor(in_time)
        if largest > self.candidate:
            self.candidate = largest
            self._largest_probe = True
            self.history.append(("largest", largest, steps / seconds))

    def _steps_in_time(self, steps, seconds):
        """How many steps fit in `max_seconds_per_execution` at `steps` per `seconds` (a float,
        `inf` for a time too small to divide by)."""
        return self.max_seconds_per_execution * steps / seconds

    def _adopt(self, rate, standing):
        """The candidate becomes the best; `standing`: its rate relative to the last count that
        paid (or the probe's start), the product of the tie ratios since."""
        self.best_steps, self.best_rate = self.candidate, rate
        self._standing = standing
        self._misses = 0

    def _probe_from(self, best, screen=True):
        """Starts probing: `best` is the count to beat, the candidate `growth_factor` times it
        (`screen=False`: without screening the best count's time per step first)."""
        self.phase = "probing"
        # every probe (the first, and a retune after drift) first runs the best count alone: a
        # step longer than max_seconds_per_step settles there before any larger count runs
        self._screening = screen and self.max_seconds_per_step is not None
        self._largest_probe = False
        self.best_steps, self.best_rate = min(best, self.cap), None
        self.candidate = min(self.best_steps * self.growth_factor, self.cap)
        self._clear_windows()
        self._drifts = self._misses = self._off_size = 0
        self._standing = 1.0
        self._cost_fit = None
        if self.candidate <= self.best_steps:
            self._settle(reason="cap")

    def _revisit(self):
        """The cap rose above a count it had limited: the cost model's count is computed again
        for the new cap; a count settled on because nothing larger fitted is probed from."""
        if self._cost_fit is None:
            self._probe_from(self.candidate)
            return
        self.best_steps = self._cost_model_count(*self._cost_fit)
        self.best_rate = None  # not measured at this count
        self._settle(reason="cost model")

    def _cost_model_count(self, best, candidate):
        """`cost_model.overhead_count` with this tuner's bounds."""
        return cost_model.overhead_count(
            best, candidate, self.overhead_tolerance, self.max_seconds_per_execution, self.cap
        )

    def _settle(self, reason):
        self.phase = "settled"
        self.candidate = self.best_steps = min(self.best_steps, self.cap)
        # whether the cap chose the count (set_horizon revisits it when the cap rises)
        self._capped = reason == "cap" or (
            reason in ("cost model", "tie at the largest") and self.candidate == self.cap
        )
        self._clear_windows()
        self.reference_rate = self.best_rate
        self._drifts = 0
        self._misses = 0
        self._off_size = 0
        self.history.append(("settle", self.candidate, reason))

    def _drift_check(self, rate):
        if self.reference_rate is None:
            self.reference_rate = rate
            return
        if abs(rate / self.reference_rate - 1.0) > self.drift_tolerance:
            self._drifts += 1
        else:
            self._drifts = 0
        if self._drifts >= self.drift_windows:
            self.history.append(("retune", self.candidate, rate))
            self._probe_from(max(self.initial, self.candidate // self.growth_factor))

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments, as a dict."""
        return {
            "initial": self.initial,
            "max_steps": self.max_steps,
            "growth_factor": self.growth_factor,
            "min_gain": self.min_gain,
            "window": self.window,
            "min_window_seconds": self.min_window_seconds,
            "warmup_executions": self.warmup_executions,
            "patience": self.patience,
            "drift_tolerance": self.drift_tolerance,
            "drift_windows": self.drift_windows,
            "max_seconds_per_execution": self.max_seconds_per_execution,
            "overhead_tolerance": self.overhead_tolerance,
            "max_seconds_per_step": self.max_seconds_per_step,
            "largest_first": self.largest_first,
        }
