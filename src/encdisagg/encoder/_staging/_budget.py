"""The staged-memory budget: the one writer of the staged byte count."""

from __future__ import annotations

import threading
from typing import final

from ..._errors import ServiceUnavailableError

__all__ = ["StagedBudget"]

_MIB = 1024 * 1024


@final
class StagedBudget:
    """Bytes of staged embeddings, against ``staged_memory_limit_mb``.

    Bytes are counted from staging until the memory is really gone: for a region whose
    deregistration is pending or failed, until a deregistration returned, which may be in
    a worker thread (hence the lock).

    :param limit_mb: the limit, or None for none.
    """

    __slots__ = ("_limit", "_limit_mb", "_lock", "staged_bytes")

    def __init__(self, limit_mb: int | None) -> None:
        self._limit_mb = limit_mb
        self._limit = None if limit_mb is None else limit_mb * _MIB
        self._lock = threading.Lock()
        self.staged_bytes = 0

    def check_admission(self, req_id: str) -> None:
        """:raises ServiceUnavailableError: the budget is used up (retry later)."""
        if self._limit is not None and self.staged_bytes >= self._limit:
            raise ServiceUnavailableError(
                f"staged embeddings use {self.staged_bytes} bytes, at the limit of "
                f"staged_memory_limit_mb={self._limit_mb}; retry later",
                req_id=req_id,
            )

    def reserve(self, req_id: str, nbytes: int) -> None:
        """Count ``nbytes`` more. :raises ServiceUnavailableError: it would pass the limit."""
        with self._lock:
            if self._limit is not None and self.staged_bytes + nbytes > self._limit:
                raise ServiceUnavailableError(
                    f"req_id {req_id!r}: staging {nbytes} bytes would pass "
                    f"staged_memory_limit_mb={self._limit_mb}; retry later",
                    req_id=req_id,
                )
            self.staged_bytes += nbytes

    def give_back(self, nbytes: int) -> None:
        with self._lock:
            self.staged_bytes -= nbytes
