"""Prometheus metrics of the encoder server.

An :class:`EncoderMetrics` accumulates what one Encoder reports through
:class:`~encdisagg.encoder.EncoderEvents` (request outcomes and phase latencies), in plain
mergeable counters. A :class:`MetricsSnapshot` adds the Encoder's gauges and cache counters
at one moment; data-parallel workers ship their snapshots to the front as msgpack maps, and
the front sums them. :class:`ServerMetrics` renders the latest snapshot, plus the front's own
HTTP and worker counters, from a per-app ``CollectorRegistry`` (never the global one).

Every metric name starts with ``encdisagg_``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Annotated, Any, Final

import msgspec
import sniffio
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from .._errors import BadRequestError
from .._strict import Message, convert
from .._version import __version__
from ..encoder import Encoder, EncoderEvents

__all__ = [
    "LATENCY_BUCKETS",
    "EncoderMetrics",
    "MetricsSnapshot",
    "ProcessStats",
    "ServerMetrics",
    "ServiceSnapshot",
    "WorkerStatus",
]

#: Upper bounds (seconds) of the latency histograms' buckets; ``+Inf`` is implied.
LATENCY_BUCKETS: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)

# histogram key -> (metric name, help)
_HISTOGRAMS: Final = {
    "request": ("encdisagg_request_seconds", "End-to-end time of an encode, admission to staged."),
    "queue": ("encdisagg_queue_seconds", "Time an encode waited for its batch to start."),
    "queue_and_forward": (
        "encdisagg_queue_and_forward_seconds",
        "Time from handing an encode to the batcher until its batched forward returned.",
    ),
    "preprocess": ("encdisagg_preprocess_seconds", "Media decoding and preprocessing time."),
    "forward": ("encdisagg_forward_seconds", "Time of one batched forward of the model."),
    "transfer": ("encdisagg_transfer_seconds", "Time of one delivery to one destination."),
}
# EncoderEvents phase name -> histogram key
_PHASES: Final = {
    "queue": "queue",
    "queue+forward": "queue_and_forward",
    "preprocess": "preprocess",
    "forward": "forward",
    "transfer": "transfer",
}
_GAUGES: Final = {
    "live_requests": "Requests the encoder holds (encoding, staged or being delivered).",
    "staged_bytes": "Bytes of staged embeddings.",
    "held_bytes": (
        "Bytes of staged embeddings a transfer may still touch (its outcome is unknown): "
        "kept out of use until the engine reports it ended."
    ),
    "inflight_transfers": "Deliveries in progress.",
    "registered_regions": "Memory regions registered with the transfer engine.",
    "cache_entries": "Entries in the prefix (embedding) cache.",
    "global_cache_breaker_open": (
        "Encoders whose global-cache breaker is open, skipping the store (0 or 1 each)."
    ),
    "retired_ids": "Ended and abandoned request ids remembered (to answer 409 and late waiters).",
    "retired_bytes": "Bytes the remembered ended and abandoned ids and their errors hold.",
}
_CACHE_COUNTERS: Final = {
    "hits": "Prefix cache lookups that found an embedding.",
    "misses": "Prefix cache lookups that found nothing.",
    "evictions": "Prefix cache entries evicted.",
    "global_hits": "Items served from the global embedding cache.",
    "global_misses": "Items the global embedding cache did not have.",
    "global_fallbacks": "Items computed because a global lookup or read failed or was late.",
    "global_skipped": "Items not looked up in the global cache: breaker open or no store.",
    "global_invalid": "Global cache entries found invalid (evicted and recomputed).",
    "global_inserts": "Items stored in the global embedding cache.",
    "global_insert_failures": "Global cache inserts that failed.",
}

#: What EncoderStats and the local PrefixCache report (the rest comes from the global tier).
_ENCODER_GAUGES: Final = tuple(name for name in _GAUGES if not name.startswith("global_"))
_LOCAL_CACHE: Final = tuple(name for name in _CACHE_COUNTERS if not name.startswith("global_"))

#: Set in a health probe's task (and inherited by the tasks it starts): its encode is not a
#: client's request and stays out of the request metrics.
PROBING: ContextVar[bool] = ContextVar("encdisagg_health_probe", default=False)


@dataclass
class _Histogram:
    # counts[i] holds observations <= LATENCY_BUCKETS[i] (and above the previous bound);
    # the last slot holds those above every bound.
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds

    def add(self, other: _Histogram) -> None:
        for index, count in enumerate(other.counts):
            self.counts[index] += count
        self.total += other.total

    def copy(self) -> _Histogram:
        return _Histogram(list(self.counts), self.total)


class EncoderMetrics:
    """Counters fed by one Encoder's events; cheap enough for the event loop.

    Pass :meth:`events` to the Encoder: ``Encoder(config, events=metrics.events())``.
    Health probes are left out (see :data:`PROBING`); the batched forward a probe shares
    with client requests still counts.
    """

    def __init__(self) -> None:
        self._requests: dict[tuple[str, str], int] = {}
        self._histograms: dict[str, _Histogram] = {key: _Histogram() for key in _HISTOGRAMS}

    def events(self) -> EncoderEvents:
        """Callbacks that record into this object."""
        return EncoderEvents(on_request_done=self._request_done, on_phase=self._phase)

    def _request_done(self, modality: str, status: str, seconds: float) -> None:
        if PROBING.get():
            return
        key = (modality, status)
        self._requests[key] = self._requests.get(key, 0) + 1
        self._histograms["request"].observe(seconds)

    def _phase(self, phase: str, seconds: float) -> None:
        if PROBING.get():
            return
        key = _PHASES.get(phase)
        if key is not None:
            self._histograms[key].observe(seconds)

    def snapshot(self, encoder: Encoder | None) -> MetricsSnapshot:
        """These counters plus ``encoder``'s gauges and cache counters, now. Not async."""
        gauges = dict.fromkeys(_GAUGES, 0)
        cache = dict.fromkeys(_CACHE_COUNTERS, 0)
        if encoder is not None:
            stats = encoder.stats()
            gauges.update({name: int(getattr(stats, name)) for name in _ENCODER_GAUGES})
            cache_stats = encoder.cache.stats()
            cache.update({name: int(getattr(cache_stats, name)) for name in _LOCAL_CACHE})
            global_stats = encoder.global_cache_stats()
            if global_stats is not None:
                for name in _CACHE_COUNTERS:
                    if name.startswith("global_"):
                        cache[name] = int(getattr(global_stats, name.removeprefix("global_")))
                gauges["global_cache_breaker_open"] = int(global_stats.breaker != "closed")
        return MetricsSnapshot(
            requests=dict(self._requests),
            histograms={key: hist.copy() for key, hist in self._histograms.items()},
            gauges=gauges,
            cache=cache,
        )


