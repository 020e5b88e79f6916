# Over 500 lines on purpose: the three measuring callbacks share the logs-dict contract and
# the sample counting this docstring describes; each class is self-contained below it.
"""Callbacks that measure training: throughput, peak memory, and a profiler window.

`ThroughputMonitor` and `MemoryMonitor` put their values into the `logs` dict, so `History`,
`CSVLogger`, `EarlyStopping` and `keras.callbacks.TensorBoard` see them like any metric.
Keras passes one `logs` dict along the callback list in order, so **put the monitors before
`TensorBoard` (and `CSVLogger`) in `callbacks=[...]`**; `History`, added by `fit`, always comes
last. TensorBoard then writes them as `epoch_samples_per_sec`, `epoch_step_time_ms` and
`epoch_peak_memory_mb` (train run; `val_peak_memory_mb` goes to the validation run as
`epoch_peak_memory_mb`), and with `update_freq` set, windowed throughput as `batch_*` scalars.

Steps are counted from batch indices, never from callback calls: with `steps_per_execution=N`
Keras calls the batch callbacks once per N batches with the index of the last one.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from keras_fastloop import _tf_internals, _validation
from keras_fastloop._warnings import FastloopWarning

__all__ = ["ThroughputMonitor", "MemoryMonitor", "ProfilerWindow", "OpTime"]

_MIB = float(2**20)


# --------------------------------------------------------------------------------------------
# Throughput
# --------------------------------------------------------------------------------------------


def _find_sample_counter(model):
    """The `count` variable of the model's `loss` Mean tracker, or None.

    Keras' built-in train step updates that tracker with `sample_weight=batch_size`, so its
    count is the number of samples seen since the metrics were last reset (every epoch).
    """
    try:
        metrics = model.metrics
    except Exception:  # noqa: BLE001 - not compiled / unusual model: no inference
        return None
    for metric in metrics:
        if getattr(metric, "name", None) == "loss" and hasattr(metric, "count"):
            return metric.count
    return None


class ThroughputMonitor(keras.callbacks.Callback):
    """Logs training throughput (samples/s) and step time (ms), without the tracing step.

    Time is wall-clock between consecutive `on_train_batch_end` calls (so it includes input
    pipeline stalls and callback overhead, as a user experiences it), divided by the number of
    steps those calls span, read from the batch indices (`steps_per_execution` > 1 is handled).
    The very first call of `fit` (the one that traces and compiles the step) is excluded; so is
    time spent in validation run from inside an epoch (`on_test_begin` .. `on_test_end`).

    Samples: `batch_size * steps` when `batch_size` is given (or found in `self.params`);
    otherwise they are counted exactly from the `count` of the model's `loss` tracker, which
    Keras' built-in train step weights by the batch size (so a short last batch counts right).
    A custom train step that does not update that tracker that way needs `batch_size`.

    Keys added to the epoch `logs` (omitted for an epoch with no timed step):
    `samples_per_sec` (samples per second, when samples are known) and `step_time_ms`
    (milliseconds per optimizer step, averaged over the epoch). With `log_every_n_steps=N` the
    same keys are added to the batch `logs` every time at least N new steps were timed, averaged
    over that window. Place this callback before `TensorBoard` so it writes them.

    Args:
        batch_size: int or None, global samples per step. `None` infers it (see above).
            Defaults to `None`.
        log_every_n_steps: int or None, window length in steps for batch-level values; `None`
            logs per epoch only. Defaults to `None`.
        timer: callable returning seconds as a float; inject a fake timer in tests. Defaults to
            `time.perf_counter` (the name `timer` is the one of `set_recommended_policy`,
            `tuning.recommended_setup` and Python's `timeit`).

    Raises:
        ValueError: if `batch_size` or `log_every_n_steps` is not a positive int or None, or
            `timer` is not callable.

    Example:

    >>> monitor = ThroughputMonitor(batch_size=32)
    >>> # model.fit(x, y, batch_size=32, callbacks=[monitor, keras.callbacks.TensorBoard("logs")])
    >>> # model.history.history["samples_per_sec"]
    """

    def __init__(
        self,
        batch_size: int | None = None,
        log_every_n_steps: int | None = None,
        timer: Callable[[], float] | None = None,
    ) -> None:
        super().__init__()
        batch_size = _validation.check_int("batch_size", batch_size, minimum=1, allow_none=True)
        log_every_n_steps = _validation.check_int(
            "log_every_n_steps", log_every_n_steps, minimum=1, allow_none=True
        )
        timer = time.perf_counter if timer is None else timer
        _validation.check_callable("timer", timer)
        self.batch_size = batch_size
        self.log_every_n_steps = log_every_n_steps
        self.timer = timer
        self._counter = None
        self._mark = None
        self._pause_start = None

    # -- helpers -------------------------------------------------------------------------------

    def _samples_seen(self):
        if self._counter is None:
            return None
        return float(keras.ops.convert_to_numpy(self._counter))

    def _values(self, seconds, steps, samples):
        values = {"step_time_ms": 1000.0 * seconds / steps}
        if samples is not None and seconds > 0:
            values["samples_per_sec"] = samples / seconds
        return values

    # -- callback hooks ------------------------------------------------------------------------

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._batch_size = self.batch_size or (self.params or {}).get("batch_size")
        self._counter = None if self._batch_size else _find_sample_counter(self.model)
        if self._batch_size is None and self._counter is None:
            warnings.warn(
                "ThroughputMonitor cannot tell the batch size (no `batch_size` argument and no "
                "`loss` tracker on the model); only `step_time_ms` will be logged.",
                FastloopWarning,
                stacklevel=2,
            )
        self._traced = False
        self._pause_start = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._mark = None
        self._mark_samples = None
        self._last_batch = -1
        self._epoch = [0.0, 0, 0.0]  # seconds, steps, samples
        self._window = [0.0, 0, 0.0]

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._mark is None:  # first call of the epoch starts the clock
            self._mark = self.timer()
            self._mark_samples = self._samples_seen()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        now = self.timer()
        steps = int(batch) - self._last_batch
        self._last_batch = int(batch)
        seconds = now - self._mark
        seen = self._samples_seen()
        if self._batch_size:
            samples = float(self._batch_size * steps)
        elif seen is not None and self._mark_samples is not None:
            samples = seen - self._mark_samples
        else:
            samples = None
        self._mark, self._mark_samples = now, seen
        if not self._traced:  # the first call of training traces the step: not representative
            self._traced = True
            return
        if steps <= 0:
            return
        for acc in (self._epoch, self._window):
            acc[0] += seconds
            acc[1] += steps
            acc[2] = None if samples is None or acc[2] is None else acc[2] + samples
        if self.log_every_n_steps and self._window[1] >= self.log_every_n_steps:
            if logs is not None:
                logs.update(self._values(*self._window))
            self._window = [0.0, 0, 0.0]

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self._mark is not None:  # validation inside a training epoch
            self._pause_start = self.timer()

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._pause_start is not None and self._mark is not None:
            self._mark += self.timer() - self._pause_start
        self._pause_start = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        seconds, steps, samples = self._epoch
        if steps > 0 and logs is not None:
            logs.update(self._values(seconds, steps, samples))
        self._mark = None  # time between epochs (validation, other callbacks) is not counted


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    """Resident set size of this process in bytes (psutil, else /proc/self/status)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.Process().memory_info().rss)
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return 0


