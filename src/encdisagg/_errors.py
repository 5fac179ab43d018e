"""The one error hierarchy of encdisagg.

Every error carries ``status``: the HTTP status the server answers with. Messages name the
offending field or request id, so a caller can act on them without reading a traceback.
Cancellation is never wrapped in these classes.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "BadRequestError",
    "ConfigError",
    "EncdisaggError",
    "InternalError",
    "NotFoundError",
    "RequestNotActiveError",
    "RequestTimeoutError",
    "ServiceUnavailableError",
    "TransferError",
    "TransferTimeoutError",
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
        # Keeps errors copyable across process boundaries we own (never from sockets).
        return (_rebuild_error, (type(self), self.message, self.req_id))


def _rebuild_error(cls: type[EncdisaggError], message: str, req_id: str | None) -> EncdisaggError:
    return cls(message, req_id=req_id)


class BadRequestError(EncdisaggError):
    """Invalid fields, undecodable media, or input the preprocessor rejected (400)."""

    status = 400


class ConfigError(BadRequestError, ValueError):
    """An invalid configuration value (``EncoderConfig``, ``ServerSettings``, client options),
    named with its field.

    A :class:`ValueError`, so code that builds configurations catches it as the standard
    "bad argument" error; a :class:`BadRequestError` (400) too, so a configuration sent in a
    request body is answered as the client's mistake.
    """


class NotFoundError(EncdisaggError):
    """An unknown ``req_id`` (404)."""

    status = 404


class RequestNotActiveError(EncdisaggError):
    """The request was released, is being released, or its id is live already (409)."""

    status = 409


class RequestTimeoutError(EncdisaggError):
    """A bounded wait ran out: registration, metadata, queue (504)."""

    status = 504


class TransferError(EncdisaggError):
    """The engine or a peer failed a transfer, registration or deregistration (502)."""

    status = 502


class TransferTimeoutError(TransferError):
    """A transfer's outcome is unknown: the engine stopped waiting for it while it may still
    read or write memory (504).

    Not a failure: the bytes may still land. The memory the transfer touches is held (kept
    alive, never freed, reused or deregistered) until ``hold`` settles, which the engine does
    once it saw the transfer end or was itself destroyed (``docs/cancellation.md``, the
    transfer contract). ``hold`` is the engine's :class:`~encdisagg.transfer.Hold`, or None
    where the error crossed a process boundary or the engine gives none.
    """

    status = 504

    def __init__(self, message: str, *, req_id: str | None = None, hold: object = None) -> None:
        super().__init__(message, req_id=req_id)
        self.hold = hold


class ServiceUnavailableError(EncdisaggError):
    """Shutting down, over the staged-memory budget, or no live worker (503)."""

    status = 503


class InternalError(EncdisaggError):
    """encdisagg broke one of its own invariants (500)."""

    status = 500


def status_of(exc: BaseException) -> int:
    """The HTTP status for ``exc``: its ``status`` if it is ours, else 500."""
    if isinstance(exc, EncdisaggError):
        return exc.status
    return 500
