"""The preallocation queue: requests waiting for KV pages and a metadata slot.

Synchronous, like the transfer queue: the scheduler calls it between forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from .._errors import BadRequestError
from ._pages import PageSource
from ._poll import KVPoll
from ._request import DecodeRequest
from ._slots import MetadataSlotAllocator
from ._transfer import _as_set

__all__ = [
    "DecodePreallocQueue",
    "PreallocPass",
    "PreallocRequest",
    "ResumePass",
    "RetractedRequest",
]


@dataclass(eq=False, slots=True)
class PreallocRequest:
    """A request that has been accepted for decode but holds no pages yet."""

    rid: str
    room: int
    #: KV pages it needs for its prompt.
    num_pages: int
    #: Prefill ranks that will write its KV.
    required_acks: int = 1


@dataclass(eq=False, slots=True)
class RetractedRequest:
    """A running request whose pages were taken back under memory pressure."""

    rid: str
    #: KV pages it needs to resume.
    num_pages: int
    #: The pages it resumed with (empty while retracted, and after a failed reload).
    pages: tuple[int, ...] = ()
    #: Writes the KV backed up at retraction into the pages it resumes with; called once, by
    #: :meth:`DecodePreallocQueue.resume_retracted`, right after the pages were taken.
    reload: Callable[[tuple[int, ...]], None] | None = None
    #: True while it waits to resume.
    is_retracted: bool = True
    #: What its ``reload`` raised, if it did: it then cannot resume.
    reload_error: Exception | None = None


class PreallocPass(NamedTuple):
    """What one :meth:`DecodePreallocQueue.pop_preallocated` pass did."""

    #: Requests that now hold pages and a metadata slot, ready for the transfer queue.
    preallocated: list[DecodeRequest]
    #: Requests removed because their transfer failed before they got any pages.
    failed: list[PreallocRequest]


class ResumePass(NamedTuple):
    """What one :meth:`DecodePreallocQueue.resume_retracted` pass did."""

    #: Requests that now hold ``pages`` with their KV reloaded, in queue order.
    resumed: list[RetractedRequest]
    #: Requests whose ``reload`` raised (``reload_error``), in queue order; they hold no
    #: pages and are out of the queue: the caller ends them.
    failed: list[RetractedRequest]


class DecodePreallocQueue:
    """Admits requests to KV pages and metadata slots in arrival order.

    :param pages: where KV pages come from.
    :param slots: the metadata slots.

    Retracted requests come first: while any is waiting, no new request is admitted (they
    already hold a place in the running batch and would otherwise starve).
    """

    def __init__(self, *, pages: PageSource, slots: MetadataSlotAllocator) -> None:
        self.pages = pages
        self.slots = slots
        #: Requests waiting for preallocation, in arrival order.
        self.queue: list[PreallocRequest] = []
        #: Retracted requests waiting to resume, in retraction order.
        self.retracted: list[RetractedRequest] = []

    def add(self, req: PreallocRequest) -> None:
        """Queue ``req``.

        :raises BadRequestError: if it needs more pages than the pool has: it could never be
            admitted and would block every request behind it.
        """
        if req.num_pages > self.pages.num_pages:
            raise BadRequestError(
                f"request {req.rid!r} needs {req.num_pages} KV pages, "
                f"more than the {self.pages.num_pages} there are",
                req_id=req.rid,
            )
        self.queue.append(req)

    def retract(self, req: RetractedRequest) -> None:
        """Queue a retracted request for resumption (its pages were freed by the caller)."""
        self.retracted.append(req)

    def _take(self, num_pages: int) -> tuple[tuple[int, ...], int] | None:
        """Pages and a slot for one request, or neither."""
        if self.slots.available() < 1:
            return None
        pages = self.pages.alloc(num_pages)
        if pages is None:
            return None
        slot = self.slots.alloc()
        if slot is None:  # pragma: no cover - checked above, and nothing ran in between
            self.pages.free(pages)
            return None
        return tuple(pages), slot

    def pop_preallocated(
        self,
        polls: Mapping[str, KVPoll],
        rids_to_check: Collection[str] | None = None,
    ) -> PreallocPass:
        """Give pages and a slot to the requests that are ready and fit, in one pass.

        Only requests whose ``rid`` is in ``rids_to_check`` are examined (all when ``None``).
        Per examined request, by its poll (a missing poll counts as ``Bootstrapping``):

        - ``Failed``: removed and reported in ``failed``, also after admission stopped;
        - ``WaitingForInput`` (handshake done): admitted if it fits; the first one that does
          not fit stops admission for the rest of the pass, so no later request overtakes
          it;
        - anything else: stays, and does not stop admission.

        Survivors keep their order.
        """
        checked = _as_set(rids_to_check)
        survivors: list[PreallocRequest] = []
        preallocated: list[DecodeRequest] = []
        failed: list[PreallocRequest] = []
        admitting = not self.retracted
        for req in self.queue:
            if checked is not None and req.rid not in checked:
                survivors.append(req)
                continue
            poll = polls.get(req.rid, KVPoll.Bootstrapping)
            if poll == KVPoll.Failed:
                failed.append(req)
                continue
            if poll != KVPoll.WaitingForInput or not admitting:
                survivors.append(req)
                continue
            pages = self._take(req.num_pages)
            if pages is None:
                admitting = False
                survivors.append(req)
                continue
            page_indices, slot = pages
            preallocated.append(
                DecodeRequest(req.rid, req.room, slot, req.required_acks, pages=page_indices)
            )
        self.queue = survivors
        return PreallocPass(preallocated, failed)

    def resume_retracted(
        self, rids_to_check: Collection[str] | None = None, *, max_pages: int | None = None
    ) -> ResumePass:
        """Give pages back to retracted requests in order, and reload their KV, in one pass.

        Only requests whose ``rid`` is in ``rids_to_check`` are examined (all when ``None``).
        The first examined request that does not fit (the pool, or ``max_pages`` in all) stops
        the pass, so no later one overtakes it; the rest stay, in order. Each request that
        fits gets pages, then its ``reload`` writes the backed-up KV into them:

        - it returns: the request is *resumed*, with ``pages`` set and ``is_retracted``
          false;
        - it raises an :class:`Exception`: the request has *failed*: its pages go back at
          once (they spend none of ``max_pages``), ``reload_error`` holds the exception,
          ``is_retracted`` is false, and the pass goes on with the next request;
        - it raises anything else (``KeyboardInterrupt``, ``SystemExit``): its pages go
          back, it and every request after it stay queued, and the exception propagates.

        Each request is marked (``is_retracted`` false) as the pass takes it out of
        ``retracted``, so after a propagating exception a caller can still tell, from the
        requests it offered, which ones the pass resumed or failed before it. Not a
        checkpoint (nothing here awaits).

        :return: the resumed and the failed requests, each in queue order.
        """
        checked = _as_set(rids_to_check)
        queue = self.retracted
        survivors: list[RetractedRequest] = []
        resumed: list[RetractedRequest] = []
        failed: list[RetractedRequest] = []
        budget = max_pages
        stopped = False
        done = 0
        try:
            for req in queue:
                done += 1
                if stopped or (checked is not None and req.rid not in checked):
                    survivors.append(req)
                    continue
                pages = None
                if budget is None or req.num_pages <= budget:
                    pages = self.pages.alloc(req.num_pages)
                if pages is None:
                    stopped = True
                    survivors.append(req)
                    continue
                try:
                    if req.reload is not None:
                        req.reload(tuple(pages))
                except Exception as exc:
                    # Its backed-up KV is lost, so it can never resume: it no longer holds a
                    # place in line, and later requests may take the pages it was handed.
                    self.pages.free(pages)
                    req.reload = None
                    req.reload_error = exc
                    req.is_retracted = False
                    failed.append(req)
                    continue
                except BaseException:
                    self.pages.free(pages)
                    done -= 1
                    raise
                if budget is not None:
                    budget -= req.num_pages
                req.pages = tuple(pages)
                req.reload = None
                req.is_retracted = False
                resumed.append(req)
        finally:
            survivors.extend(queue[done:])
            self.retracted = survivors
        return ResumePass(resumed, failed)
