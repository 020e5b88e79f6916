"""Validation every N optimizer updates (or every N epochs) inside `fit`.

Two Keras behaviours shape this callback:

- `Model.evaluate()` starts by resetting every metric of the model, the training loss
  tracker included (keras#16526). Called in the middle of an epoch it would replace the
  running training metrics, so the progress bar, the epoch's `loss` and `History` would
  report validation numbers. `PeriodicValidation` copies the values of
  `model.metrics_variables` before evaluating and assigns them back afterwards, so
  training metrics continue exactly as if no validation had run.
- Stock monitoring callbacks (`EarlyStopping`, `ModelCheckpoint`, `ReduceLROnPlateau`,
  `CSVLogger`, ...) act only in `on_epoch_end`. Rather than re-implementing them as
  step-aware subclasses, `PeriodicValidation` takes them in its own `callbacks=`
  argument and calls their `on_epoch_end` once per validation ("validation round"), with
  the current training logs plus the `val_*` results. Unchanged stock callbacks thus act
  on step-gated results, with all their options.
"""

from __future__ import annotations

import contextlib
import copy
import json
import numbers
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import keras

from keras_fastloop import _validation
from keras_fastloop.callbacks import _validation_sets as sets_module
from keras_fastloop.callbacks._log_keys import LogKeys
from keras_fastloop.callbacks.ema import check_ema_model, ema_weights

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["PeriodicValidation"]

# Plain attributes of stock monitoring callbacks (EarlyStopping, ReduceLROnPlateau,
# ModelCheckpoint) that together are their resumable state.
_MONITOR_STATE_ATTRIBUTES = ("best", "wait", "cooldown_counter", "best_epoch", "stopped_epoch")


