"""Exact mid-epoch resume with ``keras.callbacks.BackupAndRestore(save_freq=N)``.

What Keras 3.15 does on its own. ``BackupAndRestore`` with an integer ``save_freq`` saves the
weights (model, optimizer, every variable the model tracks) every ``N`` batches together with
``{"epoch": e, "batch": b}``. After a crash the next ``fit`` loads the weights and sets the model's
``_initial_epoch`` to ``e``, but it ignores ``b``: epoch ``e`` is run again *from its first batch*
with weights that have already seen batches ``0..b`` of it. The resumed run therefore takes
``b + 1`` extra optimizer steps on repeated data and does not end with the weights of an
uninterrupted run. Two more defects: after a resume the callback writes ``"epoch": 0`` in its
metadata until the resumed epoch ends (its epoch counter only advances in ``on_epoch_end``), so a
second crash in the resumed epoch restarts from epoch 0; and its step counter starts from zero, so
its save points after a resume are shifted from those of the uninterrupted run.

What this module adds (registered with :mod:`keras_fastloop.fit_loop`; Keras itself is not
patched). When ``fit`` is given a stock ``BackupAndRestore`` with an integer ``save_freq``, a small
callback is placed right after it. After the backup is restored it reads the saved
``(epoch, batch)``:

- if ``batch`` was the epoch's last batch (the epoch length is known), training resumes at epoch
  ``e + 1``: no empty replay of epoch ``e``, ``on_epoch_end(e)`` is not called a second time;
- otherwise the fit loop's resume skipping makes the first iterated epoch consume the
  ``b + 1`` batches already trained *without* training on them and without calling any callback
  for them, so the loop continues with batch ``b + 1`` and the same batch indices, data and
  optimizer steps as the uninterrupted run (also under ``steps_per_execution="auto"``, whose
  grouping is applied after the skipping).

It also puts ``BackupAndRestore``'s counters where they were right after that save (epoch ``e``,
last batch ``b``, zero batches since saving), so its later saves (and a second crash) line up
with the uninterrupted run, and those of each ``ModelCheckpoint`` with an integer ``save_freq``
where they would be after ``e * steps + b + 1`` batches of an uninterrupted ``fit``. And it
corrects Keras 3.15's first-batch count of ``BackupAndRestore`` (its batch counter starts at 0,
so under ``steps_per_execution=4`` the first execution of each epoch counted 3 batches and
``save_freq=8`` saved after steps 12, 20, 28): saves happen after every ``save_freq`` batches
exactly, as the user asked.

Exact if the data order of an epoch does not depend on the process: no shuffling, or
``Dataset.shuffle(..., seed=s, reshuffle_each_iteration=False)``. A ``tf.data`` shuffle with
``reshuffle_each_iteration=True`` draws each epoch's order from a counter of the dataset object,
which a new process starts again at 0, so the resumed epoch gets epoch 0's order. Stateful
callbacks other than ``PeriodicValidation(backup_dir=...)`` are not restored (as in Keras), and the
running means of the training metrics of the interrupted epoch restart at the resume point. On
data of unknown length a backup of an epoch's last batch replays that epoch empty (its length is
not known when training resumes).
"""

from __future__ import annotations

import json
import os

import keras

from keras_fastloop import _validation, fit_loop

__all__ = ["with_exact_resume"]


def with_exact_resume(model, callbacks):
    """``callbacks`` with a :class:`_MidEpochResume` after each step-saving ``BackupAndRestore``."""
    if callbacks is None or isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    result = []
    for callback in callbacks:
        result.append(callback)
        if isinstance(callback, keras.callbacks.BackupAndRestore) and _is_int(callback.save_freq):
            result.append(_MidEpochResume(callback))
    return result


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
        path = self.backup._training_metadata_path
        if not os.path.exists(path) or not os.path.exists(self.backup._weights_path):
            return
        with open(path) as f:
            metadata = json.load(f)
        epoch, batch = int(metadata["epoch"]), int(metadata["batch"])
        self.backup._batches_seen_since_last_saving = 0
        steps = (self.params or {}).get("steps")
        if steps and batch + 1 >= steps:  # the backup ends epoch `epoch`: resume at the next
            self.model._initial_epoch = epoch + 1
            self.backup._current_epoch = epoch + 1
            self.backup._last_batch_seen = -1
            self._align_checkpoints((epoch + 1) * steps, -1)
            return
        self.backup._current_epoch = epoch
        self.backup._last_batch_seen = batch
        self._resumed_epoch = epoch
        fit_loop.skip_next_epoch_batches(self.model, batch + 1)
        if steps:
            self._align_checkpoints(epoch * steps + batch + 1, batch)

    def _align_checkpoints(self, done, last_batch):
        run = fit_loop.current_run(self.model)
        for callback in run.callbacks if run is not None else []:
            if isinstance(callback, keras.callbacks.ModelCheckpoint) and _is_int(
                callback.save_freq
            ):
                callback._batches_seen_since_last_saving = done % callback.save_freq
                callback._last_batch_seen = None if last_batch < 0 else last_batch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self._resumed_epoch:  # continues mid-epoch from the restored batch
            self._resumed_epoch = None
            return
        # Keras starts this counter at 0, so its first execution of `s` batches counts `s - 1`.
        self.backup._last_batch_seen = -1


fit_loop.register("exact_resume", with_exact_resume)
