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

What this module adds (for :class:`~keras_fastloop.OptimizedModel`, via :class:`ExactResumeMixin`;
Keras itself is not patched). When ``fit`` is given a stock ``BackupAndRestore`` with an integer
``save_freq``, a small callback is placed right after it. After the backup is restored it reads
the saved ``(epoch, batch)``, and the first time epoch ``e`` is iterated it consumes the
``b + 1`` batches that were already trained *without* training on them and without calling any
callback for them, so the loop continues with batch ``b + 1`` and the same batch indices, data
and optimizer steps as the uninterrupted run. It also puts ``BackupAndRestore``'s counters where
they were right after that save (epoch ``e``, last batch ``b``, zero batches since saving), so its
later saves (and a second crash) line up with the uninterrupted run.

Exact if the data order of an epoch does not depend on the process: no shuffling, or
``Dataset.shuffle(..., seed=s, reshuffle_each_iteration=False)``. A ``tf.data`` shuffle with
``reshuffle_each_iteration=True`` draws each epoch's order from a counter of the dataset object,
which a new process starts again at 0, so the resumed epoch gets epoch 0's order. Stateful
callbacks other than ``PeriodicValidation(backup_dir=...)`` are not restored (as in Keras), and the
running means of the training metrics of the interrupted epoch restart at the resume point.
"""

from __future__ import annotations

import json
import os

import keras

__all__ = ["ExactResumeMixin", "remember_epoch_iterator", "with_exact_resume"]


def remember_epoch_iterator(model, iterator):
    """Keep ``fit``'s epoch iterator (passed to ``_maybe_symbolic_build``) for the resume.

    Only the first one after ``fit`` started counts (``evaluate`` inside ``fit`` passes its own).
    """
    if (
        iterator is not None
        and hasattr(iterator, "_enumerate_iterator")
        and model.__dict__.get("_fastloop_epoch_iterator", False) is None
    ):
        object.__setattr__(model, "_fastloop_epoch_iterator", iterator)


def with_exact_resume(model, callbacks):
    """``callbacks`` with a :class:`_MidEpochResume` after each step-saving ``BackupAndRestore``."""
    if callbacks is None or isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    result = []
    for callback in callbacks:
        result.append(callback)
        if isinstance(callback, keras.callbacks.BackupAndRestore) and isinstance(
            callback.save_freq, int
        ):
            result.append(_MidEpochResume(callback))
    return result


class ExactResumeMixin:
    """Model mixin: ``fit`` resumes a ``BackupAndRestore(save_freq=N)`` backup mid-epoch exactly.

    Put it before ``keras.Model`` in the bases. It only wraps ``fit`` (to add the resume callback)
    and ``_maybe_symbolic_build`` (the one place where ``fit`` hands the model its epoch
    iterator); everything else is Keras' own loop.
    """

    def fit(self, *args, **kwargs):
        if len(args) > 5:  # fit(x, y, batch_size, epochs, verbose, callbacks, ...)
            args = (*args[:5], with_exact_resume(self, args[5]), *args[6:])
        else:
            kwargs["callbacks"] = with_exact_resume(self, kwargs.get("callbacks"))
        object.__setattr__(self, "_fastloop_epoch_iterator", None)  # filled by the build below
        try:
            return super().fit(*args, **kwargs)
        finally:
            self.__dict__.pop("_fastloop_epoch_iterator", None)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        remember_epoch_iterator(self, iterator)
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)


class _MidEpochResume(keras.callbacks.Callback):
    """Skips the already-trained batches of the restored epoch (see the module docstring)."""

    def __init__(self, backup):
        super().__init__()
        self.backup = backup
        self._skip = 0
        self._epoch = None

    def on_train_begin(self, logs=None):
        # Runs after `backup.on_train_begin`, which restored the weights and the epoch.
        self._skip = 0
        path = self.backup._training_metadata_path
        if not os.path.exists(path) or not os.path.exists(self.backup._weights_path):
            return
        with open(path) as f:
            metadata = json.load(f)
        epoch, batch = int(metadata["epoch"]), int(metadata["batch"])
        self.backup._current_epoch = epoch
        self.backup._last_batch_seen = batch
        self.backup._batches_seen_since_last_saving = 0
        iterator = getattr(self.model, "_fastloop_epoch_iterator", None)
        if iterator is None:
            raise RuntimeError(
                "Exact mid-epoch resume needs the epoch iterator of `fit`; the model did not "
                "record it (is `ExactResumeMixin` among its bases?). "
                f"Received: model of type {type(self.model).__name__}"
            )
        self._skip, self._epoch = batch + 1, epoch
        _skip_first_batches(iterator, batch + 1)


def _skip_first_batches(epoch_iterator, count):
    """Make the next epoch of ``epoch_iterator`` start after ``count`` batches.

    Wraps the generator of Keras' ``EpochIterator._enumerate_iterator`` (once): executions whose
    first batch index is below ``count`` are consumed from the data iterator and not yielded,
    so neither the train function nor the callbacks see them.
    """
    original = epoch_iterator._enumerate_iterator

    def resumed():
        del epoch_iterator._enumerate_iterator  # later epochs: Keras' own generator
        for begin, end, iterator in original():
            if begin < count:
                for _ in range(end - begin + 1):
                    try:
                        next(iterator)
                    except (StopIteration, OutOfRangeErrors):
                        break
                continue
            yield begin, end, iterator

    epoch_iterator._enumerate_iterator = resumed


try:
    import tensorflow as _tf

    OutOfRangeErrors = _tf.errors.OutOfRangeError
except ImportError:  # pragma: no cover - the package requires TensorFlow
    OutOfRangeErrors = StopIteration
