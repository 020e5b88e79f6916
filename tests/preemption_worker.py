"""Training process for tests/test_preemption.py: a tiny OptimizedModel with SaveOnPreemption.

Usage: `python tests/preemption_worker.py CONFIG_JSON` (as one of `launch`'s workers when
`TF_CONFIG` is set: then under `MultiWorkerMirroredStrategy`, each worker with its own backup
directory `backup_dir/worker<i>`). The config holds:

- `out`: path prefix of the results (`.npz` with every variable), written by worker 0
  (worker i > 0: `.worker<i>.npz`).
- `backup_dir`, `save_freq`, `epochs`, `steps_per_execution`.
- `sigterm_after`: global batch count after which this process (worker 0 only) sends itself
  SIGTERM, or `null`.
- `kill_during_save`: the preemption save sends a second SIGTERM and then SIGKILL between writing
  the temporary weights and renaming them.
- `sleep`: seconds slept after each batch (lets an outside SIGTERM land mid-training).

Prints `first step <optimizer iterations>` before its first batch and `batch <global count>`\nafter each batch, flushed.
"""

import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["KERAS_BACKEND"] = "tensorflow"

import tensorflow as tf  # noqa: E402

MULTI = "TF_CONFIG" in os.environ
strategy = tf.distribute.MultiWorkerMirroredStrategy() if MULTI else tf.distribute.get_strategy()
WORKER = json.loads(os.environ["TF_CONFIG"])["task"]["index"] if MULTI else 0

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_fastloop as kf  # noqa: E402
from keras_fastloop.callbacks import preemption  # noqa: E402

GLOBAL_BATCH, NUM_SAMPLES = 8, 96


class Signaller(keras.callbacks.Callback):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if not hasattr(self, "started"):
            self.started = int(self.model.optimizer.iterations.numpy())
            print(f"first step {self.started}", flush=True)

    def on_train_batch_end(self, batch, logs=None):
        done = self.epoch * self.params["steps"] + batch + 1
        print(f"batch {done}", flush=True)
        after = self.config.get("sigterm_after")
        if WORKER == 0 and after is not None and done >= after:
            self.config["sigterm_after"] = None
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(self.config.get("sleep", 0.0))


def main(config):
    tf.config.experimental.enable_op_determinism()
    rng = np.random.default_rng(3)
    x = rng.normal(size=(NUM_SAMPLES, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    train = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(NUM_SAMPLES, seed=7, reshuffle_each_iteration=False)
        .batch(GLOBAL_BATCH, drop_remainder=True)
        .with_options(options)
    )
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        if config.get("dropout"):
            hidden = keras.layers.Dropout(0.2, seed=1)(hidden)
        model = kf.OptimizedModel(inputs, keras.layers.Dense(1)(hidden))
        model.compile(
            optimizer=keras.optimizers.AdamW(0.02),
            loss="mse",
            steps_per_execution=config.get("steps_per_execution", 1),
        )
    backup_dir = os.path.join(config["backup_dir"], f"worker{WORKER}")
    backup = keras.callbacks.BackupAndRestore(backup_dir, save_freq=config.get("save_freq", 5))
    if config.get("kill_during_save"):
        save_weights = model.save_weights

        def save_then_die(filepath, *args, **kwargs):
            save_weights(filepath, *args, **kwargs)
            if str(filepath).endswith(preemption._TMP_WEIGHTS):
                os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM: only the flag again
                time.sleep(0.2)
                os.kill(os.getpid(), signal.SIGKILL)

        model.save_weights = save_then_die
    callbacks = [backup, kf.callbacks.SaveOnPreemption(backup), Signaller(config)]
    model.fit(train, epochs=config["epochs"], callbacks=callbacks, verbose=0)
    arrays = {f"model/{v.path}": v.numpy() for v in model.weights}
    arrays.update({f"optimizer/{v.path}": v.numpy() for v in model.optimizer.variables})
    np.savez(config["out"] + (".npz" if WORKER == 0 else f".worker{WORKER}.npz"), **arrays)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
