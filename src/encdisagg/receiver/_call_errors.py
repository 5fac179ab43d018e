"""What a call from :class:`~encdisagg.receiver.EncoderClient` to one encoder can end with:
the error of a failed call, and what ``/release`` confirmed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from .._errors import EncdisaggError

__all__ = ["TIMED_OUT", "UNREACHABLE", "EncoderCallError", "ReleaseOutcome"]

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

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_call_error,
            (self.message, self.url, self.route, self.status, self.part_idx, self.req_id),
        )


def _rebuild_call_error(
    message: str, url: str, route: str, status: int, part_idx: int | None, req_id: str | None
) -> EncoderCallError:
    return EncoderCallError(
        message, url=url, route=route, status=status, part_idx=part_idx, req_id=req_id
    )


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
