"""Exact mid-epoch resume with `keras.callbacks.BackupAndRestore(save_freq=N)`.

Keras 3.15's `BackupAndRestore` restores the weights saved after batch `b` of epoch `e` but
then reruns epoch `e` from its first batch (`b + 1` extra optimizer steps). With this module
(an entry of `keras_fastloop._fit_loop.INTERNAL_CALLBACKS`, nothing to call: pass a stock
`BackupAndRestore` with an integer `save_freq` to `OptimizedModel.fit`) the resumed run
continues with batch `b + 1` and ends with the weights of an uninterrupted run; the backup's
and each integer-`save_freq` `ModelCheckpoint`'s save points line up with the uninterrupted
run, and `save_freq` batches are counted exactly.

Exact if an epoch's data order does not depend on the process: no shuffling, or
`Dataset.shuffle(..., seed=s, reshuffle_each_iteration=False)` (with
`reshuffle_each_iteration=True` a new process starts the shuffle counter again at 0). Stateful
callbacks other than `PeriodicValidation(backup_dir=...)` are not restored (as in Keras), and
the running means of the interrupted epoch's training metrics restart at the resume point. On
data of unknown length a backup of an epoch's last batch replays that epoch empty.

What Keras does and what is corrected, in detail: `docs/design.md`, section "Exact mid-epoch
resume".
"""

from __future__ import annotations

import json
import os

import keras

from keras_fastloop import _fit_run as fit_run
from keras_fastloop import _keras_internals as internals
from keras_fastloop import _validation

__all__ = ["after_backup"]


def after_backup(model, callback):
    """The internal callbacks that follow `callback`: a `_MidEpochResume` after a step-saving
    `BackupAndRestore`, else none."""
    if isinstance(callback, keras.callbacks.BackupAndRestore) and _is_int(callback.save_freq):
        return [_MidEpochResume(callback)]
    return []


_is_int = _validation.is_int


class _MidEpochResume(keras.callbacks.Callback):
    """Resumes the restored backup exactly and keeps its save points (see the module docstring)."""

    def __init__(self, backup):
        super().__init__()
        self.backup = backup
        self._resumed_epoch = None

    def on_train_begin(self, logs=None):
        # Runs after `backup.on_train_begin`, which restored the weights and the epoch.
        self._resumed_epoch = None
        files = internals.backup_files(self.backup)
        if not os.path.exists(files.metadata) or not os.path.exists(files.weights):
            return
        with open(files.metadata) as f:
            metadata = json.load(f)
        epoch, batch = int(metadata["epoch"]), int(metadata["batch"])
        internals.set_save_counters(self.backup, batches_since_saving=0)
        steps = (self.params or {}).get("steps")
        if steps and batch + 1 >= steps:  # the backup ends epoch `epoch`: resume at the next
            internals.set_initial_epoch(self.model, epoch + 1)
            internals.set_save_counters(self.backup, epoch=epoch + 1, last_batch=-1)
            self._align_checkpoints((epoch + 1) * steps, -1)
            return
        internals.set_save_counters(self.backup, epoch=epoch, last_batch=batch)
        self._resumed_epoch = epoch
        fit_run.skip_next_epoch_batches(self.model, batch + 1)
        if steps:
            self._align_checkpoints(epoch * steps + batch + 1, batch)

    def _align_checkpoints(self, done, last_batch):
        run = fit_run.current_run(self.model)
        for callback in run.callbacks if run is not None else []:
            if isinstance(callback, keras.callbacks.ModelCheckpoint) and _is_int(
                callback.save_freq
            ):
                internals.set_save_counters(
                    callback,
                    batches_since_saving=done % callback.save_freq,
                    last_batch=None if last_batch < 0 else last_batch,
                )

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self._resumed_epoch:  # continues mid-epoch from the restored batch
            self._resumed_epoch = None
            return
        # Keras starts this counter at 0, so its first execution of `s` batches counts `s - 1`.
        internals.set_save_counters(self.backup, last_batch=-1)
