"""One running `fit` (`FitRun`): its callbacks, its epoch iterator and the changes to its epochs.

`keras_fastloop._fit_loop` creates a `FitRun` per `fit` call and runs Keras' `fit` inside it;
the `FitRun` captures `fit`'s epoch iterator and replaces its `_enumerate_iterator` on that
instance only, for the whole `fit`, by the composition of its transforms, always in this order:

a. **resume skipping** (first epoch after a mid-epoch resume only): the batches already
   trained before the crash are read from the data iterator and dropped, without training
   and without callbacks (`skip_next_epoch_batches`, called by `keras_fastloop._resume`);
b. **execution grouping** (`steps_per_execution="auto"` only): consecutive one-batch slots
   of Keras' own generator are joined into one execution of `k` steps;
c. **step events**: `k` never passes the next step event of any callback
   (`keras_fastloop.callbacks.events`) nor the epoch end.

The `FitRun` drives the model's `steps_per_execution="auto"` state (`tuning._glue.AutoSteps`)
through its methods. The grouping never reads data ahead of what Keras would: on data of
unknown length it keeps one step per execution. The design is in `docs/fit_loop.md`.
"""

from __future__ import annotations

import numbers
import weakref

import keras

from keras_fastloop import _keras_internals as internals
from keras_fastloop.callbacks import events

__all__ = ["FitRun", "current_run", "skip_next_epoch_batches"]

# The running `fit` of each model: kept here, not on the model (no attribute for Keras to track).
_RUNS = weakref.WeakKeyDictionary()


class FitRun:
    """What the fit loop knows about one `fit` call; a context manager around Keras' `fit`.

    Args:
        model: the `OptimizedModel`.
        callbacks: the flat list of callbacks given to Keras (user's and internal).
        auto: the model's `AutoSteps` when `"auto"` may group steps in this `fit`, else `None`.

    Attributes:
        model, callbacks, auto: as given.
        iterator: `fit`'s epoch iterator once captured, else `None`.
    """

    def __init__(self, model, callbacks, auto):
        self.model = model
        self.callbacks = callbacks
        self.auto = auto
        self.iterator = None
        self._skip = 0
        self._pending_capture = True
        self._previous = None

    def __enter__(self):
        """Makes this the running `fit` of the model (`current_run`)."""
        self._previous = current_run(self.model)
        if self.auto is not None:
            self.auto.begin_fit()
        _RUNS[self.model] = self
        return self

    def __exit__(self, *exc_info):
        """Restores the model's previous run, the epoch iterator and one step per call."""
        if self._previous is None:
            _RUNS.pop(self.model, None)
        else:
            _RUNS[self.model] = self._previous
        if self.iterator is not None:
            internals.set_enumerate_iterator(self.iterator, None)
        if self.auto is not None:
            self.auto.end_fit()
        return False

    def skip_next_epoch_batches(self, count):
        """Makes the next epoch start after `count` batches (resume)."""
        self._skip = int(count)

    def capture(self, iterator):
        """Installs the epoch transforms on `fit`'s epoch iterator (the first one Keras
        hands to `_maybe_symbolic_build`; later ones, from `evaluate`, are left alone).

        Args:
            iterator: an `EpochIterator` or `None`.

        Raises:
            RuntimeError: Keras' `EpochIterator` lacks `_enumerate_iterator` (a Keras change).
        """
        if not self._pending_capture or iterator is None:
            return
        self._pending_capture = False
        original = internals.enumerate_iterator(iterator)
        if original is None:  # pragma: no cover - Keras changed
            raise RuntimeError(
                "keras_fastloop's fit loop relies on Keras' `EpochIterator._enumerate_iterator`, "
                f"which this Keras version lacks. Received: {type(iterator).__name__}"
            )
        self.iterator = iterator
        if self.auto is not None:
            self.auto.plan(self.callbacks, iterator.num_batches, _accumulation(self.model))

        def transformed():
            slots = original()
            if self._skip:  # a. resume skipping
                count, self._skip = self._skip, 0
                slots = _skip_first_batches(slots, count)
            if self.auto is not None:  # b. + c. grouping up to the next step event
                slots = self._grouped(slots)
            return slots

        internals.set_enumerate_iterator(iterator, transformed)

    def _grouped(self, slots):
        """Joins Keras' one-batch slots into executions of `k` steps (`"auto"`).

        `k = propose(min(batches to the epoch end, batches to the next step event))`; on data
        of unknown length `k = 1` (no batch is read before Keras would read it). Each execution
        is timed by `AutoSteps.end_execution`; one whose call traced a function is left out.
        """
        auto, model, iterator = self.auto, self.model, self.iterator
        accumulation = _accumulation(model)
        read_step = events.reads_optimizer_step(self.callbacks)
        groupable = auto.start_grouping(iterator.data_adapter.num_batches is not None)
        num_batches = iterator.num_batches
        for begin, end, data_iterator in slots:
            taken, last, gap = 1, end, None
            if groupable:
                limit = num_batches - begin if num_batches else None
                step = (
                    int(keras.ops.convert_to_numpy(model.optimizer.iterations)) if read_step else 0
                )
                gap = events.batches_until_next_event(self.callbacks, step, begin, accumulation)
                if gap is not None:
                    limit = gap if limit is None else min(limit, gap)
                k = auto.propose(limit)
                while taken < k:
                    try:
                        _, last, _ = next(slots)
                    except StopIteration:
                        break
                    taken += 1
            start = auto.begin_execution(begin, taken)
            yield begin, last, data_iterator
            if groupable:  # Keras asks for the next slot: this execution's callbacks have run
                auto.end_execution(taken, start, at_event=gap is not None and taken == gap)


def current_run(model):
    """The `FitRun` of the `fit` running on `model`, or `None`."""
    return _RUNS.get(model)


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
    run.skip_next_epoch_batches(count)


def _skip_first_batches(slots, count):
    """Slots whose first batch index is `>= count`; earlier ones are read and dropped."""
    for begin, end, iterator in slots:
        if begin < count:
            for _ in range(end - begin + 1):
                try:
                    next(iterator)
                except (StopIteration, _OutOfRange):
                    break
            continue
        yield begin, end, iterator


def _accumulation(model):
    optimizer = getattr(model, "optimizer", None)
    value = getattr(optimizer, "gradient_accumulation_steps", None)
    return int(value) if isinstance(value, numbers.Integral) and value > 1 else 1


try:
    import tensorflow as _tf

    _OutOfRange = _tf.errors.OutOfRangeError
except ImportError:  # pragma: no cover - the package requires TensorFlow
    _OutOfRange = StopIteration
