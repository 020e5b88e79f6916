"""Tests for keras_fastloop.callbacks.monitors (fake clocks; no timing is asserted)."""

import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_fastloop.callbacks import monitors
from keras_fastloop.callbacks.monitors import MemoryMonitor, ProfilerWindow, ThroughputMonitor


class FakeClock:
    """A clock that only moves when the test moves it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


class AdvanceClock(keras.callbacks.Callback):
    """Moves a fake clock at each train batch end: `first` seconds once, then `per_call`."""

    def __init__(self, clock, first, per_call):
        super().__init__()
        self.clock, self.first, self.per_call, self.calls = clock, first, per_call, 0

    def on_train_batch_end(self, batch, logs=None):
        self.clock.advance(self.first if self.calls == 0 else self.per_call)
        self.calls += 1


class BatchLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append((batch, dict(logs or {})))


def _model(steps_per_execution=1):
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(inputs)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
    return model


def _data(n=32):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


# ---------------------------------------------------------------------------------------------
# ThroughputMonitor
# ---------------------------------------------------------------------------------------------


def test_throughput_excludes_first_step_fake_clock():
    clock = FakeClock()
    monitor = ThroughputMonitor(batch_size=8, timer=clock)
    x, y = _data(32)  # 4 batches of 8
    history = _model().fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        verbose=0,
        shuffle=False,
        # The tracing call takes 5 s on the fake clock, every other call 0.5 s.
        callbacks=[AdvanceClock(clock, first=5.0, per_call=0.5), monitor],
    )
    # Epoch 1: first step excluded -> 3 steps of 0.5 s. Epoch 2: 4 steps of 0.5 s.
    assert history.history["step_time_ms"] == [500.0, 500.0]
    assert history.history["samples_per_sec"] == [16.0, 16.0]


def test_throughput_infers_samples_from_loss_tracker_with_short_last_batch():
    clock = FakeClock()
    x, y = _data(30)  # batches of 8, 8, 8, 6
    history = _model().fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        shuffle=False,
        callbacks=[AdvanceClock(clock, 5.0, 0.5), ThroughputMonitor(timer=clock)],
    )
    # Timed steps: 8 + 8 + 6 samples in 1.5 s.
    assert history.history["samples_per_sec"] == [pytest.approx(22 / 1.5)]
    assert history.history["step_time_ms"] == [500.0]


def test_throughput_counts_steps_from_batch_indices_with_steps_per_execution():
    clock = FakeClock()
    x, y = _data(64)  # 8 batches of 8, callbacks fire at batches 1, 3, 5, 7
    batch_logs = BatchLogs()
    history = _model(steps_per_execution=2).fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        shuffle=False,
        callbacks=[
            AdvanceClock(clock, 5.0, 1.0),  # 1 s per callback call = per 2 steps
            ThroughputMonitor(batch_size=8, log_every_n_steps=4, timer=clock),
            batch_logs,
        ],
    )
    assert [b for b, _ in batch_logs.logs] == [1, 3, 5, 7]
    # 3 timed calls x 2 steps in 3 s -> 500 ms per step, 16 samples/s.
    assert history.history["step_time_ms"] == [500.0]
    assert history.history["samples_per_sec"] == [16.0]
    # Window of 4 steps completes at batch 5 (steps 3..6), not at 3 or 7.
    windows = [(b, logs.get("step_time_ms")) for b, logs in batch_logs.logs]
    assert windows == [(1, None), (3, None), (5, 500.0), (7, None)]


def test_throughput_unit_calls_and_pause_during_validation():
    """Drives the hooks by hand: validation inside an epoch is not counted as training time."""
    clock = FakeClock()
    monitor = ThroughputMonitor(batch_size=10, log_every_n_steps=2, timer=clock)
    monitor.set_model(_model())
    monitor.on_train_begin()
    monitor.on_epoch_begin(0)
    monitor.on_train_batch_begin(0)
    clock.advance(9.0)  # tracing
    monitor.on_train_batch_end(0, {})
    logs = {}
    for batch in (1, 2):
        monitor.on_train_batch_begin(batch)
        clock.advance(0.2)
        monitor.on_train_batch_end(batch, logs)
    assert logs["step_time_ms"] == pytest.approx(200.0)
    assert logs["samples_per_sec"] == pytest.approx(50.0)
    monitor.on_test_begin()
    clock.advance(100.0)  # periodic validation in the middle of the epoch
    monitor.on_test_end()
    monitor.on_train_batch_begin(3)
    clock.advance(0.4)
    monitor.on_train_batch_end(3, {})
    epoch_logs = {}
    monitor.on_epoch_end(0, epoch_logs)
    assert epoch_logs["step_time_ms"] == pytest.approx(800.0 / 3)
    assert epoch_logs["samples_per_sec"] == pytest.approx(30 / 0.8)


def test_monitors_tolerate_standalone_evaluate_and_predict():
    x, y = _data(16)
    model = _model()
    callbacks = [ThroughputMonitor(batch_size=8), MemoryMonitor()]
    loss = model.evaluate(x, y, batch_size=8, verbose=0, callbacks=callbacks)
    assert np.isfinite(loss)
    model.predict(x, batch_size=8, verbose=0, callbacks=callbacks)


def test_throughput_argument_validation():
    with pytest.raises(ValueError, match="Received: batch_size=0"):
        ThroughputMonitor(batch_size=0)
    with pytest.raises(ValueError, match="Received: log_every_n_steps=1.5"):
        ThroughputMonitor(log_every_n_steps=1.5)
    with pytest.raises(ValueError, match="`timer` must be callable. Received: timer=3"):
        ThroughputMonitor(timer=3)


# ---------------------------------------------------------------------------------------------
# MemoryMonitor
# ---------------------------------------------------------------------------------------------


def test_memory_monitor_keys_in_history_on_cpu():
    x, y = _data(32)
    history = _model().fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        verbose=0,
        validation_data=(x[:16], y[:16]),
        callbacks=[MemoryMonitor()],
    )
    for key in ("peak_memory_mb", "val_peak_memory_mb"):
        values = history.history[key]
        assert len(values) == 2 and all(v > 1.0 for v in values)  # an RSS of > 1 MiB


def test_memory_monitor_separates_phases_with_scripted_rss(monkeypatch):
    """Train samples peak at 300 MiB, validation at 700 MiB: each phase keeps its own max."""
    current = {"mib": 100.0}
    monkeypatch.setattr(monitors, "_rss_bytes", lambda: int(current["mib"] * 2**20))

    class Script(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            current["mib"] = 300.0 if batch == 1 else 200.0

        def on_test_batch_end(self, batch, logs=None):
            current["mib"] = 700.0 if batch == 0 else 150.0

        def on_test_end(self, logs=None):
            current["mib"] = 120.0

    x, y = _data(32)
    history = _model().fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        validation_data=(x, y),
        validation_batch_size=8,
        callbacks=[Script(), MemoryMonitor(device="cpu")],
    )
    assert history.history["peak_memory_mb"] == [300.0]
    assert history.history["val_peak_memory_mb"] == [700.0]


def test_memory_monitor_gpu_path_uses_peak_and_reset(monkeypatch):
    """The GPU path, with TensorFlow's memory functions replaced by a fake allocator."""
    state = {"peak": 0, "resets": 0}

    def get_memory_info(device):
        assert device == "GPU:0"
        return {"current": 0, "peak": state["peak"]}

    def reset_memory_stats(device):
        state["resets"] += 1
        state["peak"] = 0

    monkeypatch.setattr(tf.config.experimental, "get_memory_info", get_memory_info)
    monkeypatch.setattr(tf.config.experimental, "reset_memory_stats", reset_memory_stats)

    class Allocate(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            state["peak"] = max(state["peak"], 64 * 2**20)

        def on_test_batch_end(self, batch, logs=None):
            state["peak"] = max(state["peak"], 32 * 2**20)

    x, y = _data(16)
    history = _model().fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        validation_data=(x, y),
        callbacks=[Allocate(), MemoryMonitor(device="GPU:0")],
    )
    assert history.history["peak_memory_mb"] == [64.0]
    assert history.history["val_peak_memory_mb"] == [32.0]
    assert state["resets"] >= 2


