"""The state of one running `fit` (`FitRun`), below the fit loop and its extensions.

`keras_fastloop._fit_loop` creates a `FitRun` per `fit` call; its extensions
(`keras_fastloop._resume`) read and change it through `current_run` and
`skip_next_epoch_batches` without importing the fit loop.
"""

from __future__ import annotations

__all__ = ["FitRun", "current_run", "skip_next_epoch_batches"]


class FitRun:
    """What the fit loop knows about one `fit` call (untracked model attribute).

    Attributes:
        callbacks: the flat list of callbacks given to Keras (user's and internal).
        iterator: `fit`'s epoch iterator once captured, else `None`.
        auto: the model's `steps_per_execution="auto"` state when it groups steps, else
            `None`.
        skip: batches at the start of the next epoch that were trained before a resume.
    """

    def __init__(self, model, callbacks, auto):
        self.model = model
        self.callbacks = callbacks
        self.auto = auto
        self.iterator = None
        self.skip = 0
        self._pending_capture = True


def current_run(model):
    """The `FitRun` of the `fit` running on `model`, or `None`."""
    return model.__dict__.get("_fastloop_fit_run")


def skip_next_epoch_batches(model, count):
    """Makes the next epoch of the running `fit` start after `count` batches (resume).

    Args:
        model: the model whose `fit` is running.
        count: int >= 0, batches at the epoch start already trained.

    Raises:
        RuntimeError: no `fit` of `model` is running or its epoch iterator is unknown.
    """
    run = current_run(model)
    if run is None or run.iterator is None:
        raise RuntimeError(
            "Exact mid-epoch resume needs the epoch iterator of a running `fit` of an "
            f"OptimizedModel. Received: model of type {type(model).__name__}"
        )
    run.skip = int(count)
