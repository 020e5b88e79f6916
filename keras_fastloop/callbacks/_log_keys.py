"""Which keys of the logs Keras passes to every callback are `PeriodicValidation`'s.

Keras hands one logs dict to each callback in turn. A key there is a training metric's, one
`fit(validation_data=...)` wrote (epoch logs), or one a `PeriodicValidation` wrote: each
callback's `LogKeys` tells them apart, so a result never overwrites another's key silently.
"""

from __future__ import annotations

import warnings
import weakref

from keras_fastloop._warnings import FastloopWarning

# Per model: the logs dict PeriodicValidation callbacks last wrote to, and the keys written
# there (two callbacks writing one key: the last one wins, as for any callback).
_WRITTEN = weakref.WeakKeyDictionary()


def _written(model, logs):
    written_logs, keys = _WRITTEN.get(model, (None, set()))
    return keys if written_logs is logs else set()


class LogKeys:
    """One `PeriodicValidation`'s view of the logs' keys during a `fit`."""

    def __init__(self):
        self.training = set()  # the last training batch's keys, other callbacks' excluded
        self._warned = False

    def begin(self, model):
        """A new `fit` starts."""
        _WRITTEN.pop(model, None)
        self.training = set()

    def see_batch(self, model, logs):
        """Records a training batch's keys (before this callback writes its own)."""
        self.training = set(logs) - _written(model, logs)

    def check(self, val_logs, sets, training=None):
        """Raises `ValueError` when a result key is a training log's (a metric `val_loss`).

        `training`: the training keys, when known before a batch (default: the last batch's).
        """
        clash = sorted(set(val_logs) & (self.training if training is None else set(training)))
        if clash:
            raise ValueError(
                "PeriodicValidation's keys must differ from the training logs' keys, which "
                f"they would overwrite: {clash}. Rename the metric or name the validation "
                f"set ({{'name': data}}). Received: sets {list(sets)}"
            )

    def write(self, model, logs, val_logs):
        """Adds `val_logs` to `logs`, less the keys `fit(validation_data=...)` logged there
        (they keep Keras' meaning; said once with a `FastloopWarning`)."""
        written = _written(model, logs)
        clash = sorted(set(val_logs) & (set(logs) - written - self.training))
        if clash and not self._warned:
            self._warned = True
            warnings.warn(
                f"`fit(validation_data=...)` already logs {clash}: the epoch logs keep fit's "
                "values; PeriodicValidation's are in its `history` and its driven callbacks. "
                "Name the set (`PeriodicValidation({'name': data})`) to log both.",
                FastloopWarning,
                stacklevel=3,
            )
        kept = {k: v for k, v in val_logs.items() if k not in clash}
        logs.update(kept)
        _WRITTEN[model] = (logs, written | set(kept))
