"""The fit loop (keras_fastloop/_fit_loop.py): features that compose, with their figures.

Each test compares against the reference run (uninterrupted, `steps_per_execution=1`): exact
optimizer step counts and weights. `"auto"` runs use a fake clock on which every execution
takes 10 ms, so larger step counts always pay and the tuner really groups steps.
"""

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_fastloop as kf
from keras_fastloop import _fit_loop as fit_loop
from keras_fastloop.callbacks import PeriodicValidation, ProfilerWindow
from keras_fastloop.model import OptimizedModel
from keras_fastloop.tuning import StepsPerExecutionTuner

# "auto-largest": "auto" with the tuner it creates by default, which screens the first step and
# then pairs the largest count that fits with one step (`largest_first`)
SPE = [1, 4, "auto", "auto-largest"]


class _FakeClock:
    def __init__(self):
        self.counter = itertools.count()

    def __call__(self):
        return 0.01 * next(self.counter)


def make_model(steps_per_execution=1, features=8, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    model = OptimizedModel(inputs, keras.layers.Dense(1)(hidden))
    auto = steps_per_execution in ("auto", "auto-largest")
    model.compile(
        keras.optimizers.SGD(0.01),
        "mse",
        steps_per_execution="auto" if auto else steps_per_execution,
    )
    if auto:
        state = model.fastloop_step.auto_steps
        largest = steps_per_execution == "auto-largest"
        state.tuner = StepsPerExecutionTuner(
            window=1,
            min_window_seconds=0,
            max_steps=32,
            max_seconds_per_step=0.05 if largest else None,
            largest_first=largest,
        )
        state.clock = _FakeClock()
    return model


def make_data(n, features=8, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = (x @ rng.normal(size=(features, 1)) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def dataset(x, y, batch_size=4):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)


def max_weight_difference(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights()))


def iterations(model):
    return int(model.optimizer.iterations.numpy())


def executions(model):
    return list(model.fastloop_step.auto_steps.executions)


class Crash(Exception):
    pass


class CrashAt(keras.callbacks.Callback):
    """Raises (a simulated crash) after batch `batch` of epoch `epoch` (or the first past it)."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) >= self.at:
            raise Crash(f"simulated crash after epoch {self.epoch} batch {batch}")


class SavedAt:
    """Records `optimizer.iterations` at each save of a checkpoint callback."""

    @staticmethod
    def backup(backup_dir, save_freq):
        class Backup(keras.callbacks.BackupAndRestore):
            saves = []

            def _save_model(self):
                self.saves.append(iterations(self.model))
                super()._save_model()

        return Backup(backup_dir, save_freq=save_freq)

    @staticmethod
    def checkpoint(path, save_freq):
        class Checkpoint(keras.callbacks.ModelCheckpoint):
            saves = []

            def _save_model(self, epoch, batch, logs):
                self.saves.append(iterations(self.model))

        return Checkpoint(path, save_freq=save_freq, save_weights_only=True)


# ---------------------------------------------------------------------------- design checks


def test_fit_arguments_are_bound_once_by_name():
    """Positional callbacks (6th argument) get the internal callbacks like keyword ones."""
    x, y = make_data(32)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen.append(
                sorted({type(c).__name__ for c in fit_loop.current_run(self.model).callbacks})
            )

    model = make_model()
    model.fit(x, y, 8, 1, 0, [Record()])
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Record()])
    assert seen[0] == seen[1] == ["NonFiniteMonitor", "Record"]
    with pytest.raises(TypeError):
        model.fit(x, y, not_an_argument=1)
    assert fit_loop.current_run(model) is None  # state of a fit does not outlive it


def test_epoch_iterator_is_restored_after_fit():
    x, y = make_data(32)
    model = make_model("auto")
    captured = []

    class Record(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            captured.append(fit_loop.current_run(self.model).iterator)

    model.fit(dataset(x, y), epochs=1, verbose=0, callbacks=[Record()])
    assert "_enumerate_iterator" not in captured[0].__dict__


def test_internal_callbacks_run_in_their_declared_order(tmp_path):
    """`INTERNAL_CALLBACKS` is the one list: its "before" entries, each user callback with its
    "after_each" entries, then its "after" entries."""
    places = [entry.place for entry in fit_loop.INTERNAL_CALLBACKS.values()]
    assert places == sorted(places, key=["before", "after_each", "after"].index)
    x, y = make_data(32)
    model = make_model("auto")
    model.compile(keras.optimizers.SGD(0.01), "mse", steps_per_execution="auto", micro_batch_size=2)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen.extend(type(c).__name__ for c in fit_loop.current_run(self.model).callbacks)

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=3)
    board = keras.callbacks.TensorBoard(str(tmp_path / "tb"), write_graph=True)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[backup, board, Record()])
    assert seen == [
        "_ExecutionClock",
        "BackupAndRestore",
        "_MidEpochResume",
        "TensorBoard",
        "TensorBoardModelSummary",
        "Record",
        "BatchSizeMonitor",
        "NonFiniteMonitor",
    ]


class _AtPowersOfTwo(keras.callbacks.Callback):
    """A user callback with step events after optimizer steps 1, 2, 4, 8, ..."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def steps_until_next_event(self, step):
        return (1 << step.bit_length()) - step

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(iterations(self.model))


class _AfterEveryTenthBatch(keras.callbacks.Callback):
    """A user callback with step events after batches 9, 19, 29, ... of every epoch."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def batches_until_next_event(self, batch):
        return 10 - batch % 10

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(batch)


@pytest.mark.parametrize("callback", [_AtPowersOfTwo, _AfterEveryTenthBatch])
def test_auto_respects_the_step_events_of_a_user_callback(callback):
    """The protocol of `keras_fastloop.callbacks.events`: every execution ends at the user
    callback's next event, and the run trains like one step per execution."""
    x, y = make_data(256)  # 64 batches of 4 per epoch, 2 epochs: 128 steps
    reference = make_model()
    reference.fit(dataset(x, y), epochs=2, verbose=0)
    model = make_model("auto")
    user = callback()
    model.fit(dataset(x, y), epochs=2, verbose=0, callbacks=[user])
    assert max(k for _, k in executions(model)) > 1  # it grouped steps
    if callback is _AtPowersOfTwo:
        expected = [1, 2, 4, 8, 16, 32, 64, 128]
    else:
        expected = [9, 19, 29, 39, 49, 59] * 2
    assert [v for v in user.seen if v in set(expected)] == expected
    assert iterations(model) == 128
    assert max_weight_difference(model, reference) <= 1e-6


def test_optimized_model_is_not_based_on_a_callbacks_module():
    for base in OptimizedModel.__mro__:
        assert ".callbacks" not in base.__module__, base


def reference_run(samples, validation_samples):
    """Training and validation data and the uninterrupted 3-epoch run the resumed one must match."""
    x, y = make_data(samples)
    validation = make_data(validation_samples, seed=2)
    reference = make_model()
    reference.fit(dataset(x, y), epochs=3, verbose=0)
    return (x, y), validation, reference


# ------------------------------------------------------------------- 1. auto + mid-epoch resume


@pytest.mark.parametrize(
    "spe",
    [
        pytest.param(1, marks=pytest.mark.slow),
        pytest.param(4, marks=pytest.mark.slow),
        "auto",
        "auto-largest",
    ],
)
def test_mid_epoch_resume_under_every_steps_per_execution(tmp_path, spe):
    """2,048 samples, batch 4, 3 epochs, BackupAndRestore(save_freq=50), crash at epoch 1 batch
    201: the resumed run ends with 1,536 optimizer steps and the uninterrupted run's weights."""
    x, y = make_data(2048)
    reference = make_model()
    reference.fit(dataset(x, y), epochs=3, verbose=0)
    assert iterations(reference) == 1536

    backup_dir = str(tmp_path / "backup")
    crashed = make_model(spe)
    with pytest.raises(Crash):
        crashed.fit(
            dataset(x, y),
            epochs=3,
            verbose=0,
            callbacks=[
                keras.callbacks.BackupAndRestore(backup_dir, save_freq=50),
                CrashAt(1, 201),
            ],
        )
    resumed = make_model(spe)
    first = []

    class First(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if not first:
                first.append((batch, iterations(self.model)))

    resumed.fit(
        dataset(x, y),
        epochs=3,
        verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup_dir, save_freq=50), First()],
    )
    assert first[0][0] > 0 and first[0][1] == 512 + first[0][0]  # resumed mid-epoch 1
    assert iterations(resumed) == 1536
    if spe in ("auto", "auto-largest"):
        sizes = [k for _, k in executions(resumed)]
        assert max(sizes) > 1 and sum(sizes) == 1536 - first[0][1]
    assert max_weight_difference(resumed, reference) <= 1e-6