def test_memory_monitor_argument_validation():
    with pytest.raises(ValueError, match="Received: device=None"):
        MemoryMonitor(device=None)


# ---------------------------------------------------------------------------------------------
# TensorBoard integration
# ---------------------------------------------------------------------------------------------


def _scalar_tags(run_dir):
    tags = {}
    for path in glob.glob(os.path.join(run_dir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                number = float(tf.make_ndarray(value.tensor)) if value.HasField("tensor") else None
                tags.setdefault(value.tag, []).append((event.step, number))
    return tags


def _tensorboard(logdir, **kwargs):
    # The real callback: the `bench` extra installs `tensorboard` (tests/test_tensorboard.py).
    return keras.callbacks.TensorBoard(logdir, write_graph=False, **kwargs)


def test_monitor_values_reach_tensorboard_event_files(tmp_path):
    clock = FakeClock()
    x, y = _data(32)
    logdir = str(tmp_path / "tb")
    _model().fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        verbose=0,
        validation_data=(x[:16], y[:16]),
        callbacks=[
            AdvanceClock(clock, 5.0, 0.25),
            ThroughputMonitor(batch_size=8, log_every_n_steps=2, timer=clock),
            MemoryMonitor(),
            _tensorboard(logdir, update_freq=1),  # after the monitors: they fill `logs` first
        ],
    )
    train = _scalar_tags(os.path.join(logdir, "train"))
    val = _scalar_tags(os.path.join(logdir, "validation"))
    assert train["epoch_step_time_ms"] == [(0, 250.0), (1, 250.0)]
    assert train["epoch_samples_per_sec"] == [(0, 32.0), (1, 32.0)]
    assert [step for step, _ in train["epoch_peak_memory_mb"]] == [0, 1]
    assert all(value > 1.0 for _, value in train["epoch_peak_memory_mb"])
    assert [step for step, _ in val["epoch_peak_memory_mb"]] == [0, 1]
    # Windowed values (every 2 timed steps) as batch scalars: global batches 3, 6, 8.
    assert train["batch_step_time_ms"] == [(3, 250.0), (6, 250.0), (8, 250.0)]


# ---------------------------------------------------------------------------------------------
# ProfilerWindow
# ---------------------------------------------------------------------------------------------


def _profile_files(logdir):
    return [
        p
        for p in glob.glob(os.path.join(logdir, "plugins", "profile", "**", "*"), recursive=True)
        if os.path.isfile(p)
    ]


def _profiler_is_free(tmp_path):
    """True if a new profiler session can start, i.e. ProfilerWindow left none running."""
    tf.profiler.experimental.start(str(tmp_path / "probe"))
    tf.profiler.experimental.stop()
    return True


def test_profiler_window_writes_trace(tmp_path):
    logdir = str(tmp_path / "prof")
    profiler = ProfilerWindow(start_step=3, stop_step=4, logdir=logdir)
    x, y = _data(32)  # 4 steps per epoch; the window spans the epoch boundary
    _model().fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[profiler])
    assert profiler.profiled_steps == (3, 4)
    assert _profile_files(logdir), "no trace under logdir/plugins/profile"
    assert _profiler_is_free(tmp_path)


