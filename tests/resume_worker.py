"""Training process for tests/test_resume.py: trains a tiny OptimizedModel, may SIGKILL itself.

Usage: `python tests/resume_worker.py CONFIG_JSON`. The config holds:

- `case`: `"plain"`, `"mixed"` (mixed_float16), `"uw"`, `"autoclip"` or `"pv"`
  (PeriodicValidation driving an EarlyStopping).
- `out`: path prefix of the results (`.npz` with every variable, `.json` with the rest).
- `backup_dir`: the `BackupAndRestore` directory (`save_freq` = `save_freq` batches).
- `kill_after`: global batch count (1-based, over all epochs) after whose end the process kills
  itself with SIGKILL (after `BackupAndRestore` has had its turn), or `null`.
- `exact`: keep OptimizedModel's mid-epoch resume (`keras_fastloop._resume`); `false` switches it
  off in this process, to show stock Keras' behaviour.
- `epochs`, `steps_per_execution`, `save_freq`.

The data holds one NaN sample, so one update per epoch is skipped (`skipped_steps`) and, under
mixed precision, the loss scale is halved: both must survive the kill.
"""

import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["KERAS_BACKEND"] = "tensorflow"

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_fastloop as kf  # noqa: E402
from keras_fastloop import _fit_loop as fit_loop  # noqa: E402

NUM_SAMPLES, BATCH_SIZE = 48, 4


def make_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_SAMPLES, 4)).astype("float32")
    ya = (x @ rng.normal(size=(4, 1))).astype("float32")
    yb = (np.tanh(x[:, :1]) * 3.0).astype("float32")
    x[13, 2] = np.nan  # one non-finite batch per epoch
    train = (
        tf.data.Dataset.from_tensor_slices((x, {"a": ya, "b": yb}))
        .shuffle(NUM_SAMPLES, seed=7, reshuffle_each_iteration=False)
        .batch(BATCH_SIZE)
    )
    xv = rng.normal(size=(16, 4)).astype("float32")
    val = tf.data.Dataset.from_tensor_slices(
        (xv, {"a": (xv @ np.ones((4, 1))).astype("float32"), "b": np.tanh(xv[:, :1]) * 3.0})
    ).batch(8)
    return train, val


class Killer(keras.callbacks.Callback):
    def __init__(self, kill_after):
        super().__init__()
        self.kill_after = kill_after

    def on_train_batch_end(self, batch, logs=None):
        done = self._epoch * self.params["steps"] + batch + 1
        if self.kill_after is not None and done >= self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch


class Recorder(keras.callbacks.Callback):
    """What this process trained: the first (epoch, batch, optimizer step) and the count."""

    def __init__(self):
        super().__init__()
        self.first = None
        self.batches = 0
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.first is None:
            self.first = [self.epoch, batch, int(self.model.optimizer.iterations.numpy())]

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1


def main(config):
    keras.utils.set_random_seed(0)
    tf.config.experimental.enable_op_determinism()
    case = config["case"]
    if case == "mixed":
        keras.mixed_precision.set_global_policy("mixed_float16")
    train, val = make_data()

    model_class = kf.OptimizedModel
    if not config["exact"]:
        # Stock Keras behaviour, for the test that shows the defect: the fit loop adds no
        # resume callback in this (throw-away) process.
        fit_loop.INTERNAL_CALLBACKS.pop("exact_resume")

    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = {
        "a": keras.layers.Dense(1, name="a", dtype="float32")(hidden),
        "b": keras.layers.Dense(1, name="b", dtype="float32")(hidden),
    }
    model = model_class(inputs, outputs)
    schedule = kf.schedules.WarmupCosineDecayRestarts(
        initial_learning_rate=0.0, warmup_target=0.05, warmup_steps=5, first_decay_steps=7
    )
    model.compile(
        optimizer=keras.optimizers.AdamW(schedule),
        loss={"a": "mse", "b": "mse"},
        steps_per_execution=config.get("steps_per_execution", 1),
        gradient_clipping=kf.clipping.AutoClip(50.0, history_size=8)
        if case == "autoclip"
        else None,
        loss_weighting="uw" if case == "uw" else None,
    )
    backup = keras.callbacks.BackupAndRestore(
        config["backup_dir"], save_freq=config.get("save_freq", 4)
    )
    callbacks = [backup]
    validation = None
    if case == "pv":
        early_stopping = keras.callbacks.EarlyStopping(monitor="val_loss", patience=1000)
        validation = kf.callbacks.PeriodicValidation(
            val,
            every_n_steps=5,
            callbacks=[early_stopping],
            backup_dir=config["backup_dir"],
        )
        callbacks.insert(0, validation)  # before BackupAndRestore: order must not matter
    recorder = Recorder()
    callbacks += [Killer(config.get("kill_after")), recorder]
    model.fit(train, epochs=config["epochs"], callbacks=callbacks, verbose=0)

    arrays = {f"model/{v.path}": v.numpy() for v in model.weights}
    arrays.update({f"optimizer/{v.path}": v.numpy() for v in model.optimizer.variables})
    arrays.update({f"state/{v.path}": v.numpy() for v in model.fastloop_step.state.weights})
    np.savez(config["out"] + ".npz", **arrays)
    result = {
        "first": recorder.first,
        "batches": recorder.batches,
        "iterations": int(model.optimizer.iterations.numpy()),
        "skipped_steps": int(model.skipped_steps.numpy()),
        "validation": validation.get_state() if validation is not None else None,
    }
    with open(config["out"] + ".json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