# --------------------------------------------------------------- 2. save points are step events


@pytest.mark.parametrize("spe", SPE)
def test_backup_and_restore_saves_where_the_user_asked(tmp_path, spe):
    """save_freq=8 on 16 batches x 2 epochs saves after steps 8, 16, 24, 32 under 1, 4, auto.

    Keras 3.15 alone saves after 12, 20, 28 under steps_per_execution=4 (its counter starts at
    0); under "auto" the tuner did not stop at the save points (8, 18, 30)."""
    x, y = make_data(64)
    model = make_model(spe)
    backup = SavedAt.backup(str(tmp_path / "b"), save_freq=8)
    model.fit(dataset(x, y), epochs=2, verbose=0, callbacks=[backup])
    assert backup.saves == [8, 16, 24, 32]


@pytest.mark.parametrize("spe", [1, "auto", "auto-largest"])
def test_model_checkpoint_save_freq_lands_on_multiples(tmp_path, spe):
    """save_freq=6 over 2 epochs of 32 batches: saves after steps 6, 12, ..., 60 (the tuner's
    powers of two would otherwise cross the save points)."""
    x, y = make_data(128)
    model = make_model(spe)
    checkpoint = SavedAt.checkpoint(str(tmp_path / "w.weights.h5"), save_freq=6)
    model.fit(dataset(x, y), epochs=2, verbose=0, callbacks=[checkpoint])
    assert checkpoint.saves == list(range(6, 61, 6))
    if spe != 1:
        assert max(k for _, k in executions(model)) == 6  # grouped, never across a save


