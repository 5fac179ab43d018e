"""``encdisagg demo``: an E→P→D pipeline on one machine, checked against a colocated run.

Topology (one process, one event loop; every hop crosses a real transport):

- ``encoders`` encoder servers: :func:`encdisagg.server.create_app` served by Hypercorn, each
  with its own :class:`~encdisagg.Encoder` (and, for Mooncake, its own engine);
- a prefill worker and a decode worker, each with its own language model instance and its
  own transfer engine (Loopback engines on one fabric for ``--transfer zmq``, Mooncake TCP
  engines for ``--transfer mooncake``);
- embeddings E→P over ZMQ or Mooncake, KV P→D over the engines, control in-process.

The encoder servers are served by :func:`serve_asgi`, which serves any ASGI app inside the
caller's task group.
"""

from __future__ import annotations

import functools
import random
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TextIO

import anyio
import sniffio

from .. import _tracing
from .._config import EncoderConfig
from .._modality import Modality
from ..nurseries import run_thread_to_completion
from ..receiver import EmbeddingReceiver, EncoderClient
from ._decode import DecodeWorker
from ._decode_types import DecodePhase, DecodeResult, DecodeStatus
from ._demo_types import DemoOptions, DemoReport, ProgressBar, RequestOutcome, request_line
from ._images import DemoImage, demo_images
from ._lm import BUILTIN_LANGUAGE_MODELS, LanguageModel
from ._prefill import PrefillWorker
from ._prefill_types import PipelineRequest, PrefillReport, PrefillStatus

if TYPE_CHECKING:
    from ..models import VisionModel
    from ..transfer import TransferEngine

__all__ = ["DemoOptions", "DemoReport", "RequestOutcome", "run_demo", "serve_asgi"]

_PROMPTS = (
    "Describe the picture.",
    "What colours do you see?",
    "Count the shapes.",
    "Is there anything round in it?",
    "Write a caption for this image.",
)

#: The root span of one traced demo request.
DEMO_SPAN = "encdisagg.demo.request"

#: Where an abort may hit a request (the decode side's phases).
ABORT_PHASES = (
    DecodePhase.WAITING,
    DecodePhase.PREALLOC,
    DecodePhase.TRANSFER,
    DecodePhase.DECODING,
)


@dataclass(frozen=True, slots=True)
class _Planned:
    request: PipelineRequest
    images: tuple[DemoImage, ...]
    abort_phase: DecodePhase | None


def _plan(options: DemoOptions) -> list[_Planned]:
    rng = random.Random(options.seed)
    counts = [rng.randint(1, options.max_images) for _ in range(options.requests)]
    pool = demo_images(
        sum(counts),
        seed=options.seed,
        min_side=options.image_min_side,
        max_side=options.image_max_side,
    )
    rng.shuffle(pool)
    planned = []
    cursor = 0
    for index, count in enumerate(counts):
        images = tuple(pool[cursor : cursor + count])
        cursor += count
        abort = rng.choice(ABORT_PHASES) if rng.random() < options.abort_rate else None
        request = PipelineRequest(
            rid=f"req-{index:03d}",
            room=index + 1,
            prompt=rng.choice(_PROMPTS),
            images=tuple(image.data_url for image in images),
            max_new_tokens=options.new_tokens,
        )
        planned.append(_Planned(request, images, abort))
    return planned


async def _load_models(options: DemoOptions) -> tuple[LanguageModel, LanguageModel, LanguageModel]:
    def load() -> LanguageModel:
        if options.model in BUILTIN_LANGUAGE_MODELS:
            return LanguageModel.tiny(name=options.model)
        return LanguageModel.from_pretrained(options.model)

    # Three instances: prefill, decode and the colocated reference never share a model.
    return (
        await run_thread_to_completion(load),
        await run_thread_to_completion(load),
        await run_thread_to_completion(load),
    )


