"""The one check of a number handed in by a caller or a peer, where no decoder made it.

``bool`` is a subclass of ``int``, so ``isinstance(True, int)`` holds and a JSON ``true``
would pass as ``1``. Every hand-made check of a count, a size or a duration goes through
:func:`whole` or :func:`real`, which refuse a boolean and name the field in the message.
Neither is async.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["whole", "real"]

Refusal = Callable[[str], Exception]


def whole(name: str, value: object, *, least: int = 0, error: Refusal = ValueError) -> int:
    """``value`` if it is an integer (never a bool) of at least ``least``; else raise ``error``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        wanted = {0: "a non-negative integer", 1: "a positive integer"}.get(
            least, f"an integer >= {least}"
        )
        raise error(f"{name} must be {wanted}; got {value!r}")
    return value


def real(
    name: str,
    value: object,
    *,
    least: float | None = None,
    above: float | None = None,
    finite: bool = True,
    error: Refusal = ValueError,
) -> float:
    """``value`` if it is a number (never a bool or NaN) within the bounds; else raise ``error``.

    ``least`` is an inclusive lower bound and ``above`` an exclusive one; infinity passes
    only where ``finite`` is false (a timeout that never fires).
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or math.isnan(value)
        or (finite and math.isinf(value))
        or (least is not None and value < least)
        or (above is not None and value <= above)
    ):
        if above == 0:
            wanted = "positive number"
        elif above is not None:
            wanted = f"number > {above}"
        elif least == 0:
            wanted = "non-negative number"  # as whole() words it
        else:
            wanted = "number" if least is None else f"number >= {least}"
        wanted = f"a finite {wanted}" if finite else f"a {wanted}"
        raise error(f"{name} must be {wanted}; got {value!r}")
    return value
