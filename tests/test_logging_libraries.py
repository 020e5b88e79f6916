"""MLflow and Weights & Biases log the figures `fit` computed, with the swap as with `keras.Model`.

Each test trains on the bundled digits with the library's own Keras callback, offline (MLflow:
a file store under `tmp_path`; W&B: `mode="offline"` under `tmp_path`), reads back what the
library recorded and compares it with `history.history`, `PeriodicValidation.history` and the
same run of `keras.Model` (features off: identical numbers, 1e-6).
"""

import glob
import json
import os
import struct
import time

import keras
import numpy as np
import pytest

import keras_fastloop as kf

ATOL = 1e-6


@pytest.fixture(scope="module")
def digits():
    return kf.datasets.load_digits_data(image_size=8)  # 1438 train (23 batches of 64), 359 val


def _model(cls=kf.OptimizedModel):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Flatten()(inputs))
    return cls(inputs, keras.layers.Dense(10)(hidden))


def _compile(model, **options):
    model.compile(
        keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.01, 10, 0.5)),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **options,
    )
    return model


class _BatchEnds(keras.callbacks.Callback):
    """`(batch, optimizer.iterations)` at each `on_train_batch_end`."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append((batch, int(self.model.optimizer.iterations)))


def _assert_grouped(batch_ends, model):
    """The run grouped steps (fewer batch-end calls than steps): else a test of grouping
    could not fail."""
    assert len(batch_ends.calls) < int(model.optimizer.iterations), batch_ends.calls


# -- MLflow ----------------------------------------------------------------------------------


@pytest.fixture
def mlflow(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store, no server
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("mlflow.keras")
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    mlflow.set_experiment("keras_fastloop")
    yield mlflow
    mlflow.end_run()
    mlflow.set_tracking_uri(None)


def _mlflow_fit(mlflow, model, x, y, callbacks, **fit_kwargs):
    """`fit` inside an MLflow run: (history, {key: [(step, value), ...]} as MLflow stored it)."""
    with mlflow.start_run() as run:
        history = model.fit(x, y, batch_size=64, verbose=0, callbacks=callbacks, **fit_kwargs)
    mlflow.flush_async_logging()
    client = mlflow.tracking.MlflowClient()
    keys = client.get_run(run.info.run_id).data.metrics
    recorded = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        for key in keys
    }
    return history, recorded


def _epoch_series(recorded, key):
    points = sorted(recorded[key])
    assert [step for step, _ in points] == list(range(len(points))), points
    return [value for _, value in points]


def test_mlflow_epoch_metrics_are_the_history_and_keras_models(mlflow, digits):
    (x, y), validation_data = digits
    runs = {}
    for cls in (keras.Model, kf.OptimizedModel):
        model = _compile(_model(cls))
        runs[cls] = _mlflow_fit(
            mlflow,
            model,
            x,
            y,
            [mlflow.keras.MlflowCallback()],
            epochs=2,
            validation_data=validation_data,
        )
    history, recorded = runs[kf.OptimizedModel]
    reference_history, reference = runs[keras.Model]
    assert sorted(history.history) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    for key in history.history:
        np.testing.assert_allclose(_epoch_series(recorded, key), history.history[key], atol=ATOL)
        np.testing.assert_allclose(
            _epoch_series(recorded, key), _epoch_series(reference, key), atol=ATOL
        )
        np.testing.assert_allclose(history.history[key], reference_history.history[key], atol=ATOL)
    # MlflowCallback.on_test_end: `validation_*` of fit's validation, as for keras.Model
    assert sorted(recorded) == sorted(reference)
    np.testing.assert_allclose(
        [v for _, v in recorded["validation_loss"]], history.history["val_loss"], atol=ATOL
    )


def test_mlflow_records_step_logs_and_named_validation_sets(mlflow, digits):
    (x, y), (x_val, y_val) = digits
    model = _compile(
        _model(),
        gradient_clipping=1.0,
        log_metrics=["grad_norm", "skipped_steps"],
        steps_per_execution="auto",
    )
    sets = {"easy": (x_val[:160], y_val[:160]), "hard": (x_val[160:], y_val[160:])}
    validation = kf.callbacks.PeriodicValidation(sets, every_n_steps=10)
    batch_ends = _BatchEnds()
    history, recorded = _mlflow_fit(
        mlflow,
        model,
        x,
        y,
        [validation, mlflow.keras.MlflowCallback(), batch_ends],
        epochs=2,
    )
    _assert_grouped(batch_ends, model)
    expected = {"accuracy", "loss", "grad_norm", "skipped_steps"}
    expected |= {f"val_{name}_{key}" for name in sets for key in ("loss", "accuracy")}
    assert set(history.history) == expected
    assert set(recorded) == expected
    for key in expected:
        np.testing.assert_allclose(_epoch_series(recorded, key), history.history[key], atol=ATOL)
    # each epoch's named-set figures are that epoch's last validation (steps 20, 40)
    assert [entry["step"] for entry in validation.history] == [10, 20, 30, 40]
    last_of_epoch = [validation.history[1], validation.history[3]]
    for key in ("val_easy_loss", "val_hard_loss", "val_hard_accuracy"):
        np.testing.assert_allclose(
            _epoch_series(recorded, key), [entry[key] for entry in last_of_epoch], atol=ATOL
        )
    assert _epoch_series(recorded, "skipped_steps") == [0.0, 0.0]
    assert all(value > 0 for value in _epoch_series(recorded, "grad_norm"))


def test_mlflow_every_n_steps_logs_at_the_steps_of_keras_model(mlflow, digits):
    """`MlflowCallback(log_every_n_steps=5)` under `steps_per_execution="auto"` logs at
    optimizer steps 5, 10, ..., 45 with the values `keras.Model` logs there (one step per call)."""
    (x, y), _ = digits
    runs = {}
    for cls, options in ((keras.Model, {}), (kf.OptimizedModel, {"steps_per_execution": "auto"})):
        model = _compile(_model(cls), **options)
        batch_ends = _BatchEnds()
        logger = mlflow.keras.MlflowCallback(log_every_epoch=False, log_every_n_steps=5)
        runs[cls] = _mlflow_fit(mlflow, model, x, y, [logger, batch_ends], epochs=2)[1]
    _assert_grouped(batch_ends, model)
    recorded, reference = runs[kf.OptimizedModel], runs[keras.Model]
    assert sorted(recorded) == sorted(reference) == ["accuracy", "loss"]
    for key in reference:
        assert [step for step, _ in sorted(recorded[key])] == list(range(5, 47, 5))
        np.testing.assert_allclose(sorted(recorded[key]), sorted(reference[key]), atol=ATOL)
    # the callback read the iteration at each of its calls: those are the steps it logged at
    assert {step for _, step in batch_ends.calls} >= set(range(5, 47, 5))


def test_mlflow_step_logs_carry_each_validation_at_its_step(mlflow, digits):
    """`PeriodicValidation` writes each validation's keys into the batch logs of its step;
    `MlflowCallback(log_every_n_steps=5)` after it records them at that optimizer step."""
    (x, y), (x_val, y_val) = digits
    model = _compile(_model(), steps_per_execution="auto")
    sets = {"easy": (x_val[:160], y_val[:160]), "hard": (x_val[160:], y_val[160:])}
    validation = kf.callbacks.PeriodicValidation(sets, every_n_steps=10)
    logger = mlflow.keras.MlflowCallback(log_every_epoch=False, log_every_n_steps=5)
    batch_ends = _BatchEnds()
    _, recorded = _mlflow_fit(mlflow, model, x, y, [validation, logger, batch_ends], epochs=2)
    _assert_grouped(batch_ends, model)
    assert [entry["step"] for entry in validation.history] == [10, 20, 30, 40]
    for key in ("val_easy_loss", "val_easy_accuracy", "val_hard_loss"):
        expected = [(entry["step"], entry[key]) for entry in validation.history]
        np.testing.assert_allclose(sorted(recorded[key]), expected, atol=ATOL)
    assert [step for step, _ in sorted(recorded["loss"])] == list(range(5, 47, 5))


def test_mlflow_records_the_loss_scale_under_mixed_float16(mlflow, digits):
    (x, y), _ = digits
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Flatten()(inputs))
    model = kf.OptimizedModel(inputs, keras.layers.Dense(10, dtype="float32")(hidden))
    _compile(model, log_metrics=["loss_scale", "grad_norm"], steps_per_execution="auto")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    history, recorded = _mlflow_fit(mlflow, model, x, y, [mlflow.keras.MlflowCallback()], epochs=2)
    assert {"loss_scale", "grad_norm", "loss"} <= set(recorded)
    for key in history.history:
        np.testing.assert_allclose(_epoch_series(recorded, key), history.history[key], atol=ATOL)
    assert all(value >= 1.0 for value in _epoch_series(recorded, "loss_scale"))


def test_mlflow_autolog_records_the_history_of_an_optimized_model(mlflow, digits):
    """`mlflow.tensorflow.autolog()` patches `keras.Model.fit`; our `fit` reaches it."""
    pytest.importorskip("mlflow.tensorflow")
    (x, y), validation_data = digits
    model = _compile(_model(), gradient_clipping=1.0, steps_per_execution="auto")
    mlflow.tensorflow.autolog(log_models=False, silent=True)
    try:
        history = model.fit(
            x, y, batch_size=64, epochs=2, verbose=0, validation_data=validation_data
        )
    finally:
        mlflow.tensorflow.autolog(disable=True)
    mlflow.flush_async_logging()
    run_id = mlflow.last_active_run().info.run_id
    client = mlflow.tracking.MlflowClient()
    assert set(history.history) == {"accuracy", "loss", "grad_norm", "val_accuracy", "val_loss"}
    for key, values in history.history.items():
        points = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert [step for step, _ in points] == [0, 1]
        np.testing.assert_allclose([value for _, value in points], values, atol=ATOL)
    assert client.get_run(run_id).data.params["epochs"] == "2"


@pytest.mark.xfail(
    strict=True,
    reason="autolog adds its MlflowCallback(log_every_n_steps=5) to a copy of the callback "
    "list inside the patched keras.Model.fit, after OptimizedModel.fit handed its list to the "
    'FitRun: "auto" does not see the event and groups past steps 5, 10, ...; nothing is '
    "logged (keras.Model: 9 rows). Workaround: an explicit MlflowCallback(log_every_n_steps=N).",
)
def test_mlflow_autolog_every_n_steps_logs_at_the_steps_of_keras_model(mlflow, digits):
    """`autolog(log_every_n_steps=5)` adds its `MlflowCallback` to a copy of `fit`'s callback
    list inside the patched `keras.Model.fit`: under `"auto"` it logs at the steps and with
    the values `keras.Model` logs (one step per call)."""
    pytest.importorskip("mlflow.tensorflow")
    (x, y), _ = digits
    recorded = {}
    for cls, options in ((keras.Model, {}), (kf.OptimizedModel, {"steps_per_execution": "auto"})):
        model = _compile(_model(cls), **options)
        mlflow.tensorflow.autolog(
            log_models=False, silent=True, log_every_epoch=False, log_every_n_steps=5
        )
        try:
            model.fit(x, y, batch_size=64, epochs=2, verbose=0)
        finally:
            mlflow.tensorflow.autolog(disable=True)
        mlflow.flush_async_logging()
        run_id = mlflow.last_active_run().info.run_id
        client = mlflow.tracking.MlflowClient()
        recorded[cls] = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
    assert [step for step, _ in recorded[keras.Model]] == list(range(5, 47, 5))
    assert [step for step, _ in recorded[kf.OptimizedModel]] == list(range(5, 47, 5))
    np.testing.assert_allclose(recorded[kf.OptimizedModel], recorded[keras.Model], atol=ATOL)


def test_mlflow_keras_flavor_round_trips_an_optimized_model(mlflow, digits, tmp_path):
    (x, y), (x_val, _) = digits
    model = _compile(_model(), gradient_clipping=1.0, steps_per_execution="auto")
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    with mlflow.start_run():
        info = mlflow.keras.log_model(model, name="model", pip_requirements=["keras"])
    loaded = mlflow.keras.load_model(info.model_uri)
    assert type(loaded) is type(model) and isinstance(loaded, kf.OptimizedModel)
    assert loaded.get_compile_config()["gradient_clipping"] is not None
    np.testing.assert_array_equal(loaded.predict(x_val, verbose=0), model.predict(x_val, verbose=0))
    # training goes on from the saved step state: as the model itself does
    after_model = model.fit(x, y, batch_size=64, epochs=1, verbose=0).history["loss"]
    after_loaded = loaded.fit(x, y, batch_size=64, epochs=1, verbose=0).history["loss"]
    np.testing.assert_allclose(after_loaded, after_model, atol=ATOL)


# -- Weights & Biases ------------------------------------------------------------------------


@pytest.fixture
def wandb(tmp_path, monkeypatch):
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CACHE_DIR": str(tmp_path / "cache"),  # wandb-core's logs: not in the home
        "WANDB_CONFIG_DIR": str(tmp_path / "config"),
        "WANDB_DATA_DIR": str(tmp_path / "data"),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    wandb = pytest.importorskip("wandb")
    pytest.importorskip("wandb.integration.keras")
    yield wandb
    if wandb.run is not None:
        wandb.run.finish()


def _wandb_rows(run_dir, timeout=30.0):
    """The history rows of an offline run, read from its `.wandb` file.

    The file is a LevelDB-style log (W&B's record store): a 7-byte header (`:W&B`, magic,
    version), then 32 KiB blocks of chunks `crc32 (4) | length (2) | type (1) | data`, type 1
    a whole record, 2/3/4 its first/middle/last part; a block's tail shorter than a chunk
    header is padding. Each record is a `wandb_internal_pb2.Record`. Waits for the run's exit
    record (the writer may still be flushing after `finish`); a chunk cut short by the end of
    the file is one still being written, read again on the next pass.
    """
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(run_dir, "*.wandb"))
    deadline = time.monotonic() + timeout
    while True:
        with open(path, "rb") as file:
            data = file.read()
        assert data[:4] == b":W&B", data[:7]
        records, pos, payload, block = [], 7, b"", 32768
        while pos + 7 <= len(data):
            room = block - pos % block
            if room < 7:
                pos += room
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if kind == 0:  # zero padding up to the block's end
                pos += room
                continue
            if pos + 7 + length > len(data):  # a chunk still being written: read again
                break
            payload += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(payload)
                records.append(record)
                payload = b""
        kinds = [record.WhichOneof("record_type") for record in records]
        if "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert "exit" in kinds, f"no exit record in {path}: {kinds}"
    return [
        {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in record.history.item
        }
        for record in records
        if record.WhichOneof("record_type") == "history"
    ]


def _wandb_fit(wandb, model, x, y, log_freq, callbacks=(), **fit_kwargs):
    """`fit` in an offline W&B run with `WandbMetricsLogger(log_freq)`: (history, rows, summary)."""
    from wandb.integration.keras import WandbMetricsLogger

    run = wandb.init(mode="offline", project="keras_fastloop")
    run_dir = os.path.dirname(run.dir.rstrip(os.sep))  # run.dir is <run>/files
    history = model.fit(
        x,
        y,
        batch_size=64,
        verbose=0,
        callbacks=[*callbacks, WandbMetricsLogger(log_freq=log_freq)],
        **fit_kwargs,
    )
    summary = {key: value for key, value in dict(run.summary).items() if not key.startswith("_")}
    run.finish()
    return history, _wandb_rows(run_dir), summary


def _columns(rows, prefix):
    """{key: [values]} over the rows that hold keys starting with `prefix`."""
    columns = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith(prefix):
                columns.setdefault(key[len(prefix) :], []).append(value)
    return columns


def test_wandb_epoch_logs_are_the_history_and_keras_models(wandb, digits):
    (x, y), validation_data = digits
    runs = {}
    for cls in (keras.Model, kf.OptimizedModel):
        model = _compile(_model(cls))
        runs[cls] = _wandb_fit(
            wandb, model, x, y, "epoch", epochs=2, validation_data=validation_data
        )
    history, rows, summary = runs[kf.OptimizedModel]
    _, reference_rows, reference_summary = runs[keras.Model]
    logged = _columns(rows, "epoch/")
    assert logged["epoch"] == [0, 1]
    for key in history.history:
        np.testing.assert_allclose(logged[key], history.history[key], atol=ATOL)
        np.testing.assert_allclose(summary[f"epoch/{key}"], history.history[key][-1], atol=ATOL)
    reference = _columns(reference_rows, "epoch/")
    assert sorted(logged) == sorted(reference)
    for key in reference:
        np.testing.assert_allclose(logged[key], reference[key], atol=ATOL)
    assert sorted(summary) == sorted(reference_summary)


def test_wandb_epoch_logs_carry_step_statistics_and_named_sets(wandb, digits):
    (x, y), (x_val, y_val) = digits
    model = _compile(
        _model(), gradient_clipping=1.0, log_metrics=["grad_norm"], steps_per_execution="auto"
    )
    sets = {"easy": (x_val[:160], y_val[:160]), "hard": (x_val[160:], y_val[160:])}
    validation = kf.callbacks.PeriodicValidation(sets, every_n_steps=10)
    history, rows, summary = _wandb_fit(
        wandb, model, x, y, "epoch", callbacks=[validation], epochs=2
    )
    logged = _columns(rows, "epoch/")
    assert {"grad_norm", "val_easy_loss", "val_hard_accuracy"} <= set(logged)
    for key in history.history:
        np.testing.assert_allclose(logged[key], history.history[key], atol=ATOL)
        np.testing.assert_allclose(summary[f"epoch/{key}"], history.history[key][-1], atol=ATOL)
    np.testing.assert_allclose(
        logged["val_hard_loss"],
        [validation.history[1]["val_hard_loss"], validation.history[3]["val_hard_loss"]],
        atol=ATOL,
    )


def test_wandb_batch_logs_under_auto_are_keras_models(wandb, digits):
    """`WandbMetricsLogger(log_freq=5)` logs after batches 0, 5, ..., 20 of each epoch, on
    the axis `batch/batch_step` it counts itself (+5 per log). Under grouped steps it saw
    only the executions' last batches: 2 rows instead of 10, step 44's figures at
    `batch_step` 5. `"auto"` ends an execution after each batch it logs at."""
    (x, y), _ = digits
    runs = {}
    for cls, options in ((keras.Model, {}), (kf.OptimizedModel, {"steps_per_execution": "auto"})):
        model = _compile(_model(cls), **options)
        batch_ends = _BatchEnds()
        runs[cls] = _wandb_fit(wandb, model, x, y, 5, callbacks=[batch_ends], epochs=2)[1]
    _assert_grouped(batch_ends, model)
    logged, reference = (
        _columns(runs[kf.OptimizedModel], "batch/"),
        _columns(runs[keras.Model], "batch/"),
    )
    assert reference["batch_step"] == list(range(0, 50, 5))
    assert sorted(logged) == sorted(reference)
    assert logged["batch_step"] == reference["batch_step"]
    for key in ("loss", "accuracy", "learning_rate"):
        np.testing.assert_allclose(logged[key], reference[key], atol=ATOL)
    # the batches it logged after, as optimizer steps: 1, 6, ..., 21 and 24, 29, ..., 44
    logged_steps = [step for batch, step in batch_ends.calls if batch % 5 == 0]
    assert logged_steps == [1, 6, 11, 16, 21, 24, 29, 34, 39, 44]


def test_wandb_batch_logger_declares_its_logged_batches_as_events(wandb):
    from wandb.integration.keras import WandbMetricsLogger

    from keras_fastloop.callbacks import events

    class Own(WandbMetricsLogger):  # a user's subclass is the same logger
        pass

    wandb.init(mode="offline", project="keras_fastloop")
    every_5, per_epoch, own = WandbMetricsLogger(log_freq=5), WandbMetricsLogger(), Own("batch")
    assert [events.logged_batch_period(c) for c in (every_5, per_epoch, own)] == [5, None, 1]
    # from the next batch's index: batches to train up to and including the next logged one
    gaps = [events.batches_until_next_event([every_5], 0, batch) for batch in (0, 1, 4, 5, 6)]
    assert gaps == [1, 5, 2, 1, 5]
    assert events.batches_until_next_event([per_epoch], 0, 3) is None
    assert events.event_periods([every_5, per_epoch]) == [5]


def test_wandb_logging_every_batch_under_auto_says_it_runs_one_step(wandb, digits):
    (x, y), _ = digits
    model = _compile(_model(), steps_per_execution="auto")
    with pytest.warns(kf.FastloopWarning, match=r"WandbMetricsLogger logs after every batch"):
        _, rows, _ = _wandb_fit(wandb, model, x[:640], y[:640], "batch", epochs=2)
    logged = _columns(rows, "batch/")
    assert logged["batch_step"] == list(range(20))  # every batch of both epochs, in order
