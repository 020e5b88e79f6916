"""Save on preemption: SIGTERM finishes the step, writes the mid-epoch backup, exits.

`SaveOnPreemption(backup)` installs a handler for SIGTERM (and any other signal named) for the
length of `fit`. The handler only sets a flag; at the next step boundary (the end of an
execution of `steps_per_execution` steps) the flag is combined across workers (maximum over a
`MultiWorkerMirroredStrategy`'s workers, so every worker stops after the same step), the
backup of `backup` (a `keras.callbacks.BackupAndRestore` with an integer `save_freq`) is
written with that step's position, and the process exits with `exit_code` (default 42,
`PREEMPTED_EXIT_CODE`). Restarting the same script with the same `backup_dir` resumes after
that step exactly (`keras_fastloop._resume`): weights, optimizer, loss scale, step state and
data position. Under a strategy every worker writes its own `backup_dir` (the workers hold the
same variables); give each worker its own directory or a shared one per worker index.

The files are written under temporary names and renamed into place, so a process killed during
the save (SIGKILL after a grace period) leaves the previous backup whole. A second SIGTERM
during the save only sets the flag again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading

import keras
import tensorflow as tf

from keras_fastloop import _keras_internals as internals
from keras_fastloop import _tf_internals as tf_internals
from keras_fastloop import _validation

__all__ = ["PREEMPTED_EXIT_CODE", "SaveOnPreemption"]

PREEMPTED_EXIT_CODE = 42
_TMP_WEIGHTS = ".preemption-tmp.weights.h5"
_TMP_METADATA = ".preemption-tmp.json"


class SaveOnPreemption(keras.callbacks.Callback):
    """Saves `backup`'s mid-epoch checkpoint after the current step when a signal arrives, then exits.

    List it with `backup` in `fit(callbacks=[backup, SaveOnPreemption(backup)])`.

    Args:
        backup: a `keras.callbacks.BackupAndRestore` with an integer `save_freq` (steps), also
            passed to `fit`; its directory receives the checkpoint.
        signals: tuple of `signal.Signals` to act on. Default `(signal.SIGTERM,)`.
        exit_code: int, the process's exit status after the save, default 42; `None` keeps the
            process alive and only stops `fit` (`model.stop_training`).

    Raises:
        ValueError: `backup` is not a `BackupAndRestore` with an integer `save_freq`, an empty
            `signals` or SIGKILL/SIGSTOP among them, or a non-int `exit_code`.

    Example:
        >>> backup = keras.callbacks.BackupAndRestore("/tmp/run", save_freq=500)
        >>> callbacks = [backup, SaveOnPreemption(backup)]
    """

    def __init__(
        self,
        backup: keras.callbacks.BackupAndRestore,
        signals: tuple = (signal.SIGTERM,),
        exit_code: int | None = PREEMPTED_EXIT_CODE,
    ) -> None:
        super().__init__()
        if not isinstance(backup, keras.callbacks.BackupAndRestore) or not _validation.is_int(
            backup.save_freq
        ):
            raise ValueError(
                "`backup` must be a keras.callbacks.BackupAndRestore with an integer `save_freq` "
                "(the mid-epoch resume needs step backups). "
                f"Received: backup={backup!r} (save_freq="
                f"{getattr(backup, 'save_freq', None)!r})"
            )
        signals = tuple(signals)
        if not signals or any(
            s in (signal.SIGKILL, getattr(signal, "SIGSTOP", None)) for s in signals
        ):
            raise ValueError(
                f"`signals` must name at least one catchable signal. Received: signals={signals!r}"
            )
        if exit_code is not None and (
            isinstance(exit_code, bool) or not isinstance(exit_code, int)
        ):
            raise ValueError(
                f"`exit_code` must be an int or None. Received: exit_code={exit_code!r}"
            )
        self.backup = backup
        self.signals = signals
        self.exit_code = exit_code
        self.requested = False
        self.saved_at = None
        self._previous = {}
        self._epoch = 0

    def _handler(self, signum, frame):
        self.requested = True

    def on_train_begin(self, logs=None):
        self.requested = False
        self.saved_at = None
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "SaveOnPreemption installs signal handlers and needs `fit` on the main thread. "
                f"Received: thread={threading.current_thread().name!r}"
            )
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handler)

    def on_train_end(self, logs=None):
        self._restore_handlers()

    def _restore_handlers(self):
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if not self._agreed():
            return
        self._save(self._epoch, batch)
        self.saved_at = (self._epoch, batch)
        step = int(self.model.optimizer.iterations.numpy())
        print(
            f"[keras_fastloop] preemption: saved the backup after epoch {self._epoch} batch "
            f"{batch} (optimizer step {step}) to {self.backup.backup_dir}"
            + (f"; exiting with code {self.exit_code}" if self.exit_code is not None else ""),
            flush=True,
        )
        self.model.stop_training = True
        if self.exit_code is not None:
            self._restore_handlers()
            raise SystemExit(self.exit_code)

    def _agreed(self):
        strategy = getattr(self.model, "distribute_strategy", None) or tf.distribute.get_strategy()
        workers = tf_internals.num_workers(strategy)
        if workers <= 1:
            return self.requested
        flag = tf.constant(1 if self.requested else 0, tf.int32)
        per_replica = strategy.run(lambda: tf.identity(flag))
        total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
        return int(total.numpy()) > 0

    def _save(self, epoch, batch):
        directory = self.backup.backup_dir
        os.makedirs(directory, exist_ok=True)
        files = internals.backup_files(self.backup)
        tmp_weights = os.path.join(directory, _TMP_WEIGHTS)
        tmp_metadata = os.path.join(directory, _TMP_METADATA)
        self.model.save_weights(tmp_weights, overwrite=True)
        with open(tmp_metadata, "w") as f:
            json.dump({"epoch": int(epoch), "batch": int(batch)}, f)
            f.flush()
            os.fsync(f.fileno())
        with open(tmp_weights, "rb") as f:
            os.fsync(f.fileno())
        if self.backup.double_checkpoint:
            for path, previous in (
                (files.weights, files.previous_weights),
                (files.metadata, files.previous_metadata),
            ):
                if os.path.exists(path):
                    shutil.copyfile(path, previous)
        os.replace(tmp_weights, files.weights)
        os.replace(tmp_metadata, files.metadata)
