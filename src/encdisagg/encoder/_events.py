"""Callbacks for metrics: what the Encoder reports as work completes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["EncoderEvents"]


@dataclass
class EncoderEvents:
    """Optional callbacks the Encoder calls (synchronously, on its event loop) as work
    completes; the server's metrics hang here. Callbacks must not block."""

    on_request_done: Callable[[str, str, float], None] | None = None  # modality, status, seconds
    on_phase: Callable[[str, float], None] | None = None  # phase name, seconds
    #: "hit" | "miss" | "eviction" | "invalid", and "joined": a request joined a concurrent
    #: encode of the same content (single-flight, docs/cache.md) instead of computing its own.
    on_cache: Callable[[str], None] | None = None
    #: Global cache counters, ``(event, items)``: see :class:`~encdisagg.cache.GlobalCache`.
    on_global_cache: Callable[[str, int], None] | None = None
    on_breaker: Callable[[str], None] | None = None  # "closed" | "open" | "half_open"

    def phase(self, name: str, seconds: float) -> None:
        if self.on_phase is not None:
            self.on_phase(name, seconds)

    def cache(self, what: str) -> None:
        if self.on_cache is not None:
            self.on_cache(what)