# ------------------------------------------------- 7. and 8. data of unknown length under auto


def unknown_length_dataset(x, y, batch_size=8, reshuffle=True):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: a[0] > -100.0)
    return ds.shuffle(len(x), seed=3, reshuffle_each_iteration=reshuffle).batch(batch_size)


class _ScriptedTuner(StepsPerExecutionTuner):
    """Proposes the scripted counts, then 8 (capped by the limit the fit loop passes)."""

    def __init__(self, script):
        super().__init__()
        self.script = list(script)

    def propose(self, limit=None):
        k = self.script.pop(0) if self.script else 8
        return k if limit is None else max(1, min(k, int(limit)))


def test_auto_does_not_change_the_data_order_on_unknown_length():
    """19 batches per epoch of unknown cardinality, reshuffled each epoch, 4 epochs: "auto"
    trains the same batch at every step as steps_per_execution=1 (the grouping used to read
    batches ahead, made Keras infer 21-22 batches and restart the data at other points)."""
    x, y = make_data(152)
    reference = make_model()  # seeds TF: build each dataset after its model
    data = unknown_length_dataset(x, y)
    assert data.cardinality().numpy() == tf.data.UNKNOWN_CARDINALITY
    history_1 = reference.fit(data, epochs=4, verbose=0).history
    model = make_model("auto")
    # Executions of 4 steps in epoch 0, then of 8: with read-ahead grouping Keras would infer
    # 24 batches, and the last execution of epoch 1 would end on the 24th slot and make Keras
    # open one more data iterator, shifting the shuffle order of every later epoch.
    model.fastloop_step.auto_steps.tuner = _ScriptedTuner([4] * 6)
    history_auto = model.fit(unknown_length_dataset(x, y), epochs=4, verbose=0).history
    assert iterations(model) == iterations(reference) == 76
    assert all(k == 1 for _, k in executions(model))
    np.testing.assert_allclose(history_auto["loss"], history_1["loss"], rtol=1e-6)
    assert max_weight_difference(model, reference) <= 1e-6