async def run_demo(
    options: DemoOptions,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> DemoReport:
    """Run the whole pipeline once and check it against the colocated model.

    A checkpoint; runs on the current backend (asyncio or Trio). Prints one line per
    request to ``out`` (stdout) and a progress bar to ``err`` (stderr); the caller prints
    the report's :meth:`DemoReport.summary_line`.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    from ..encoder import Encoder
    from ..server import create_app

    backend = sniffio.current_async_library()
    flavour: Literal["asyncio", "trio"] = "trio" if backend == "trio" else "asyncio"
    planned = await run_thread_to_completion(_plan, options)
    started = anyio.current_time()
    async with AsyncExitStack() as stack:
        if options.torch_threads is not None:
            stack.enter_context(_torch_threads(options.torch_threads))
        prefill_engine, decode_engine = await _open_engines(stack, options.transfer)
        config = EncoderConfig(
            model=options.model,
            transfer=options.transfer,
            device=options.device,
            allow_local_files=False,
            request_timeout_s=60.0,
            send_timeout_s=60.0,
        )
        encoders = [Encoder(config) for _ in range(options.encoders)]
        urls = [
            await stack.enter_async_context(serve_asgi(create_app(encoder, flavour=flavour)))
            for encoder in encoders
        ]
        lm_prefill, lm_decode, lm_reference = await _load_models(options)
        client = await stack.enter_async_context(EncoderClient(urls))
        receiver = await stack.enter_async_context(
            EmbeddingReceiver(
                transport=options.transfer,
                hidden_size=lm_prefill.embedding_width,
                dtype=lm_prefill.dtype,
                layout=lm_prefill.embedding_layout,
                engine=prefill_engine if options.transfer == "mooncake" else None,
            )
        )
        decode = DecodeWorker(
            lm_decode,
            engine=decode_engine,
            release_timeout_s=options.release_timeout_s,
            num_pages=options.kv_pages,
            max_running=options.max_running,
        )
        prefill = PrefillWorker(
            lm_prefill,
            client=client,
            receiver=receiver,
            engine=prefill_engine,
            page_bytes=decode.page_bytes,
        )
        prefill.connect(decode.deliver)
        decode.connect(prefill.deliver)
        await stack.enter_async_context(decode)
        await stack.enter_async_context(prefill)

        results: dict[str, tuple[DecodeResult, PrefillReport]] = {}
        bar = ProgressBar(len(planned), stream=err)
        limiter = anyio.CapacityLimiter(options.concurrency)

        async def one(item: _Planned) -> None:
            request = item.request
            reports: list[PrefillReport] = []

            async def run_prefill() -> None:
                reports.append(await prefill.prefill(request))

            async def abort_later(phase: DecodePhase) -> None:
                await decode.wait_phase(request.rid, phase)
                decode.abort(request.rid)

            # The root of a traced request's one trace: encode, prefill and decode below it.
            with _tracing.span(_tracing.current(), DEMO_SPAN, {"encdisagg.rid": request.rid}):
                async with limiter:
                    handle = decode.admit(
                        request.rid, request.room, max_new_tokens=request.max_new_tokens
                    )
                    async with anyio.create_task_group() as group:
                        group.start_soon(run_prefill)
                        if item.abort_phase is not None:
                            group.start_soon(abort_later, item.abort_phase)
                        result = await handle.wait()
            results[request.rid] = (result, reports[0])
            bar.advance(result.status.value)

        bar.draw()
        async with anyio.create_task_group() as group:
            for item in planned:
                group.start_soon(one, item)
        bar.finish()

        # Everything answered: every page must come back (held ones once acked).
        with anyio.move_on_after(options.release_timeout_s + 5.0):
            await decode.wait_idle()
        encoder_live = await _settle_encoders(encoders)
        decode_stats = decode.stats()
        prefill_stats = prefill.stats()
        leaked_staging = (prefill_stats.staging_pages - prefill_stats.staging_pages_free) + (
            prefill_stats.staging_rows - prefill_stats.staging_rows_free
        )
        receiver_stats = receiver.stats()

        outcomes = await _compare(planned, results, lm_reference, encoders[0].model)
    elapsed = anyio.current_time() - started
    report = DemoReport(
        options=options,
        outcomes=tuple(outcomes),
        decode=decode_stats,
        prefill=prefill_stats,
        leaked_staging=leaked_staging,
        leaked_landing=receiver_stats.landing_pages_in_use,
        held_landing=receiver_stats.held_pages,
        encoder_live=encoder_live,
        elapsed_s=elapsed,
        backend=backend,
        problems=(f"{encoder_live} requests left on the encoders",) if encoder_live else (),
    )
    if options.verbose:
        for outcome in outcomes:
            print(request_line(outcome), file=out)
    return report


@asynccontextmanager
async def serve_asgi(
    app: Any,
    *,
    host: str = "127.0.0.1",
    graceful_timeout_s: float = 5.0,
    startup_timeout_s: float = 120.0,
    shutdown_timeout_s: float = 30.0,
) -> AsyncIterator[str]:
    """Serve ``app`` with Hypercorn on ``host`` (a free port) for the block; yields its URL.

    Runs on the current backend (:func:`encdisagg.server.serve`): a ``Quart`` app needs
    asyncio, a ``QuartTrio`` app Trio. Entering waits (at most ``startup_timeout_s``) until
    the app's lifespan startup completed, so the server answers from the first request on.
    Leaving shuts it down gracefully, also when the block raised: requests in flight finish
    (``graceful_timeout_s``), then the lifespan shutdown runs; the whole is shielded and
    bounded by the sum of the timeouts, after which the server is cancelled.

    :raises TimeoutError: the startup took longer than ``startup_timeout_s``.
    """
    from ..server import serve

    shutdown = anyio.Event()
    started = anyio.Event()
    urls: list[str] = []

    def on_serving(url: str) -> None:
        urls.append(url)
        started.set()

    # Shielded: when the block raises (which cancels the task group), the server still
    # shuts down through its trigger instead of being torn down mid-request. Its deadline,
    # set on the way out, bounds that.
    server_scope = anyio.CancelScope(shield=True)

    async def run() -> None:
        with server_scope:
            await serve(
                app,
                host=host,
                shutdown_trigger=shutdown.wait,
                on_serving=on_serving,
                graceful_timeout_s=graceful_timeout_s,
                startup_timeout_s=startup_timeout_s,
                shutdown_timeout_s=shutdown_timeout_s,
            )

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        try:
            with anyio.fail_after(startup_timeout_s):
                await started.wait()
            yield urls[0]
        finally:
            shutdown.set()
            server_scope.deadline = (
                anyio.current_time() + graceful_timeout_s + shutdown_timeout_s + 1.0
            )


@contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` for the block (a process-wide setting)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


async def _open_engines(
    stack: AsyncExitStack, transfer: str
) -> tuple[TransferEngine, TransferEngine]:
    """Prefill's and decode's engines: Mooncake TCP, or Loopback engines on one fabric."""
    from ..transfer import LoopbackEngine, LoopbackFabric, MooncakeEngine

    fabric = LoopbackFabric()

    async def engine(name: str) -> TransferEngine:
        opened = MooncakeEngine() if transfer == "mooncake" else LoopbackEngine(fabric, name=name)
        return await stack.enter_async_context(opened)

    return await engine("prefill"), await engine("decode")


async def _settle_encoders(encoders: Sequence[Any]) -> int:
    """Requests still live on the encoders, after giving releases in flight a moment."""
    with anyio.move_on_after(10.0):
        # The Encoder offers no idle event; a bounded poll is enough for a final check.
        while any(encoder.stats().live_requests for encoder in encoders):  # noqa: ASYNC110
            await anyio.sleep(0.01)
    return sum(encoder.stats().live_requests for encoder in encoders)


async def _compare(
    planned: Sequence[_Planned],
    results: dict[str, tuple[DecodeResult, PrefillReport]],
    reference: LanguageModel,
    vision: VisionModel,
) -> list[RequestOutcome]:
    """Each request's outcome beside the colocated run's tokens. The colocated model gets the
    pixels the encoders' own preprocessing makes (``preprocess="fast"`` differs from the
    image processor by a level or two, enough to turn a greedy token many steps on): the
    check is that disaggregation loses nothing, not how preprocessing rounds."""
    outcomes = []
    for item in planned:
        request = item.request
        result, report = results[request.rid]
        expected: tuple[int, ...] | None = None
        if result.status is DecodeStatus.COMPLETED:
            images = [image.image for image in item.images]
            run = functools.partial(
                reference.generate_colocated,
                request.prompt,
                images,
                max_new_tokens=request.max_new_tokens,
                pixels=_encoder_pixels(vision, images) if images else None,
            )
            expected = tuple(await run_thread_to_completion(run))
        ttft = tpot = None
        if result.first_token_at is not None:
            ttft = result.first_token_at - result.started_at
            if result.status is DecodeStatus.COMPLETED and len(result.tokens) > 1:
                tpot = (result.finished_at - result.first_token_at) / (len(result.tokens) - 1)
        error = result.error
        if report.status is PrefillStatus.FAILED and not error:
            error = report.error
        outcomes.append(
            RequestOutcome(
                rid=request.rid,
                images=len(item.images),
                status=result.status,
                tokens=result.tokens,
                reference=expected,
                error=error,
                abort_phase=item.abort_phase,
                ttft_s=ttft,
                tpot_s=tpot,
                prompt_tokens=report.seq_len,
                prefill_checksum=report.checksum,
                decode_checksum=result.checksum,
                retractions=result.retractions,
            )
        )
    return outcomes


def _encoder_pixels(vision: VisionModel, images: Sequence[Any]) -> dict[str, Any]:
    """``images`` as the encoders preprocess them, in the language model's keywords. Blocks."""
    features = vision.preprocess(list(images), Modality.IMAGE).features
    return {"pixel_values": features["pixel_values"], "image_grid_thw": features["grid_thw"]}
