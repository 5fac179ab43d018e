"""The demo's options, its per-request outcomes, its report (the summary line), and the
progress bar it draws on stderr (no dependency)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

from .._devices import check_device
from .._errors import ConfigError
from ._decode_types import DecodePhase, DecodeStats, DecodeStatus
from ._prefill_types import PrefillStats

__all__ = ["DemoOptions", "DemoReport", "ProgressBar", "RequestOutcome", "request_line"]


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """What ``encdisagg demo`` runs. Invalid values raise ``ConfigError`` naming them."""

    requests: int = 8
    transfer: str = "zmq"
    #: ``"tiny"``, ``"tiny-qwen3-vl"`` or a local full Qwen2-VL / Qwen3-VL checkpoint folder
    #: (tower and language model).
    model: str = "tiny"
    #: Probability that a request is aborted (at a random phase on the decode side).
    abort_rate: float = 0.0
    new_tokens: int = 8
    #: Seeds the workload: images, prompts, aborts (not the model weights).
    seed: int = 0
    encoders: int = 2
    #: Where the encoder servers' vision towers run (``"cpu"``, ``"cuda"``, ``"cuda:1"``);
    #: the language models of prefill, decode and the colocated reference stay on the CPU.
    device: str = "cpu"
    concurrency: int = 4
    max_images: int = 3
    image_min_side: int = 56
    image_max_side: int = 112
    release_timeout_s: float = 30.0
    #: Decode KV pool pages (16 tokens each): small pools force retractions.
    kv_pages: int = 512
    #: Requests decoded together in one batched step at most.
    max_running: int = 64
    #: Intra-op threads of torch for the run (``None``: leave torch's setting). The pipeline
    #: runs several compute threads at once (encoders, prefill, decode); on a machine with
    #: few cores, one intra-op thread each keeps them from crowding each other out.
    torch_threads: int | None = None
    #: Print one line per request.
    verbose: bool = True

    def __post_init__(self) -> None:
        checks = (
            ("requests", self.requests >= 1),
            ("transfer", self.transfer in ("zmq", "mooncake")),
            ("abort_rate", 0.0 <= self.abort_rate <= 1.0),
            ("new_tokens", self.new_tokens >= 1),
            ("encoders", self.encoders >= 1),
            ("concurrency", self.concurrency >= 1),
            ("max_images", self.max_images >= 1),
            ("image_min_side", 1 <= self.image_min_side <= self.image_max_side),
            ("release_timeout_s", self.release_timeout_s > 0),
            ("kv_pages", self.kv_pages >= 1),
            ("max_running", self.max_running >= 1),
            ("torch_threads", self.torch_threads is None or self.torch_threads >= 1),
        )
        for name, ok in checks:
            if not ok:
                raise ConfigError(f"{name}: invalid value {getattr(self, name)!r}")
        check_device(self.device)


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """One request of the demo, end to end."""

    rid: str
    images: int
    status: DecodeStatus
    tokens: tuple[int, ...]
    #: The colocated run's tokens (``None`` if it was not run: aborted or failed requests).
    reference: tuple[int, ...] | None
    error: str
    #: The decode phase an abort was aimed at, if one was.
    abort_phase: DecodePhase | None
    ttft_s: float | None
    tpot_s: float | None
    prompt_tokens: int
    prefill_checksum: int
    decode_checksum: int
    #: How often decode retracted it (KV backed up, pages freed, later reloaded).
    retractions: int = 0

    @property
    def parity(self) -> bool | None:
        """Whether the tokens equal the colocated run's (``None``: not compared)."""
        return None if self.reference is None else self.tokens == self.reference

    @property
    def kv_intact(self) -> bool | None:
        """Whether decode committed the exact KV prefill wrote (``None``: not committed)."""
        if self.status is not DecodeStatus.COMPLETED:
            return None
        return self.decode_checksum != 0 and self.decode_checksum == self.prefill_checksum


