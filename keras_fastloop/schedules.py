"""Learning-rate schedules that Keras lacks: SGDR restarts with an optional linear warmup."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import keras
from keras import ops

from keras_fastloop import _validation

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["WarmupCosineDecayRestarts"]


_is_number = _validation.is_real
_is_int = _validation.is_int


@keras.saving.register_keras_serializable(package="keras_fastloop")
class WarmupCosineDecayRestarts(keras.optimizers.schedules.LearningRateSchedule):
    """Cosine decay with warm restarts (SGDR), with an optional linear warmup.

    The signature is `keras.optimizers.schedules.CosineDecayRestarts`', plus the keyword-only
    warmup of `keras.optimizers.schedules.CosineDecay` (`warmup_target=None`,
    `warmup_steps=0`). Without a warmup (`warmup_target=None`) the schedule *is*
    `CosineDecayRestarts(initial_learning_rate, first_decay_steps, t_mul, m_mul, alpha)`,
    bit for bit. With `warmup_target` set, for `step < warmup_steps` the learning rate rises
    linearly from `initial_learning_rate` to `warmup_target` (the formula of `CosineDecay`'s
    warmup); from `step == warmup_steps` on it is `CosineDecayRestarts(warmup_target,
    first_decay_steps, t_mul, m_mul, alpha)` evaluated at `step - warmup_steps`. As in
    Keras, `warmup_target` with `warmup_steps=0` starts the decay at `warmup_target`.

    How it behaves in detail: docs/behaviour.md#warmupcosinedecayrestarts.

    Args:
        initial_learning_rate: Float, >= 0. Learning rate at step 0: the peak of the first
            cosine period without a warmup, where the warmup starts with one.
        first_decay_steps: Integer, > 0. Length of the first cosine period in optimizer
            updates.
        t_mul: Float, >= 1. Each period is `t_mul` times longer than the one before.
            Defaults to `2.0`.
        m_mul: Float, >= 0. Each period's cosine amplitude is `m_mul` times the
            previous one's. Defaults to `1.0`.
        alpha: Float in [0, 1]. Floor of every period as a fraction of the peak.
            Defaults to `0.0`.
        name: String. Name scope of the ops. Defaults to `"WarmupCosineDecayRestarts"`.
        warmup_target: Keyword-only. Float >= 0 or `None` (default: no warmup). Learning
            rate reached at the end of the warmup, and the peak of the first cosine period.
        warmup_steps: Keyword-only. Integer, >= 0. Length of the linear warmup in optimizer
            updates. Defaults to `0`. Needs `warmup_target` when > 0.
        gradient_accumulation_steps: Keyword-only. Integer >= 1 or `None`. Set it to the
            optimizer's `gradient_accumulation_steps` so the schedule counts updates
            rather than micro-batches (see above). Defaults to `None` (no conversion).
        allow_decreasing_warmup: Keyword-only. Boolean. Allow `warmup_target <
            initial_learning_rate` (a linear decrease). Defaults to `False`.

    Returns:
        Called with a scalar step, the learning rate as a scalar float32 tensor.

    Raises:
        ValueError: an argument out of range or of the wrong type, `warmup_steps > 0`
            without `warmup_target`, or a decreasing warmup not allowed.

    Example:

    >>> schedule = WarmupCosineDecayRestarts(
    ...     0.0, first_decay_steps=2000, t_mul=2.0, m_mul=0.8, alpha=0.01,
    ...     warmup_target=1e-3, warmup_steps=500)
    >>> optimizer = keras.optimizers.AdamW(learning_rate=schedule)
    >>> round(float(schedule(250)), 6)  # half-way through the warmup
    0.0005
    >>> plain = WarmupCosineDecayRestarts(1e-3, first_decay_steps=1000)  # no warmup
    >>> round(float(plain(0)), 6)
    0.001

    Reference:
        Loshchilov & Hutter, "SGDR", ICLR 2017 (arXiv:1608.03983); Goyal et al.,
        "Accurate, Large Minibatch SGD", 2017 (arXiv:1706.02677): linear warmup.
    """

    def __init__(
        self,
        initial_learning_rate: float,
        first_decay_steps: int,
        t_mul: float = 2.0,
        m_mul: float = 1.0,
        alpha: float = 0.0,
        name: str = "WarmupCosineDecayRestarts",
        *,
        warmup_target: float | None = None,
        warmup_steps: int = 0,
        gradient_accumulation_steps: int | None = None,
        allow_decreasing_warmup: bool = False,
    ) -> None:
        super().__init__()
        _check(
            _is_number(initial_learning_rate)
            and math.isfinite(initial_learning_rate)
            and initial_learning_rate >= 0,
            "initial_learning_rate",
            "a finite number >= 0",
            initial_learning_rate,
        )
        _check(
            warmup_target is None
            or (_is_number(warmup_target) and math.isfinite(warmup_target) and warmup_target >= 0),
            "warmup_target",
            "None or a finite number >= 0",
            warmup_target,
        )
        _check(
            _is_int(warmup_steps) and warmup_steps >= 0,
            "warmup_steps",
            "an integer >= 0",
            warmup_steps,
        )
        if warmup_target is None and warmup_steps > 0:
            raise ValueError(
                "`warmup_steps > 0` needs a `warmup_target` (the learning rate the warmup "
                "reaches); pass `warmup_target=...` or `warmup_steps=0`. "
                f"Received: warmup_target=None, warmup_steps={warmup_steps}"
            )
        _check(
            _is_int(first_decay_steps) and first_decay_steps > 0,
            "first_decay_steps",
            "an integer > 0",
            first_decay_steps,
        )
        _check(
            _is_number(t_mul) and math.isfinite(t_mul) and t_mul >= 1,
            "t_mul",
            "a finite number >= 1",
            t_mul,
        )
        _check(
            _is_number(m_mul) and math.isfinite(m_mul) and m_mul >= 0,
            "m_mul",
            "a finite number >= 0",
            m_mul,
        )
        _check(_is_number(alpha) and 0 <= alpha <= 1, "alpha", "a number in [0, 1]", alpha)
        _check(
            gradient_accumulation_steps is None
            or (_is_int(gradient_accumulation_steps) and gradient_accumulation_steps >= 1),
            "gradient_accumulation_steps",
            "None or an integer >= 1",
            gradient_accumulation_steps,
        )
        _check(
            isinstance(allow_decreasing_warmup, bool),
            "allow_decreasing_warmup",
            "a bool",
            allow_decreasing_warmup,
        )
        _check(isinstance(name, str), "name", "a string", name)
        if (
            warmup_target is not None
            and warmup_target < initial_learning_rate
            and not allow_decreasing_warmup
        ):
            raise ValueError(
                "`warmup_target` must be >= `initial_learning_rate` (the warmup raises the "
                "learning rate); pass `allow_decreasing_warmup=True` to warm down on purpose. "
                f"Received: initial_learning_rate={initial_learning_rate}, "
                f"warmup_target={warmup_target}"
            )

        self.initial_learning_rate = float(initial_learning_rate)
        self.warmup_target = None if warmup_target is None else float(warmup_target)
        self.warmup_steps = int(warmup_steps)
        self.first_decay_steps = int(first_decay_steps)
        self.t_mul = float(t_mul)
        self.m_mul = float(m_mul)
        self.alpha = float(alpha)
        self.gradient_accumulation_steps = (
            None if gradient_accumulation_steps is None else int(gradient_accumulation_steps)
        )
        self.allow_decreasing_warmup = allow_decreasing_warmup
        self.name = name
        # The part after the warmup is exactly Keras' SGDR schedule (shifted by the warmup).
        peak = self.initial_learning_rate if self.warmup_target is None else self.warmup_target
        self._restarts = keras.optimizers.schedules.CosineDecayRestarts(
            peak,
            self.first_decay_steps,
            t_mul=self.t_mul,
            m_mul=self.m_mul,
            alpha=self.alpha,
            name=name,
        )

    def __call__(self, step: int | float | tf.Tensor) -> tf.Tensor:
        with keras.name_scope(self.name):
            if self.gradient_accumulation_steps:
                step = ops.floor_divide(step, self.gradient_accumulation_steps)
            if self.warmup_target is None or self.warmup_steps == 0:
                return self._restarts(step)  # Keras' own schedule, bit for bit
            warmup_target = ops.convert_to_tensor(self.warmup_target)
            dtype = warmup_target.dtype
            step = ops.cast(step, dtype)
            initial_learning_rate = ops.convert_to_tensor(self.initial_learning_rate, dtype)
            warmup_steps = ops.cast(self.warmup_steps, dtype)
            # Same expression (and operation order) as keras' CosineDecay warmup.
            warmup = (warmup_target - initial_learning_rate) * (
                step / warmup_steps
            ) + initial_learning_rate
            # Clamp so the unused branch never sees a negative step (log of < 1).
            decayed = self._restarts(ops.maximum(step - warmup_steps, 0.0))
            return ops.where(step < warmup_steps, warmup, decayed)

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "warmup_target": self.warmup_target,
            "warmup_steps": self.warmup_steps,
            "first_decay_steps": self.first_decay_steps,
            "t_mul": self.t_mul,
            "m_mul": self.m_mul,
            "alpha": self.alpha,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "allow_decreasing_warmup": self.allow_decreasing_warmup,
            "name": self.name,
        }


_check = _validation.check
