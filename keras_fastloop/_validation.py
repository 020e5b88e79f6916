"""Argument checks shared by every public constructor and function (internal).

One message shape, Keras' own: "`x` must be <requirement>. Received: x=<repr>". One argument
order: `(name, value)`. NumPy scalars are accepted wherever Python numbers are
(`np.int64(32)` is an integer, `np.float32(0.5)` a real number); `bool` is never a number.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any


def is_int(value: Any) -> bool:
    """Whether `value` is an integer (Python or NumPy), `bool` excluded."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """Whether `value` is a real number (Python or NumPy int/float), `bool` excluded."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def fail(name: str, requirement: str, value: Any, error: type[Exception] = ValueError):
    """Raises `error("`name` must be <requirement>. Received: name=<value!r>")`."""
    raise error(f"`{name}` must be {requirement}. Received: {name}={value!r}")


def check(
    condition: bool, name: str, requirement: str, value: Any, error: type[Exception] = ValueError
) -> None:
    """Raises as `fail` unless `condition`."""
    if not condition:
        fail(name, requirement, value, error)


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    allow_none: bool = False,
    requirement: str | None = None,
) -> int | None:
    """Checks an integer argument (at least `minimum`); returns it as a Python `int`.

    Args:
        name: the argument's name, for the message.
        value: the argument.
        minimum: int or None, the smallest allowed value. Defaults to `None` (no bound).
        allow_none: whether `None` passes (and is returned). Defaults to `False`.
        requirement: string, the message's requirement; by default derived from `minimum`
            ("a positive integer" for 1, "a non-negative integer" for 0, ...).

    Raises:
        ValueError: when `value` is not an integer or is below `minimum`.
    """
    if value is None and allow_none:
        return None
    if requirement is None:
        requirement = {1: "a positive integer", 0: "a non-negative integer"}.get(
            minimum, "an integer" if minimum is None else f"an integer >= {minimum}"
        )
        if allow_none:
            requirement = f"None or {requirement}"
    check(is_int(value) and (minimum is None or value >= minimum), name, requirement, value)
    return int(value)


def check_real(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
    allow_none: bool = False,
    requirement: str | None = None,
) -> float | None:
    """Checks a finite real argument within optional bounds; returns it as a Python `float`.

    Args:
        name: the argument's name, for the message.
        value: the argument.
        minimum, maximum: float or None, the bounds. Default `None` (unbounded).
        exclusive_minimum, exclusive_maximum: whether the bounds themselves are excluded.
            Default `False`.
        allow_none: whether `None` passes (and is returned). Defaults to `False`.
        requirement: string, the message's requirement. Defaults to one derived from the bounds.

    Raises:
        ValueError: when `value` is not a finite real number or is out of bounds.
    """
    if value is None and allow_none:
        return None
    if requirement is None:
        if minimum == 0 and maximum is None:
            requirement = "a positive number" if exclusive_minimum else "a non-negative number"
        else:
            parts = []
            if minimum is not None:
                parts.append(f"{'>' if exclusive_minimum else '>='} {minimum}")
            if maximum is not None:
                parts.append(f"{'<' if exclusive_maximum else '<='} {maximum}")
            requirement = "a finite number" + (f" {' and '.join(parts)}" if parts else "")
        if allow_none:
            requirement = f"None or {requirement}"
    ok = is_real(value) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value > minimum if exclusive_minimum else value >= minimum
    if ok and maximum is not None:
        ok = value < maximum if exclusive_maximum else value <= maximum
    check(ok, name, requirement, value)
    return float(value)


def check_callable(name: str, value: Any, *, allow_none: bool = False) -> Callable | None:
    """Checks that `value` is callable (or `None` with `allow_none`); returns it.

    Raises:
        ValueError: when it is not.
    """
    if value is None and allow_none:
        return None
    check(callable(value), name, "None or a callable" if allow_none else "callable", value)
    return value