@dataclass(frozen=True, slots=True)
class DemoReport:
    options: DemoOptions
    outcomes: tuple[RequestOutcome, ...]
    decode: DecodeStats
    prefill: PrefillStats
    #: Pages and rows of prefill's staging memory not back at the end.
    leaked_staging: int
    #: Landing pages still in use at the end (held ones are not leaked: ``held_landing``).
    leaked_landing: int
    #: Requests still live on the encoders once the pipeline went idle.
    encoder_live: int
    elapsed_s: float
    backend: str
    #: Landing pages held at the end: a write into them may still land (retired or still
    #: asked about), so they are out of use, not leaked.
    held_landing: int = 0
    problems: tuple[str, ...] = field(default=())

    @property
    def parity_failures(self) -> tuple[str, ...]:
        """Requests that were not aborted yet did not match the colocated run (or failed)."""
        bad = []
        for outcome in self.outcomes:
            if outcome.abort_phase is not None and outcome.status is not DecodeStatus.COMPLETED:
                continue
            if outcome.status is not DecodeStatus.COMPLETED:
                bad.append(f"{outcome.rid} ({outcome.status.value}: {outcome.error})")
            elif not outcome.parity:
                expected = list(outcome.reference or ())
                bad.append(f"{outcome.rid} (tokens {list(outcome.tokens)} != {expected})")
        return tuple(bad)

    @property
    def kv_corrupt(self) -> int:
        corrupt = self.decode.corrupt + self.decode.draft_mismatches
        return corrupt + sum(1 for o in self.outcomes if o.kv_intact is False)

    @property
    def ok(self) -> bool:
        return (
            not self.parity_failures
            and self.kv_corrupt == 0
            and self.leaked_pages == 0
            and self.leaked_slots == 0
            and not self.problems
        )

    @property
    def leaked_pages(self) -> int:
        """Pages not back at the end that no hold accounts for (retired decode pages and
        held landing pages are out of use on purpose)."""
        return (
            self.decode.pages_total
            - self.decode.pages_free
            - self.decode.retired_pages
            + self.leaked_staging
            + self.leaked_landing
        )

    @property
    def leaked_slots(self) -> int:
        return self.decode.slots_total - self.decode.slots_free - self.decode.retired

    @property
    def retired_pages(self) -> int:
        """Pages kept out of use because a write may still land in them."""
        return self.decode.retired_pages + self.held_landing

    def summary_line(self) -> str:
        counts = dict.fromkeys(DecodeStatus, 0)
        for outcome in self.outcomes:
            counts[outcome.status] += 1
        ttfts = [o.ttft_s for o in self.outcomes if o.ttft_s is not None]
        tpots = [o.tpot_s for o in self.outcomes if o.tpot_s is not None]
        failures = self.parity_failures
        parity = "parity=ok" if not failures else f"parity=FAILED {'; '.join(failures)}"
        parts = [
            f"requests={len(self.outcomes)}",
            f"completed={counts[DecodeStatus.COMPLETED]}",
            f"aborted={counts[DecodeStatus.ABORTED]}",
            f"failed={counts[DecodeStatus.FAILED]}",
            f"transfer={self.options.transfer}",
            f"encoders={self.options.encoders}",
            f"ttft_p50={_ms(_median(ttfts))}",
            f"tpot_p50={_ms(_median(tpots))}",
            f"writes_stopped={self.prefill.writes_stopped}",
            f"held_releases={self.decode.held_releases}",
            f"drained={self.decode.drained_releases}",
            f"timed_out={self.decode.timed_out_releases}",
            f"retired_pages={self.retired_pages}",
            f"decode_steps={self.decode.decode_steps}",
            f"retractions={self.decode.retractions}",
            f"leaked_pages={self.leaked_pages}",
            f"leaked_slots={self.leaked_slots}",
            f"kv_corrupt={self.kv_corrupt}",
            f"elapsed={self.elapsed_s:.2f}s",
        ]
        if self.problems:
            parts.append(f"problems={'; '.join(self.problems)}")
        parts.append(parity)
        return "demo: " + " ".join(parts)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.1f}ms"


def request_line(outcome: RequestOutcome) -> str:
    parts = [
        f"{outcome.rid}",
        f"images={outcome.images}",
        f"prompt={outcome.prompt_tokens:>4} tok",
        f"ttft={_ms(outcome.ttft_s):>8}",
        f"tpot={_ms(outcome.tpot_s):>7}",
        f"tokens={len(outcome.tokens):>2}",
        f"{outcome.status.value:<9}",
    ]
    if outcome.retractions:
        parts.append(f"retracted={outcome.retractions}")
    if outcome.abort_phase is not None:
        parts.append(f"abort@{outcome.abort_phase.name.lower()}")
    if outcome.parity is not None:
        parts.append("parity ok" if outcome.parity else "PARITY MISMATCH")
    if outcome.status is DecodeStatus.FAILED:
        parts.append(outcome.error)
    return "  ".join(parts)


class ProgressBar:
    """``[#########-----------]  9/20  completed=8 aborted=1  3.1 s``.

    Redraws in place on a terminal; elsewhere (a file, a pipe) it writes only the final line.
    Reads the wall clock for display only.
    """

    def __init__(self, total: int, *, stream: TextIO, width: int = 30) -> None:
        self.total = total
        self.done = 0
        self.counts: dict[str, int] = {}
        self._stream = stream
        self._width = width
        self._start = time.monotonic()
        isatty = getattr(stream, "isatty", None)
        self._live = bool(isatty and isatty())

    def line(self) -> str:
        filled = self._width * self.done // max(1, self.total)
        bar = "#" * filled + "-" * (self._width - filled)
        counts = " ".join(f"{key}={value}" for key, value in sorted(self.counts.items()))
        elapsed = time.monotonic() - self._start
        return (
            f"[{bar}] {self.done:>{len(str(self.total))}}/{self.total}  {counts}  {elapsed:.1f} s"
        )

    def draw(self) -> None:
        if self._live:
            self._stream.write("\r" + self.line())
            self._stream.flush()

    def advance(self, label: str) -> None:
        self.done += 1
        self.counts[label] = self.counts.get(label, 0) + 1
        self.draw()

    def finish(self) -> None:
        self._stream.write(("\r" if self._live else "") + self.line() + "\n")
        self._stream.flush()
