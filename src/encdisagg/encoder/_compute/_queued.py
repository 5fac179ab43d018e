"""The queued-input budget: bytes of preprocessed inputs that wait for (or are in) a forward.

Preprocessing turns a 1.9 MB PNG into about 22 MB of pixel values, and the batcher may hold
many of them; counting jobs does not bound that memory, counting their bytes does. While the
count is at ``queued_memory_limit_mb``, new encodes are refused with a 503 (the server adds
``Retry-After``), and those admitted earlier wait for room before they preprocess, instead
of preprocessing more. Bytes are counted from the end of a request's preprocessing to the
end of its forward. All of it runs on the event loop: no lock. The bytes are counted where
the tensors live: with ``preprocess="device"`` they are the model device's memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, final

import anyio
import torch

from ..._errors import ServiceUnavailableError

if TYPE_CHECKING:
    from ._batcher import ForwardJob

__all__ = ["QueuedHolding", "QueuedInputs", "feature_bytes"]

_MIB = 1024 * 1024


def feature_bytes(features: Mapping[str, Any]) -> int:
    """Bytes of the tensors (and arrays) among a ``Preprocessed``'s features."""
    total = 0
    for value in features.values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        else:
            nbytes = getattr(value, "nbytes", None)  # numpy arrays and the like
            if isinstance(nbytes, int):
                total += nbytes
    return total


@final
class QueuedInputs:
    """Bytes of preprocessed inputs held until their forward ends, against a limit.

    :param limit_mb: ``queued_memory_limit_mb``, or None for no limit.
    """

    __slots__ = ("_limit", "_limit_mb", "_room", "held_bytes", "peak_bytes")

    def __init__(self, limit_mb: int | None) -> None:
        self._limit_mb = limit_mb
        self._limit = None if limit_mb is None else limit_mb * _MIB
        #: Bytes held now; invariant: the sum of every hold not yet given back.
        self.held_bytes = 0
        #: The most ever held at once (what the limit really allowed, overshoot included).
        self.peak_bytes = 0
        #: Set (and replaced) when bytes are given back; made on first use, in a loop.
        self._room: anyio.Event | None = None

    @property
    def full(self) -> bool:
        return self._limit is not None and self.held_bytes >= self._limit

    def check_admission(self, req_id: str) -> None:
        """Decide whether a request may start preprocessing. Never waits.

        :raises ServiceUnavailableError: the budget is used up (retry later).
        """
        if self.full:
            raise ServiceUnavailableError(
                f"req_id {req_id!r}: preprocessed inputs waiting for the model use "
                f"{self.held_bytes} bytes, at the limit of queued_memory_limit_mb="
                f"{self._limit_mb}; retry later",
                req_id=req_id,
            )

    async def wait_for_room(self) -> None:
        """Wait until the held bytes are under the limit. A checkpoint only when it waits;
        cancelling it leaves nothing behind."""
        while self.full:
            if self._room is None:
                self._room = anyio.Event()
            await self._room.wait()

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` that now exist (preprocessing ended); never refuses."""
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def give_back(self, nbytes: int) -> None:
        self.held_bytes -= nbytes
        room, self._room = self._room, None
        if room is not None:
            room.set()  # every waiter checks again


class QueuedHolding:
    """The queued-input bytes one ``ComputePath.run`` holds, given back when it ends,
    or, if it left jobs behind in the batcher (cancelled), when the last of them finished."""

    __slots__ = ("_pending", "_queued", "nbytes")

    def __init__(self, queued: QueuedInputs) -> None:
        self._queued = queued
        self.nbytes = 0
        #: Jobs left in the batcher; while any is, the bytes stay held.
        self._pending = 0

    def add(self, nbytes: int) -> None:
        self._queued.hold(nbytes)
        self.nbytes += nbytes

    def outlive(self, jobs: Sequence[ForwardJob]) -> None:
        """Keep the bytes held until each unfinished job of ``jobs`` finished."""
        for job in jobs:
            if not job.done.is_set():
                self._pending += 1
                job.on_finish = self._job_finished

    def _job_finished(self) -> None:
        self._pending -= 1
        self.release()

    def release(self) -> None:
        if self._pending == 0:
            self._queued.give_back(self.nbytes)
            self.nbytes = 0
