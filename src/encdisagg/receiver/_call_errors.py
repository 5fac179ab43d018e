"""What calls from :class:`~encdisagg.receiver.EncoderClient` to encoders can end with: the
error of a failed call, an encoder gone mid-request, what ``/release`` confirmed, and the one
error a caller sees of a task group of calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import anyio

from .._errors import EncdisaggError, ServiceUnavailableError
from ..nurseries import leaf_exceptions

__all__ = [
    "TIMED_OUT",
    "UNREACHABLE",
    "EncoderCallError",
    "EncoderLeftError",
    "ReleaseOutcome",
    "first_error",
]

#: Status given to an encoder that could not be reached, or answered nonsense.
UNREACHABLE: Final = 502
#: Status given to a call that ran out of time.
TIMED_OUT: Final = 504


class EncoderCallError(EncdisaggError):
    """One call to one encoder failed.

    :attr:`status` is the encoder's own answer status (``400`` for media it rejected,
    ``503`` for an encoder shutting down…), ``502`` if it could not be reached or answered
    something that is not the contract, ``504`` if the call timed out. :attr:`url` names
    the encoder, :attr:`route` the call, :attr:`part_idx` the part.
    """

    status = UNREACHABLE

    def __init__(
        self,
        message: str,
        *,
        url: str,
        route: str,
        status: int,
        part_idx: int | None = None,
        req_id: str | None = None,
    ) -> None:
        super().__init__(message, req_id=req_id)
        self.url = url
        self.route = route
        self.part_idx = part_idx
        # Per instance: the status is the encoder's answer, not a property of the class.
        self.__dict__["status"] = status


class EncoderLeftError(ServiceUnavailableError):
    """An encoder left the registry (its lease ran out, or it drained) while it held an
    undelivered part of the request (503)."""

    def __init__(self, url: str, rid: str) -> None:
        super().__init__(f"encoder {url} left the registry during request {rid!r}", req_id=rid)
        self.url = url


@dataclass(frozen=True, slots=True)
class ReleaseOutcome:
    """What the encoders answered to ``POST /release``, by part id.

    Only :attr:`confirmed` parts are known to be over: memory they were written into may be
    reused. A :attr:`held` part's transfer may still land (its encoder said so); of an
    :attr:`unconfirmed` part nothing is known.
    """

    #: Answered 2xx: no transfer of the part can land any more.
    confirmed: frozenset[str] = frozenset()
    #: The encoder itself answered 504: a transfer of the part ended with an unknown outcome
    #: and may still land, until the encoder's engine reports that it ended.
    held: frozenset[str] = frozenset()
    #: Not reached, not answered in time, refused, or answered by something else than the
    #: encoder (a proxy's 504 says nothing about the encoder's transfers).
    unconfirmed: frozenset[str] = frozenset()


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