def _to_python(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return keras.ops.convert_to_numpy(value).item()


class PeriodicValidation(keras.callbacks.Callback):
    """Evaluates `validation_data` every N optimizer updates or every N epochs.

    How it behaves in detail: docs/behaviour.md#periodicvalidation.

    Args:
        validation_data: What `model.evaluate` accepts: a `tf.data.Dataset`, a
            `keras.utils.PyDataset`, or a tuple `(x, y)` / `(x, y, sample_weight)` of
            arrays. Must be finite or used with `validation_steps`; give a dataset of
            unknown cardinality a known one or `validation_steps` (docs/behaviour.md).
            Or named sets, `{"easy": ds1, "hard": (x, y)}`, logged as `val_{name}_loss`, ...
        every_n_steps: Integer > 0 or `None`. Validate every this many optimizer
            updates. Defaults to `None`.
        every_n_epochs: Integer > 0 or `None`. Validate at the end of every this many
            epochs. Defaults to `None`. Exactly one of the two frequencies must be set.
        validation_steps: Integer > 0 or `None`. Number of validation batches per
            evaluation (the `steps` argument of `evaluate`). Defaults to `None` (the
            whole `validation_data`).
        batch_size: Integer > 0 or `None`. Batch size for array `validation_data`.
            Defaults to `None` (`evaluate`'s default, 32).
        callbacks: List of `keras.callbacks.Callback` or `None`. Callbacks whose
            `on_epoch_end` runs after every validation (see above). Defaults to `None`.
        validate_at_end: Boolean. Also validate the final weights when training ends
            (after the last epoch, or when a callback stops training) if the last step
            was not validated already. Defaults to `False`, so "every N steps" means
            exactly the multiples of N.
        verbose: `0` or `1`. `1` prints one line per validation. Defaults to `0`.
        backup_dir: String, path-like or `None`. The `backup_dir` of the
            `keras.callbacks.BackupAndRestore` used in the same `fit`; the callback's
            state is saved there and restored after a crash (see above). Defaults to
            `None` (each `fit` starts afresh unless `set_state` is used).
        ema: Boolean. Evaluate the optimizer's EMA weights (`use_ema=True`), giving the
            raw weights back bit for bit (`kf.callbacks.ema_weights`). Defaults to `False`.

    Attributes:
        history: List of dicts, one per validation (see above).
        last_validated_step: Integer. Step of the latest validation; before the first
            one, the step at which training started (intervals count from there).

    Raises:
        ValueError: At construction, for an argument out of its range above, a missing,
            empty or infinite (without `validation_steps`) set, arrays of different lengths,
            a set name not of letters, digits and underscores, or a named-set monitor in
            `mode="auto"`. At the start of `fit`, for an unbatched `tf.data` set, arrays
            without targets for a compiled loss, `ema=True` without the optimizer's
            `use_ema=True`, or result keys shared by two sets or with a training metric
            (at the first validation where the metrics are not built yet: `keras.Model`).

    Example:

    ```python
    early_stopping = keras.callbacks.EarlyStopping(monitor="val_loss", patience=3)
    checkpoint = keras.callbacks.ModelCheckpoint(
        "best.keras", monitor="val_loss", save_best_only=True)
    validation = PeriodicValidation(
        val_ds, every_n_steps=500, callbacks=[early_stopping, checkpoint])
    model.fit(train_ds, epochs=10, callbacks=[validation])
    validation.history  # [{"step": 500, "epoch": 0, "val_loss": ...}, ...]
    ```
    """

    def __init__(
        self,
        validation_data: tf.data.Dataset | keras.utils.PyDataset | tuple[Any, ...] | list[Any],
        every_n_steps: int | None = None,
        every_n_epochs: int | None = None,
        validation_steps: int | None = None,
        batch_size: int | None = None,
        callbacks: keras.callbacks.Callback | Sequence[keras.callbacks.Callback] | None = None,
        validate_at_end: bool = False,
        verbose: int = 0,
        backup_dir: str | os.PathLike[str] | None = None,
        ema: bool = False,
    ) -> None:
        super().__init__()
        if validation_data is None:
            raise ValueError(
                "`validation_data` must be a dataset or a tuple (x, y[, sample_weight]). "
                "Received: validation_data=None"
            )
        if isinstance(validation_data, (str, bytes, numbers.Number)):
            raise ValueError(
                "`validation_data` must be a dataset or a tuple (x, y[, sample_weight]). "
                f"Received: validation_data={validation_data!r}"
            )
        if (every_n_steps is None) == (every_n_epochs is None):
            raise ValueError(
                "Exactly one of `every_n_steps` and `every_n_epochs` must be set. "
                f"Received: every_n_steps={every_n_steps}, every_n_epochs={every_n_epochs}"
            )
        every_n_steps, every_n_epochs, validation_steps, batch_size = (
            _validation.check_int(
                name, value, minimum=1, allow_none=True, requirement="None or an integer > 0"
            )
            for name, value in (
                ("every_n_steps", every_n_steps),
                ("every_n_epochs", every_n_epochs),
                ("validation_steps", validation_steps),
                ("batch_size", batch_size),
            )
        )
        if not isinstance(validate_at_end, bool):
            raise ValueError(
                f"`validate_at_end` must be a bool. Received: validate_at_end={validate_at_end!r}"
            )
        _validation.check(
            isinstance(verbose, numbers.Integral) and verbose in (0, 1),
            "verbose",
            "0 or 1",
            verbose,
        )
        verbose = int(verbose)
        if not isinstance(ema, bool):
            raise ValueError(f"`ema` must be a bool. Received: ema={ema!r}")
        if backup_dir is not None and (
            not isinstance(backup_dir, (str, os.PathLike)) or not os.fspath(backup_dir)
        ):
            raise ValueError(
                "`backup_dir` must be None or a non-empty path (the directory of a "
                f"BackupAndRestore). Received: backup_dir={backup_dir!r}"
            )
        if isinstance(callbacks, keras.callbacks.Callback):
            callbacks = [callbacks]
        callbacks = list(callbacks or [])
        for callback in callbacks:
            if not isinstance(callback, keras.callbacks.Callback) or callback is self:
                raise ValueError(
                    "`callbacks` must be a list of other `keras.callbacks.Callback` "
                    f"instances. Received: callbacks={callbacks!r}"
                )
        named = sets_module.named_sets(validation_data)
        if named is not None:
            sets_module.check_monitor_modes(named, callbacks)
        sets = named if named is not None else {None: validation_data}
        self._sets = {
            name: sets_module.unpack(data, validation_steps) for name, data in sets.items()
        }

        self.validation_data = validation_data
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.validation_steps = validation_steps
        self.batch_size = batch_size
        self.callbacks = callbacks
        self.validate_at_end = validate_at_end
        self.verbose = verbose
        self.backup_dir = None if backup_dir is None else os.fspath(backup_dir)
        self.ema = ema

        self.history = []
        self.last_validated_step = None
        self._pending_callback_state = None
        self._epoch = 0
        self._epoch_val_logs = None
        self._backup = None  # per-validation states, written to backup_dir
        self._restore_pending = False
        self._log_keys = LogKeys()

    def __deepcopy__(self, memo: dict[int, Any]) -> PeriodicValidation:
        """A copy that shares the validation sets and deep-copies the rest (driven callbacks,
        history). A `tf.data.Dataset` cannot be deep-copied, and KerasTuner deep-copies the
        search's callbacks for every trial; the sets are only read."""
        for x, y, sample_weight in self._sets.values():
            for data in (x, y, sample_weight):
                memo[id(data)] = data
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return copied

    # -- Keras plumbing, forwarded to the driven callbacks ---------------------------------

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        for callback in self.callbacks:
            callback.set_model(model)

    def set_params(self, params: dict[str, Any]) -> None:
        super().set_params(params)
        for callback in self.callbacks:
            callback.set_params(params)

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._log_keys.begin(self.model)
        self._check_validation_batched()
        sets_module.check_targets(self.model, self._sets)
        sets_module.check_result_keys(self.model, self._sets, self._log_keys)
        if self.ema:
            check_ema_model(self.model, "`PeriodicValidation(ema=True)`")
        for callback in self.callbacks:
            callback.on_train_begin(logs)
        if self._pending_callback_state is not None:  # set_state() was called: resume
            for callback, state in zip(self.callbacks, self._pending_callback_state):
                for name, value in state.items():
                    setattr(callback, name, value)
            self._pending_callback_state = None
        else:
            self.history = []
            self.last_validated_step = None
        if self.backup_dir is not None:
            # The weights (and so the step) may be restored by a callback listed after this
            # one; decide at the first epoch begin, when every on_train_begin has run.
            self._restore_pending = True
        elif self.last_validated_step is None:
            self.last_validated_step = self._current_step()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        for callback in self.callbacks:
            callback.on_train_end(logs)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._restore_pending:
            self._restore_pending = False
            self._restore_from_backup()
        self._epoch = epoch
        self._epoch_val_logs = None

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            self._log_keys.see_batch(self.model, logs)
        if self.every_n_steps is None:
            return
        step = self._current_step()
        n = self.every_n_steps
        if step // n > self.last_validated_step // n:
            val_logs = self._validate(step, logs)
            if logs is not None:
                self._log_keys.write(self.model, logs, val_logs)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        due = self.every_n_epochs is not None and (epoch + 1) % self.every_n_epochs == 0
        step = self._current_step()
        if not due and self.validate_at_end and step != self.last_validated_step:
            last_epoch = self.params.get("epochs") if self.params else None
            due = bool(self.model.stop_training) or (
                last_epoch is not None and epoch + 1 >= last_epoch
            )
        if due:
            self._validate(step, logs)
        if self._epoch_val_logs is not None and logs is not None:
            self._log_keys.write(self.model, logs, self._epoch_val_logs)

    # -- validation -------------------------------------------------------------------------

    def _check_validation_batched(self):
        """Raises at the start of `fit` when a `tf.data` validation set is not batched.

        An unbatched dataset would otherwise fail at the first validation, mid-training,
        with a layer-shape error. Detected when every input of `x` has exactly one axis
        fewer than the model's corresponding input (models with known `inputs` only).
        """
        import tensorflow as tf

        try:
            model_inputs = list(self.model.inputs or [])  # flattened, as tf.nest does
        except (AttributeError, ValueError):  # subclassed model: no symbolic inputs
            return
        for x, _, _ in self._sets.values():
            if isinstance(x, tf.data.Dataset):
                sets_module.check_batched(x, model_inputs)

    def _current_step(self):
        return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def _evaluate(self):
        """Runs `model.evaluate` on each set and leaves the model's metric state as it found it.

        Returns:
            Dict of the logged results: `{"val_loss": ...}` for one set, `{"val_easy_loss":
            ...}` for named sets.

        Raises:
            ValueError: two sets' results would share a key (e.g. sets `"a"` and `"a_b"` with
                a metric `"b_loss"`), or a set yielded no batch, before anything is logged.
        """
        variables = list(self.model.metrics_variables)
        saved = [keras.ops.convert_to_numpy(variable) for variable in variables]
        results = {}
        try:
            for name, (x, y, sample_weight) in self._sets.items():
                set_results = self.model.evaluate(
                    x=x,
                    y=y,
                    sample_weight=sample_weight,
                    batch_size=self.batch_size,
                    steps=self.validation_steps,
                    verbose=0,
                    return_dict=True,
                )
                if not set_results:  # a dataset of unknown length that yielded no batch
                    raise ValueError(
                        "Each validation set must yield at least one batch; the set "
                        f"{name!r} yielded none. Received: sets {list(self._sets)}"
                    )
                results[name] = {metric: float(value) for metric, value in set_results.items()}
        finally:
            for variable, value in zip(variables, saved):
                variable.assign(value)
        return sets_module.logged_results(results, self._sets)

    def _validate(self, step, train_logs):
        # With `ema`, the driven callbacks also see the EMA weights that were scored (a best
        # checkpoint holds them, as with Keras' SwapEMAWeights); the raw ones come back after.
        with ema_weights(self.model) if self.ema else contextlib.nullcontext():
            return self._validate_weights(step, train_logs)

    def _validate_weights(self, step, train_logs):
        val_logs = self._evaluate()
        self._log_keys.check(val_logs, self._sets)
        self.last_validated_step = step
        self.history.append({"step": step, "epoch": self._epoch, **val_logs})
        self._epoch_val_logs = val_logs
        if self.backup_dir is not None:
            self._save_to_backup()
        if self.verbose:
            values = " - ".join(f"{name}: {value:.4f}" for name, value in val_logs.items())
            print(f"Step {step}: {values}")
        if self.callbacks:
            callback_logs = {**(train_logs or {}), **val_logs, "step": step}
            for callback in self.callbacks:
                self._drive(callback, callback_logs)
        return val_logs

    def _drive(self, callback, logs):
        """Calls `callback.on_epoch_end` with the training epoch (see the class docstring)."""
        if not isinstance(callback, keras.callbacks.EarlyStopping) or self._epoch > 0:
            callback.on_epoch_end(self._epoch, logs)
            return
        # Stock EarlyStopping never stops while `epoch == 0` (its `epoch > 0` guard, meant
        # for epoch-end use), so mid-epoch validations of the first epoch could never stop
        # training: apply its rule (patience exceeded without improvement) here, with the
        # guard read as "not at the first validation".
        best, wait = callback.best, callback.wait
        callback.on_epoch_end(0, logs)
        no_improvement = callback.best == best and callback.wait > wait
        later_validation = len(self.history) > 1  # Keras: never at the very first epoch end
        if no_improvement and later_validation and callback.wait >= callback.patience:
            callback.stopped_epoch = 0
            self.model.stop_training = True

    # -- crash safety (backup_dir) -------------------------------------------------------------

    @property
    def _backup_path(self):
        return os.path.join(self.backup_dir, "periodic_validation.json")

    def _restore_from_backup(self):
        """Start from the saved validations up to the (restored) current step, or afresh."""
        step = self._current_step()
        saved = None
        if os.path.exists(self._backup_path):
            with open(self._backup_path) as f:
                saved = json.load(f)
        if saved is None or saved["start_step"] > step:
            if self.last_validated_step is None:  # no set_state(): start afresh
                self.history = []
                self.last_validated_step = step
            self._backup = {
                "start_step": self.last_validated_step,
                "history": copy.deepcopy(self.history),
                "callbacks": [None] * len(self.history),
            }
            return
        count = sum(1 for record in saved["history"] if record["step"] <= step)
        self._backup = {
            "start_step": saved["start_step"],
            "history": saved["history"][:count],
            "callbacks": saved["callbacks"][:count],
        }
        self.history = copy.deepcopy(self._backup["history"])
        self.last_validated_step = self.history[-1]["step"] if count else saved["start_step"]
        callback_states = saved["callbacks"][count - 1] if count else None
        for callback, state in zip(self.callbacks, callback_states or []):
            for name, value in state.items():
                setattr(callback, name, value)

    def _save_to_backup(self):
        self._backup["history"].append(copy.deepcopy(self.history[-1]))
        self._backup["callbacks"].append(self.get_state()["callbacks"])
        os.makedirs(self.backup_dir, exist_ok=True)
        temporary = f"{self._backup_path}.tmp"
        with open(temporary, "w") as f:
            json.dump(self._backup, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, self._backup_path)

    # -- resumable state ---------------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        """Returns the state needed to resume, as a JSON-compatible dict.

        Returns:
            Dict with `"last_validated_step"` (int or None), `"history"` (list of dicts)
            and `"callbacks"` (one dict per driven callback with those of `best`, `wait`,
            `cooldown_counter`, `best_epoch`, `stopped_epoch` it has). Best weights kept
            by `EarlyStopping(restore_best_weights=True)` are not included.
        """
        return {
            "last_validated_step": self.last_validated_step,
            "history": copy.deepcopy(self.history),
            "callbacks": [
                {
                    name: _to_python(getattr(callback, name))
                    for name in _MONITOR_STATE_ATTRIBUTES
                    if hasattr(callback, name)
                }
                for callback in self.callbacks
            ],
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restores a state from `get_state()`; the next `fit` continues from it.

        Args:
            state: Dict returned by `get_state()`.

        Raises:
            ValueError: If `state` lacks a key or holds state for a different number of
                driven callbacks.
        """
        missing = {"last_validated_step", "history", "callbacks"} - set(state)
        if missing:
            raise ValueError(
                f"`state` must come from `get_state()`; missing keys {sorted(missing)}. "
                f"Received: state={state!r}"
            )
        if len(state["callbacks"]) != len(self.callbacks):
            raise ValueError(
                f"`state` holds state for {len(state['callbacks'])} callbacks but this "
                f"PeriodicValidation drives {len(self.callbacks)}. "
                f"Received: state={state!r}"
            )
        self.last_validated_step = state["last_validated_step"]
        self.history = copy.deepcopy(list(state["history"]))
        self._pending_callback_state = copy.deepcopy(list(state["callbacks"]))
