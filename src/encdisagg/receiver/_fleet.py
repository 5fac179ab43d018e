"""``EncoderFleet``: the encoders a registry announces, and which of them gets each part.

Discovery is one etcd watch (:class:`~encdisagg.registry.RegistryWatcher`): joins, load
refreshes and leaves arrive as events, and no request waits on etcd. Routing is a
synchronous decision over that view, made when a request is planned:

- only encoders of the client's model (and transfer kind) that serve the part's modality
  and are not suspected dead are candidates;
- with ``routing="affine"`` (the default, :class:`~._routing.FleetRouting`), each item goes
  to the encoder most likely to hold its embedding: rendezvous hashing on the item's
  affinity key, skipping encoders over the load bound (:mod:`._routing`); consecutive items
  bound for one encoder travel as one part;
- with ``routing="least_loaded"``, candidates are ranked least-loaded first: the queue
  depth they last reported plus the parts this client sent them since that report and
  that are still in flight (:meth:`part_finished`; at most ``recent_s``), over their
  capacity; staged bytes break ties, then a hash of the request id, so that the parts
  of one request rank the encoders in the same order for every modality (``req_id``
  affinity); a modality's items are cut into runs of consecutive items, one per candidate,
  as for a fixed list of URLs (:func:`~encdisagg.receiver.assign_parts`).

An encoder that failed a call (connection lost, 503) is suspected until it publishes a new
record or ``suspect_s`` passes; a draining encoder takes no new parts; an encoder whose
lease ran out leaves the view.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import AsyncGenerator, Collection, Mapping, Sequence
from contextlib import asynccontextmanager

import anyio
import httpx

from .._errors import BadRequestError, ServiceUnavailableError
from .._modality import Modality
from .._numbers import whole
from ..registry import EncoderRecord, RegistryUrl, RegistryView, RegistryWatcher
from ._plan import RequestPlan, attempt_rid, check_rid, cut, group_items, numbered
from ._routing import FleetRouting, Slot, affinity_key, rendezvous_weight, route_items

__all__ = ["EncoderFleet"]

_log = logging.getLogger("encdisagg.receiver")


class EncoderFleet(anyio.AsyncContextManagerMixin):
    """The live encoders of one registry prefix; routes parts to them.

    ``async with EncoderFleet("etcd://host:2379/prefix") as fleet:`` starts the watch and
    waits (at most ``sync_timeout_s``) for the first read of the prefix; if etcd does not
    answer by then the fleet starts empty and fills once it does. Leaving stops the watch.

    :param registry: ``etcd://HOST:PORT/PREFIX``.
    :param model: only encoders serving this model are used (``None``: any).
    :param transfer: only encoders delivering with this transfer kind (``None``: any).
    :param max_parts: the most encoders one modality of one request is spread over.
    :param suspect_s: how long an encoder that failed a call is left out, unless it
        publishes a fresh record first.
    :param recent_s: how long a part sent to an encoder counts towards its load when the
        encoder has published no newer figure.
    :param sync_timeout_s: bound on the wait for the first read when entering.
    :param transport: an ``httpx`` transport for the etcd calls.
    :param routing: how items are routed (default: affine, ``load_bound`` 1.25).
    """

    def __init__(
        self,
        registry: RegistryUrl | str,
        *,
        model: str | None = None,
        transfer: str | None = None,
        max_parts: int | None = None,
        suspect_s: float = 5.0,
        recent_s: float = 5.0,
        sync_timeout_s: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
        routing: FleetRouting | None = None,
    ) -> None:
        if max_parts is not None:
            whole("max_parts", max_parts, least=1, error=BadRequestError)
        self._watcher = RegistryWatcher(registry, transport=transport)
        self.registry = self._watcher.registry
        self.model = model
        self.transfer = transfer
        self._max_parts = max_parts
        self._suspect_s = suspect_s
        self._recent_s = recent_s
        self._sync_timeout_s = sync_timeout_s
        self.routing = routing or FleetRouting()
        #: url -> (when it was suspected, the record it had then).
        self._suspects: dict[str, tuple[float, EncoderRecord | None]] = {}
        #: url -> when this client sent it each part lately, and the record it saw then.
        self._sent: dict[str, deque[float]] = {}
        self._sent_against: dict[str, EncoderRecord] = {}
        self._open = False

    @property
    def view(self) -> RegistryView:
        """The registry view (every encoder, also of other models)."""
        return self._watcher.view

    @property
    def urls(self) -> tuple[str, ...]:
        """The encoders that are candidates now (any modality), in URL order."""
        return tuple(sorted(r.url for r in self._candidates(None, ())))

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[EncoderFleet]:
        """Entering is a checkpoint (bounded by ``sync_timeout_s``); leaving is not."""
        if self._open:
            raise RuntimeError("an EncoderFleet is entered once at a time")
        async with self._watcher:
            with anyio.move_on_after(self._sync_timeout_s) as waited:
                await self._watcher.wait_synced()
            if waited.cancelled_caught:
                _log.warning(
                    "registry %s did not answer within %s s; starting with no encoders",
                    self.registry,
                    self._sync_timeout_s,
                )
            self._open = True
            try:
                yield self
            finally:
                self._open = False

    # -- decisions: synchronous --------------------------------------------------------------

    def mark_failed(self, url: str) -> None:
        """Leave ``url`` out of routing: a call to it failed (lost connection, 503)."""
        self._suspects[url] = (anyio.current_time(), self.view.get(url))

    def is_suspect(self, url: str, now: float | None = None) -> bool:
        entry = self._suspects.get(url)
        if entry is None:
            return False
        since, record = entry
        now = anyio.current_time() if now is None else now
        current = self.view.get(url)
        # A fresh record (a new put since) or the end of the pause clears the suspicion.
        if now - since >= self._suspect_s or (current is not None and current is not record):
            del self._suspects[url]
            return False
        return True

    def _candidates(
        self, modality: Modality | None, exclude: Collection[str]
    ) -> list[EncoderRecord]:
        now = anyio.current_time()
        return [
            record
            for record in self.view.records.values()
            if (self.model is None or record.model == self.model)
            and (self.transfer is None or self.transfer in record.transfers)
            and (modality is None or modality in record.modalities)
            and record.url not in exclude
            and not record.draining
            and not self.is_suspect(record.url, now)
        ]

    def load(self, url: str) -> float:
        """``url``'s load as this client sees it: reported queue depth plus the parts sent
        to it since, over its capacity (``inf`` if it is not in the view)."""
        record = self.view.get(url)
        if record is None:
            return math.inf
        return (record.load.queue_depth + self._recent(record)) / record.capacity

    def _recent(self, record: EncoderRecord) -> int:
        sent = self._sent.get(record.url)
        if not sent:
            return 0
        if self._sent_against.get(record.url) is not record:
            # The encoder published figures since: they include what was sent before.
            sent.clear()
            return 0
        horizon = anyio.current_time() - self._recent_s
        while sent and sent[0] < horizon:
            sent.popleft()
        return len(sent)

    def _note_sent(self, record: EncoderRecord) -> None:
        if self._sent_against.get(record.url) is not record:
            self._sent[record.url] = deque()
            self._sent_against[record.url] = record
        self._sent[record.url].append(anyio.current_time())

    def part_finished(self, url: str) -> None:
        """A part this client sent to ``url`` ended (delivered or failed): it stops counting
        towards the encoder's load before the encoder's next report. Not a checkpoint."""
        sent = self._sent.get(url)
        if sent:
            sent.popleft()

    def ranked(
        self, rid: str, modality: Modality, exclude: Collection[str] = ()
    ) -> list[EncoderRecord]:
        """The candidates for a part of ``rid`` of ``modality``, best first."""
        return sorted(
            self._candidates(modality, exclude),
            key=lambda r: (
                self.load(r.url),
                r.load.staged_bytes,
                rendezvous_weight(rid.encode(), r.url),
            ),
        )

    def plan(
        self,
        rid: str,
        items: Mapping[Modality | str, Sequence[object]],
        *,
        exclude: Collection[str] = (),
    ) -> RequestPlan:
        """Split request ``rid``'s items into parts over the encoders, as :attr:`routing`
        says.

        Not a checkpoint. Affine: each item goes to its rendezvous winner under the load
        bound, consecutive items bound for one encoder making one part. Least-loaded (or
        affine needing more than ``max_parts`` parts): each modality's items are cut into at
        most as many runs of consecutive items as there are candidates (and ``max_parts``),
        sizes differing by one at most, each run going to the next-best candidate. Numbering
        is as :func:`~encdisagg.receiver.assign_parts`'s: modality-outer, item order inside.

        :param exclude: encoders not to use (those that failed this request already).
        :raises BadRequestError: naming the field (empty id, no items, unknown modality).
        :raises ServiceUnavailableError: no live encoder serves one of the modalities.
        """
        return self._plan_attempt(rid, 0, items, exclude)

    def _plan_attempt(
        self,
        rid: str,
        attempt: int,
        items: Mapping[Modality | str, Sequence[object]],
        exclude: Collection[str],
    ) -> RequestPlan:
        """:meth:`plan`, under the id of attempt ``attempt`` of the caller's ``rid``
        (:func:`~encdisagg.receiver._plan.attempt_rid`). Only the library retries, so only
        it names an attempt: ``rid`` is checked as a caller's id either way."""
        check_rid(rid)
        plan_rid = attempt_rid(rid, attempt)
        runs: list[tuple[Modality, EncoderRecord, tuple[object, ...], int]] = []
        for modality, values in group_items(rid, items):
            ranked = self.ranked(plan_rid, modality, exclude)
            if not ranked:
                raise ServiceUnavailableError(
                    f"request {rid!r}: no live encoder"
                    + (f" of model {self.model!r}" if self.model else "")
                    + f" serves {modality.value} (registry {self.registry}, "
                    f"{len(self.view)} registered)",
                    req_id=rid,
                )
            chosen = None
            if self.routing.routing == "affine":
                chosen = self._affine_runs(ranked, values)
            if chosen is None:
                n_runs = min(len(ranked), len(values), self._max_parts or len(values))
                chosen = [(ranked[i], *run) for i, run in enumerate(cut(values, n_runs))]
            runs.extend((modality, record, run, first) for record, run, first in chosen)
        for _, record, _, _ in runs:
            self._note_sent(record)
        return numbered(plan_rid, [(m, record.url, run, first) for m, record, run, first in runs])

    def _affine_runs(
        self, candidates: Sequence[EncoderRecord], values: Sequence[object]
    ) -> list[tuple[EncoderRecord, tuple[object, ...], int]] | None:
        """``values`` routed by affinity, as runs of consecutive items bound for one encoder
        (``(record, items, first item)``); ``None`` if that takes more runs than
        ``max_parts`` (the caller then cuts them least-loaded)."""
        by_url = {record.url: record for record in candidates}
        slots = [
            Slot(r.url, r.load.queue_depth + self._recent(r), max(r.capacity, 1))
            for r in candidates
        ]
        targets = route_items(
            [affinity_key(value) for value in values], slots, load_bound=self.routing.load_bound
        )
        runs: list[tuple[EncoderRecord, tuple[object, ...], int]] = []
        start = 0
        for index in range(1, len(values) + 1):
            if index == len(values) or targets[index] != targets[start]:
                runs.append((by_url[targets[start]], tuple(values[start:index]), start))
                start = index
        if self._max_parts is not None and len(runs) > self._max_parts:
            return None
        return runs

    # -- waits -------------------------------------------------------------------------------

    async def wait_for(self, count: int, modality: Modality | str | None = None) -> None:
        """Wait until at least ``count`` candidate encoders (serving ``modality``) are in the
        view. A checkpoint; not bounded: put it under a deadline."""
        kind = None if modality is None else Modality.parse(modality)
        await anyio.lowlevel.checkpoint()
        while len(self._candidates(kind, ())) < count:
            await self.view.wait_changed()
