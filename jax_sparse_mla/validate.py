"""Host-side argument checks shared by the planner and the serving loop (ValueError naming the argument)."""

from __future__ import annotations

import math

import numpy as np

INT32_MAX = 2 ** 31 - 1


def is_int(value) -> bool:
    """A Python or numpy integer; bool is not one here."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def as_int(value, what: str, minimum: int) -> int:
    """value (a Python or numpy integer, not bool, in [minimum, 2**31)) as an int; ValueError naming `what`."""
    if not is_int(value):
        raise ValueError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    if not minimum <= value <= INT32_MAX:
        raise ValueError(range_message(what, minimum, value))
    return int(value)


def range_message(what: str, minimum: int, value) -> str:
    """as_int's message for an integer outside [minimum, 2**31)."""
    return f"{what} must be >= {minimum}" + (", got " if value < minimum else " and < 2**31, got ") + str(value)


def as_real(value, what: str, *, finite: bool = False, positive: bool = False, nonnegative: bool = False) -> float:
    """value (an int or float, numpy's too, not bool) as a float, optionally finite, > 0 or >= 0;
    ValueError naming `what`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{what} must be a real number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if finite and not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value}")
    if positive and not value > 0:
        raise ValueError(f"{what} must be positive, got {value}")
    if nonnegative and not value >= 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return value


def as_bool(value, what: str) -> bool:
    """value (a Python or numpy bool) as a bool; ValueError naming `what`."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{what} must be a bool, got {value!r}")
    return bool(value)