@pytest.mark.parametrize("spe", SPE)
def test_exactly_one_step_per_batch_on_unknown_length(spe):
    """3 epochs x 4 batches of unknown length: 12 optimizer steps (keras.Model takes 15)."""
    x, y = make_data(32)
    model = make_model(spe)
    model.fit(unknown_length_dataset(x, y, reshuffle=False), epochs=3, verbose=0)
    assert iterations(model) == 12


def test_keras_takes_an_extra_step_per_epoch_on_unknown_length():
    """What Keras 3.15 does on its own (documents the README sentence; not our defect)."""
    x, y = make_data(32)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(keras.optimizers.SGD(0.01), "mse")
    model.fit(unknown_length_dataset(x, y, reshuffle=False), epochs=3, verbose=0)
    assert iterations(model) == 15  # Keras 3.15.1; OptimizedModel: 12 (above)


# ------------------------------------------------------- 9. backup on an epoch's last batch


@pytest.mark.parametrize("spe", SPE)
def test_backup_on_the_last_batch_resumes_at_the_next_epoch(tmp_path, spe):
    """8 batches per epoch, save_freq=8: the backup after step 8 resumes at epoch 1 (no empty
    replay of epoch 0, on_epoch_end once per epoch, validation steps [8, 16, 24])."""
    (x, y), (x_val, y_val), reference = reference_run(samples=32, validation_samples=8)
    backup_dir = str(tmp_path / "backup")

    def callbacks(crash):
        validation = PeriodicValidation((x_val, y_val), every_n_epochs=1, backup_dir=backup_dir)
        extra = [CrashAt(1, 2)] if crash else []
        return validation, [
            validation,
            keras.callbacks.BackupAndRestore(backup_dir, save_freq=8),
            *extra,
        ]

    model = make_model(spe)
    _, crash_callbacks = callbacks(crash=True)
    with pytest.raises(Crash):
        model.fit(dataset(x, y), epochs=3, verbose=0, callbacks=crash_callbacks)
    ends = []

    class Ends(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            ends.append(epoch)

    resumed = make_model(spe)
    validation, resume_callbacks = callbacks(crash=False)
    history = resumed.fit(dataset(x, y), epochs=3, verbose=0, callbacks=[*resume_callbacks, Ends()])
    assert ends == [1, 2]
    assert history.epoch == [1, 2] and len(history.history["loss"]) == 2
    assert [record["step"] for record in validation.history] == [8, 16, 24]
    assert iterations(resumed) == 24
    assert max_weight_difference(resumed, reference) <= 1e-6


# ---------------------------------------------------------------- 10. profiler window under auto


def test_profiler_window_records_under_auto(tmp_path):
    """A window of steps 100-104 inside 200 steps: executions end before 100 and after 104."""
    x, y = make_data(200)
    model = make_model("auto")
    profiler = ProfilerWindow(start_step=100, stop_step=104, logdir=str(tmp_path / "logs"))
    model.fit(dataset(x, y, batch_size=1), epochs=1, verbose=0, callbacks=[profiler])
    assert profiler.profiled_steps == (100, 104)
    ends = {begin + k for begin, k in executions(model)}
    assert {99, 104} <= ends
    assert max(k for _, k in executions(model)) > 5  # the tuner did group steps


# ----------------------------------------- pairwise: steps_per_execution x {PV, checkpoint}


@pytest.mark.parametrize("spe", SPE)
def test_pairwise_periodic_validation(spe):
    x, y = make_data(96)  # 24 batches per epoch
    x_val, y_val = make_data(16, seed=2)
    reference = make_model()
    reference_validation = PeriodicValidation((x_val, y_val), every_n_steps=8)
    reference.fit(dataset(x, y), epochs=2, verbose=0, callbacks=[reference_validation])
    model = make_model(spe)
    validation = PeriodicValidation((x_val, y_val), every_n_steps=8)
    model.fit(dataset(x, y), epochs=2, verbose=0, callbacks=[validation])
    assert iterations(model) == iterations(reference) == 48
    steps = [r["step"] for r in validation.history]
    assert steps == [r["step"] for r in reference_validation.history] == list(range(8, 49, 8))
    for a, b in zip(validation.history, reference_validation.history):
        assert abs(a["val_loss"] - b["val_loss"]) <= 1e-5
    assert max_weight_difference(model, reference) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("spe", SPE)
def test_pairwise_resume_with_checkpoint_and_validation(tmp_path, spe):
    """Mid-epoch resume + ModelCheckpoint(save_freq=8) + PeriodicValidation(every_n_steps=8)."""
    (x, y), (x_val, y_val), reference = reference_run(samples=96, validation_samples=16)
    backup_dir = str(tmp_path / "backup")

    def callbacks(crash):
        validation = PeriodicValidation((x_val, y_val), every_n_steps=8, backup_dir=backup_dir)
        checkpoint = SavedAt.checkpoint(str(tmp_path / "w.weights.h5"), save_freq=8)
        extra = [CrashAt(1, 11)] if crash else []
        backup = keras.callbacks.BackupAndRestore(backup_dir, save_freq=4)
        return validation, checkpoint, [validation, backup, checkpoint, *extra]

    with pytest.raises(Crash):
        make_model(spe).fit(dataset(x, y), epochs=3, verbose=0, callbacks=callbacks(True)[2])
    validation, checkpoint, resume_callbacks = callbacks(False)
    resumed = make_model(spe)
    resumed.fit(dataset(x, y), epochs=3, verbose=0, callbacks=resume_callbacks)
    assert iterations(resumed) == 72
    assert [r["step"] for r in validation.history] == list(range(8, 73, 8))
    assert checkpoint.saves == list(range(40, 73, 8))  # after the resume at step 36
    assert max_weight_difference(resumed, reference) <= 1e-6


def test_fit_takes_a_callback_list_like_keras_and_leaves_it_unchanged():
    """`fit(callbacks=keras.callbacks.CallbackList(...))` raised AttributeError (review); the
    internal callbacks must not pile up in the user's list across fits either."""
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x[:, :1] * 2.0
    results = []
    for cls, compile_kwargs in (
        (keras.Model, {}),
        (kf.OptimizedModel, {}),
        (kf.OptimizedModel, {"steps_per_execution": "auto", "micro_batch_size": 2}),
    ):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        model = cls(inputs, keras.layers.Dense(1)(inputs))
        model.compile("sgd", "mse", **compile_kwargs)
        history = keras.callbacks.History()
        callback_list = keras.callbacks.CallbackList([history], model=model)
        for _ in range(2):
            model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callback_list)
        assert callback_list.callbacks == [history]
        results.append((history.history, model.get_weights()))
    for h, w in results[1:]:
        assert h.keys() == results[0][0].keys()
        for key in h:
            np.testing.assert_allclose(h[key], results[0][0][key], rtol=1e-6, err_msg=key)
        for a, b in zip(results[0][1], w):
            np.testing.assert_allclose(b, a, rtol=1e-6)
