"""Turning a task group's ExceptionGroup back into the one error a caller should see."""

from __future__ import annotations

import anyio

from .._errors import EncdisaggError
from ..nurseries import leaf_exceptions

__all__ = ["first_error"]


def first_error(exc: BaseException) -> BaseException:
    """The error to raise for ``exc``.

    Not a group: ``exc`` itself. A group: its first encdisagg error, else its first error
    that is not a cancellation; the other errors become notes on it. A group of
    cancellations only stays the group (the caller's cancel scope then handles it).

    Raise the result outside the handler that caught ``exc``, so the group does not become
    its ``__context__`` (see :func:`~encdisagg.nurseries.sole_error`, the one-error case).
    """
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    cancelled = anyio.get_cancelled_exc_class()
    errors = [leaf for leaf in leaf_exceptions(exc) if not isinstance(leaf, cancelled)]
    if not errors:
        return exc
    chosen = next((e for e in errors if isinstance(e, EncdisaggError)), errors[0])
    for other in errors:
        if other is not chosen:
            chosen.add_note(f"also failed: {other!r}")
    return chosen
