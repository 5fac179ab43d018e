"""Continuous batching over landed KV: the decode scheduler's synchronous core.

Requests whose KV landed (committed by :meth:`DecodeTransferQueue.pop_transferred`) wait in
``waiting``. Each step (:meth:`DecodeBatchScheduler.schedule_step`) resumes retracted requests,
forms a *prebuilt* batch from the waiting queue's prefix (bounded by free running slots and
by the pages the pool can still give), merges it into the running batch, makes sure every
running request has a page for the token it is about to add (retracting the newest ones when
the pool cannot), and hands the running batch out for one batched forward. The result comes
back through :meth:`DecodeBatchScheduler.process_batch_result_decode`.

Metadata slots: a request whose commit found a draft state keeps its slot past the prebuilt
batch until the first real decode step consumed the state; a request that ends frees its slot
at once. :meth:`DecodeBatchScheduler.free_metadata_if_held` frees a slot at most once.

One request's KV backup (at retraction) or reload (at resume) that raises ends that request
as failed, its pages and slot freed; the step goes on with the others, in order.

Nothing here awaits or reads the wall clock (the clock is injected), so the state is
consistent at every checkpoint of the async shell around it and tests drive it directly.
"""

from __future__ import annotations

import enum
import functools
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .._errors import InternalError
from .._numbers import whole
from ._pages import PageSource
from ._prealloc import DecodePreallocQueue, RetractedRequest
from ._request import DecodeRequest
from ._transfer import DecodeTransferQueue

__all__ = [
    "DecodeBatch",
    "DecodeBatchScheduler",
    "FinishReason",
    "KVBackup",
    "RunningRequest",
]

_log = logging.getLogger("encdisagg.decode")

#: Decision rounds of one step at most (two suffice: the second uses what the first freed).
_MAX_ROUNDS = 4


class FinishReason(enum.Enum):
    """Why a decode request left the batch."""

    #: It produced ``max_new_tokens`` tokens.
    LENGTH = "length"
    #: It produced an end-of-sequence token.
    STOP = "stop"
    #: Its client went away.
    ABORTED = "aborted"
    #: A step or its preparation raised.
    FAILED = "failed"


class KVBackup(Protocol):
    """Copies a request's KV off the page pool and back (synchronous)."""

    def backup(self, pages: tuple[int, ...], kv_len: int) -> object:
        """A copy of the first ``kv_len`` tokens' KV in ``pages`` that owns its memory."""
        ...

    def restore(self, backup: object, pages: tuple[int, ...]) -> None:
        """Write ``backup`` into ``pages`` (at least as many as it was taken from)."""
        ...


@dataclass(eq=False, slots=True)
class RunningRequest:
    """A request whose KV landed, from the waiting queue until it finished."""

    req: DecodeRequest
    max_new_tokens: int
    #: Tokens whose KV is in ``req.pages``: the prompt, then one per decode step.
    kv_len: int
    #: The token prefill produced (the first of ``max_new_tokens``).
    first_token: int
    #: Added to ``kv_len`` to give the next token's position (e.g. a multimodal RoPE offset).
    position_offset: int = 0
    #: Tokens produced so far, ``first_token`` first.
    output: list[int] = field(default_factory=list)
    #: The first token's top-k ``(id, logprob)``, recorded when a step consumed the draft state.
    first_top: tuple[tuple[int, float], ...] = ()
    abort_requested: bool = False
    finished: FinishReason | None = None
    error: str = ""
    #: Clock readings: when it entered a prebuilt batch, when it finished.
    entered_at: float | None = None
    finished_at: float | None = None
    #: Decode steps it took part in, and how often it was retracted.
    steps: int = 0
    retractions: int = 0

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def next_position(self) -> int:
        """The position of the token the next step feeds in (its KV lands at ``kv_len``)."""
        return self.kv_len + self.position_offset


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """The running requests of one decode step, in batch order."""

    reqs: tuple[RunningRequest, ...]

    def __len__(self) -> int:
        return len(self.reqs)


