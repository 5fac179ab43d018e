"""What the routes call: one Encoder in this process, or data-parallel workers.

:class:`LocalBackend` wraps one :class:`~encdisagg.Encoder`; the data-parallel front
(``_dp._front.DataParallelBackend``) forwards the same calls to worker processes, each of which runs
a :class:`LocalBackend` of its own.
"""

from __future__ import annotations

import io
import itertools
import logging
import secrets
from collections.abc import AsyncGenerator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import anyio.lowlevel

from .._config import EncoderConfig
from .._errors import EncdisaggError
from .._modality import Modality
from ..encoder import Encoder, EncodeRequest, EncodeResult
from ..models import ModelOptions, NullVisionModel, VisionModel
from ..nurseries import ServiceTaskGroup, collapse_single_error, run_thread_to_completion
from ._heap import freeze_startup_heap
from ._messages import EncodeBody, MetadataBody, ReceiveUrlBody, SendBody
from ._metrics import PROBING, EncoderMetrics, ServiceSnapshot

__all__ = ["Backend", "HealthReport", "LocalBackend", "release_within", "server_model"]

_log = logging.getLogger("encdisagg.server")

#: Model names only the server knows: ``"null"`` is :class:`~encdisagg.models.NullVisionModel`
#: (no decoding, no compute), for testing the plumbing around the model.
SERVER_MODELS = ("null",)


def server_model(config: EncoderConfig) -> VisionModel | None:
    """The model for a server-only model name, or ``None`` (the Encoder loads it)."""
    if config.model == "null":
        return NullVisionModel()
    return None


@dataclass(frozen=True, slots=True)
class HealthReport:
    """The outcome of a health check.

    :ivar ok: whether the service can encode.
    :ivar probed: whether a probe encode ran (``False``: skipped while busy).
    :ivar message: why it is not ok (empty when ok).
    """

    ok: bool
    probed: bool = False
    message: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"ok": self.ok, "probed": self.probed, "message": self.message}

    @classmethod
    def from_wire(cls, value: object) -> HealthReport:
        if isinstance(value, dict) and set(value) == {"ok", "probed", "message"}:
            match value:
                case {"ok": bool(ok), "probed": bool(probed), "message": str(message)}:
                    return cls(ok, probed, message)
        raise ValueError("malformed health report")


class Backend(Protocol):
    """The calls behind the routes.

    Each is a checkpoint and has the meaning of the Encoder method it is named after
    (``register`` is ``register_destinations``, ``metadata`` is ``wait_metadata``),
    cancellation included: a cancelled ``encode`` or ``send`` leaves nothing staged once its
    work stopped. Errors are :class:`~encdisagg.EncdisaggError` subclasses carrying their
    HTTP status.
    """

    async def encode(self, body: EncodeBody) -> EncodeResult: ...

    async def send(self, body: SendBody) -> None: ...

    async def register(self, body: ReceiveUrlBody) -> None: ...

    async def metadata(self, body: MetadataBody) -> EncodeResult: ...

    async def release(self, req_id: str) -> None: ...

    async def health(self) -> HealthReport: ...

    async def snapshot(self) -> ServiceSnapshot: ...


async def release_within(
    backend: Backend, req_id: str, timeout_s: float, log: logging.Logger
) -> None:
    """Release ``req_id`` on ``backend``, giving up after ``timeout_s``; a failure is logged
    on ``log``, never raised. A checkpoint; callers shield it where a cancellation must not
    cut the release short."""
    try:
        with anyio.move_on_after(timeout_s):
            await backend.release(req_id)
    except EncdisaggError as exc:
        log.warning("releasing req_id %r failed: %s", req_id, exc)