@dataclass(frozen=True)
class MetricsSnapshot:
    """What one or more Encoders reported, at one moment."""

    requests: Mapping[tuple[str, str], int] = field(default_factory=dict)
    histograms: Mapping[str, _Histogram] = field(default_factory=dict)
    gauges: Mapping[str, int] = field(default_factory=dict)
    cache: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def merge(cls, snapshots: Iterable[MetricsSnapshot]) -> MetricsSnapshot:
        """The sum of ``snapshots`` (counters, histograms and gauges alike)."""
        requests: dict[tuple[str, str], int] = {}
        histograms: dict[str, _Histogram] = {key: _Histogram() for key in _HISTOGRAMS}
        gauges = dict.fromkeys(_GAUGES, 0)
        cache = dict.fromkeys(_CACHE_COUNTERS, 0)
        for snapshot in snapshots:
            for labels, count in snapshot.requests.items():
                requests[labels] = requests.get(labels, 0) + count
            for key, hist in snapshot.histograms.items():
                histograms[key].add(hist)
            for name, value in snapshot.gauges.items():
                gauges[name] += value
            for name, value in snapshot.cache.items():
                cache[name] += value
        return cls(requests, histograms, gauges, cache)

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-friendly map (see :meth:`from_wire`)."""
        return {
            "requests": [[m, s, n] for (m, s), n in self.requests.items()],
            "histograms": {k: [list(h.counts), h.total] for k, h in self.histograms.items()},
            "gauges": dict(self.gauges),
            "cache": dict(self.cache),
        }

    @classmethod
    def from_wire(cls, value: object) -> MetricsSnapshot:
        """Decode :meth:`to_wire`'s map strictly. Not async.

        :raises BadRequestError: naming what is malformed.
        """
        wire = convert(value, _SnapshotWire, "a metrics snapshot", BadRequestError)
        return cls(
            {(modality, status): count for modality, status, count in wire.requests},
            {key: _Histogram(counts, total) for key, (counts, total) in wire.histograms.items()},
            wire.gauges,
            wire.cache,
        )


_Count = Annotated[int, msgspec.Meta(ge=0)]
_Buckets = Annotated[
    list[_Count],
    msgspec.Meta(min_length=len(LATENCY_BUCKETS) + 1, max_length=len(LATENCY_BUCKETS) + 1),
]


class _SnapshotWire(Message, frozen=True):
    requests: list[tuple[str, str, int]]
    histograms: dict[str, tuple[_Buckets, float]]
    gauges: dict[str, _Count]
    cache: dict[str, _Count]

    def __post_init__(self) -> None:
        for name, known in (
            ("histograms", _HISTOGRAMS),
            ("gauges", _GAUGES),
            ("cache", _CACHE_COUNTERS),
        ):
            unknown = sorted(getattr(self, name).keys() - known.keys())
            if unknown:
                raise ValueError(f"{name}.{unknown[0]} is unknown")


@dataclass(frozen=True, slots=True)
class ProcessStats:
    """What ``/proc/PID/stat`` says of one process."""

    cpu_seconds: float
    resident_bytes: int


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One data-parallel worker, as the front sees it."""

    rank: int
    alive: bool
    pending: int
    #: Its process id, once started.
    pid: int | None = None
    #: How often the front started this rank's process again after it died.
    restarts: int = 0
    #: Its process's CPU time and memory, read by the front for a scrape; ``None`` when
    #: unread or unreadable (not started, gone, no Linux): then it is left out, not zero.
    process: ProcessStats | None = None