class DecodeBatchScheduler:
    """The decode scheduler above the prealloc and transfer queues.

    :param transfer: the transfer queue; its :meth:`~DecodeTransferQueue.free_metadata`
        frees slots (zeroed, exactly once).
    :param prealloc: the prealloc queue; retracted requests wait in its ``retracted`` list
        (which also stops new admissions until they resumed).
    :param pages: the KV page pool running requests grow into.
    :param page_tokens: tokens of KV per page.
    :param max_running: running requests at most (the batch size bound).
    :param kv_backup: copies KV off the pool at retraction and back at resume; a copy that
        raises an :class:`Exception` fails that request alone (logged with its cause).
    :param eos_token_ids: tokens that end a request.
    :param prepare_prebuilt: called with each prebuilt batch before it is merged (the
        shell's per-request setup); if it raises, the batch's requests fail, their slots and
        pages are freed, and the error propagates.
    :param clock: time source for the requests' timestamps.
    """

    def __init__(
        self,
        *,
        transfer: DecodeTransferQueue,
        prealloc: DecodePreallocQueue,
        pages: PageSource,
        page_tokens: int,
        max_running: int,
        kv_backup: KVBackup,
        eos_token_ids: Collection[int] = (),
        prepare_prebuilt: Callable[[list[RunningRequest]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        whole("page_tokens", page_tokens, least=1)
        whole("max_running", max_running, least=1)
        self.transfer = transfer
        self.prealloc = prealloc
        self.pages = pages
        self.page_tokens = page_tokens
        self.max_running = max_running
        self.kv_backup = kv_backup
        self.eos_token_ids = frozenset(eos_token_ids)
        self._prepare = prepare_prebuilt
        self._clock = clock
        #: Committed requests waiting for a place in the running batch, in commit order.
        self.waiting: list[RunningRequest] = []
        #: The running batch, oldest first (the newest are retracted first).
        self.running: list[RunningRequest] = []
        # Retracted requests by rid; their places in line are prealloc.retracted's order.
        self._retracted: dict[str, RunningRequest] = {}
        # rids with an abort not yet applied (saves a scan of every queue each step).
        self._aborts: set[str] = set()
        self._ended: list[RunningRequest] = []
        self.retractions = 0
        self.resumptions = 0
        self.steps = 0

    # -- views ---------------------------------------------------------------------------------

    @property
    def retracted(self) -> list[RunningRequest]:
        """The retracted requests in the order they resume."""
        return [self._retracted[r.rid] for r in self.prealloc.retracted if r.rid in self._retracted]

    def is_idle(self) -> bool:
        return not (self.waiting or self.running or self._retracted)

    def owned_pages(self) -> int:
        """Pages held by waiting and running requests (retracted ones hold none)."""
        return sum(len(rr.req.pages) for rr in (*self.waiting, *self.running))

    def take_ended(self) -> list[RunningRequest]:
        """The requests that finished since the last call, in the order they finished."""
        ended, self._ended = self._ended, []
        return ended

    # -- requests in -----------------------------------------------------------------------------

    def add(self, rr: RunningRequest) -> None:
        """Queue a request whose KV was committed (it holds its prompt pages)."""
        if rr.kv_len > len(rr.req.pages) * self.page_tokens:
            raise InternalError(f"request {rr.rid!r}: {rr.kv_len} tokens do not fit its pages")
        self.waiting.append(rr)

    def request_abort(self, rr: RunningRequest) -> None:
        """Abort ``rr`` at the next decision (a step in flight finishes first)."""
        if rr.finished is None:
            rr.abort_requested = True
            self._aborts.add(rr.rid)

    def free_metadata_if_held(self, rr: RunningRequest) -> bool:
        """Free the metadata slot ``rr`` still holds (zeroed); a second call is a no-op."""
        return self.transfer.free_metadata(rr.req)

    # -- the prebuilt batch ----------------------------------------------------------------------

    def get_new_prebuilt_batch(self) -> list[RunningRequest] | None:
        """Take the waiting queue's longest prefix that fits, and prebuild it.

        The prefix is bounded by the running slots left (``max_running``) and by the pages
        the pool can give once the running batch's next step is provided for. With no
        capacity the waiting queue is left untouched and ``None`` returned. Prebuilding
        stamps ``entered_at``, puts the first token into ``output`` and marks requests that
        are finished by it; their draft slots stay held (the first decode step reads them).
        """
        room = self.max_running - len(self.running)
        if room <= 0 or not self.waiting:
            return None
        spare = self.pages.available() - self._running_need()
        take = need = 0
        for rr in self.waiting[:room]:
            short = self._pages_short(rr)
            if need + short > spare:
                break
            need += short
            take += 1
        if take == 0:
            return None
        batch = self.waiting[:take]
        del self.waiting[:take]
        try:
            now = self._clock()
            for rr in batch:
                self._prebuild(rr, now)
            if self._prepare is not None:
                self._prepare(batch)
        except BaseException as exc:
            for rr in batch:
                self._end(rr, FinishReason.FAILED, f"preparing its prebuilt batch failed: {exc!r}")
            raise
        return batch

    def _prebuild(self, rr: RunningRequest, now: float) -> None:
        rr.entered_at = now
        if rr.max_new_tokens < 1:
            rr.finished = FinishReason.LENGTH
            return
        rr.output = [rr.first_token]
        if len(rr.output) >= rr.max_new_tokens:
            rr.finished = FinishReason.LENGTH
        elif rr.first_token in self.eos_token_ids:
            rr.finished = FinishReason.STOP

    def process_batch_result_prebuilt(self, batch: Sequence[RunningRequest]) -> None:
        """Merge a prebuilt batch into the running batch; requests it finished (or that were
        aborted meanwhile) end now, their slots and pages freed."""
        for rr in batch:
            if rr.finished is not None:
                self._end(rr, rr.finished)
            elif rr.abort_requested:
                self._end(rr, FinishReason.ABORTED)
            else:
                self.running.append(rr)

    # -- one step ---------------------------------------------------------------------------------

    def schedule_step(self) -> DecodeBatch | None:
        """Every decision of one step; returns the batch to run, or ``None`` if none runs.

        Applies pending aborts, resumes retracted requests, merges a prebuilt batch, and
        gives each running request the page its next token needs, retracting the newest
        running requests while the pool cannot. A prebuilt batch that fails to prepare is
        logged (its requests are ended as failed) and the step goes on without it; so does a
        request whose KV backup or reload raises. Not a checkpoint (nothing here awaits).
        """
        if self._aborts:
            self._apply_aborts()
        # Each round may free pages (a request finished by its prebuilt step, waiting
        # requests retracted so the head can start) that an earlier decision of the same
        # round could have used; go round again until something runs or nothing changes.
        for _ in range(_MAX_ROUNDS):
            before = (len(self.prealloc.retracted), len(self.waiting), self.pages.available())
            self.resume_retracted()
            try:
                batch = self.get_new_prebuilt_batch()
            except Exception:
                _log.exception("preparing a prebuilt decode batch failed")
                batch = None
            if batch:
                self.process_batch_result_prebuilt(batch)
            self._reserve_next_step()
            if self.running:
                return DecodeBatch(tuple(self.running))
            if before == (len(self.prealloc.retracted), len(self.waiting), self.pages.available()):
                break
        return None

    def process_batch_result_decode(self, batch: DecodeBatch, next_tokens: Sequence[int]) -> None:
        """Apply one step's result: ``next_tokens[i]`` follows ``batch.reqs[i]``.

        Each request's KV grew by the token it fed in; a draft state the step consumed frees
        its slot now; requests that reached their length, produced an end-of-sequence token
        or were aborted end, their pages freed.
        """
        if len(next_tokens) != len(batch.reqs):
            raise InternalError(f"{len(next_tokens)} tokens for a batch of {len(batch.reqs)}")
        self.steps += 1
        for rr, token in zip(batch.reqs, next_tokens, strict=True):
            if rr.finished is not None:
                continue
            # The step consumed the draft state: from now on the slot may be rewritten.
            self.free_metadata_if_held(rr)
            rr.kv_len += 1
            rr.steps += 1
            if rr.abort_requested:
                self._end(rr, FinishReason.ABORTED)
                continue
            rr.output.append(int(token))
            if len(rr.output) >= rr.max_new_tokens:
                self._end(rr, FinishReason.LENGTH)
            elif token in self.eos_token_ids:
                self._end(rr, FinishReason.STOP)
        self.running = [rr for rr in self.running if rr.finished is None]

    def fail_batch(self, batch: DecodeBatch, message: str) -> None:
        """A step raised: its requests end as failed, their slots and pages freed."""
        for rr in batch.reqs:
            if rr.finished is None:
                self._end(rr, FinishReason.FAILED, message)
        self.running = [rr for rr in self.running if rr.finished is None]

    # -- memory pressure ---------------------------------------------------------------------------

    def _pages_short(self, rr: RunningRequest) -> int:
        """Pages ``rr`` lacks for its next token."""
        need = -(-(rr.kv_len + 1) // self.page_tokens)
        return max(0, need - len(rr.req.pages))

    def _running_need(self) -> int:
        return sum(self._pages_short(rr) for rr in self.running)

    def _reserve_next_step(self) -> None:
        need = self._running_need()
        while self.running and need > self.pages.available():
            victim = self.running.pop()
            need -= self._pages_short(victim)
            self._retract(victim)
        if not self.running and self.waiting:
            # Nothing runs and the head cannot start: waiting requests hold the pages it
            # needs. Retract the newest of them until it can (else nobody ever runs again).
            while len(self.waiting) > 1 and self._pages_short(self.waiting[0]) > (
                self.pages.available()
            ):
                self._retract(self.waiting.pop())
        for rr in self.running:
            short = self._pages_short(rr)
            if short:
                pages = self.pages.alloc(short)
                if pages is None:  # pragma: no cover - the loop above made room
                    raise InternalError(f"no page for request {rr.rid!r} after retraction")
                rr.req.pages = (*rr.req.pages, *pages)

    def _retract(self, rr: RunningRequest) -> None:
        """Back ``rr``'s KV up off the pool, free its pages, and queue it to resume.

        ``rr`` is already out of the running batch or the waiting queue. If the backup raises,
        ``rr`` ends as failed instead (its pages and slot freed, so the step can use them);
        an exception that is not an :class:`Exception` then propagates.
        """
        try:
            backup = self.kv_backup.backup(rr.req.pages, rr.kv_len)
        except BaseException as exc:
            # Without a copy its KV cannot leave the pool, so it cannot wait to resume; ending
            # it still frees the pages this step retracts it for.
            self._end(rr, FinishReason.FAILED, f"backing up its KV for retraction failed: {exc!r}")
            if not isinstance(exc, Exception):
                raise
            _log.exception("backing up decode request %r for retraction failed", rr.rid)
            return
        pages, rr.req.pages = rr.req.pages, ()
        self.pages.free(pages)
        rr.retractions += 1
        self.retractions += 1
        self._retracted[rr.rid] = rr
        self.prealloc.retract(
            RetractedRequest(
                rr.rid,
                num_pages=-(-(rr.kv_len + 1) // self.page_tokens),
                reload=functools.partial(self.kv_backup.restore, backup),
            )
        )

    def resume_retracted(self) -> list[RunningRequest]:
        """Resume retracted requests in order, in one pass, reloading their KV backups.

        Bounded by the running slots left and by the pages the running batch's next step
        leaves; the first that does not fit stops the pass (no overtaking). Requests that
        never ran go back to the front of the waiting queue, the others rejoin the running
        batch. A request whose reload raises an :class:`Exception` ends as failed (logged,
        its slot freed; its pages were given back) and the pass goes on past it. If a reload
        raises anything else, the requests settled before it are still taken in, and the
        exception propagates. Not a checkpoint.

        :return: the resumed requests (the failed ones are in :meth:`take_ended`).
        """
        queue = self.prealloc.retracted
        room = self.max_running - len(self.running)
        if not queue or room <= 0:
            return []
        budget = self.pages.available() - self._running_need()
        if budget <= 0:
            return []
        offered = queue[:room]
        try:
            self.prealloc.resume_retracted([r.rid for r in offered], max_pages=budget)
        finally:
            # The pass marks each request as it takes it out of the queue: reading the marks
            # rather than the returned lists takes in even what it settled before an
            # exception (a KeyboardInterrupt in a reload) cut it short.
            resumed = self._take_in([r for r in offered if not r.is_retracted])
        return resumed

    def _take_in(self, settled: list[RetractedRequest]) -> list[RunningRequest]:
        """Settle the requests a prealloc pass took out of its retracted queue, in order."""
        back: list[RunningRequest] = []
        never_ran: list[RunningRequest] = []
        for entry in settled:
            rr = self._retracted.pop(entry.rid)
            if entry.reload_error is not None:
                _log.error(
                    "reloading the KV of retracted decode request %r failed",
                    rr.rid,
                    exc_info=entry.reload_error,
                )
                error = f"reloading its KV after retraction failed: {entry.reload_error!r}"
                self._end(rr, FinishReason.FAILED, error)
                continue
            rr.req.pages = entry.pages
            self.resumptions += 1
            (never_ran if rr.entered_at is None else back).append(rr)
        self.running.extend(back)
        self.waiting[:0] = never_ran
        return back + never_ran

    # -- endings -----------------------------------------------------------------------------------

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, set()
        for queue in (self.waiting, self.running):
            keep = []
            for rr in queue:
                if rr.abort_requested and rr.rid in aborts:
                    self._end(rr, FinishReason.ABORTED)
                else:
                    keep.append(rr)
            queue[:] = keep
        gone = [rid for rid in aborts if rid in self._retracted]
        if gone:
            self.prealloc.retracted = [r for r in self.prealloc.retracted if r.rid not in gone]
            for rid in gone:
                self._end(self._retracted.pop(rid), FinishReason.ABORTED)

    def _end(self, rr: RunningRequest, reason: FinishReason, error: str = "") -> None:
        rr.finished = reason
        rr.error = error
        rr.finished_at = self._clock()
        self.free_metadata_if_held(rr)
        pages, rr.req.pages = rr.req.pages, ()
        if pages:
            self.pages.free(pages)
        self._aborts.discard(rr.rid)
        self._ended.append(rr)
