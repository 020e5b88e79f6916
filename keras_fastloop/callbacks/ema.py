"""Validation on the optimizer's EMA weights while training continues on the raw ones.

With `optimizer(use_ema=True)` Keras keeps an exponential moving average of each trainable
variable (Polyak averaging; Polyak & Juditsky 1992) as an optimizer variable, and overwrites the
model with it only when `fit` ends. How validation reads it here, why Keras'
`keras.callbacks.SwapEMAWeights` is not enough, and what happens to BatchNorm statistics:
docs/guide.md, "EMA weights".
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import keras

from keras_fastloop import _keras_internals as internals

__all__ = ["EMAValidation", "ema_weights", "use_ema_warmup"]

# The update rule `use_ema_warmup` installed, per (inner) optimizer: a train function traced
# before the call keeps the old rule, so `OptimizedModel` retraces when this changes.
_RULES = weakref.WeakKeyDictionary()


def _unwrapped(optimizer):
    """The optimizer that keeps the averages: a `LossScaleOptimizer`'s inner one."""
    inner = getattr(optimizer, "inner_optimizer", None)
    return inner if inner is not None else optimizer


def ema_rule(optimizer):
    """The EMA update `use_ema_warmup` gave `optimizer` (or its inner one), else `None`."""
    return _RULES.get(_unwrapped(optimizer))


def _ema_optimizer(optimizer, what):
    optimizer = _unwrapped(optimizer)
    if not getattr(optimizer, "use_ema", False):
        raise ValueError(
            f"{what} needs an optimizer with `use_ema=True` (it keeps the moving averages). "
            f"Received: optimizer={type(optimizer).__name__} with "
            f"use_ema={getattr(optimizer, 'use_ema', None)}"
        )
    return optimizer


def check_ema_model(model, what):
    """The model's (inner) optimizer, checked to keep EMA weights.

    Raises:
        ValueError: if the model has no optimizer with `use_ema=True`.
    """
    return _ema_optimizer(getattr(model, "optimizer", None), what)


class _Swap:
    """The optimizer's EMA weights in the model; `restore()` puts the raw ones back exactly."""

    def __init__(self, model, what):
        optimizer = check_ema_model(model, what)
        if not optimizer.built or int(keras.ops.convert_to_numpy(optimizer.iterations)) == 0:
            raise ValueError(
                f"{what} needs at least one optimizer update (the moving averages start at "
                "the first one). Received: optimizer.iterations=0"
            )
        self._pairs = internals.ema_pairs(optimizer)
        self._raw = [keras.ops.convert_to_numpy(variable) for variable, _ in self._pairs]
        for variable, average in self._pairs:
            variable.assign(average)

    def restore(self):
        for (variable, _), value in zip(self._pairs, self._raw):
            variable.assign(value)


@contextlib.contextmanager
def ema_weights(model: keras.Model) -> Iterator[None]:
    """Puts the optimizer's EMA weights into `model` and restores the raw ones bit for bit.

    The raw values are copied to host memory (one copy of the trainable weights) and assigned
    back on exit, also when the body raises. Keras' `SwapEMAWeights` swaps by additions and
    subtractions on TensorFlow, which changes the raw weights in their last bits. Under a
    `tf.distribute` strategy every replica's copy is assigned. Non-trainable variables
    (BatchNorm moving statistics, step state) are left as they are.

    Args:
        model: A compiled, trained `keras.Model` whose optimizer has `use_ema=True`.

    Raises:
        ValueError: If the optimizer does not use EMA or has not applied an update yet.

    Example:

    ```python
    with kf.callbacks.ema_weights(model):
        model.evaluate(test_ds)  # EMA weights
    ```
    """
    swap = _Swap(model, "`ema_weights`")
    try:
        yield
    finally:
        swap.restore()