@dataclass(frozen=True, slots=True)
class ServiceSnapshot:
    """What a backend reports for one scrape: its Encoders' metrics, and (data parallel)
    its workers and the worker messages it dropped."""

    encoder: MetricsSnapshot
    workers: tuple[WorkerStatus, ...] = ()
    malformed_messages: int | None = None


class ServerMetrics:
    """The metrics of one app: a private registry and what the routes count.

    ``registry`` may be added to a larger exposition by the embedding application.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._http: dict[tuple[str, str], int] = {}
        # (route template, status) -> latency; bounded: the routes are the app's own paths
        # (anything else is one "unmatched" route), the statuses those the server answers.
        self._http_latency: dict[tuple[str, str], _Histogram] = {}
        self._info: dict[str, str] = {"version": __version__}
        self._latest = ServiceSnapshot(MetricsSnapshot.merge(()))
        self.registry.register(self)
        # This process's CPU, memory and open files (process_*); the data-parallel
        # workers' own come from the front's scrape of their /proc entries.
        ProcessCollector(registry=self.registry)

    def observe_http(self, route: str, code: int, seconds: float) -> None:
        """Count one answered HTTP request and record its time, from its arrival until its
        response ended, under its route template and status code. Every answer goes
        through here (the access middleware's), so the counter and the histogram agree.
        Not async."""
        key = (route, str(code))
        self._http[key] = self._http.get(key, 0) + 1
        histogram = self._http_latency.get(key)
        if histogram is None:
            histogram = self._http_latency[key] = _Histogram()
        histogram.observe(seconds)

    def set_info(self, **labels: str) -> None:
        """Add labels of the ``encdisagg_build_info`` metric (model, transfer...); the
        version is there already, the worker class is the serving event loop. Not async."""
        self._info.update(labels)

    def update(self, snapshot: ServiceSnapshot) -> None:
        """Replace what the next :meth:`render` shows. Not async."""
        self._latest = snapshot

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry. Not async."""
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        """The families of :attr:`registry` (its collector is this object). Not async."""
        latest = self._latest
        snapshot = latest.encoder
        yield from self._service_families()
        http = CounterMetricFamily(
            "encdisagg_http_requests",
            "HTTP requests answered by the encoder routes.",
            labels=["route", "code"],
        )
        for (route, code), count in sorted(self._http.items()):
            http.add_metric([route, code], count)
        yield http
        requests = CounterMetricFamily(
            "encdisagg_requests",
            "Encode requests by modality and outcome.",
            labels=["modality", "status"],
        )
        for (modality, status), count in sorted(snapshot.requests.items()):
            requests.add_metric([modality, status], count)
        yield requests
        for key, (name, documentation) in _HISTOGRAMS.items():
            hist = snapshot.histograms.get(key, _Histogram())
            yield HistogramMetricFamily(
                name, documentation, buckets=_buckets(hist), sum_value=hist.total
            )
        for name, documentation in _GAUGES.items():
            yield GaugeMetricFamily(
                f"encdisagg_{name}", documentation, value=snapshot.gauges.get(name, 0)
            )
        for name, documentation in _CACHE_COUNTERS.items():
            yield CounterMetricFamily(
                f"encdisagg_cache_{name}", documentation, value=snapshot.cache.get(name, 0)
            )
        if latest.workers:
            alive = GaugeMetricFamily(
                "encdisagg_dp_worker_up", "1 if the data-parallel worker is alive.", labels=["rank"]
            )
            pending = GaugeMetricFamily(
                "encdisagg_dp_pending",
                "Calls dispatched to the worker and not answered yet.",
                labels=["rank"],
            )
            restarts = CounterMetricFamily(
                "encdisagg_dp_worker_restarts",
                "Times the front started the data-parallel worker again after it died.",
                labels=["rank"],
            )
            # Each process is counted once: the front's by ProcessCollector (process_*), a
            # worker's here under its rank.
            cpu = CounterMetricFamily(
                "encdisagg_dp_worker_cpu_seconds",
                "User and system CPU time of the data-parallel worker's process.",
                labels=["rank"],
            )
            memory = GaugeMetricFamily(
                "encdisagg_dp_worker_resident_memory_bytes",
                "Resident memory of the data-parallel worker's process.",
                labels=["rank"],
            )
            for worker in latest.workers:
                rank = [str(worker.rank)]
                alive.add_metric(rank, 1 if worker.alive else 0)
                pending.add_metric(rank, worker.pending)
                restarts.add_metric(rank, worker.restarts)
                if worker.process is not None:
                    cpu.add_metric(rank, worker.process.cpu_seconds)
                    memory.add_metric(rank, worker.process.resident_bytes)
            yield from (alive, pending, restarts, cpu, memory)
        if latest.malformed_messages is not None:
            yield CounterMetricFamily(
                "encdisagg_dp_malformed_messages",
                "Messages from workers that were dropped as malformed.",
                value=latest.malformed_messages,
            )

    def _service_families(self) -> Iterator[Metric]:
        """The build info and the HTTP latency by route and status."""
        try:
            loop = sniffio.current_async_library()
        except sniffio.AsyncLibraryNotFoundError:
            loop = "none"  # rendered outside an event loop (an embedding application's)
        yield InfoMetricFamily(
            "encdisagg_build",
            "encdisagg's version, the model, the transfer and the event loop serving.",
            value={**self._info, "worker_class": loop},
        )
        latency = HistogramMetricFamily(
            "encdisagg_http_request_duration_seconds",
            "Time from a request's arrival until its response ended, by route and status code.",
            labels=["route", "code"],
        )
        for (route, status), hist in sorted(self._http_latency.items()):
            latency.add_metric([route, status], _buckets(hist), hist.total)
        yield latency


def _buckets(hist: _Histogram) -> list[tuple[str, float]]:
    """``hist`` as Prometheus' cumulative ``(le, count)`` pairs, ``+Inf`` last."""
    cumulative = 0
    buckets: list[tuple[str, float]] = []
    for bound, count in zip(
        (*(repr(float(b)) for b in LATENCY_BUCKETS), "+Inf"), hist.counts, strict=True
    ):
        cumulative += count
        buckets.append((bound, cumulative))
    return buckets