class MemoryMonitor(keras.callbacks.Callback):
    """Logs the peak memory of each phase of an epoch: training and validation.

    On GPU the peak comes from `tf.config.experimental.get_memory_info(device)["peak"]`, reset
    with `tf.config.experimental.reset_memory_stats` when a phase begins; with several GPUs the
    largest per-device peak is logged (out-of-memory happens per device). On CPU the value is the
    process' resident set size (psutil, else `/proc/self/status` VmRSS), sampled at each batch
    end and at phase boundaries, keeping the maximum per phase. The kernel's own high-water mark
    (VmHWM) cannot be reset per phase, so it is not used; a transient peak inside a step that is
    freed before the step returns is therefore not seen on CPU.

    Keys added to the epoch `logs`, in MiB (2**20 bytes): `peak_memory_mb` (training phase)
    and, when validation ran in that epoch, `val_peak_memory_mb`. Validation run from inside an
    epoch (e.g. periodic validation) counts toward `val_peak_memory_mb` and is kept out of the
    training peak. Place this callback before `TensorBoard` so it writes them.

    Args:
        device: string, `"auto"` (all visible GPUs if any, else host memory), `"cpu"` (host
            memory), or a GPU device name such as `"GPU:0"`. Defaults to `"auto"`.

    Raises:
        ValueError: if `device` is not a string.

    Example:

    >>> monitor = MemoryMonitor()
    >>> # model.fit(x, y, validation_data=(xv, yv), callbacks=[monitor])
    >>> # model.history.history["peak_memory_mb"], model.history.history["val_peak_memory_mb"]
    """

    def __init__(self, device: str = "auto") -> None:
        super().__init__()
        if not isinstance(device, str) or not device:
            raise ValueError(
                '`device` must be "auto", "cpu" or a GPU device name such as "GPU:0". '
                f"Received: device={device!r}"
            )
        self.device = device
        self._phase = None
        self._peaks = {"train": None, "val": None}

    def _resolve_devices(self):
        device = self.device.lower()
        if device == "cpu":
            return []
        if device == "auto":
            return [d.name.replace("/device:", "") for d in tf.config.list_logical_devices("GPU")]
        return [self.device]

    # -- phase bookkeeping ---------------------------------------------------------------------

    def _reset(self):
        for device in self._devices:
            try:
                tf.config.experimental.reset_memory_stats(device)
            except Exception:  # noqa: BLE001 - unsupported device: peak is then cumulative
                pass

    def _measure(self) -> float:
        if not self._devices:
            return _rss_bytes() / _MIB
        peaks = []
        for device in self._devices:
            try:
                peaks.append(tf.config.experimental.get_memory_info(device)["peak"])
            except Exception:  # noqa: BLE001
                continue
        return max(peaks) / _MIB if peaks else 0.0

    def _record(self, phase, value):
        old = self._peaks.get(phase)
        self._peaks[phase] = value if old is None else max(old, value)

    def _enter(self, phase):
        self._phase = phase
        self._reset()
        if not self._devices:
            self._record(phase, self._measure())

    def _leave(self):
        if self._phase is not None:
            self._record(self._phase, self._measure())
        self._phase = None

    # -- callback hooks ------------------------------------------------------------------------

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._devices = self._resolve_devices()
        self._resume = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._peaks = {"train": None, "val": None}
        self._enter("train")

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self._devices and self._phase == "train":
            self._record("train", self._measure())

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not hasattr(self, "_devices"):  # standalone evaluate()
            self._devices = self._resolve_devices()
        self._resume = self._phase
        self._leave()
        self._enter("val")

    def on_test_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self._devices and self._phase == "val":
            self._record("val", self._measure())

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
        self._leave()
        if self._resume is not None:
            self._enter(self._resume)
        self._resume = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._phase == "train":
            self._leave()
        if logs is None:
            return
        if self._peaks["train"] is not None:
            logs["peak_memory_mb"] = float(self._peaks["train"])
        if self._peaks["val"] is not None:
            logs["val_peak_memory_mb"] = float(self._peaks["val"])