class EMAValidation(keras.callbacks.Callback):
    """Evaluates `fit(validation_data=...)` on the EMA weights, training on the raw ones.

    Swaps the optimizer's EMA weights in at `on_test_begin` and the raw weights back, bit for
    bit, at `on_test_end` (see `ema_weights`). For `PeriodicValidation` pass `ema=True` to it
    instead: its mid-epoch evaluations do not call `fit`'s callbacks. After `fit` the model
    holds the EMA weights (Keras' `finalize_variable_values`).

    Args:
        swap_on_epoch: bool, also hold the EMA weights from `on_epoch_end` to the next
            `on_epoch_begin`, so that callbacks listed after this one (`ModelCheckpoint`,
            `EarlyStopping(restore_best_weights=True)`) see the weights that were scored, as
            with Keras' `SwapEMAWeights(swap_on_epoch=True)`. List a `BackupAndRestore`
            before it (it then backs up the raw weights). Defaults to `False`.

    Raises:
        ValueError: At the start of `fit` (or of `evaluate`), if the optimizer does not have
            `use_ema=True`; on an `OptimizedModel`, if `swap_on_epoch=True` and a
            `BackupAndRestore` is listed after it.

    Example:

    ```python
    model.compile(keras.optimizers.AdamW(use_ema=True, ema_momentum=0.999), "mse")
    checkpoint = keras.callbacks.ModelCheckpoint("best.keras", save_best_only=True)
    model.fit(
        train_ds,
        validation_data=val_ds,
        callbacks=[kf.callbacks.EMAValidation(swap_on_epoch=True), checkpoint],
    )
    ```
    """

    def __init__(self, swap_on_epoch: bool = False) -> None:
        super().__init__()
        self.swap_on_epoch = bool(swap_on_epoch)
        self._swap = None

    def _swap_in(self):
        if self._swap is None:
            self._swap = _Swap(self.model, "`EMAValidation`")

    def _restore(self):
        if self._swap is not None:
            swap, self._swap = self._swap, None
            swap.restore()

    def on_train_begin(self, logs=None):
        check_ema_model(self.model, "`EMAValidation`")

    def on_test_begin(self, logs=None):
        self._swap_in()

    def on_test_end(self, logs=None):
        self._restore()

    def on_epoch_begin(self, epoch, logs=None):
        self._restore()

    def on_epoch_end(self, epoch, logs=None):
        if self.swap_on_epoch:
            self._swap_in()

    def on_train_end(self, logs=None):
        # Keras' `finalize_variable_values` has put the averages into the model before
        # `on_train_end`: the model already holds what it should keep.
        self._swap = None


def check_callback_order(callbacks) -> None:
    """Refuses a `BackupAndRestore` listed after an `EMAValidation(swap_on_epoch=True)`.

    Its `on_epoch_end` would then back up the averages as the training weights, and a resumed
    run would train on from them. Listed before, it backs up the raw weights.

    Args:
        callbacks: the `fit` call's callbacks, in order.

    Raises:
        ValueError: if such a pair is found.
    """
    swapping = False
    for callback in callbacks:
        if isinstance(callback, EMAValidation) and callback.swap_on_epoch:
            swapping = True
        elif swapping and isinstance(callback, keras.callbacks.BackupAndRestore):
            raise ValueError(
                "`BackupAndRestore` must be listed before `EMAValidation(swap_on_epoch=True)`: "
                "after it, it would back up the EMA weights as the training weights and a "
                "resumed run would train on from them. Received: callbacks="
                f"{[type(c).__name__ for c in callbacks]}"
            )


def use_ema_warmup(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """Makes the optimizer's EMA decay warm up: `min(ema_momentum, (1 + t) / (10 + t))`.

    `t` is `optimizer.iterations` at the update (0 at the first, which copies the weights as
    Keras does). The rule is `tf.compat.v1.train.ExponentialMovingAverage`'s `num_updates`
    correction (TF-slim and TF 1 trainers); without it an EMA with decay 0.999 is still
    mostly the initial weights after a few hundred steps. With gradient accumulation Keras
    updates the average at every micro-batch, and `t` counts micro-batches.

    The rule lives on this optimizer object, not in its config: call it again on the optimizer
    of a model from `keras.saving.load_model` or before resuming; the averages and `iterations`
    themselves are optimizer variables and are saved and restored. An `OptimizedModel` whose
    train function was traced before the call retraces it at the next `fit`; a `keras.Model`
    keeps the traced rule: call it before its first `fit`.

    Args:
        optimizer: A `keras.optimizers.Optimizer` (or `LossScaleOptimizer`) with
            `use_ema=True`.

    Returns:
        The same optimizer.

    Raises:
        ValueError: If the optimizer does not have `use_ema=True`.
    """
    ema_optimizer = _ema_optimizer(optimizer, "`use_ema_warmup`")
    ops = keras.ops

    def update(trainable_variables):
        step = ops.cast(ema_optimizer.iterations, "float32")
        decay = ops.minimum(
            ops.cast(ema_optimizer.ema_momentum, "float32"),
            ops.divide(ops.add(1.0, step), ops.add(10.0, step)),
        )
        decay = ops.where(ops.equal(ema_optimizer.iterations, 0), 0.0, decay)
        for variable, average in internals.ema_pairs(ema_optimizer):
            momentum = ops.cast(decay, variable.dtype)
            average.assign(
                ops.add(
                    ops.multiply(momentum, average),
                    ops.multiply(ops.subtract(1, momentum), variable),
                )
            )

    internals.set_ema_update(ema_optimizer, update)
    _RULES[ema_optimizer] = update
    return optimizer