def test_profiler_window_says_where_the_time_went_by_op_type(tmp_path):
    profiler = ProfilerWindow(start_step=3, stop_step=6, logdir=str(tmp_path / "prof"))
    with pytest.raises(RuntimeError, match="recorded no trace yet"):
        profiler.op_time_by_type()
    x, y = _data(64)
    _model().fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[profiler])
    rows = profiler.op_time_by_type()
    assert rows and all(r.ms_per_step > 0 and r.occurrences > 0 for r in rows)
    assert sum(r.share for r in rows) == pytest.approx(1.0)
    assert [r.ms_per_step for r in rows] == sorted((r.ms_per_step for r in rows), reverse=True)
    kinds = {r.op_type for r in rows}
    assert "IDLE" not in kinds
    # the Dense layers' kernels: Eigen's `MatMul`/`_FusedMatMul`, or oneDNN's (`_MklMatMul`,
    # `_MklNativeFusedMatMul`) where TensorFlow turns oneDNN on (CPUs with AVX512_BF16, ...)
    assert any("MatMul" in kind for kind in kinds), sorted(kinds)
    assert profiler.op_time_by_type(top=2) == rows[:2]
    with pytest.raises(ValueError, match="Received: top=0"):
        profiler.op_time_by_type(top=0)


def test_profiler_window_stops_when_training_ends_inside_window(tmp_path):
    logdir = str(tmp_path / "prof")
    profiler = ProfilerWindow(start_step=2, stop_step=100, logdir=logdir)
    x, y = _data(16)
    _model().fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[profiler])
    assert profiler.profiled_steps == (2, 4)
    assert _profile_files(logdir)
    assert _profiler_is_free(tmp_path)


def test_profiler_window_with_steps_per_execution_widens_to_whole_executions(tmp_path):
    logdir = str(tmp_path / "prof")
    profiler = ProfilerWindow(start_step=4, stop_step=5, logdir=logdir)
    x, y = _data(64)  # 8 steps, executions of 2: (1-2), (3-4), (5-6), (7-8)
    _model(steps_per_execution=2).fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[profiler])
    assert profiler.profiled_steps == (3, 6)


def test_profiler_window_warns_when_training_is_too_short(tmp_path):
    profiler = ProfilerWindow(start_step=50, stop_step=60, logdir=str(tmp_path / "p"))
    x, y = _data(16)
    with pytest.warns(UserWarning, match="no trace recorded"):
        _model().fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[profiler])
    assert profiler.profiled_steps is None


def test_profiler_window_argument_validation(tmp_path):
    with pytest.raises(ValueError, match="Received: start_step=0"):
        ProfilerWindow(0, 3, str(tmp_path))
    with pytest.raises(ValueError, match="Received: start_step=5, stop_step=4"):
        ProfilerWindow(5, 4, str(tmp_path))
    with pytest.raises(ValueError, match="Received: start_step=True"):
        ProfilerWindow(True, 4, str(tmp_path))
    with pytest.raises(ValueError, match="Received: logdir=''"):
        ProfilerWindow(1, 2, "")