# --------------------------------------------------------------------------------------------
# Profiler
# --------------------------------------------------------------------------------------------


class ProfilerWindow(keras.callbacks.Callback):
    """Runs the TensorFlow profiler over a chosen window of training steps.

    Steps are numbered from 1 at the start of each `fit()` call and counted across epochs from
    batch indices (like `keras.callbacks.TensorBoard(profile_batch=...)`), so
    `steps_per_execution` > 1 is handled; the window is then widened to whole executions. The
    profiler starts before the first step of the window and stops after `stop_step`, or at the
    end of training if it ends inside the window. The trace lands in
    `logdir/plugins/profile/<timestamp>/`, which TensorBoard's Profile tab shows when `logdir` is
    (or is under) the TensorBoard log directory. If another profiler is already running (e.g.
    `TensorBoard(profile_batch=...)`), a warning is issued and nothing is recorded.

    After training, `profiled_steps` holds `(first, last)` steps covered, or `None`, and
    `op_time_by_type()` says where the window's time went, by op type, without TensorBoard.

    Args:
        start_step: int >= 1, first step to profile (1-based, counted from the start of `fit`).
        stop_step: int >= `start_step`, last step to profile.
        logdir: string or path-like, directory for the trace.

    Raises:
        ValueError: if `start_step` is not an int >= 1, `stop_step` not an int >= `start_step`,
            or `logdir` is empty.

    Example:

    >>> profiler = ProfilerWindow(start_step=10, stop_step=15, logdir="logs")
    >>> # model.fit(x, y, callbacks=[profiler]); then `tensorboard --logdir logs` -> Profile tab
    >>> # or: for row in profiler.op_time_by_type(top=5): print(row)
    """

    def __init__(self, start_step: int, stop_step: int, logdir: str | os.PathLike[str]) -> None:
        super().__init__()
        start_step = _validation.check_int("start_step", start_step, minimum=1)
        if not _validation.is_int(stop_step) or stop_step < start_step:
            raise ValueError(
                "`stop_step` must be an integer >= `start_step`. "
                f"Received: start_step={start_step!r}, stop_step={stop_step!r}"
            )
        stop_step = int(stop_step)
        if logdir is None or not os.fspath(logdir):
            raise ValueError(
                f"`logdir` must be a non-empty directory path. Received: logdir={logdir!r}"
            )
        self.start_step = start_step
        self.stop_step = stop_step
        self.logdir = os.fspath(logdir)
        self.profiled_steps = None
        self.trace_dir = None
        self._running = False
        self._before = set()

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._base = 0  # steps completed before the current epoch
        self._completed = 0
        self._done = False
        self._first = None
        self.profiled_steps = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._base = self._completed

    def batches_until_next_event(self, batch: int) -> int | None:
        """Batches from the next one (index `batch` of the epoch) to the window's next edge.

        A step event for `steps_per_execution="auto"` (`keras_fastloop.callbacks.events`):
        executions end right before `start_step` and right after `stop_step`, so the window
        is profiled exactly. Returns an int >= 1, or `None` once the window is done.
        """
        if self._done:
            return None
        first = self._base + int(batch) + 1
        if first < self.start_step:
            return self.start_step - first
        if first <= self.stop_step:
            return self.stop_step - first + 1
        return None

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self._running or self._done:
            return
        first = self._base + int(batch) + 1
        span = max(int(getattr(self.model, "steps_per_execution", 1) or 1), 1)
        if first + span - 1 >= self.start_step and first <= self.stop_step:
            self._before = set(self._trace_dirs())
            try:
                tf.profiler.experimental.start(self.logdir)
            except Exception as e:  # noqa: BLE001 - e.g. another profiler already running
                warnings.warn(
                    f"ProfilerWindow could not start the profiler ({e}); no trace recorded.",
                    FastloopWarning,
                    stacklevel=2,
                )
                self._done = True
                return
            self._running = True
            self._first = first

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._completed = self._base + int(batch) + 1
        if self._running and self._completed >= self.stop_step:
            self._stop()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._running:  # training ended inside the window
            self._stop()
        elif not self._done:
            warnings.warn(
                f"ProfilerWindow: training ended after {self._completed} steps, before "
                f"start_step={self.start_step}; no trace recorded.",
                FastloopWarning,
                stacklevel=2,
            )

    def _stop(self):
        try:
            tf.profiler.experimental.stop()
        finally:
            self._running = False
            self._done = True
            self.profiled_steps = (self._first, self._completed)
            new = sorted(set(self._trace_dirs()) - self._before)
            self.trace_dir = new[-1] if new else None

    def _trace_dirs(self):
        root = os.path.join(self.logdir, "plugins", "profile")
        if not os.path.isdir(root):
            return []
        return [os.path.join(root, d) for d in os.listdir(root)]

    def op_time_by_type(self, top: int | None = None) -> list[OpTime]:
        """Where the profiled window's time went: self time per op type, per training step.

        Read from this window's trace with TensorFlow's `framework_op_stats` tool (what
        TensorBoard's Profile tab shows as "TensorFlow Stats"). Self times are summed over all
        threads, so on a CPU a step's op time can exceed its wall time; the profiler's `IDLE`
        pseudo-op is left out.

        Args:
            top: int >= 1 or `None`: keep the `top` op types with the most time. Defaults to
                `None` (all).

        Returns:
            A list of `OpTime(op_type, device, ms_per_step, share, occurrences)`, most time
            first; `device` is `"Host"` or `"Device"`, `ms_per_step` is milliseconds per
            profiled step and `share` the fraction of all op time in the window.

        Raises:
            RuntimeError: no trace was recorded (training has not run through the window).
            ValueError: `top` is not an int >= 1.
        """
        if top is not None:
            top = _validation.check_int("top", top, minimum=1)
        paths = []
        if self.trace_dir is not None:
            paths = [
                os.path.join(self.trace_dir, f)
                for f in sorted(os.listdir(self.trace_dir))
                if f.endswith(".xplane.pb")
            ]
        if not paths or self.profiled_steps is None:
            raise RuntimeError(
                "ProfilerWindow recorded no trace yet: train through the window first. "
                f"Received: profiled_steps={self.profiled_steps!r}, logdir={self.logdir!r}"
            )
        labels, rows = _tf_internals.profiler_op_stats(paths)
        column = {label.lower(): i for i, label in enumerate(labels)}
        kind, device = column["operation type"], column["host/device"]
        self_us, count = column["total self-time (us)"], column["#occurrences"]
        totals = {}
        for row in rows:
            if row[kind] == "IDLE":
                continue
            key = (row[kind], row[device])
            us, n = totals.get(key, (0.0, 0))
            totals[key] = (us + float(row[self_us] or 0.0), n + int(row[count] or 0))
        steps = self.profiled_steps[1] - self.profiled_steps[0] + 1
        all_us = sum(us for us, _ in totals.values()) or 1.0
        result = sorted(
            (
                OpTime(op_type, where, us / 1e3 / steps, us / all_us, n)
                for (op_type, where), (us, n) in totals.items()
            ),
            key=lambda r: -r.ms_per_step,
        )
        return result[:top] if top is not None else result


class OpTime(NamedTuple):
    """One op type's time in a `ProfilerWindow` (see `ProfilerWindow.op_time_by_type`)."""

    op_type: str
    device: str
    ms_per_step: float
    share: float
    occurrences: int