def _probe_item(model: object, index: int) -> tuple[str, Modality]:
    """The probe's item and modality: a 0.1 s WAV for a model that encodes audio and no
    images, else a tiny PNG data URL; either differs per probe, so no cache can answer it."""
    if ModelOptions.of(model).modalities == frozenset({Modality.AUDIO}):
        from ..models._media._waveforms import probe_wav

        return probe_wav(index), Modality.AUDIO
    import base64

    from PIL import Image

    image = Image.new("RGB", (32, 32))
    seed = index * 2654435761
    image.putdata(
        [
            ((seed + i) % 251, (seed // 7 + 3 * i) % 253, (seed // 13 + 5 * i) % 255)
            for i in range(1024)
        ]
    )
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    png = base64.b64encode(buffer.getvalue()).decode("ascii")
    return "data:image/png;base64," + png, Modality.IMAGE


@dataclass(eq=False)
class _Probe:
    done: anyio.Event
    report: HealthReport | None = None


class LocalBackend(anyio.AsyncContextManagerMixin):
    """Serves the routes with one Encoder in this process.

    ``async with LocalBackend(config_or_encoder) as backend:`` opens the Encoder, unless it
    was given already open (then its owner closes it). A lone error raised in the block (or
    by the Encoder) leaves it as itself, not wrapped in an exception group. Built from a
    config, the Encoder gets ``metrics.events()`` and the server-only model names
    (``"null"``) are honoured.

    :param health_timeout_s: the bound on one probe encode.
    :param freeze_heap: once the Encoder is open, freeze what startup left alive
        (``ServerSettings.freeze_heap``).
    """

    def __init__(
        self,
        config_or_encoder: EncoderConfig | Encoder,
        *,
        metrics: EncoderMetrics | None = None,
        health_timeout_s: float = 20.0,
        freeze_heap: bool = False,
    ) -> None:
        self.metrics = metrics or EncoderMetrics()
        if isinstance(config_or_encoder, Encoder):
            self.encoder = config_or_encoder
        else:
            self.encoder = Encoder(
                config_or_encoder,
                model=server_model(config_or_encoder),
                events=self.metrics.events(),
            )
        self._health_timeout_s = health_timeout_s
        self._freeze_heap = freeze_heap
        self._probe: _Probe | None = None
        self._probes = itertools.count()
        self._probe_prefix = f"encdisagg-health-{secrets.token_hex(4)}"
        self._group: ServiceTaskGroup | None = None
        # Encodes in flight, when the count last went up from zero, when one last ended:
        # /health skips its probe while encodes make progress.
        self._encoding = 0
        self._busy_since = 0.0
        self._last_done = 0.0

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[LocalBackend]:
        with collapse_single_error():
            async with AsyncExitStack() as stack:
                if not self.encoder.is_open:
                    await stack.enter_async_context(self.encoder)
                if self._freeze_heap:
                    # The model and the engine are loaded: what lives now lives on.
                    freeze_startup_heap()
                # Unwrapped here too, so the Encoder's block sees the error itself and does
                # not attach the probes' group to it as context when it unwraps its own.
                with collapse_single_error():
                    async with ServiceTaskGroup("health probes", logger=_log) as group:
                        self._group = group
                        try:
                            yield self
                        finally:
                            self._group = None

    # -- the routes' calls ---------------------------------------------------------------------

    async def encode(self, body: EncodeBody) -> EncodeResult:
        """Encode and stage; see :meth:`~encdisagg.Encoder.encode`."""
        request = body.to_request()
        if self._encoding == 0:
            self._busy_since = anyio.current_time()
        self._encoding += 1
        try:
            return await self.encoder.encode(request)
        finally:
            self._encoding -= 1
            self._last_done = anyio.current_time()

    async def send(self, body: SendBody) -> None:
        """Deliver to one destination; see :meth:`~encdisagg.Encoder.send`."""
        await self.encoder.send(body.req_id, body.destination, receive_count=body.receive_count)

    async def register(self, body: ReceiveUrlBody) -> None:
        """Push mode; see :meth:`~encdisagg.Encoder.register_destinations`."""
        await self.encoder.register_destinations(
            body.req_id, body.receive_count, list(body.receive_urls)
        )

    async def metadata(self, body: MetadataBody) -> EncodeResult:
        """Wait for the metadata; see :meth:`~encdisagg.Encoder.wait_metadata`."""
        return await self.encoder.wait_metadata(body.req_id)

    async def release(self, req_id: str) -> None:
        """Release; see :meth:`~encdisagg.Encoder.release`."""
        await self.encoder.release(req_id)

    async def abandon(self, req_id: str) -> None:
        """Release now, or as soon as an encode creates the id; see
        :meth:`~encdisagg.Encoder.abandon`."""
        await self.encoder.abandon(req_id)

    async def snapshot(self) -> ServiceSnapshot:
        """The metrics now. A checkpoint."""
        await anyio.lowlevel.checkpoint()
        encoder = self.encoder if self.encoder.is_open else None
        return ServiceSnapshot(self.metrics.snapshot(encoder))

    @property
    def busy(self) -> bool:
        """Whether encodes are in flight and made progress within the health timeout."""
        if self._encoding == 0:
            return False
        progress = max(self._busy_since, self._last_done)
        return anyio.current_time() - progress < self._health_timeout_s

    async def health(self) -> HealthReport:
        """Probe the model with a tiny encode, unless encodes are making progress.

        A checkpoint. Concurrent calls share one probe; the probe is owned by this backend,
        so a caller that leaves early does not cut it short. The probe's request is
        released whatever its outcome.
        """
        await anyio.lowlevel.checkpoint()
        if not self.encoder.is_open or self._group is None:
            return HealthReport(False, message="the encoder is not running")
        if self.busy:
            return HealthReport(True)
        probe = self._probe
        if probe is None:
            probe = self._probe = _Probe(anyio.Event())
            self._group.start_soon(self._run_probe, probe, name="health probe")
        with anyio.move_on_after(self._health_timeout_s + 1.0):
            await probe.done.wait()
        if probe.report is None:
            return HealthReport(False, True, "the health probe did not finish in time")
        return probe.report

    async def _run_probe(self, probe: _Probe) -> None:
        index = next(self._probes)
        req_id = f"{self._probe_prefix}-{index}"
        PROBING.set(True)  # this task is the probe's own
        try:
            item, modality = await run_thread_to_completion(_probe_item, self.encoder.model, index)
            with anyio.fail_after(self._health_timeout_s):
                await self.encoder.encode(EncodeRequest(req_id, [item], modality=modality))
            probe.report = HealthReport(True, True)
        except TimeoutError:
            probe.report = HealthReport(
                False, True, f"the probe encode took longer than {self._health_timeout_s} s"
            )
        except EncdisaggError as exc:
            probe.report = HealthReport(False, True, f"the probe encode failed: {exc.message}")
        except Exception as exc:
            _log.exception("the health probe failed unexpectedly")
            probe.report = HealthReport(False, True, f"the probe encode failed: {exc!r}")
        finally:
            if self._probe is probe:
                self._probe = None
            probe.done.set()
            with anyio.CancelScope(shield=True):
                await release_within(self, req_id, self._health_timeout_s, _log)
