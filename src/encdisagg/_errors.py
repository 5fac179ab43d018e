"""The one error hierarchy of encdisagg.

Every error carries ``status``: the HTTP status the server answers with, set by
:data:`WIRE_ANSWERS`, the one table of what each error answers on every wire. Messages name
the offending field or request id, so a caller can act on them without reading a traceback.
Cancellation is never wrapped in these classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Final

__all__ = [
    "WIRE_ANSWERS",
    "BadRequestError",
    "ConfigError",
    "EncdisaggError",
    "ForbiddenError",
    "InternalError",
    "NotFoundError",
    "RequestNotActiveError",
    "RequestTimeoutError",
    "ServiceUnavailableError",
    "TransferError",
    "TransferTimeoutError",
    "error_of_status",
    "grpc_code_of",
]


class EncdisaggError(Exception):
    """Base class of every error encdisagg raises on purpose.

    :param message: what went wrong, naming the field or id concerned.
    :param req_id: the request the error belongs to, when there is one.
    """

    status: ClassVar[int] = 500

    def __init__(self, message: str, *, req_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.req_id = req_id

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[object, ...]:
        # Keeps errors copyable across process boundaries we own (never from sockets). The
        # copy is made from the attributes, not through the constructor, so a subclass whose
        # constructor takes other arguments copies too.
        return (type(self).__new__, (type(self), self.message), self.__dict__)


class BadRequestError(EncdisaggError):
    """Invalid fields, undecodable media, or input the preprocessor rejected (400)."""


class ConfigError(BadRequestError, ValueError):
    """An invalid configuration value (``EncoderConfig``, ``ServerSettings``, client options),
    named with its field.

    A :class:`ValueError`, so code that builds configurations catches it as the standard
    "bad argument" error; a :class:`BadRequestError` (400) too, so a configuration sent in a
    request body is answered as the client's mistake.
    """


class ForbiddenError(EncdisaggError):
    """A destination outside the server's configured allow-list (403)."""


class NotFoundError(EncdisaggError):
    """An unknown ``req_id`` (404)."""


class RequestNotActiveError(EncdisaggError):
    """The request was released, is being released, or its id is live already (409)."""


class RequestTimeoutError(EncdisaggError):
    """A bounded wait ran out: registration, metadata, queue (504)."""


class TransferError(EncdisaggError):
    """The engine or a peer failed a transfer, registration or deregistration (502)."""


class TransferTimeoutError(TransferError):
    """A transfer's outcome is unknown: the engine stopped waiting for it while it may still
    read or write memory (504).

    Not a failure: the bytes may still land. The memory the transfer touches is held (kept
    alive, never freed, reused or deregistered) until ``hold`` settles, which the engine does
    once it saw the transfer end or was itself destroyed (``docs/cancellation.md``, the
    transfer contract). ``hold`` is the engine's :class:`~encdisagg.transfer.Hold`, or None
    where the error crossed a process boundary or the engine gives none.
    """

    def __init__(self, message: str, *, req_id: str | None = None, hold: object = None) -> None:
        super().__init__(message, req_id=req_id)
        self.hold = hold

    def __reduce__(self) -> tuple[object, ...]:
        # The hold is the engine's live object: a copy carries none.
        return (*super().__reduce__()[:2], {**self.__dict__, "hold": None})


class ServiceUnavailableError(EncdisaggError):
    """Shutting down, over the staged-memory budget, or no live worker (503)."""


class InternalError(EncdisaggError):
    """encdisagg broke one of its own invariants (500)."""


#: What each error answers on the wire: its HTTP status (its class's ``status``), and the
#: ``grpc.StatusCode``, by name, an RPC of SGLang's gRPC encoder service ends with. SGLang
#: itself ends a bad request with INVALID_ARGUMENT and anything else with INTERNAL; the other
#: codes tell apart what it does not: a refused destination, a transfer whose outcome is
#: unknown (its bytes may still land), a server taking no new work (a client's retry policy
#: may try another). An error answers as the nearest class of its own that is listed; the way
#: back, from a status to an error, takes the first row answering that status.
WIRE_ANSWERS: Final[Mapping[type[EncdisaggError], tuple[int, str]]] = {
    BadRequestError: (400, "INVALID_ARGUMENT"),
    ForbiddenError: (403, "PERMISSION_DENIED"),
    NotFoundError: (404, "INTERNAL"),
    RequestNotActiveError: (409, "INTERNAL"),
    RequestTimeoutError: (504, "INTERNAL"),
    TransferTimeoutError: (504, "DEADLINE_EXCEEDED"),
    TransferError: (502, "INTERNAL"),
    ServiceUnavailableError: (503, "UNAVAILABLE"),
    InternalError: (500, "INTERNAL"),
    EncdisaggError: (500, "INTERNAL"),
}

for _error, (_status, _) in WIRE_ANSWERS.items():
    _error.status = _status
del _error, _status


def grpc_code_of(exc: BaseException) -> str:
    """The name of the ``grpc.StatusCode`` an RPC that raised ``exc`` ends with. Not async."""
    for cls in type(exc).__mro__:
        if cls in WIRE_ANSWERS:
            return WIRE_ANSWERS[cls][1]
    return "INTERNAL"


def error_of_status(status: int | None) -> type[EncdisaggError]:
    """The error class an HTTP error status names (:class:`InternalError` for a status no
    error of ours answers, or none). Not async."""
    for cls, (answered, _) in WIRE_ANSWERS.items():
        if answered == status:
            return cls
    return InternalError
